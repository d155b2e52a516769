"""The trust boundary: hostile bytes from a store, and hostile files planted beside a root (a node's
hostPath is writable by every pod on it). Each case here hung, activated the wrong artifact, ran
code, or deleted the wrong thing before warmer parsed its inputs once at the boundary."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import zstandard

from tests.conftest import REPO, make_cache_tree, run_warmer, time_cap, tiny_recipe, write_tiny_recipe
from warmer import archive, build, catalog, fetch, restore
from warmer.components import flashinfer as flashinfer_jit
from warmer.artifact import canonical
from warmer.envfile import EnvFile, EnvFileError
from warmer.recipe import parse
from warmer.store import open_store
from tests.unit.test_signing import _keypair


def _publish(packed, tmp_path, name="a", key_pair=None, **kw):
    p = packed(name, **kw)
    store = open_store(f"file://{tmp_path / 'store'}")
    result = build.publish(store, p.path, str(key_pair[0]) if key_pair else None)
    return store, p, result


def _entry_path(store, recipe: str, key: str) -> Path:
    return Path(store.base) / "index" / recipe / f"{key}.json"


def _blob_path(store, sha: str) -> Path:
    return Path(store.base) / "blobs" / "sha256" / sha[:2] / f"{sha}.tar.zst"


# -- 1. hangs ------------------------------------------------------------------------------------

def _archive_with_first_header(header: bytes, tmp_path: Path) -> Path:
    path = tmp_path / "neg.tar.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(header + bytes(4096)))
    return path


def _header_with_size_field(size_field: bytes) -> bytes:
    info = tarfile.TarInfo(archive.MANIFEST_MEMBER)
    info.size = 10
    block = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT))
    block[archive.H_SIZE] = size_field
    block[archive.H_CHKSUM] = b" " * 8
    block[148:155] = b"%06o\0" % sum(block)
    return bytes(block)


@pytest.mark.parametrize("how", ["pax size=-1", "base-256 negative"])
def test_a_member_with_a_negative_size_is_refused_not_read_forever(tmp_path, how):
    if how == "pax size=-1":
        info = tarfile.TarInfo(archive.MANIFEST_MEMBER)
        info.size = 10
        info.pax_headers = {"size": "-1"}
        header = info.tobuf(format=tarfile.PAX_FORMAT)
    else:
        header = _header_with_size_field(b"\xff" * 12)  # base-256 for -1
    path = _archive_with_first_header(header, tmp_path)
    with time_cap(20), open(path, "rb") as f, pytest.raises(archive.ArchiveError, match="size"):
        archive.read_manifest(f)
    with time_cap(20), pytest.raises(restore.RestoreError, match="size"):
        restore.restore_file(path, tmp_path / "root")


def test_a_store_writer_without_the_key_cannot_hang_a_signed_fetch(packed, tmp_path):
    """The entry pointed at an archive whose manifest member has a negative size (the blob's name
    and size are not what the signature covers): the signed entry still verifies, so the bytes
    are read, and refused, not looped on while holding the lock."""
    keys = _keypair(tmp_path, "builder")
    store, p, published = _publish(packed, tmp_path, key_pair=keys)
    info = tarfile.TarInfo(archive.MANIFEST_MEMBER)
    info.pax_headers = {"size": "-1"}
    hostile = zstandard.ZstdCompressor().compress(info.tobuf(format=tarfile.PAX_FORMAT) + bytes(4096))
    sha = hashlib.sha256(hostile).hexdigest()
    _blob_path(store, sha).parent.mkdir(parents=True, exist_ok=True)
    _blob_path(store, sha).write_bytes(hostile)
    entry_file = _entry_path(store, "tiny", p.artifact.key)
    entry = json.loads(entry_file.read_bytes())
    entry["blob"] = {"sha256": sha, "size": len(hostile)}
    entry_file.write_text(json.dumps(entry))
    with time_cap(60):
        got = fetch.fetch(tiny_recipe(), store, tmp_path / "node", trusted_keys=[keys[1]])
    assert got.status == "error" and any("size" in w for w in got.warnings), got.warnings
    assert restore.active(tmp_path / "node") is None
    # The published blob replaced in place: refused by its size, or by its digest, unread or read once.
    _blob_path(store, published.blob).write_bytes(hostile)
    entry["blob"] = {"sha256": published.blob, "size": len(hostile)}
    entry_file.write_text(json.dumps(entry))
    got = fetch.fetch(tiny_recipe(), store, tmp_path / "node", trusted_keys=[keys[1]])
    assert got.status == "error" and any(f"blob {published.blob} in file://" in w and "corrupt in the store" in w
                                         for w in got.warnings), got.warnings
    assert restore.active(tmp_path / "node") is None


@pytest.mark.parametrize("what", ["index entry", "blob"])
def test_a_fifo_in_a_file_store_is_refused(packed, tmp_path, what):
    store, p, published = _publish(packed, tmp_path)
    target = _entry_path(store, "tiny", p.artifact.key) if what == "index entry" else _blob_path(store, published.blob)
    target.unlink()
    os.mkfifo(target)
    with time_cap(30):
        got = fetch.fetch(tiny_recipe(), store, tmp_path / "node")
    assert not got.hit and any("not a regular file" in w for w in got.warnings), got.warnings


def test_a_fifo_planted_at_the_lock_is_refused(packed, tmp_path):
    p = packed("a")
    root = tmp_path / "node" / "root"
    root.parent.mkdir()
    os.mkfifo(restore.lock_path(root))
    with time_cap(20), pytest.raises(restore.RestoreError, match="not a regular file"):
        restore.restore_file(p.path, root)


def _lock_holder(path: Path, how: str) -> subprocess.Popen:
    """A process that holds the lock file at path (LOCK_SH or LOCK_EX) until its stdin closes."""
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.{how}); "
                               "print('held', flush=True); sys.stdin.read()", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"  # the lock is taken: synchronised by the pipe
    return holder


def test_a_lock_held_by_another_process_times_out_naming_it(packed, tmp_path):
    p = packed("a")
    root = tmp_path / "node" / "root"
    root.parent.mkdir()
    holder = _lock_holder(restore.lock_path(root), "LOCK_EX")
    try:
        with time_cap(30), pytest.raises(restore.RestoreError,
                                         match=rf"still held after 1 s by pid {holder.pid} \(.*\), running since "):
            restore.restore_file(p.path, root, lock_timeout=1)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert restore.restore_file(p.path, root).status == "restored"  # released: the next restore goes through


def test_a_shared_lock_holder_is_waited_on_briefly_not_for_the_whole_timeout(packed, tmp_path, monkeypatch):
    """warmer locks exclusively: a LOCK_SH holder is never a restore, so the default 900 s does not apply."""
    p = packed("a")
    root = tmp_path / "node" / "root"
    root.parent.mkdir()
    monkeypatch.setattr(restore, "FOREIGN_HOLDER_WAIT_S", 0.5)
    holder = _lock_holder(restore.lock_path(root), "LOCK_SH")
    try:
        with time_cap(30), pytest.raises(restore.RestoreError, match=f"held shared .* after 0 s by pid {holder.pid}"):
            restore.restore_file(p.path, root)  # lock_timeout: the default, 900 s
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert not root.exists()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv (util-linux)")
def test_the_lock_file_is_the_root_owners_alone(packed, tmp_path):
    """Mode 0600: another local user (nobody) cannot open the lock file, so cannot hold a restore."""
    p = packed("a")
    root = tmp_path / "node" / "root"
    root.parent.mkdir()
    root.parent.chmod(0o755)
    tmp_path.chmod(0o755)
    lock = restore.lock_path(root)
    lock.write_bytes(b"")
    lock.chmod(0o644)  # as an older warmer made it: the next restore takes that back
    assert restore.restore_file(p.path, root).status == "restored"
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                          "import sys; open(sys.argv[1], 'a')", str(lock)], capture_output=True, text=True)
    assert out.returncode != 0 and "Permission denied" in out.stderr, out.stderr


# -- 2. signatures bound to what was asked for ---------------------------------------------------

def _other_recipe(name="other"):
    return parse({"name": name, "model": {"path": "/models/tiny"}, "engine": {"max_model_len": 128},
                  "env": {"VLLM_USE_AOT_COMPILE": "0"},
                  "workload": {"prompt_lengths": [8], "batch_sizes": [1], "max_tokens": 4}}, Path(f"{name}.toml"))


def test_a_signed_entry_copied_into_another_recipes_slot_is_refused(packed, tmp_path):
    keys = _keypair(tmp_path, "builder")
    store, p, _ = _publish(packed, tmp_path, key_pair=keys)
    other = _other_recipe()
    other_key = packed("o", recipe=other).artifact.key
    slot = _entry_path(store, "other", other_key)
    slot.parent.mkdir(parents=True)
    slot.write_bytes(_entry_path(store, "tiny", p.artifact.key).read_bytes())
    got = fetch.fetch(other, store, tmp_path / "node", trusted_keys=[keys[1]])
    assert got.status == "untrusted" and any("copied into another slot" in w for w in got.warnings), got.warnings
    assert restore.active(tmp_path / "node") is None


def test_a_signed_entry_copied_into_another_keys_slot_is_refused(packed, tmp_path):
    keys = _keypair(tmp_path, "builder")
    from tests.fixtures import nodes
    h200 = packed("h200", fp=nodes.gpu_node("h200"))  # the same recipe, another node kind: another key
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, h200.path, str(keys[0]))
    here_key = packed("here").artifact.key  # this node's key, never published
    slot = _entry_path(store, "tiny", here_key)
    slot.write_bytes(_entry_path(store, "tiny", h200.artifact.key).read_bytes())
    got = fetch.fetch(tiny_recipe(), store, tmp_path / "node", trusted_keys=[keys[1]])
    assert got.status == "untrusted" and any("copied into another slot" in w for w in got.warnings)


def _older_copy(p, tmp_path: Path, created_at: str, name: str = "old") -> Path:
    """The same artifact, re-dated: an earlier build of the same key."""
    doc = p.artifact.to_json()
    doc["created_at"] = created_at
    doc["timings"] = {"build": {"name": name}}
    path = tmp_path / f"{name}.tar.zst"
    path.write_bytes(p.path.read_bytes())
    archive.replace_manifest(path, canonical(doc))
    return path


def test_a_rollback_to_an_older_signed_build_of_the_same_key_is_refused(packed, tmp_path):
    keys = _keypair(tmp_path, "builder")
    store, p, _ = _publish(packed, tmp_path, key_pair=keys)
    old_store = open_store(f"file://{tmp_path / 'old-store'}")
    build.publish(old_store, _older_copy(p, tmp_path, "2020-01-01T00:00:00+00:00"), str(keys[0]))
    node = tmp_path / "node"
    assert fetch.fetch(tiny_recipe(), store, node, trusted_keys=[keys[1]]).status == "hit"
    # A store writer puts the older signed entry (and its blob) back into the slot.
    got = fetch.fetch(tiny_recipe(), old_store, node, trusted_keys=[keys[1]])
    assert got.status == "rollback" and any("older than the signed one active" in w for w in got.warnings)
    assert restore.active(node).artifact.timings["build"]["name"] == "a"
    # Leaving the active build on purpose, as the message says: its entry removed, a rebuild (newer) taken.
    assert any("`warmer rm` the slot's entry and build again" in w for w in got.warnings), got.warnings
    rebuilt = open_store(f"file://{tmp_path / 'rebuilt-store'}")
    build.publish(rebuilt, _older_copy(p, tmp_path, "2099-01-01T00:00:00+00:00"), str(keys[0]))
    assert fetch.fetch(tiny_recipe(), rebuilt, node, trusted_keys=[keys[1]]).status == "hit"
    assert restore.active(node).artifact.created_at.startswith("2099")


def test_a_rebuild_replaces_a_build_whose_builders_clock_ran_ahead(packed, tmp_path):
    """A bad build from a machine whose clock ran hours ahead: the README's way off it (`warmer rm`,
    build again) was refused on every node holding it as a rollback, until that hour came. A date
    ahead of the node's clock orders nothing; one within the slack still does."""
    from datetime import UTC, datetime, timedelta

    keys = _keypair(tmp_path, "builder")
    store, p, _ = _publish(packed, tmp_path, key_pair=keys)
    node = tmp_path / "node"
    ahead = open_store(f"file://{tmp_path / 'ahead-store'}")
    later = (datetime.now(UTC) + timedelta(hours=3)).isoformat(timespec="seconds")
    build.publish(ahead, _older_copy(p, tmp_path, later, "ahead"), str(keys[0]))
    assert fetch.fetch(tiny_recipe(), ahead, node, trusted_keys=[keys[1]]).status == "hit"
    rebuilt = fetch.fetch(tiny_recipe(), store, node, trusted_keys=[keys[1]])  # created now, by a right clock
    assert rebuilt.status == "hit", rebuilt.warnings
    assert restore.active(node).artifact.timings["build"]["name"] == "a"

    soon = open_store(f"file://{tmp_path / 'soon-store'}")  # a minute ahead: within the slack, still ordered
    build.publish(soon, _older_copy(p, tmp_path, (datetime.now(UTC) + timedelta(minutes=1)).isoformat(), "soon"),
                  str(keys[0]))
    assert fetch.fetch(tiny_recipe(), soon, node, trusted_keys=[keys[1]]).status == "hit"
    assert fetch.fetch(tiny_recipe(), store, node, trusted_keys=[keys[1]]).status == "rollback"


