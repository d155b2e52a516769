"""Pack → publish → fetch → restore through the file store and the CLI, on a fake cache tree."""

import json
import os
from pathlib import Path

import pytest

from tests.conftest import publish_at_once, run_warmer, tiny_recipe, write_tiny_recipe
from warmer import build, fetch, restore
from warmer.errors import UsageError
from warmer.store import open_store

def _recipe_file(tmp_path, max_model_len=128):
    return write_tiny_recipe(tmp_path / f"tiny-{max_model_len}.toml", max_model_len=max_model_len)




@pytest.fixture
def published(tmp_path, packed):
    p = packed("a", timings={"build": {"init_engine_s": 30.0}})
    store = open_store(f"file://{tmp_path / 'store'}")
    result = build.publish(store, p.path)
    return {"store": store, "recipe": tiny_recipe(), "doc": p.artifact, "files": p.files, "artifact": p.path,
            "publish": result, "source": p.source}


def test_pack_takes_cache_files_and_leaves_locks_and_scratch(published):
    paths = {f.path for f in published["doc"].files}
    assert paths == set(published["files"])
    comps = published["doc"].components
    assert comps["inductor-headers"].files == 1 and comps["inductor"].files == 3


def test_publish_is_idempotent_and_first_writer_wins(published, tmp_path):
    assert published["publish"].status == "published" and published["publish"].blob_uploaded
    again = build.publish(published["store"], published["artifact"])
    assert again.status == "already-published" and not again.blob_uploaded
    # Eight builders of the same key race with different artifacts: exactly one entry wins.
    root = published["source"]
    arts = []
    for i in range(8):
        arts.append(tmp_path / f"race{i}.tar.zst")
        build.pack_root(root, tiny_recipe(max_model_len=64), arts[-1], timings={"build": {"run": i}})
    results = publish_at_once([published["store"]] * 8, arts)
    assert sorted(r.status for r in results) == ["already-published"] * 7 + ["published"]
    winner = next(r for r in results if r.status == "published")
    assert all((r.published_blob or winner.blob) == winner.blob for r in results)
    # The losers leave no blob behind: none uploaded, or each removed the one it uploaded.
    first = published["publish"].blob
    assert {b.sha256 for b in published["store"].list_blobs()} == {first, winner.blob}


def test_publishing_again_mends_an_entry_whose_blob_is_gone(published, tmp_path):
    """A blob deleted under its entry (by hand, a lifecycle rule): every node misses, and fetch's
    line says to publish the artifact again. That publish uploads the blob again; a file of another
    build of the key cannot, and says which blob the entry lacks."""
    store, blob = published["store"], published["publish"].blob
    store.delete_blob(blob)
    got = fetch.fetch(published["recipe"], store.url, tmp_path / "node-a")
    assert got.status == "error" and any("publish the artifact again" in w for w in got.warnings), got.warnings

    other = tmp_path / "other.tar.zst"  # the same key, other bytes (its timings)
    build.pack_root(published["source"], tiny_recipe(), other, timings={"build": {"run": 2}})
    refused = build.publish(store, other)
    assert refused.status == "already-published" and refused.missing_blobs == (blob,) and not refused.mended

    mended = build.publish(store, published["artifact"])
    assert mended.status == "mended" and mended.blob_uploaded and mended.mended == (blob,)
    assert mended.bytes_uploaded == published["artifact"].stat().st_size
    assert fetch.fetch(published["recipe"], store.url, tmp_path / "node-b").status == "hit"
    again = build.publish(store, published["artifact"])  # nothing missing: nothing sent
    assert again.status == "already-published" and again.mended is None and not again.blob_uploaded


