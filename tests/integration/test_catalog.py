"""ls and gc on both stores: what is kept, what is deleted, and that a used blob never goes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from tests.fixtures import nodes
from warmer import catalog
from warmer.cli import gc, ls
from warmer.archive import FileEntry
from warmer.artifact import Artifact, RecipeRef
from warmer.contract import PathContract
from warmer.entry import BlobRef, IndexEntry
from warmer.errors import UsageError
from warmer.store import StoreError, open_store

NOW = datetime.now(timezone.utc).replace(microsecond=0)
# The node each GPU name stands for (None: a CPU host, vLLM's CPU backend).
NODES = {"NVIDIA H200": lambda: nodes.gpu_node("h200"),
         "NVIDIA H100 80GB HBM3": lambda: nodes.gpu_node("h100-sxm"),
         None: lambda: nodes.cpu_node("intel-sapphire-rapids"),
         "AVX2 CPU": lambda: nodes.cpu_node("intel-broadwell")}


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(f"file://{tmp_path / 'store'}")
    return open_store(request.getfixturevalue("s3_url"))


def put_blob(store, tmp_path) -> tuple[str, int]:
    data = os.urandom(2000)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    store.put_blob(str(path), sha)
    return sha, len(data)


def publish(store, tmp_path, recipe: str, gpu: str | None, days_ago: float, blob=None) -> IndexEntry:
    """An index entry as publish writes it, published days_ago, for a node with this GPU."""
    sha, size = blob or put_blob(store, tmp_path)
    key = hashlib.sha256(f"{recipe}{gpu}{days_ago}{sha}".encode()).hexdigest()
    art = Artifact.new(key=key, recipe=RecipeRef(recipe, "0" * 64, {"name": recipe}), fingerprint=NODES[gpu](),
                       path_contract=PathContract(root="/cache/root", model="/models/tiny", python_prefix="/opt/venv"),
                       components={}, files=[FileEntry("vllm/a", 10, "0" * 64, 0o644, 0)], timings={})
    entry = IndexEntry(recipe, key, BlobRef(sha, size), art, None, NOW - timedelta(days=days_ago))
    assert store.put_index(recipe, key, entry.to_bytes())
    return entry


def state(store):
    return sorted(store.list_index()), sorted(b.sha256 for b in store.list_blobs())


@pytest.fixture
def fleet(store, tmp_path):
    """tiny on H200 (four builds) and on H100 (one old build); other on CPUs (three builds)."""
    e = {f"h200-{d}": publish(store, tmp_path, "tiny", "NVIDIA H200", d) for d in (10, 5, 1, 0)}
    e["h100-30"] = publish(store, tmp_path, "tiny", "NVIDIA H100 80GB HBM3", 30)
    e |= {f"cpu-{d}": publish(store, tmp_path, "other", None, d) for d in (20, 19, 18)}
    return e


def test_ls_lists_every_artifact_newest_first(store, fleet):
    listing = catalog.ls(store)
    rows = listing.rows
    assert len(rows) == 8
    assert [(r.recipe, r.machine, r.published_at.isoformat()[:10]) for r in rows][:3] == [
        ("other", "x86_64/cpu", (NOW - timedelta(days=18)).isoformat()[:10]),
        ("other", "x86_64/cpu", (NOW - timedelta(days=19)).isoformat()[:10]),
        ("other", "x86_64/cpu", (NOW - timedelta(days=20)).isoformat()[:10])]
    assert {r.key for r in catalog.ls(store, "tiny").rows} == {e.key for n, e in fleet.items() if "cpu" not in n}
    text = ls.report(listing)
    assert fleet["h100-30"].key[:16] in text and "x86_64/NVIDIA H100 80GB HBM3" in text


def test_gc_keeps_the_newest_n_per_recipe_and_machine_kind(store, fleet):
    before = state(store)
    plan = catalog.gc(store, 2, dry_run=True)
    assert state(store) == before  # a dry run deletes nothing
    doomed = {fleet[n].key for n in ("h200-10", "h200-5", "cpu-20")}
    assert {e.key for e in plan.deleted_entries} == doomed
    assert set(plan.deleted_blobs) == {fleet[n].blob.sha256 for n in ("h200-10", "h200-5", "cpu-20")}

    done = catalog.gc(store, 2)
    assert {e.key for e in done.deleted_entries} == doomed and done.freed_bytes == 3 * 2000
    kept = {k for _, k in store.list_index()}
    assert kept == {e.key for e in fleet.values()} - doomed
    assert fleet["h100-30"].key in kept  # the only H100 artifact survives the H200's newer builds
    blobs = {b.sha256 for b in store.list_blobs()}
    assert blobs == {fleet[n].blob.sha256 for n in fleet if fleet[n].key in kept}
    assert catalog.gc(store, 2).deleted_entries == ()  # and then there is nothing more to do


def test_gc_keeps_an_avx2_fleets_only_artifact_beside_an_avx512_fleets_newer_ones(store, fleet, tmp_path):
    """vLLM's CPU backend: an AVX2 host's key differs from an AVX-512 host's (cpu.isa is hard: the
    other's kernels gave wrong numbers or crashed), the machine kind is x86_64/cpu for both. gc
    --keep 1 deleted the AVX2 fleet's only artifact for the AVX-512 fleet's newer builds."""
    avx2 = publish(store, tmp_path, "other", "AVX2 CPU", 30)
    assert avx2.artifact.fingerprint.machine_kind() == fleet["cpu-18"].artifact.fingerprint.machine_kind()
    done = catalog.gc(store, 1)
    assert {e.key for e in done.deleted_entries} == {fleet[n].key for n in ("h200-10", "h200-5", "h200-1",
                                                                              "cpu-20", "cpu-19")}
    assert avx2.key in {k for _, k in store.list_index()}


def test_gc_older_than_spares_recent_artifacts(store, fleet):
    done = catalog.gc(store, 1, older_than_days=7)
    assert {e.key for e in done.deleted_entries} == {fleet[n].key for n in ("h200-10", "cpu-20", "cpu-19")}
    assert {fleet["h200-5"].key, fleet["h200-1"].key} <= {k for _, k in store.list_index()}


def test_gc_never_deletes_a_blob_an_entry_still_uses(store, tmp_path):
    shared = put_blob(store, tmp_path)
    old = publish(store, tmp_path, "tiny", "NVIDIA H200", 9, blob=shared)
    new = publish(store, tmp_path, "tiny", "NVIDIA H200", 1, blob=shared)
    done = catalog.gc(store, 1)
    assert [e.key for e in done.deleted_entries] == [old.key]
    assert done.deleted_blobs == ()
    assert [b.sha256 for b in store.list_blobs()] == [shared[0]]
    assert store.get_index("tiny", new.key) is not None


def test_a_blob_no_entry_names_is_deleted_only_after_the_grace(store, tmp_path):
    # A publish in flight (blob up, entry not yet) or the loser of a race looks like this.
    orphan, _ = put_blob(store, tmp_path)
    publish(store, tmp_path, "tiny", None, 0)
    assert catalog.gc(store, 1).deleted_blobs == ()
    assert orphan in {b.sha256 for b in store.list_blobs()}
    # From now, not from NOW (taken at collection, maybe minutes before this blob was written).
    later = datetime.now(timezone.utc) + catalog.ORPHAN_GRACE + timedelta(minutes=5)
    assert catalog.gc(store, 1, now=later).deleted_blobs == (orphan,)
    assert orphan not in {b.sha256 for b in store.list_blobs()} and len(store.list_blobs()) == 1


def test_ls_and_gc_dry_run_show_orphan_blobs(store, tmp_path):
    # An upload in flight, or a publish killed between its blob and its entry, leaves this.
    entry = publish(store, tmp_path, "tiny", None, 0)
    orphan, size = put_blob(store, tmp_path)
    listing = catalog.ls(store)
    assert [b.sha256 for b in listing.orphans] == [orphan] and listing.orphans[0].size == size
    assert f"1 orphan blob(s), {size / 1e6:.1f} MB that no index entry names" in ls.report(listing)
    said = re.search(r"`(warmer gc [^`]+)`", ls.report(listing))[1].replace(" N ", " 1 ").split()
    out = subprocess.run([sys.executable, "-m", "warmer", *said[1:]], capture_output=True, text=True)
    assert out.returncode == 0 and f"kept: orphan blob {orphan[:16]}" in out.stdout, out.stderr  # as it says
    assert {"orphan_blob": orphan, "bytes": size}.items() <= listing.to_json()[-1].items()
    assert catalog.ls(store, "tiny").orphans is None  # one recipe's entries cannot say which blobs are orphans
    assert [r.key for r in catalog.ls(store, "tiny").rows] == [entry.key]

    young = catalog.gc(store, 1, dry_run=True)
    assert young.orphans_deleted == () and [b.sha256 for b in young.orphans_kept] == [orphan]
    text = gc.report(young)
    assert f"kept: orphan blob {orphan[:16]}" in text and "younger than 6 h" in text
    later = datetime.now(timezone.utc) + catalog.ORPHAN_GRACE + timedelta(minutes=5)
    old = catalog.gc(store, 1, dry_run=True, now=later)
    assert [b.sha256 for b in old.orphans_deleted] == [orphan] and old.orphans_kept == ()
    assert f"would delete: orphan blob {orphan[:16]}" in gc.report(old)
    assert old.deleted_blobs == (orphan,) and orphan in {b.sha256 for b in store.list_blobs()}  # a dry run


def test_gc_refuses_what_it_cannot_do_safely(store, tmp_path):
    publish(store, tmp_path, "tiny", None, 3)
    with pytest.raises(UsageError, match="keep at least 1"):
        catalog.gc(store, 0)
    store.put_index("broken", "f" * 64, b"{not json")
    before = state(store)
    with pytest.raises(StoreError, match="index entry broken/f{16} .* is unreadable") as e:
        catalog.gc(store, 1)
    assert state(store) == before  # it cannot know what that entry uses, so it deletes nothing
    # the fix it names, as an operator pastes it, removes the entry (without --yes, a dry run)
    fix = re.search(r"`(warmer rm [^`]+)`", str(e.value))[1].split()
    out = subprocess.run([sys.executable, "-m", "warmer", *fix[1:]], capture_output=True, text=True)
    assert out.returncode == 0 and ("broken", "f" * 64) not in store.list_index(), out.stderr
    assert catalog.gc(store, 1).entries == 1  # it runs again


def test_cli_ls_gc_inspect_on_a_file_store(tmp_path):
    store = open_store(f"file://{tmp_path / 'store'}")
    entries = [publish(store, tmp_path, "tiny", None, d) for d in (3, 2, 1)]

    def warmer(*args):
        out = subprocess.run([sys.executable, "-m", "warmer", *args], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "3 artifact(s) in " + store.url in warmer("ls", "--store", store.url)
    assert [r["key"] for r in json.loads(warmer("ls", "--store", store.url, "--json"))] == \
        [e.key for e in reversed(entries)]
    dry = json.loads(warmer("gc", "--store", store.url, "--keep", "1", "--dry-run", "--json"))
    assert len(dry["deleted_entries"]) == 2 and len(store.list_index()) == 3
    assert "deleted 2 of 3 index entries and 2 blob(s)" in warmer("gc", "--store", store.url, "--keep", "1")
    assert store.list_index() == [("tiny", entries[2].key)]
    shown = json.loads(warmer("inspect", f"{store.url}/index/tiny/{entries[2].key[:12]}", "--json"))
    assert shown["blob"]["sha256"] == entries[2].blob.sha256


def test_gc_deletes_the_copy_a_killed_publisher_left_in_a_file_store(tmp_path):
    """A CI job cancelled mid-publish: its half-copied blob sits under a name no listing shows (up
    to an artifact's size each time). gc keeps it while it may still be written, then deletes it."""
    store = open_store(f"file://{tmp_path / 'store'}")
    entry = publish(store, tmp_path, "tiny", None, 1)
    source = tmp_path / "artifact-on-its-way"
    os.mkfifo(source)  # the copy blocks on it: the publisher is killed mid-copy, not before or after
    sha = "ab" * 32
    child = subprocess.Popen([sys.executable, "-c", "import sys; from warmer.store import open_store; "
                              "open_store(sys.argv[1]).put_blob(sys.argv[2], sys.argv[3])", store.url, str(source), sha])
    with open(source, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        scraps = []
        deadline = datetime.now(timezone.utc) + timedelta(seconds=60)
        while not (scraps and scraps[0].size >= 1 << 20):  # the copy has the first MiB: kill it there
            assert child.poll() is None and datetime.now(timezone.utc) < deadline, "the publisher never copied"
            scraps = store.list_scraps()
        child.kill()
        child.wait()
    assert [x.path.rsplit("/", 1)[0] for x in scraps] == [f"blobs/sha256/{sha[:2]}"]
    assert sha not in {b.sha256 for b in store.list_blobs()}  # not a blob: ls and the orphans never see it

    assert catalog.gc(store, 1).scraps_deleted == ()  # younger than the grace: maybe still being written
    later = datetime.now(timezone.utc) + catalog.ORPHAN_GRACE + timedelta(minutes=5)
    dry = catalog.gc(store, 1, dry_run=True, now=later)
    assert dry.scraps_deleted == tuple(scraps) and store.list_scraps() == scraps
    assert f"would delete: {scraps[0].path} (1.0 MB" in gc.report(dry)
    done = catalog.gc(store, 1, now=later)
    assert done.to_json()["scraps_deleted"][0]["bytes"] == 1 << 20
    assert store.list_scraps() == [] and store.list_index() == [("tiny", entry.key)]


def test_gc_of_a_file_store_skips_what_a_publish_or_gc_removed_while_it_listed(tmp_path, monkeypatch):
    """Every publish makes and renames a part; gc and rm delete blobs: a file the listing named and
    then found gone failed the gc (11 runs of 15 beside a busy publisher), after its index deletes."""
    from pathlib import Path

    store = open_store(f"file://{tmp_path / 'store'}")
    publish(store, tmp_path, "tiny", None, 1)
    scrap = tmp_path / "store" / "index" / "tiny" / ".incoming-gone"
    scrap.write_bytes(b"part")
    [blob] = store.list_blobs()
    gone = {scrap, tmp_path / "store" / f"blobs/sha256/{blob.sha256[:2]}/{blob.sha256}.tar.zst"}
    real = Path.lstat

    def lstat(self):  # the file is removed between the listing and its lstat, as a racer does
        if self in gone:
            self.unlink(missing_ok=True)
        return real(self)

    monkeypatch.setattr(Path, "lstat", lstat)
    assert store.list_scraps() == [] and store.list_blobs() == []


@pytest.mark.parametrize("days", ["nan", "-1", "1e10"])
def test_gc_older_than_that_is_no_number_of_days_is_a_usage_error(tmp_path, days):
    """`--older-than nan` (or past what a timedelta holds) was a traceback, with no JSON on stdout."""
    store = open_store(f"file://{tmp_path / 'store'}")
    publish(store, tmp_path, "tiny", None, 40)
    publish(store, tmp_path, "tiny", None, 30)
    before = state(store)
    out = subprocess.run([sys.executable, "-m", "warmer", "gc", "--store", store.url, "--keep", "1", "--older-than",
                          days, "--json"], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    doc = json.loads(out.stdout)
    assert doc["kind"] == "usage" and "--older-than" in doc["error"] and "Traceback" not in out.stderr
    assert state(store) == before


def test_rm_and_inspect_name_an_entry_of_a_recipe_named_index(tmp_path):
    """STORE/index/index/KEY: the URL is read from the right, so a recipe named "index" can still be
    inspected and removed (rm is the one way out for a bad entry)."""
    store = open_store(f"file://{tmp_path / 'store'}")
    entry, other = publish(store, tmp_path, "index", None, 1), publish(store, tmp_path, "tiny", None, 1)
    assert catalog.split_entry_url(f"{store.url}/index/index/{entry.key[:12]}") == (store.url, "index", entry.key[:12])
    assert catalog.read_entry(f"{store.url}/index/index/{entry.key[:12]}").key == entry.key
    catalog.rm(f"{store.url}/index/index/{entry.key[:12]}", yes=True)
    assert store.list_index() == [("tiny", other.key)]
    with pytest.raises(UsageError, match="does not name a published artifact"):
        catalog.split_entry_url(f"{store.url}/index/tiny/x/{other.key[:12]}")
