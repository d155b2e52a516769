"""Bounded work for every tar header (issue 27, item 3): pax extended headers, GNU long names and
artifact.json are capped in bytes and in count on their header block, before their payload is
read. A bomb of a few KiB that inflates to 250 MiB of headers ahead of artifact.json is refused
in well under a second and 64 MiB, by `restore` and by a signed `fetch` alike."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tracemalloc
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.conftest import REPO, make_cache_tree, time_cap, tiny_recipe, write_tiny_recipe
from tests.unit.test_signing import _keypair
from warmer import archive, build, restore
from warmer.archive import BLOCK, FileEntry, FileList
from warmer.store import MAX_INDEX_BYTES, open_store

MiB = 1 << 20


# -- building headers by hand ----------------------------------------------------------------------

def _header(name: str, size: int, kind: bytes) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _record_head(key: bytes, value_size: int) -> bytes:
    """b"LEN key=" of a pax record whose value is value_size bytes (LEN counts its own digits)."""
    rest = len(key) + 3 + value_size  # " " "=" "\n"
    digits = len(str(rest))
    if len(str(rest + digits)) != digits:
        digits += 1
    return b"%d %s=" % (rest + digits, key)


def _records(**records: str) -> bytes:
    return b"".join(_record_head(k.encode(), len(v)) + v.encode() + b"\n" for k, v in records.items())


def _pax(payload: bytes) -> bytes:
    return _header("././@PaxHeader", len(payload), tarfile.XHDTYPE) + payload + bytes(-len(payload) % BLOCK)


def _member(name: str, data: bytes) -> bytes:
    return _header(name, len(data), tarfile.REGTYPE) + data + bytes(-len(data) % BLOCK)


def _zst(data: bytes) -> io.BytesIO:
    return io.BytesIO(zstandard.ZstdCompressor().compress(data))


# -- each header refused on its block ----------------------------------------------------------------

def test_each_header_is_refused_on_its_block_before_its_payload():
    """Every stream here ends right after the header block in question: a reader that took the
    payload would fail on the missing bytes ("truncated"); each is refused for what it declares."""
    manifest = _member(archive.MANIFEST_MEMBER, b"{}")
    cases = [
        (_header("././@PaxHeader", archive.PAX_HEADER_LIMIT + 1, tarfile.XHDTYPE),
         f"pax extended header of {archive.PAX_HEADER_LIMIT + 1} bytes"),
        (_pax(_records(comment="a")) * archive.PAX_HEADERS_PER_MEMBER + _header("././@PaxHeader", 100, tarfile.XHDTYPE),
         f"more than {archive.PAX_HEADERS_PER_MEMBER} pax extended headers"),
        (_header(archive.MANIFEST_MEMBER, archive.MANIFEST_LIMIT + 1, tarfile.REGTYPE),
         f"declares {archive.MANIFEST_LIMIT + 1} bytes"),
        (_header(archive.MANIFEST_MEMBER, 250 * MiB, tarfile.REGTYPE), f"declares {250 * MiB} bytes"),
        (_pax(_records(size=str(archive.MANIFEST_LIMIT + 1))) + _header(archive.MANIFEST_MEMBER, 2, tarfile.REGTYPE),
         f"declares {archive.MANIFEST_LIMIT + 1} bytes"),
        # GNU long names and global pax headers: never a member warmer writes, refused as they come
        (_header("././@LongLink", 1 << 30, tarfile.GNUTYPE_LONGNAME), "not artifact.json"),
        (_header("././@LongLink", 1 << 30, tarfile.GNUTYPE_LONGLINK), "not artifact.json"),
        (_header("pax_global_header", 1 << 30, tarfile.XGLTYPE), "not artifact.json"),
    ]
    for stream, message in cases:
        with pytest.raises(archive.ArchiveError, match=re.escape(message)):
            archive.read_manifest(_zst(stream))
    # The same in the body, before a file: one listed as 1 GiB, so that the archive's own limit is far
    entries = FileList.of([FileEntry("inductor/a.so", 1 << 30, "0" * 64, 0o644, 0)])
    body = [(_header("PaxHeader", archive.PAX_HEADER_LIMIT + 1, tarfile.XHDTYPE), "pax extended header of"),
            (_pax(_records(comment="a")) * (archive.PAX_HEADERS_PER_MEMBER + 1),
             f"more than {archive.PAX_HEADERS_PER_MEMBER} pax extended headers"),
            (_header("LongLink", 1 << 30, tarfile.GNUTYPE_LONGNAME), "GNU long-name header"),
            (_header("LongLink", 1 << 30, tarfile.GNUTYPE_LONGLINK), "GNU long-link header"),
            (_header("pax_global_header", 1 << 30, tarfile.XGLTYPE), "global pax header")]
    for stream, message in body:
        with pytest.raises(archive.ArchiveError, match=message):
            archive.check(_zst(manifest + stream), lambda _: entries, 1 << 40)
    # what warmer writes itself still reads: a long name's pax header, one per member
    name = "inductor/" + "x" * 300 + ".so"
    data = manifest + archive.tarwrite._member_header(name, 1, 0o644, 0) + b"x" + bytes(BLOCK - 1) + bytes(2 * BLOCK)
    one = FileList.of([FileEntry(name, 1, hashlib.sha256(b"x").hexdigest(), 0o644, 0)])
    assert archive.check(_zst(data), lambda _: one, 1 << 20).files == 1


def test_artifact_json_is_capped_at_what_an_index_entry_holds():
    """artifact.json travels whole in the index entry too: one larger could never be published."""
    assert archive.MANIFEST_LIMIT == MAX_INDEX_BYTES


def test_pack_refuses_a_listing_no_reader_would_take(tmp_path, monkeypatch):
    """A root of some 300,000 files makes an artifact.json over the limit: pack says so, with each
    component's count, instead of writing an artifact that restore and publish refuse as a bomb.
    The limit is scaled down here to what the tiny root's listing exceeds."""
    make_cache_tree(tmp_path / "src")
    monkeypatch.setattr(build, "_ENTRY_HEADROOM", archive.MANIFEST_LIMIT - 1000)
    with pytest.raises(build.BuildError, match=r"lists 5 files \(inductor 3, vllm 1, inductor-headers 1\): artifact.json would take"):
        build.pack_root(tmp_path / "src", tiny_recipe(), tmp_path / "a.tar.zst")
    assert not (tmp_path / "a.tar.zst").exists()
    monkeypatch.undo()
    assert build.pack_root(tmp_path / "src", tiny_recipe(), tmp_path / "a.tar.zst").files