def test_fetch_restores_verified_files_and_is_then_a_no_op(published, tmp_path):
    node_root = tmp_path / "node-root"
    got = fetch.fetch(published["recipe"], published["store"].url, node_root).to_json()
    assert got["status"] == "hit", got["warnings"]
    for rel, content in published["files"].items():
        assert (node_root / rel).read_bytes() == content
    assert got["env"]["VLLM_CACHE_ROOT"] == str(node_root / "vllm")
    assert got["env"]["TMPDIR"] == str(node_root / "tmp") and (node_root / "tmp").is_dir()
    assert got["env"]["VLLM_USE_AOT_COMPILE"] == "0"
    assert got["env"]["VLLM_RPC_BASE_PATH"] == "/tmp"  # short socket paths whatever the root
    # Restored under another root: the relocatable caches are fine, so no warning about them.
    assert not [w for w in got["warnings"] if "will rebuild" in w]
    again = fetch.fetch(published["recipe"], published["store"].url, node_root).to_json()
    assert again["status"] == "already-active" and again["restore"]["seconds"] < 0.5
    assert not list(tmp_path.glob(".node-root.staging-*"))


def test_a_corrupt_blob_is_never_activated(published, tmp_path):
    node_root = tmp_path / "node-root"
    restore.prepare(node_root)  # as a miss leaves it: vLLM compiled into it
    (node_root / "vllm" / "previous.json").write_text("previous cache")
    blob = published["publish"].blob
    path = Path(published["store"].base) / "blobs" / "sha256" / blob[:2] / f"{blob}.tar.zst"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    got = fetch.fetch(published["recipe"], published["store"].url, node_root)
    assert got.status == "error"
    assert any("unchanged" in w for w in got.warnings), got.warnings
    assert (node_root / "vllm" / "previous.json").read_text() == "previous cache"
    assert not (node_root / restore.MARKER).exists()
    assert not list(tmp_path.glob(".node-root.staging-*"))


@pytest.mark.parametrize("offered", [True, False], ids=["refused", "miss"])
def test_a_root_of_someone_elses_files_is_left_as_it_is_fetch_after_fetch(published, tmp_path, offered):
    """fetch refuses to replace a root warmer did not make; it must not mark it as warmer's either,
    or the next fetch (a pod restart, the prefetch timer's next round) replaces it whole. vLLM is
    sent to a cold directory of its own meanwhile."""
    root = tmp_path / "node-root"
    root.mkdir()
    (root / "my-notes.txt").write_text("precious")
    recipe = published["recipe"] if offered else tiny_recipe(max_model_len=4096)  # a recipe nobody built
    for _ in range(2):
        got = fetch.fetch(recipe, published["store"].url, root)
        assert got.status in ("error", "miss"), got.status
        assert sorted(p.name for p in root.iterdir()) == ["my-notes.txt"]
        assert not str(got.env.vars["VLLM_CACHE_ROOT"]).startswith(str(root)), got.env.vars
        assert any("warmer did not put there" in w for w in got.warnings), got.warnings
        assert not any("pass --force" in w for w in got.warnings)  # fetch has no --force


def test_a_directory_of_roots_given_as_the_root_is_named_so_not_to_be_removed(published, tmp_path):
    """--root /cache for --root /cache/RECIPE: the advice for files warmer did not put there was to
    remove them, which here is every recipe's warmed cache."""
    base = tmp_path / "cache"
    assert fetch.fetch(published["recipe"], published["store"].url, base / "tiny").hit
    got = fetch.fetch(published["recipe"], published["store"].url, base)
    assert not got.hit and (base / "tiny" / restore.MARKER).is_file()  # left as it was
    said = " ".join(got.warnings)
    assert f"{base} holds warmer roots (tiny)" in said and f"--root {base}/RECIPE" in said, said
    assert "remove them" not in said
    # nor does --force, given for another reason (an artifact of another recipe), replace them
    with pytest.raises(restore.RestoreError, match="a directory of roots, not a root \\(not even with --force\\)"):
        restore.restore_file(published["artifact"], base, force=True)
    assert (base / "tiny" / restore.MARKER).is_file()
    # a root once restored into ROOT/ROOT (given its own path twice) is said as that
    mistaken = tmp_path / "rr" / "tiny"
    restore.restore_file(published["artifact"], mistaken / "tiny")
    with pytest.raises(restore.RestoreError, match=f"holds a warmer root of its own name, {mistaken / 'tiny'}"):
        restore.restore_file(published["artifact"], mistaken)