def test_a_rollback_between_builds_dated_alike_by_source_date_epoch_is_refused(packed, tmp_path):
    """SOURCE_DATE_EPOCH gives a bad build and its rebuild from one commit the same created_at:
    when the key signed each orders them, so the bad one cannot be put back over the rebuild."""
    keys = _keypair(tmp_path, "builder")
    p = packed("a")
    epoch = "2025-11-24T16:00:00+00:00"
    stores = {}
    for name in ("bad", "fixed"):  # signed in this order
        stores[name] = open_store(f"file://{tmp_path / name}-store")
        build.publish(stores[name], _older_copy(p, tmp_path, epoch, name), str(keys[0]))
    node = tmp_path / "node"
    assert fetch.fetch(tiny_recipe(), stores["bad"], node, trusted_keys=[keys[1]]).status == "hit"
    assert fetch.fetch(tiny_recipe(), stores["fixed"], node, trusted_keys=[keys[1]]).status == "hit"
    back = fetch.fetch(tiny_recipe(), stores["bad"], node, trusted_keys=[keys[1]])
    assert back.status == "rollback" and any("older than the signed one active" in w for w in back.warnings)
    assert restore.active(node).artifact.timings["build"]["name"] == "fixed"
    # The older file published again with the key: the signature beside it keeps its time, refused still.
    _entry_path(stores["bad"], "tiny", p.artifact.key).unlink()
    build.publish(stores["bad"], tmp_path / "bad.tar.zst", str(keys[0]))
    assert fetch.fetch(tiny_recipe(), stores["bad"], node, trusted_keys=[keys[1]]).status == "rollback"
    # The bad entry's time taken off (an older warmer's signature) or moved later: still refused.
    entry_path = _entry_path(stores["bad"], "tiny", p.artifact.key)
    entry = json.loads(entry_path.read_text())
    for forged in ({"signed_at": "2099-01-01T00:00:00+00:00"}, {"signed_at": None, "time_signature": None}):
        sig = {k: v for k, v in {**entry["signature"], **forged}.items() if v is not None}
        entry_path.write_text(json.dumps({**entry, "signature": sig}))
        got = fetch.fetch(tiny_recipe(), stores["bad"], node, trusted_keys=[keys[1]])
        assert got.status == "rollback", (forged, got.status, got.warnings)
        assert any("signed with no time" in w and "rebuild it with this one" in w for w in got.warnings), got.warnings
    assert restore.active(node).artifact.timings["build"]["name"] == "fixed"


