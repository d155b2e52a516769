"""A corpus of hostile index entries and markers, through every command that reads them, and
property-based fuzzing of the two parsers at the boundary (the archive's header reader and the
index entry): every input ends in a parsed value or one error type with a one-line message,
never a traceback, never a hang."""

from __future__ import annotations

import copy
import io
import json
import os
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import make_cache_tree, run_warmer, time_cap, tiny_recipe, write_tiny_recipe
from warmer import archive, build, fetch, restore
from warmer.entry import IndexEntry
from warmer.errors import UntrustedInput
from warmer.store import open_store


def _mutate(entry: dict, path: tuple, value) -> dict:
    doc = copy.deepcopy(entry)
    target = doc
    for part in path[:-1]:
        target = target[part]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


DELETE = object()
# name -> (path into the entry, new value): each was a traceback before the typed parse.
MUTATIONS = {
    "files entry without size": (("artifact", "files", 0, "size"), DELETE),
    "recipe not an object": (("artifact", "recipe"), "tiny"),
    "string fingerprint": (("artifact", "fingerprint"), "x86_64"),
    "missing path contract": (("artifact", "path_contract"), DELETE),
    "signature of the wrong shape": (("signature",), "abc"),
    "signature with a number for alg": (("signature",), {"alg": 1, "key_id": "k", "signature": "s"}),
    "huge mtime_ns": (("artifact", "files", 0, "mtime_ns"), 10 ** 30),
    "huge size": (("artifact", "files", 0, "size"), 10 ** 30),
    "negative size": (("artifact", "files", 0, "size"), -1),
    "path with dot-dot": (("artifact", "files", 0, "path"), "inductor/../../etc/passwd"),
    "blob digest not hex": (("blob", "sha256"), "not-a-digest"),
    "published_at not a time": (("published_at",), "yesterday"),
    "timings a list": (("artifact", "timings"), []),
    "gpu count a string": (("artifact", "fingerprint", "gpu", "count"), "eight"),
    "schema 2": (("schema",), 2),
}
RAW = {
    "invalid JSON": b"{not json",
    "nested 200,000 deep": b"[" * 200_000 + b"]" * 200_000,
    "a list": b"[]",
    "not UTF-8": b"\xff\xfe\x00{",
    "null": b"null",
}


@pytest.fixture(scope="module")
def real_entry(tmp_path_factory):
    from tests.conftest import make_cache_tree

    tmp = tmp_path_factory.mktemp("real")
    make_cache_tree(tmp / "src")
    art = tmp / "a.tar.zst"
    build.pack_root(tmp / "src", tiny_recipe(), art)
    store = open_store(f"file://{tmp / 'store'}")
    result = build.publish(store, art)
    raw = store.get_index("tiny", result.key)
    return {"store": store, "key": result.key, "raw": raw, "doc": json.loads(raw)}


CORPUS = sorted(MUTATIONS) + sorted(RAW) + ["/dev/urandom"]