def test_a_root_of_cache_directories_alone_is_warmers_even_without_its_mark(published, tmp_path):
    """A root that lost .warmer-root (a cleaner of old files) but holds nothing but the caches warmer
    points vLLM at is still restored into, not left cold for good."""
    root = tmp_path / "node-root"
    restore.prepare(root)
    (root / "vllm" / "modelinfos.json").write_text("{}")
    (root / restore.PREPARED).unlink()
    assert fetch.fetch(published["recipe"], published["store"].url, root).status == "hit"


def test_a_root_this_user_cannot_look_into_is_a_cold_start_not_a_crash(published, tmp_path, monkeypatch):
    """A root of another user's with mode 0700: looking for warmer's marker in it raises EACCES.
    These tests run as root, which no mode stops, so the lookup's PermissionError is raised here
    by hand (a stand-in); what follows it is the real fetch."""
    root = tmp_path / "node-root"

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path / restore.MARKER))

    monkeypatch.setattr(restore, "_replaceable", denied)
    monkeypatch.setattr(restore, "prepare", lambda root, owner=None: "cannot prepare it (Permission denied)")
    got = fetch.fetch(tiny_recipe(max_model_len=4096), published["store"].url, root)
    assert got.status == "miss" and any("not writable" in w for w in got.warnings), got.warnings
    assert not str(got.env.vars["VLLM_CACHE_ROOT"]).startswith(str(root)), got.env.vars


def test_miss_exits_zero_with_env_unless_required(published, tmp_path):
    recipe_file = _recipe_file(tmp_path, max_model_len=4096)  # a recipe nobody built
    env_file = tmp_path / "vllm.env"
    args = ["fetch", recipe_file, "--store", published["store"].url, "--root", tmp_path / "r", "--env-file", env_file]
    miss = run_warmer(*args)
    assert miss.returncode == 0, miss.stderr
    assert "warning: no artifact" in miss.stderr and "another version of tiny" in miss.stderr
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "r" / "vllm")
    assert run_warmer(*args, "--require").returncode == 3


def test_cli_fetch_hit_prints_env_to_source(published, tmp_path):
    out = run_warmer("fetch", _recipe_file(tmp_path), "--store", published["store"].url, "--root", tmp_path / "n")
    assert out.returncode == 0, out.stderr
    assert f"export VLLM_CACHE_ROOT={tmp_path / 'n' / 'vllm'}" in out.stdout
    assert "warmer fetch: hit" in out.stderr
    assert run_warmer("fetch", _recipe_file(tmp_path), "--store", published["store"].url, "--root", tmp_path / "n",
                   "--require").returncode == 0  # already active: still a hit


@pytest.mark.parametrize("max_model_len", [128, 4096], ids=["hit", "miss"])
def test_fetch_refuses_a_recipe_that_fails_its_schema_check(published, tmp_path, max_model_len):
    # fetch checks the recipe's schema while the first bytes download: a typo that leaves the key
    # unchanged (workload.max_token is not part of it) reaches the store, and must still be refused,
    # with nothing activated, on a hit as on a miss.
    recipe_file = _recipe_file(tmp_path, max_model_len=max_model_len)
    recipe_file.write_text(recipe_file.read_text() + "max_token = 4\n")
    root, env_file = tmp_path / "r", tmp_path / "vllm.env"
    out = run_warmer("fetch", recipe_file, "--store", published["store"].url, "--root", root, "--env-file", env_file)
    assert out.returncode == 2, out.stderr
    assert f"{recipe_file}:12:1: unknown key workload.max_token; did you mean max_tokens?" in out.stderr
    assert "Traceback" not in out.stderr and "hit" not in out.stderr
    assert not root.exists() and not env_file.exists()
    assert not list(tmp_path.glob(".r.staging-*"))
    assert fetch.fetch(tiny_recipe(max_model_len=max_model_len), published["store"].url, root).status == \
        ("hit" if max_model_len == 128 else "miss")  # the same recipe without the typo


_GOOD = {"name": "t", "model": {"path": "/m"}, "env": {"A": "1"}, "workload": {"prompt_lengths": [4]}}