# -- 3. the env file cannot run code -------------------------------------------------------------

def test_env_values_are_quoted_and_bad_names_refused(tmp_path):
    hostile = {"A": "$(touch {p})", "B": "x; touch {p}", "C": "`touch {p}`"}
    proof = tmp_path / "proof"
    env = EnvFile.of({k: v.format(p=proof) for k, v in hostile.items()})
    for fmt in ("dotenv", "shell"):
        f = tmp_path / f"env.{fmt}"
        f.write_text(env.render(fmt))
        out = subprocess.run(["sh", "-c", f'set -a; . "{f}"; set +a; printf %s "$A|$B|$C"'], capture_output=True,
                             text=True)
        assert out.returncode == 0 and not proof.exists(), fmt
        assert out.stdout == "|".join(v.format(p=proof) for v in hostile.values())
        assert EnvFile.parse(f.read_text()).vars == env.vars
    for bad in ("X=1; touch /tmp/p; Y", "A\nB", "1A", ""):
        with pytest.raises(EnvFileError, match="not a valid variable name"):
            EnvFile.of({bad: "1"})
    with pytest.raises(EnvFileError, match="NUL"):
        EnvFile.of({"A": "x\0y"})
    with pytest.raises(EnvFileError, match="use --env-format shell"):
        EnvFile.of({"A": "it's\nmultiline"}).render("dotenv")