def test_another_form_of_artifact_json_is_bounded_by_the_one_asked_for(packed):
    """A restore compares the archive's artifact.json with the index's as it streams by. Another
    byte form of the same one (indented) is parsed, up to twice the size of the one asked for:
    4 MiB of whitespace (a store writer's, without the key) is refused before it is all read."""
    art = packed("a").artifact
    indented = json.dumps(art.to_json(), indent=1).encode()
    assert restore._files_of(art, _pieces(indented)) is art.files
    padded = art.canonical[:1] + b" " * (4 * MiB) + art.canonical[1:]
    tracemalloc.start()
    try:
        with pytest.raises(archive.ArchiveError, match="more than twice"):
            restore._files_of(art, _pieces(padded))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * MiB, peak  # a piece of the index's own bytes (1 MiB) and what was compared


def _pieces(data: bytes):
    """artifact.json in pieces (views of 64 KiB), as extraction hands it on."""
    view = memoryview(data)
    return iter([view[i:i + (64 << 10)] for i in range(0, len(view), 64 << 10)])


# -- the bombs, in a child process as users run them -----------------------------------------------------

def _write_records(w, total: int) -> None:
    """One pax header of `total` bytes of 8-byte records: millions for the parser to loop over."""
    w.write(_header("././@PaxHeader", total, tarfile.XHDTYPE))
    chunk = b"8 a=xyz\n" * (MiB // 8)
    for _ in range(total // MiB):
        w.write(chunk)


def _write_one_record(w, total: int) -> None:
    """One pax header of `total` bytes holding one record: LEN is the record's whole length."""
    head = b"%d comment=" % total
    w.write(_header("././@PaxHeader", total, tarfile.XHDTYPE) + head)
    _write_bytes(w, b"x", total - len(head) - 1)
    w.write(b"\n" + bytes(-total % BLOCK))


def _write_many_headers(w, total: int) -> None:
    """Headers of 60 KiB each, every one under the size cap: the count cap refuses them."""
    one = _pax(_records(comment="x" * (60 << 10)))
    for _ in range(total // len(one)):
        w.write(one)


def _write_bytes(w, byte: bytes, n: int) -> None:
    chunk = byte * MiB
    while n:
        w.write(chunk[:n])
        n -= min(n, MiB)


BOMBS = {"pax records": _write_records, "one pax record": _write_one_record, "many pax headers": _write_many_headers}


def _bomb(good: Path, out: Path, kind: str, size: int = 249 * MiB) -> Path:
    """good's archive with `size` bytes of `kind` ahead of its artifact.json (or, for
    "whitespace", inside it): zstd squeezes them into KiB."""
    with open(good, "rb") as f:
        body_at = archive.first_frame_size(f)
    data = good.read_bytes()
    manifest = archive.read_manifest(io.BytesIO(data))
    with open(out, "wb") as o:
        with zstandard.ZstdCompressor(level=9).stream_writer(o, closefd=False) as w:
            if kind == "whitespace":
                n = len(manifest) + size
                w.write(_header(archive.MANIFEST_MEMBER, n, tarfile.REGTYPE) + manifest[:1])
                _write_bytes(w, b" ", size)
                w.write(manifest[1:] + bytes(-n % BLOCK))
            else:
                BOMBS[kind](w, size)
                w.write(_member(archive.MANIFEST_MEMBER, manifest))
        o.write(data[body_at:])
    return out


# The child reports its own high-water mark (VmHWM of its address space) as it exits: the
# ru_maxrss that wait4 returns starts from the forking parent's (pytest's).
_REPORT_HWM = ("import atexit, re, runpy, sys; atexit.register(lambda: print('VmHWM', re.search(r'VmHWM:\\s+(\\d+)', "
               "open('/proc/self/status').read())[1], file=sys.stderr)); sys.argv[0] = 'warmer'; "
               "runpy.run_module('warmer', run_name='__main__', alter_sys=True)")


def _warmer(*args) -> tuple[subprocess.CompletedProcess, float, int]:
    """warmer ARGS in a child process: its result, wall time and peak RSS (bytes)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _REPORT_HWM, *map(str, args)], cwd=REPO, capture_output=True,
                         text=True, timeout=30)
    wall = time.perf_counter() - t0
    return out, wall, int(re.search(r"^VmHWM (\d+)$", out.stderr, re.M)[1]) * 1024


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("good")
    make_cache_tree(tmp / "src")
    build.pack_root(tmp / "src", tiny_recipe(), tmp / "a.tar.zst")
    return tmp / "a.tar.zst"


@pytest.mark.parametrize("kind", sorted(BOMBS) + ["whitespace"])
def test_a_bomb_ahead_of_the_files_is_refused_at_once(good, tmp_path, kind):
    """`warmer restore` of 249 MiB of pax headers (or of whitespace in artifact.json) squeezed
    into KiB: refused, exit 1, the root as it was, within a second and under 64 MiB."""
    bomb = _bomb(good, tmp_path / "bomb.tar.zst", kind)
    assert bomb.stat().st_size < MiB
    root = tmp_path / "root"
    done, base_wall, base_rss = _warmer("restore", good, "--root", root)
    assert done.returncode == 0, done.stderr
    marker = (root / restore.MARKER).read_bytes()
    out, wall, rss = _warmer("restore", bomb, "--root", root)
    print(f"{kind}: {bomb.stat().st_size} bytes, {wall:.2f} s and {rss / MiB:.0f} MiB "
          f"(a good restore: {base_wall:.2f} s, {base_rss / MiB:.0f} MiB)")
    assert out.returncode == 1, out.stderr
    assert re.search(r"not activated: .*(pax extended header|declares \d+ bytes, over)", out.stderr), out.stderr
    assert "Traceback" not in out.stderr
    assert (root / restore.MARKER).read_bytes() == marker and not list(tmp_path.glob(".root.staging-*"))
    assert wall < base_wall + 1.0 and rss < 64 * MiB, (wall, base_wall, rss)


@pytest.mark.parametrize("kind", ["pax records", "whitespace"])
def test_a_store_writer_without_the_key_cannot_make_a_signed_fetch_inflate_a_bomb(good, tmp_path, kind):
    """The index entry's blob digest and size are not what the signature covers: the entry is
    pointed at a bomb. `fetch --trusted-key` refuses it within a second and 64 MiB, nothing activated."""
    private, public = _keypair(tmp_path, "builder")
    art = tmp_path / "a.tar.zst"
    shutil.copy(good, art)
    (tmp_path / "store").mkdir()
    store = open_store(f"file://{tmp_path / 'store'}")
    published = build.publish(store, art, str(private))
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    fetch = ("fetch", recipe, "--store", store.url, "--trusted-key", public, "--json", "--root")
    done, base_wall, base_rss = _warmer(*fetch, tmp_path / "hit")
    assert json.loads(done.stdout)["status"] == "hit", done.stdout + done.stderr

    bomb = _bomb(good, tmp_path / "bomb.tar.zst", kind).read_bytes()
    sha = hashlib.sha256(bomb).hexdigest()
    blob = Path(store.base) / "blobs" / "sha256" / sha[:2] / f"{sha}.tar.zst"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(bomb)
    entry_file = Path(store.base) / "index" / "tiny" / f"{published.key}.json"
    entry = json.loads(entry_file.read_bytes())
    entry["blob"] = {"sha256": sha, "size": len(bomb)}
    entry_file.write_text(json.dumps(entry))

    out, wall, rss = _warmer(*fetch, tmp_path / "node")
    print(f"{kind}: {wall:.2f} s and {rss / MiB:.0f} MiB (a hit: {base_wall:.2f} s, {base_rss / MiB:.0f} MiB)")
    got = json.loads(out.stdout)
    assert got["status"] == "error", got
    # the warning is shortened in its middle: its start and end name the refusal
    assert any(re.search(r"not activated.*(pax extended head|artifact.json decl).*refused \(decompression bomb", w)
               for w in got["warnings"]), got["warnings"]
    assert restore.active(tmp_path / "node") is None
    assert wall < base_wall + 1.0 and rss < 64 * MiB, (wall, base_wall, rss)


# -- fuzzing the header reader -------------------------------------------------------------------------

# Payloads that really inflate (16 MiB of them is what a reader that takes a payload whole holds):
# compressed once, each its own zstd frame in the stream.
_FILLERS: dict[int, bytes] = {}


def _filler(n: int) -> bytes:
    if n not in _FILLERS:
        _FILLERS[n] = zstandard.ZstdCompressor().compress(b"x" * n)
    return _FILLERS[n]


FILLER_SIZES = st.sampled_from([0, 100, 70 << 10, 16 * MiB])
# Sizes a member may declare: small, past every cap, or negative; never one that would make the
# manifest itself (which a reader holds, by design) take megabytes of the stream that follows.
SIZES = st.integers(0, 4096) | st.integers(1 << 30, 1 << 70) | st.integers(-(1 << 40), -1)
KEYS = st.sampled_from(["path", "size", "mtime", "comment", "linkpath", "GNU.sparse.size", "uid"]) | st.text(max_size=8)
VALUES = (st.text(max_size=40) | SIZES.map(str) | st.just(archive.MANIFEST_MEMBER)
          | st.sampled_from(["", "-1", "1e9", "0x10", "9" * 30]))


@st.composite
def _pax_part(draw) -> list[bytes]:
    """A pax 'x' header: well-formed records, or malformed bytes, then maybe a record that really
    inflates; its declared size right, or anything."""
    if draw(st.booleans()):
        payload = b"".join(_record_head(k.encode("utf-8", "surrogateescape"), len(v.encode("utf-8", "surrogateescape")))
                           + v.encode("utf-8", "surrogateescape") + b"\n"
                           for k, v in draw(st.lists(st.tuples(KEYS, VALUES), max_size=4)))
    else:
        payload = draw(st.binary(max_size=64))
    big = draw(FILLER_SIZES)
    head = _record_head(b"comment", big) if big else b""
    size = len(payload) + len(head) + big + (1 if big else 0)
    declared = size if draw(st.booleans()) else draw(SIZES)
    block = _declared(_header("././@PaxHeader", 0, tarfile.XHDTYPE), declared)
    parts = [zstandard.ZstdCompressor().compress(block + payload + head)]
    if big:
        parts += [_filler(big), zstandard.ZstdCompressor().compress(b"\n" + bytes(-size % BLOCK))]
    else:
        parts.append(zstandard.ZstdCompressor().compress(bytes(-size % BLOCK)))
    return parts


def _declared(block: bytes, size: int) -> bytes:
    """block with its size field set to size (octal, or base-256 past 8 GiB or below 0), checksum fixed."""
    b = bytearray(block)
    if 0 <= size < 8 ** 11:
        b[archive.H_SIZE] = b"%011o\0" % size
    else:
        b[archive.H_SIZE] = (size % (1 << 88) | (0xFF << 88 if size < 0 else 0x80 << 88)).to_bytes(12, "big")
    b[archive.H_CHKSUM] = b" " * 8
    b[148:155] = b"%06o\0" % sum(b)
    return bytes(b)


@st.composite
def _other_part(draw) -> list[bytes]:
    """A GNU long name or link, a global pax header, a regular member (artifact.json or not), a
    header of any type with random fields, random bytes, or a zero block."""
    kind = draw(st.sampled_from(["gnu", "global", "member", "manifest", "any", "random", "zero"]))
    if kind == "random":
        return [zstandard.ZstdCompressor().compress(draw(st.binary(min_size=BLOCK, max_size=BLOCK)))]
    if kind == "zero":
        return [zstandard.ZstdCompressor().compress(bytes(BLOCK))]
    if kind == "any":
        b = bytearray(draw(st.binary(min_size=BLOCK, max_size=BLOCK)))
        b[archive.H_TYPE] = draw(st.sampled_from([b"0", b"x", b"g", b"L", b"K", b"S", b"5", b"\0", b"X"])
                                 | st.binary(min_size=1, max_size=1))
        if draw(st.booleans()):
            b[archive.H_MAGIC] = tarfile.POSIX_MAGIC
        return [zstandard.ZstdCompressor().compress(_declared(bytes(b), draw(SIZES)))]
    name = {"gnu": "././@LongLink", "global": "pax_global_header", "member": "inductor/a.so",
            "manifest": archive.MANIFEST_MEMBER}[kind]
    type_ = {"gnu": draw(st.sampled_from([tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK])),
             "global": tarfile.XGLTYPE}.get(kind, tarfile.REGTYPE)
    data = draw(st.binary(max_size=64)) if kind != "gnu" else b"x" * 200 + b"\0"
    big = draw(FILLER_SIZES) if kind in ("gnu", "global") else 0
    declared = len(data) + big if draw(st.booleans()) else draw(SIZES)
    parts = [zstandard.ZstdCompressor().compress(_declared(_header(name, 0, type_), declared) + data)]
    if big:
        parts.append(_filler(big))
    parts.append(zstandard.ZstdCompressor().compress(bytes(-(len(data) + big) % BLOCK)))
    return parts


STREAMS = st.lists(_pax_part() | _other_part(), min_size=1, max_size=6)
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# What the header reader may hold besides the stream it is given: a piece of the decompressed
# stream (1 MiB) and capped headers. A reader that took a 16 MiB payload whole held twice that.
MEMORY_CAP = 6 * MiB


@FUZZ
@given(STREAMS)
def test_fuzz_the_header_reader_with_pax_records_and_long_names(parts):
    """Tar streams of pax headers (well-formed, malformed, of any declared size, many), GNU long
    names, global headers and random header fields: read_manifest and extract either return or
    raise ArchiveError, within seconds, holding no more than MEMORY_CAP."""
    raw = b"".join(p for part in parts for p in part)
    empty = FileList.of([])
    for read in (lambda: archive.read_manifest(io.BytesIO(raw)),
                 lambda: archive.check(io.BytesIO(raw), lambda _: empty, 1 << 40)):
        tracemalloc.start()
        try:
            with time_cap(5):
                try:
                    read()
                    event("read")
                except archive.ArchiveError as e:
                    event(re.sub(r"'[^']*'|\d+", "N", str(e))[:60])  # what refused it, in --hypothesis-show-statistics
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < MEMORY_CAP, peak