@pytest.mark.parametrize("change", [
    {"name": 5}, {"name": "Bad Name"}, {"model": {"id": 5}}, {"model": "m"}, {"engine": 3}, {"engine": {"x": 1}},
    {"env": {"A": 1}}, {"env": {"A": ["1"]}}, {"env": 3}, {"workload": 3}, {"workload": {"prompt_lengths": "8"}},
    {"workload": {"prompt_lengths": [4], "sampling": 3}}, {"targets": "h200"}, {"offline": "yes"},
    {"description": 3}, {"unknown": 1},
], ids=repr)
def test_fetch_refuses_every_recipe_that_parse_refuses(tmp_path, change):
    # A fetch checks the schema late (while its first bytes download), so the recipe's values are
    # used unchecked until then: whatever they are, the outcome is parse's own RecipeError.
    from warmer.recipe import RecipeError, parse
    doc = {**_GOOD, **change}
    with pytest.raises(RecipeError) as refused:
        parse(doc, Path("r.toml"))
    root = tmp_path / "root"
    with pytest.raises(RecipeError) as e:
        fetch.fetch(parse(doc, Path("r.toml"), schema_later=True), f"file://{tmp_path / 'store'}", root)
    assert e.value.errors == refused.value.errors
    assert not root.exists()


def test_a_recipe_checked_late_still_warns_once(tmp_path, monkeypatch):
    # an engine arg newer than warmer's table is a note (warning) where another vLLM is installed:
    # a fetch that checks the schema late reports it in its warnings, once, first
    from warmer import recipe as recipe_module
    from warmer.recipe import parse
    monkeypatch.setattr(recipe_module, "_installed_vllm", lambda: "999.0.0")
    doc = {**_GOOD, "engine": {"new_in_a_later_vllm": True}}
    got = fetch.fetch(parse(doc, Path("r.toml"), schema_later=True), f"file://{tmp_path / 'store'}", tmp_path / "r")
    notes = [w for w in got.warnings if "new_in_a_later_vllm" in w]
    assert len(notes) == 1 and got.warnings[0] == notes[0] and got.status == "miss"


def test_the_recipe_file_is_the_recipe(tmp_path):
    from warmer.recipe import load
    assert load(_recipe_file(tmp_path)).digest() == tiny_recipe().digest()


def test_cli_restore_refuses_a_truncated_file(published, tmp_path):
    bad = tmp_path / "bad.tar.zst"
    data = published["artifact"].read_bytes()
    bad.write_bytes(data[: len(data) - 4000])
    out = run_warmer("restore", bad, "--root", tmp_path / "r")
    assert out.returncode == 1
    assert "not activated" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "r").exists()


def test_restore_replaces_the_previous_cache_whole(published, tmp_path):
    root = tmp_path / "r"
    restore.prepare(root)  # a root warmer prepared, where vLLM compiled after a miss
    (root / "inductor" / "stale.so").write_bytes(b"old")
    result = restore.restore_file(published["artifact"], root)
    assert result.status == "restored"
    assert not (root / "inductor" / "stale.so").exists()
    assert restore.active(root).artifact.key == published["doc"].key