# -- 4. planted files beside the root ------------------------------------------------------------

def test_a_planted_staging_symlink_never_becomes_the_root(packed, tmp_path):
    p = packed("a")
    base = tmp_path / "node"
    evil = tmp_path / "evil"
    make_cache_tree(evil)
    (evil / restore.MARKER).write_text("{}")
    base.mkdir()
    planted = base / ".root.staging-0123.old"
    os.symlink(evil, planted)
    restore.restore_file(p.path, base / "root")
    assert not (base / "root").is_symlink() and restore.active(base / "root").artifact.id == p.artifact.id
    assert planted.is_symlink() and (evil / restore.MARKER).read_text() == "{}"  # left alone, not followed


def test_a_symlink_at_the_lock_is_refused_and_creates_nothing(packed, tmp_path):
    p = packed("a")
    root = tmp_path / "node" / "root"
    root.parent.mkdir()
    target = tmp_path / "elsewhere" / "created-by-warmer"
    target.parent.mkdir()
    os.symlink(target, restore.lock_path(root))
    with pytest.raises(restore.RestoreError, match="symbolic link"):
        restore.restore_file(p.path, root)
    assert not target.exists()


# -- 5. back-dating stays inside the root ---------------------------------------------------------

def test_backdate_changes_nothing_outside_the_root(tmp_path, monkeypatch):
    root = tmp_path / "root"
    module = root / "flashinfer" / ".cache" / "flashinfer" / "0.7" / "90a" / "cached_ops" / "m"
    module.mkdir(parents=True)
    (module / "m.so").write_bytes(b"so")
    os.utime(module / "m.so", ns=(10**18, 10**18))
    inside, outside = module / "gen.cu", tmp_path / "system" / "header.h"
    outside.parent.mkdir()
    for f in (inside, outside):
        f.write_text("x")
        os.utime(f, ns=(2 * 10**18, 2 * 10**18))
    monkeypatch.setattr(flashinfer_jit, "newer_inputs", lambda r, env: [(str(inside), "m"), (str(outside), "m")])
    monkeypatch.setattr(flashinfer_jit, "modules_by_name", lambda r: {"m": module})
    result = flashinfer_jit.backdate(root, {}, apply=True, include_site_packages=True)
    assert result["files"] == [str(inside)] and result["held_back_outside_root"] == [str(outside)]
    assert inside.stat().st_mtime_ns < 10**18 and outside.stat().st_mtime_ns == 2 * 10**18