def _plant(real_entry, case: str, tmp_path: Path):
    """A copy of the real store whose entry for this node is the hostile case."""
    base = tmp_path / "store"
    src = Path(real_entry["store"].base)
    for p in src.rglob("*"):
        if p.is_file():
            (base / p.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (base / p.relative_to(src)).write_bytes(p.read_bytes())
    slot = base / "index" / "tiny" / f"{real_entry['key']}.json"
    slot.unlink()
    if case == "/dev/urandom":
        os.symlink("/dev/urandom", slot)
    elif case in RAW:
        slot.write_bytes(RAW[case])
    else:
        path, value = MUTATIONS[case]
        slot.write_text(json.dumps(_mutate(real_entry["doc"], path, value)))
    return f"file://{base}", slot


@pytest.mark.parametrize("case", CORPUS)
def test_every_command_answers_a_hostile_entry_in_one_line(real_entry, case, tmp_path):
    store, slot = _plant(real_entry, case, tmp_path)
    with time_cap(60):
        got = fetch.fetch(tiny_recipe(), store, tmp_path / "api-root")
    assert not got.hit and got.warnings and restore.active(tmp_path / "api-root") is None

    recipe, env_file = write_tiny_recipe(tmp_path / "tiny.toml"), tmp_path / "vllm.env"
    out = run_warmer("fetch", recipe, "--store", store, "--root", tmp_path / "root", "--env-file", env_file,
                     timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "VLLM_CACHE_ROOT=" in env_file.read_text()

    ls = run_warmer("ls", "--store", store, timeout=120)
    assert ls.returncode == 0 and "Traceback" not in ls.stderr, ls.stderr
    assert "UNREADABLE" in ls.stdout or case == "schema 2" and "UNREADABLE" in ls.stdout

    inspect = run_warmer("inspect", f"{store}/index/tiny/{real_entry['key']}", "--json", timeout=120)
    assert inspect.returncode == 1 and "Traceback" not in inspect.stderr, inspect.stderr
    assert len(inspect.stderr.strip().splitlines()) == 1
    assert json.loads(inspect.stdout)["kind"] in ("untrusted-input", "store")

    # The same bytes as a marker in a root (a pod can write there): doctor says no artifact is active.
    root = tmp_path / "doctor-root"
    root.mkdir()
    (root / restore.MARKER).write_bytes(slot.read_bytes() if case != "/dev/urandom" else b"x")
    doctor = run_warmer("doctor", "--root", root, timeout=120)
    assert doctor.returncode in (0, 5) and "Traceback" not in doctor.stderr, doctor.stderr
    assert "no warmer artifact is active" in doctor.stdout


def test_doctor_on_an_env_file_with_an_unterminated_quote(tmp_path):
    env = tmp_path / "vllm.env"
    env.write_text("VLLM_CACHE_ROOT='/cache/x\n")
    out = run_warmer("doctor", "--env-file", env)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "unterminated quote" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_a_flashinfer_module_whose_build_file_is_not_text_is_judged_not_a_crash_loop(tmp_path):
    """An artifact that passes every check and holds a FlashInfer module whose build.ninja is not
    UTF-8 (a latin-1 path in it; the shared workspace is the pods' to write, too): fetch activated
    it, then crashed on the check of what it activated, before the env file, and so did every later
    fetch, serve and doctor on that root. Now the module is judged (built elsewhere: a rebuild)."""
    src = tmp_path / "src"
    make_cache_tree(src)
    module = src / "flashinfer/.cache/flashinfer/0.7.0.post1/90a/cached_ops/norm"
    module.mkdir(parents=True)
    (module / "build.ninja").write_bytes(b"# built in /data/mod\xe8les\nrule cc\n  command = true\nbuild norm.so: cc\n")
    (module / "norm.so").write_bytes(b"\x7fELF" + os.urandom(100))
    art = build.pack_root(src, tiny_recipe(), tmp_path / "a.tar.zst")
    assert art.path_contract.flashinfer is not None and art.path_contract.flashinfer.modules == ("norm",)
    build.publish(open_store(f"file://{tmp_path / 'store'}"), tmp_path / "a.tar.zst")
    recipe, root, env_file = write_tiny_recipe(tmp_path / "tiny.toml"), tmp_path / "root", tmp_path / "vllm.env"

    for attempt in ("hit", "already-active"):
        out = run_warmer("fetch", recipe, "--store", f"file://{tmp_path / 'store'}", "--root", root,
                         "--env-file", env_file, "--json", timeout=120)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert json.loads(out.stdout)["status"] == attempt and env_file.is_file()
        assert "ninja would rebuild FlashInfer module(s) norm" in out.stderr, out.stderr
    serve = run_warmer("serve", recipe, "--root", root, "--dry-run", timeout=120)
    assert serve.returncode == 0 and "Traceback" not in serve.stderr, serve.stderr
    doctor = run_warmer("doctor", "--root", root, "--env-file", env_file, timeout=120)
    assert "Traceback" not in doctor.stderr and "ninja would rebuild" in doctor.stdout, doctor.stderr


def test_a_stray_byte_in_the_markers_file_list_is_no_marker_not_a_crash_loop(tmp_path, packed):
    """Bit rot, or a pod that shares the hostPath: one byte of the active marker's file list that is
    not UTF-8. serve and doctor crashed on it (the Deployment's vllm container in CrashLoopBackOff),
    and fetch said "not activated" on every run and never replaced it. It is no marker now: serve
    starts cold and says so, and the next fetch restores over it."""
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, packed("a").path)
    recipe, root = write_tiny_recipe(tmp_path / "tiny.toml"), tmp_path / "root"
    assert fetch.fetch(tiny_recipe(), store, root).status == "hit"
    marker = root / restore.MARKER
    data = marker.read_bytes()
    at = data.index(b'"path":"') + len(b'"path":"')
    marker.write_bytes(data[:at] + b"\xff" + data[at + 1:])

    serve = run_warmer("serve", recipe, "--root", root, "--dry-run", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert serve.returncode == 0 and "Traceback" not in serve.stderr, serve.stderr
    assert f"no warmed cache is active in {root}" in serve.stderr, serve.stderr
    doctor = run_warmer("doctor", "--root", root)
    assert doctor.returncode in (0, 5) and "Traceback" not in doctor.stderr, doctor.stderr
    again = run_warmer("fetch", recipe, "--store", store.url, "--root", root, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["status"] == "hit", again.stderr
    assert restore.active(root) is not None


# -- fuzzing ----------------------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_the_archive_header_reader(data):
    """Random bytes as a decompressed tar stream: a manifest or ArchiveError, within a second."""
    with time_cap(5):
        try:
            archive.read_manifest(io.BytesIO(zstandard.ZstdCompressor().compress(data)))
        except archive.ArchiveError:
            pass


@FUZZ
@given(st.data())
def test_fuzz_mutations_of_a_real_archive(real_entry, data):
    store = real_entry["store"]
    blob = next(Path(store.base, "blobs").rglob("*.tar.zst")).read_bytes()
    head = bytearray(zstandard.ZstdDecompressor().decompressobj().decompress(blob)[:8192])
    for _ in range(data.draw(st.integers(1, 8))):
        head[data.draw(st.integers(0, len(head) - 1))] = data.draw(st.integers(0, 255))
    with time_cap(5):
        try:
            archive.read_manifest(io.BytesIO(zstandard.ZstdCompressor().compress(bytes(head))))
        except archive.ArchiveError:
            pass


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children,
                                                                                      max_size=4),
                    max_leaves=12)


def _paths(doc, prefix=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):
            yield prefix + (i,)
            yield from _paths(v, prefix + (i,))


@FUZZ
@given(st.data())
def test_fuzz_the_index_entry_parser(real_entry, data):
    """A real entry with one field replaced by any JSON value, or random bytes: an IndexEntry or
    an UntrustedInput error, never another exception."""
    paths = sorted(_paths(real_entry["doc"]), key=str)
    if data.draw(st.booleans()):
        raw = data.draw(st.binary(max_size=2048))
    else:
        path = data.draw(st.sampled_from(paths))
        raw = json.dumps(_mutate(real_entry["doc"], path, data.draw(JSON))).encode()
    with time_cap(5):
        try:
            IndexEntry.read(raw, "tiny", real_entry["key"])
        except UntrustedInput:
            pass