def test_symlinked_root_is_refused(published, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    # The operator's input: a usage error (exit 2), before anything is read.
    with pytest.raises(UsageError, match="symlink"):
        restore.restore_file(published["artifact"], tmp_path / "link")


def test_inspect_shows_the_manifest(published):
    out = run_warmer("inspect", published["artifact"], "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["key"] == published["doc"].key


def test_gc_stops_at_an_index_directory_it_cannot_list_and_deletes_no_blob(packed):
    """A store shared by publishers and a gc job of another uid: a recipe directory the gc user cannot
    list was read as empty, so every blob its entries name looked like an orphan and went (exit 0, every
    node on those keys then missed). Directories a publish creates are listable by all, as the files
    in them are (0644); one left unlistable (an older publisher's umask 077) stops gc and ls."""
    import shutil
    import stat
    import subprocess
    import sys
    import tempfile
    from datetime import UTC, datetime, timedelta

    from tests.conftest import REPO
    from warmer import catalog

    top = Path(tempfile.mkdtemp(prefix="warmer-gc-", dir="/tmp"))  # pytest's own tmp is 0700
    try:
        top.chmod(0o755)
        store = open_store(f"file://{top / 'store'}")
        old = os.umask(0o077)  # a publisher's umask
        try:
            a = packed("a")
            blob = build.publish(store, a.path).blob
        finally:
            os.umask(old)
        index = top / "store" / "index" / "tiny"
        assert stat.S_IMODE(index.stat().st_mode) == 0o755 and stat.S_IMODE((top / "store").stat().st_mode) == 0o755
        long_ago = (datetime.now(UTC) - catalog.ORPHAN_GRACE - timedelta(hours=1)).timestamp()
        blob_file = store._blob(blob)
        os.utime(blob_file, (long_ago, long_ago))  # past the orphan grace: an unnamed blob would go
        for d in (top / "store", *(p for p in (top / "store").rglob("*") if p.is_dir())):
            d.chmod(0o777)
        index.chmod(0o700)  # as that older publisher left it: root's, unlistable by the gc user

        # Everything imported first: this Python may sit where the gc user cannot read.
        script = ("import os, sys; from warmer import cli, catalog, store; import warmer.store.file\n"
                  "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
                  "sys.exit(cli.main(sys.argv[1:]))\n")
        for argv in (["ls", "--store", store.url], ["gc", "--store", store.url, "--keep", "1"]):
            out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=REPO,
                                 timeout=120)
            assert out.returncode != 0 and f"cannot list {index}" in out.stderr, (argv, out.stdout, out.stderr)
            assert "chmod -R a+rX" in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert blob_file.exists() and store.list_index() == [("tiny", a.artifact.key)]

        # A directory warmer never writes (ext4's lost+found at the top of a dedicated disk) stops nothing.
        index.chmod(0o755)
        (top / "store" / "lost+found").mkdir(mode=0o700)
        out = subprocess.run([sys.executable, "-c", script, "gc", "--store", store.url, "--keep", "1"],
                             capture_output=True, text=True, cwd=REPO, timeout=120)
        assert out.returncode == 0 and blob_file.exists(), out.stderr
    finally:
        shutil.rmtree(top)


def test_an_entry_of_another_warmers_schema_keeps_a_warm_root_of_the_key(published, tmp_path):
    """Mid-upgrade, the store holds this key's entry in a schema this warmer cannot read: a root
    holding the key's whole artifact, intact, is kept (as when the entry is gone), where the fetch
    said `error` and failed the pod under --require. An entry whose artifact.json is of another
    schema is a version mismatch too, not `untrusted`."""
    store, recipe = published["store"], published["recipe"]
    root = tmp_path / "node"
    assert fetch.fetch(recipe, store.url, root).status == "hit"
    entry = store.base / "index" / "tiny" / f"{published['doc'].key}.json"
    doc = json.loads(entry.read_bytes())
    for newer in ({**doc, "schema": 3}, {**doc, "artifact": {**doc["artifact"], "schema": 2}}):
        entry.write_text(json.dumps(newer))
        kept = fetch.fetch(recipe, store.url, root)
        assert kept.status == "already-active", kept.warnings
        assert any("has schema" in w and "this warmer" in w for w in kept.warnings), kept.warnings
        assert any("intact, is kept: vLLM starts warm" in w for w in kept.warnings), kept.warnings
        fresh = fetch.fetch(recipe, store.url, tmp_path / f"fresh-{newer['schema']}")
        assert fresh.status == "error" and any("another warmer version" in w or "use the warmer version" in w
                                               for w in fresh.warnings), fresh.warnings


def test_two_recipes_given_one_root_are_told_each_replaces_the_other(published, tmp_path):
    """Two served models given the same --root: each fetch swapped the other's cache out from under
    its vLLM, downloading it again every start, and both said `hit`."""
    from dataclasses import replace as with_

    other = with_(tiny_recipe(), name="other")
    art = tmp_path / "other.tar.zst"
    build.pack_root(published["source"], other, art)
    store = published["store"]
    build.publish(store, art)
    root = tmp_path / "node"
    first = fetch.fetch(published["recipe"], store.url, root)
    assert first.status == "hit" and not any("replaced by recipe" in w for w in first.warnings), first.warnings
    second = fetch.fetch(other, store.url, root)
    assert second.status == "hit", second.warnings
    assert any(f"{root} held recipe tiny's artifact, now replaced by recipe other's" in w and "a root of its own" in w
               for w in second.warnings), second.warnings