# -- 6. a newer entry is a miss, not a failed pod -------------------------------------------------

def test_a_newer_index_entry_is_a_miss_with_an_env_file(packed, tmp_path):
    store, p, _ = _publish(packed, tmp_path)
    path = _entry_path(store, "tiny", p.artifact.key)
    entry = json.loads(path.read_text())
    entry["schema"] = 2
    path.write_text(json.dumps(entry))
    recipe, env_file = write_tiny_recipe(tmp_path / "tiny.toml"), tmp_path / "vllm.env"
    args = ["fetch", recipe, "--store", store.url, "--root", tmp_path / "node", "--env-file", env_file]
    out = run_warmer(*args)
    assert out.returncode == 0 and "schema 2" in out.stderr and "Traceback" not in out.stderr
    assert "VLLM_CACHE_ROOT=" in env_file.read_text()
    assert run_warmer(*args, "--require").returncode == 3


# -- 7. gc goes by where an entry is, not by what it says --------------------------------------------

def test_a_copied_entry_cannot_make_gc_delete_the_real_newest(packed, tmp_path):
    store, p, published = _publish(packed, tmp_path)
    from tests.fixtures import nodes
    h200 = packed("h200", fp=nodes.gpu_node("h200"))
    build.publish(store, h200.path)
    planted = _entry_path(store, "tiny", "e" * 64)
    planted.write_bytes(_entry_path(store, "tiny", p.artifact.key).read_bytes())  # claims to be the real one
    with pytest.raises(catalog.StoreError, match="unreadable"):
        catalog.gc(store, 1)
    assert _entry_path(store, "tiny", p.artifact.key).exists()  # nothing was deleted
    listing = catalog.ls(store)
    assert {r.key for r in listing.rows} == {p.artifact.key, h200.artifact.key}
    assert [u.key for u in listing.unreadable] == ["e" * 64]
    removed = catalog.rm(f"{store.url}/index/tiny/{'e' * 16}", yes=True)
    assert removed.blob is None and not planted.exists()
    assert catalog.gc(store, 1).kept_entries == 2  # one per machine kind


