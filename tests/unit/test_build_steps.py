"""The build journey as a person watching it sees it (a line as each step starts and ends), what a
re-publish leaves in the store, and packs that are the same bytes when SOURCE_DATE_EPOCH says so.

The engine run is the one part replaced here: a real one needs vLLM and tens of seconds
(tests/e2e/test_loop_cpu.py runs it, and checks the same lines on stderr). Everything around
it (pack, restore, verify's delta, publish) is the real code on real files."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest

from tests.conftest import make_cache_tree, run_warmer, tiny_recipe, write_tiny_recipe
from warmer import build, restore, warmup
from warmer.errors import StoreError, UsageError
from warmer.store import open_store
from warmer.store.file import FileStore


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def progress_lines():
    """What the "warmer" logger says at INFO (the CLI's stderr), whatever other tests did to it."""
    logger, handler = logging.getLogger("warmer"), Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


class Started(list):
    """The labels the engine was started with; envs: each start's extra_env; hold: called as a cold
    run starts (a build caught mid-warm-up)."""

    def __init__(self):
        super().__init__()
        self.envs: list[dict | None] = []
        self.hold = None


@pytest.fixture
def engine(monkeypatch):
    """warmup.run_engine without vLLM: the cold run leaves a cache tree in the root, as the warm-up
    does; later runs write nothing (a full hit). Returns the labels it was started with."""
    labels = Started()

    def run_engine(recipe, root, workdir, label, *, extra_env=None):
        warmup.require_model(recipe)
        labels.append(label)
        labels.envs.append(extra_env)
        if labels.hold is not None and label.startswith("cold"):
            labels.hold()
        restore.prepare(root)
        if label.startswith("cold"):
            make_cache_tree(root)
        workdir.mkdir(parents=True, exist_ok=True)
        log = warmup.engine_log(workdir, label)
        log.write_text("")
        return warmup.EngineRun({"engine_init_s": 1.0}, warmup.parse_log(""), 1.0, log,
                                workdir / f"{label}.home")

    monkeypatch.setattr(warmup, "run_engine", run_engine)
    return labels


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "models" / "tiny"
    path.mkdir(parents=True)
    return path


# -- progress -------------------------------------------------------------------------------------

STEP = re.compile(r"^(?P<step>.+?) (?:\.\.\.(?: \(log (?P<log>\S+)\))?|done in (?P<s>\d+\.\d) s.*)$")


def test_each_build_step_says_when_it_starts_and_ends(tmp_path, engine, model, progress_lines):
    store = open_store(f"file://{tmp_path / 'store'}")
    root, work = tmp_path / "root", tmp_path / "work"
    result = build.build(tiny_recipe(str(model)), store, root, work)
    assert result.status == "published" and engine == ["cold", "verify"]
    steps = [(m["step"], "start" if m["s"] is None else "end", m["log"]) for m in map(STEP.match, progress_lines) if m]
    assert [(s, e) for s, e, _ in steps] == [(s, e) for s in (
        f"build: fingerprint and {store.url} check", f"build: warm-up engine run from cold into {root}", "build: pack",
        f"build: restore over {root}, as a node does", "build: verify: FlashInfer ninja dry run",
        f"build: verify: engine run on {root}", f"build: publish to {store.url}") for e in ("start", "end")], \
        progress_lines
    logs = {s: log for s, e, log in steps if e == "start" and log}
    assert logs == {f"build: warm-up engine run from cold into {root}": str(work / "cold.log"),
                    f"build: verify: engine run on {root}": str(work / "verify.log")}
    ends = [line for line in progress_lines if " done in " in line]
    assert any(line.endswith(f"{result.files} files, {result.bytes / 1e6:.1f} MB into {result.artifact} "
                             f"({result.archive_bytes / 1e6:.1f} MB)") for line in ends), ends
    assert ends[-1].endswith(": published")


def test_warmer_build_shows_its_steps_on_stderr_unless_quiet_or_json(tmp_path, model):
    recipe = write_tiny_recipe(tmp_path / "tiny.toml", model_path=str(model))
    store = open_store(f"file://{tmp_path / 'store'}")
    packed = tmp_path / "a.tar.zst"
    src = tmp_path / "src"
    make_cache_tree(src)
    build.pack_root(src, tiny_recipe(str(model)), packed)
    build.publish(store, packed)  # this node's key: the build stops after its first step
    args = ["build", recipe, "--store", store.url, "--root", tmp_path / "root"]
    out = run_warmer(*args)
    assert out.returncode == 0, out.stderr
    [start, end] = [line for line in out.stderr.splitlines() if "fingerprint and" in line]
    assert start == f"warmer: build: fingerprint and {store.url} check ..."
    assert re.fullmatch(rf"warmer: build: fingerprint and {re.escape(store.url)} check done in \d+\.\d s: key "
                        r"[0-9a-f]{16}, already published: nothing to build", end), end
    for flag in ("-q", "--json"):
        out = run_warmer(*args, flag)
        assert out.returncode == 0 and "fingerprint and" not in out.stderr, out.stderr


def test_a_missing_model_stops_the_build_before_any_step(tmp_path, engine, progress_lines):
    with pytest.raises(UsageError, match=r"model path /models/absent \(model.path in tiny.toml\) does not exist"):
        build.build(tiny_recipe("/models/absent"), open_store(f"file://{tmp_path / 's'}"), tmp_path / "root",
                    tmp_path / "work")
    assert engine == [] and progress_lines == []


# -- publish: look before uploading ---------------------------------------------------------------

def _same_key_other_bytes(tmp_path, packed, name: str):
    """An artifact of the same recipe and node as packed("a"), so the same key, with other bytes."""
    return packed(name, timings={"build": {"run": name}})


def test_republishing_a_published_key_uploads_nothing(tmp_path, packed):
    store = open_store(f"file://{tmp_path / 'store'}")
    first = build.publish(store, packed("a").path)
    again = build.publish(store, _same_key_other_bytes(tmp_path, packed, "b").path)
    assert again.status == "already-published" and not again.blob_uploaded
    assert again.published_blob == first.blob and again.blob != first.blob
    assert [b.sha256 for b in store.list_blobs()] == [first.blob]  # no orphan left behind


class RacedStore(FileStore):
    """A file store in which another builder publishes the same key while this one uploads its blob:
    the race between the look and the index write, made to happen."""

    def __init__(self, path: str, rival: Path):
        super().__init__(path)
        self.rival = rival

    def _upload_blob(self, path: str, sha256: str) -> None:
        super()._upload_blob(path, sha256)
        if self.rival:
            rival, self.rival = self.rival, None
            build.publish(FileStore(str(self.base)), rival)


def test_a_publish_that_loses_the_race_removes_the_blob_it_uploaded(tmp_path, packed):
    mine, rival = packed("a"), _same_key_other_bytes(tmp_path, packed, "b")
    store = RacedStore(str(tmp_path / "store"), rival.path)
    lost = build.publish(store, mine.path)
    assert lost.status == "already-published" and lost.blob_uploaded and lost.removed_own_blob
    winner = lost.published_blob
    assert winner != lost.blob and [b.sha256 for b in store.list_blobs()] == [winner]


class NoDeleteStore(RacedStore):
    """A publisher's credentials without delete (s3:DeleteObject), as least privilege hands out: the
    store's own refusal stands in for S3's 403 (the file store has no permissions of its own)."""

    def delete_blob(self, sha256: str) -> None:
        raise StoreError(f"access denied to delete {sha256[:12]}: grant s3:DeleteObject")


def test_a_publish_that_loses_the_race_without_delete_permission_is_already_published(tmp_path, packed):
    mine, rival = packed("a"), _same_key_other_bytes(tmp_path, packed, "b")
    lost = build.publish(NoDeleteStore(str(tmp_path / "store"), rival.path), mine.path)
    assert lost.status == "already-published" and lost.removed_own_blob is False
    assert any("stays" in w and "access denied" in w for w in lost.warnings or ()), lost


def test_a_publish_that_loses_to_the_same_bytes_keeps_the_blob(tmp_path, packed):
    mine = packed("a")
    twin = tmp_path / "twin.tar.zst"
    twin.write_bytes(mine.path.read_bytes())
    store = RacedStore(str(tmp_path / "store"), twin)
    lost = build.publish(store, mine.path)
    assert lost.status == "already-published" and lost.published_blob == lost.blob and not lost.removed_own_blob
    assert [b.sha256 for b in store.list_blobs()] == [lost.blob]  # the entry's blob, never deleted


# -- SOURCE_DATE_EPOCH -------------------------------------------------------------------------------

def test_source_date_epoch_makes_packs_of_one_root_the_same_bytes(tmp_path, monkeypatch):
    src = tmp_path / "src"
    make_cache_tree(src)
    (src / "inductor" / "ab").mkdir(parents=True)
    (src / "inductor" / "ab" / "big.so").write_bytes(os.urandom(1 << 20) * 12)  # zstd's threads split it
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    one = build.pack_root(src, tiny_recipe(), tmp_path / "one.tar.zst")
    two = build.pack_root(src, tiny_recipe(), tmp_path / "two.tar.zst")
    assert one.created_at == two.created_at == "2023-11-14T22:13:20+00:00"
    assert (tmp_path / "one.tar.zst").read_bytes() == (tmp_path / "two.tar.zst").read_bytes()
    # The files keep their own times: restores (and FlashInfer's ninja) depend on them.
    entry = one.files.by_path()["inductor/ab/big.so"]
    assert entry.mtime_ns == (src / "inductor" / "ab" / "big.so").stat().st_mtime_ns
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(UsageError, match="SOURCE_DATE_EPOCH='yesterday'"):
        build.pack_root(src, tiny_recipe(), tmp_path / "three.tar.zst")


# -- what a build claims, and what it checks first ---------------------------------------------------

def test_a_bad_source_date_epoch_stops_the_build_before_the_warm_up(tmp_path, engine, model, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "")  # $(git log -1 --format=%ct) run outside a checkout
    with pytest.raises(UsageError, match="SOURCE_DATE_EPOCH=''"):
        build.build(tiny_recipe(str(model)), open_store(f"file://{tmp_path / 'store'}"), tmp_path / "root", tmp_path / "w")
    assert engine == [] and not (tmp_path / "root").exists()  # no cold run paid for, the root left empty


def test_a_second_build_on_the_same_root_is_refused_while_the_first_runs(tmp_path, engine, model):
    """Two jobs on one runner given one root: the second would warm into the first one's caches and
    pack them under its own key, and the first one's verify would swap the root under it."""
    import threading

    store, root = open_store(f"file://{tmp_path / 'store'}"), tmp_path / "root"
    warming, go_on = threading.Event(), threading.Event()

    def hold():
        warming.set()
        assert go_on.wait(30)
    engine.hold = hold
    first: list = []
    a = threading.Thread(target=lambda: first.append(build.build(tiny_recipe(str(model)), store, root, tmp_path / "a")))
    a.start()
    try:
        assert warming.wait(30)
        engine.hold = None
        with pytest.raises(build.BuildError, match=f"another warmer build is using root {root}"):
            build.build(tiny_recipe(str(model), max_model_len=64), store, root, tmp_path / "b")
    finally:
        go_on.set()
        a.join(30)
    assert first and first[0].status == "published" and engine == ["cold", "verify"]
    # Run again on the root it left (a kept root): its key is published, nothing to do.
    again = build.build(tiny_recipe(str(model)), store, root, tmp_path / "c")
    assert again.status == "already-published" and engine == ["cold", "verify"]


def test_a_published_entry_nodes_cannot_read_fails_publish_and_build(tmp_path, engine, model):
    """An entry the store altered (an S3-compatible store that kept the upload's encoding in it) or
    someone edited: every node refuses it, and publish and build said `already-published`, run after
    run, green. Both fail and name the fix; an entry of another warmer's schema stays theirs."""
    import json

    store = open_store(f"file://{tmp_path / 'store'}")
    first = build.build(tiny_recipe(str(model)), store, tmp_path / "root", tmp_path / "a")
    assert first.status == "published" and engine == ["cold", "verify"]
    entry = store.base / "index" / "tiny" / f"{first.key}.json"
    good = entry.read_bytes()
    entry.write_bytes(b"2be\r\n" + good)  # what such a store kept
    fix = f"`warmer rm {store.url}/index/tiny/{first.key} --yes`, then publish again"
    with pytest.raises(build.BuildError, match="its entry is unreadable") as e:
        build.build(tiny_recipe(str(model)), store, tmp_path / "root", tmp_path / "b")
    assert fix in str(e.value) and engine == ["cold", "verify"]  # refused before any warm-up
    with pytest.raises(build.BuildError, match="its entry is unreadable") as e:
        build.publish(store, Path(first.artifact))
    assert fix in str(e.value)

    entry.write_text(json.dumps({**json.loads(good), "schema": 99}))  # a newer warmer's
    assert build.publish(store, Path(first.artifact)).status == "already-published"


def test_a_published_key_whose_blob_is_gone_fails_the_build_that_would_say_already_published(
        tmp_path, engine, model):
    """A lifecycle rule (or a hand, or a gc that raced) deleted the blob of a published key: every
    node fetching it misses, and the CI build run again said `already-published`, green. It fails
    and names the fix; publishing the artifact file mends the entry, and the build then has nothing
    to do."""
    store = open_store(f"file://{tmp_path / 'store'}")
    first = build.build(tiny_recipe(str(model)), store, tmp_path / "root", tmp_path / "a")
    assert first.status == "published" and engine == ["cold", "verify"]
    blob = first.publish.blob
    store.delete_blob(blob)
    with pytest.raises(build.BuildError, match=f"the store lacks 1 blob.*{blob[:12]}") as e:
        build.build(tiny_recipe(str(model)), store, tmp_path / "root", tmp_path / "b")
    assert "`warmer publish FILE" in str(e.value) and f"warmer rm {store.url}/index/tiny/{first.key} --yes" in str(e.value)
    assert engine == ["cold", "verify"]  # refused before any warm-up
    assert build.publish(store, Path(first.artifact)).status == "mended"
    again = build.build(tiny_recipe(str(model)), store, tmp_path / "root", tmp_path / "c")
    assert again.status == "already-published" and engine == ["cold", "verify"]


def test_verify_starts_the_engine_with_the_env_the_artifact_is_served_with(tmp_path, engine, model):
    """A build that turned AOT off publishes that in serve_env; fetch and serve pass it on, and so
    must `warmer verify` on a node: with vLLM 0.32's default (AOT on) that start would compile. So
    too what a component needs for what the artifact holds: the builder's user name, under which
    torch finds the precompiled header (tmp/torchinductor_root)."""
    from warmer import api

    src, art = tmp_path / "src", tmp_path / "a.tar.zst"
    make_cache_tree(src)
    build.pack_root(src, tiny_recipe(str(model)), art, serve_env={build.AOT_ENV: "0"})
    root = tmp_path / "root"
    restore.restore_file(art, root)
    report = api.verify(tiny_recipe(str(model)), root, workdir=tmp_path / "w")
    [env] = engine.envs
    assert engine == ["verify"] and env[build.AOT_ENV] == "0" and env["LOGNAME"] == "root"
    assert env["TMPDIR"] == str(root / "tmp")
    assert report.verdict == "hit"