# -- 8. publish reads the whole artifact; rm removes one -------------------------------------------

def test_publish_refuses_a_truncated_artifact_and_rm_removes_one(packed, tmp_path):
    p = packed("a", extra={"inductor/big.so": os.urandom(2 << 20)})
    truncated = tmp_path / "truncated.tar.zst"
    truncated.write_bytes(p.path.read_bytes()[:-100_000])
    store = open_store(f"file://{tmp_path / 'store'}")
    with pytest.raises(build.BuildError, match="not publishing"):
        build.publish(store, truncated)
    assert not (Path(store.base) / "index").exists() and not (Path(store.base) / "blobs").exists()
    published = build.publish(store, p.path)
    url = f"{store.url}/index/tiny/{p.artifact.key[:12]}"
    dry = run_warmer("rm", url)
    assert dry.returncode == 0 and "--yes" in dry.stderr and _entry_path(store, "tiny", p.artifact.key).exists()
    out = run_warmer("rm", url, "--yes", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["blob_deleted"] and not _blob_path(store, published.blob).exists()
    [audit] = (Path(store.base) / "audit").iterdir()
    record = json.loads(audit.read_text())
    assert record["action"] == "rm" and record["key"] == p.artifact.key and record["blob"] == published.blob


# -- 9. roots warmer did not create, forged markers, oversized entries -------------------------------

def test_restore_refuses_a_directory_warmer_did_not_create(packed, tmp_path):
    p = packed("a")
    root = tmp_path / "data"
    root.mkdir()
    (root / "precious.txt").write_text("mine")
    with pytest.raises(restore.RestoreError, match="--force"):
        restore.restore_file(p.path, root)
    assert (root / "precious.txt").read_text() == "mine"
    out = run_warmer("restore", p.path, "--root", root)
    assert out.returncode == 1 and "--force" in out.stderr
    assert run_warmer("restore", p.path, "--root", root, "--force").returncode == 0
    assert not (root / "precious.txt").exists()


def test_a_forged_marker_is_not_trusted_with_trusted_keys(packed, tmp_path):
    keys = _keypair(tmp_path, "builder")
    store, p, _ = _publish(packed, tmp_path, key_pair=keys)
    node = tmp_path / "node"
    assert fetch.fetch(tiny_recipe(), store, node, trusted_keys=[keys[1]]).status == "hit"
    marker = restore.active(node)
    # A pod rewrites a cached file and the marker, without the signature (it has no key).
    rel = next(r for r in p.files if r.endswith(".so"))
    (node / rel).write_bytes(b"evil")
    (node / restore.MARKER).write_bytes(restore.Marker(marker.artifact, marker.archive_sha256, marker.restored_at,
                                                       None).to_bytes())
    got = fetch.fetch(tiny_recipe(), store, node, trusted_keys=[keys[1]])
    assert got.status == "hit"  # restored again, not taken as already active
    assert (node / rel).read_bytes() == p.files[rel]


def test_an_oversized_or_deeply_nested_entry_is_refused_cheaply(packed, tmp_path):
    store, p, _ = _publish(packed, tmp_path)
    path = _entry_path(store, "tiny", p.artifact.key)
    path.write_bytes(b"[" * 200_000 + b"]" * 200_000)
    got = fetch.fetch(tiny_recipe(), store, tmp_path / "n1")
    assert got.status == "untrusted" and any("nests" in w for w in got.warnings), got.warnings
    with open(path, "wb") as f:
        f.truncate(70 << 20)  # 70 MB of zeros: over the cap
    got = fetch.fetch(tiny_recipe(), store, tmp_path / "n2")
    assert not got.hit and any("larger than" in w for w in got.warnings), got.warnings


def test_ctrl_c_in_fetch_exits_130_without_a_traceback(packed, tmp_path):
    store, p, _ = _publish(packed, tmp_path)
    root = tmp_path / "node" / "root"
    root.parent.mkdir()
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    with open(restore.lock_path(root), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held here: the fetch waits for it
        # SIGINT at its default in the child: a test run started in the background by a shell
        # without job control (`cmd &`, nohup) has it ignored, and Python then never raises on it.
        proc = subprocess.Popen([sys.executable, "-m", "warmer", "fetch", str(recipe), "--store", store.url,
                                 "--root", str(root)], cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        for line in proc.stderr:  # synchronised on what it prints when it starts to wait
            if "waiting up to" in line:
                break
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        assert proc.wait(timeout=30) == 130
    assert "interrupted" in rest and "Traceback" not in rest


def _child_running(parent: int, marker: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and marker in cmdline:
            return int(entry.name)
    return None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM (the `cpu` extra) is not installed")
def test_sigterm_in_verify_stops_the_engine_it_started(tmp_path):
    """The engine child runs in a process group of its own: SIGTERM to warmer must take it down too."""
    # An empty model directory: there (a missing one is refused before any engine starts), but the
    # engine only finds it holds no model after seconds of importing vLLM.
    (tmp_path / "no-model").mkdir()
    recipe = write_tiny_recipe(tmp_path / "tiny.toml", model_path=str(tmp_path / "no-model"))
    proc = subprocess.Popen([sys.executable, "-m", "warmer", "verify", str(recipe), "--root", str(tmp_path / "root"),
                             "--workdir", str(tmp_path / "work")], cwd=REPO, stderr=subprocess.PIPE, text=True)
    child = None
    with time_cap(120):  # the engine child imports vLLM for seconds: it is found while it does
        while child is None and proc.poll() is None:
            child = _child_running(proc.pid, "warmer.workload")
            time.sleep(0.05)  # polls /proc for a condition nothing signals
    assert child is not None, "the engine child was never seen"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert "terminated" in proc.stderr.read()
    assert not Path(f"/proc/{child}").exists()  # killed and reaped, not left running


def test_sigterm_as_the_engine_child_starts_stops_it_too(tmp_path, monkeypatch):
    """SIGTERM that lands once the engine child has exec'd but before Popen returns (or before the
    run's cleanup covers it) left the engine running with its parent gone. Here the signal is raised
    right after the child starts, inside the Popen call warmup makes."""
    from warmer import warmup
    from warmer.cli import _terminated
    from warmer.errors import Terminated

    (tmp_path / "no-model").mkdir()
    recipe = tiny_recipe(model_path=str(tmp_path / "no-model"))
    started: list[int] = []
    real_popen = subprocess.Popen

    def popen_then_sigterm(*args, **kwargs):
        child = real_popen(*args, **kwargs)
        started.append(child.pid)
        signal.raise_signal(signal.SIGTERM)
        return child

    monkeypatch.setattr(subprocess, "Popen", popen_then_sigterm)
    before = signal.signal(signal.SIGTERM, _terminated)
    try:
        with pytest.raises(Terminated):
            warmup.run_engine(recipe, tmp_path / "root", tmp_path / "work", "cold")
    finally:
        signal.signal(signal.SIGTERM, before)
    try:
        assert started and not Path(f"/proc/{started[0]}").exists()  # killed and reaped, not left running
    finally:
        if started and Path(f"/proc/{started[0]}").exists():
            os.killpg(started[0], signal.SIGKILL)
