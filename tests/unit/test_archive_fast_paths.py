"""The fast paths of archive.py (bench/, BENCHMARKS.md): the hand-built ustar header, the
streaming tar reader and the writer threads must keep every guarantee of the slow ones."""

import hashlib
import io
import os
import subprocess
import tarfile

import pytest
import zstandard

from warmer import archive
from warmer.archive import ArchiveError, FileEntry, FileList


@pytest.mark.parametrize("name", ["a", "inductor/ab/c" + "x" * 50 + ".py", "x" * 100, "y" * 101, "ü/a.so",
                                  "flashinfer/" + "m" * 120 + "/k.so"])
@pytest.mark.parametrize("size,mode,mtime_ns", [(0, 0o644, 0), (12345, 0o755, 1_700_000_000_123_456_789),
                                                (8 ** 11 - 1, 0o600, 5 * 10 ** 9), (8 ** 11, 0o644, 0),
                                                (5, 0o4755, 10 ** 9)])
def test_member_header_is_the_one_tarfile_writes(name, size, mode, mtime_ns):
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = size, mode & archive.MODE_MASK, mtime_ns // 10 ** 9, tarfile.REGTYPE
    assert archive.tarwrite._member_header(name, size, mode, mtime_ns) == info.tobuf(format=tarfile.PAX_FORMAT,
                                                                                     encoding="utf-8", errors="strict")


def _tree(root):
    files = {
        "inductor/" + "d" * 90 + "/" + "f" * 60 + ".py": b"print('long path: a pax record')\n" * 100,
        "triton/ü-ñ/kernel.json": b'{"name": "non-ascii path"}',
        "vllm/empty": b"",
        "flashinfer/big.so": os.urandom(3 * archive.CHUNK + 12345),  # spans several chunks
        **{f"inductor/{i % 7}/c{i}.cpp": (f"// {i}\n" * (i % 50)).encode() for i in range(300)},
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def _archive(root, rels):
    body = io.BytesIO()
    entries = archive.pack_body(root, rels, body)
    out = io.BytesIO()
    body.seek(0)
    archive.assemble(b'{"files": []}', body, out)
    return out.getvalue(), entries


def test_round_trip_of_long_names_big_files_and_many_small_ones(tmp_path):
    files = _tree(tmp_path / "src")
    data, entries = _archive(tmp_path / "src", sorted(files))
    got = archive.extract(io.BytesIO(data), tmp_path / "dst", lambda m: FileList.of(entries), 1 << 30)
    assert got.files == len(files) and got.archive_sha256 == hashlib.sha256(data).hexdigest()
    for rel, content in files.items():
        assert (tmp_path / "dst" / rel).read_bytes() == content
    (tmp_path / "a.tar.zst").write_bytes(data)
    listed = subprocess.run(["tar", "--zstd", "-tf", str(tmp_path / "a.tar.zst")], capture_output=True, text=True,
                            check=True).stdout.split("\n")
    assert set(files) <= set(listed)


# GNU and global headers are named ././@...: refused for their name before their type.
@pytest.mark.parametrize("case,message", [("gnu-longname", "refused"), ("sparse", "sparse file"),
                                          ("global-pax", "refused")])
def test_headers_warmer_never_writes_are_refused(tmp_path, case, message):
    name = "inductor/" + "n" * 120 + ".so"
    entry = FileEntry(name, 1, hashlib.sha256(b"x").hexdigest(), 0o644, 0)
    info = tarfile.TarInfo(name)
    info.size = 1
    if case == "gnu-longname":
        head = info.tobuf(format=tarfile.GNU_FORMAT)
    elif case == "sparse":
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0"}
        head = info.tobuf(format=tarfile.PAX_FORMAT)
    else:
        head = (tarfile.TarInfo._create_pax_generic_header({"comment": "x"}, tarfile.XGLTYPE, "utf-8")
                + info.tobuf(format=tarfile.PAX_FORMAT))
    body = head + b"x" + bytes(tarfile.BLOCKSIZE - 1) + bytes(2 * tarfile.BLOCKSIZE)
    data = archive.manifest_frame(b"{}") + zstandard.ZstdCompressor().compress(body)
    with pytest.raises(ArchiveError, match=message):
        archive.extract(io.BytesIO(data), tmp_path / "dst", lambda m: FileList.of([entry]), 1 << 30)


def test_a_write_error_in_a_writer_thread_reaches_the_caller(tmp_path):
    """A file where the archive needs a directory: the OSError of the thread that hit it."""
    files = _tree(tmp_path / "src")
    data, entries = _archive(tmp_path / "src", sorted(files))
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "inductor").write_bytes(b"in the way")
    with pytest.raises(OSError):
        archive.extract(io.BytesIO(data), tmp_path / "dst", lambda m: FileList.of(entries), 1 << 30)


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("name,size,mode,kind", [
    ("inductor/a.so", 10, 0o644, tarfile.REGTYPE), ("d" * 120 + "/" + "f" * 90, 0, 0o755, tarfile.REGTYPE),
    ("x/ü.json", 8 ** 11 + 5, 0o600, tarfile.REGTYPE), ("old/a", 3, 0o644, tarfile.AREGTYPE),
    ("link", 0, 0o777, tarfile.SYMTYPE), ("fifo", 0, 0o644, tarfile.FIFOTYPE)])
def test_header_parser_agrees_with_tarfile(fmt, name, size, mode, kind):
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.type = size, mode, kind
    try:
        block = info.tobuf(format=fmt, encoding="utf-8", errors="surrogateescape")[-tarfile.BLOCKSIZE:]
    except ValueError:
        pytest.skip("not representable in this format")
    ref = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    got = archive.tarread._parse_header(block)
    assert (got.name, got.type, got.mode, got.size) == (ref.name, ref.type, ref.mode, ref.size)
    bad = bytearray(block)
    bad[5] ^= 1  # the checksum no longer holds: an error (tarfile's, as ArchiveError), not a silent parse
    with pytest.raises(archive.ArchiveError, match="checksum"):
        archive.tarread._parse_header(bytes(bad))


def test_a_corrupt_byte_in_a_big_file_is_refused(tmp_path):
    files = _tree(tmp_path / "src")
    body = io.BytesIO()
    entries = archive.pack_body(tmp_path / "src", sorted(files), body)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(body.getvalue(), max_output_size=1 << 30))
    at = raw.find(files["flashinfer/big.so"][2 * archive.CHUNK:2 * archive.CHUNK + 64])
    raw[at] ^= 0xFF
    data = archive.manifest_frame(b"{}") + zstandard.ZstdCompressor().compress(bytes(raw))
    with pytest.raises(ArchiveError, match="big.so.*sha256 differs"):
        archive.extract(io.BytesIO(data), tmp_path / "dst", lambda m: FileList.of(entries), 1 << 30)


def test_assemble_copies_the_body_in_the_kernel_or_through_a_buffer_alike(tmp_path, monkeypatch):
    """Files take the copy_file_range path, streams the buffered one; both give the same bytes,
    from wherever the body's position stands (replace_manifest starts past the old manifest)."""
    body = b"skipped" + os.urandom(3 * archive.CHUNK + 777)
    (tmp_path / "body").write_bytes(body)
    expected = archive.manifest_frame(b"{}") + body[7:]
    calls = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: calls.append(a[2:]) or real(*a))
    with open(tmp_path / "body", "rb") as src, open(tmp_path / "out", "wb") as dst:
        src.seek(7)
        archive.assemble(b"{}", src, dst)
        assert src.tell() == len(body) and dst.tell() == len(expected)
    assert (tmp_path / "out").read_bytes() == expected
    assert calls and calls[0][1:] == (7, len(expected) - len(body) + 7)  # from the positions given
    src = io.BytesIO(body)
    src.seek(7)
    out = io.BytesIO()
    archive.assemble(b"{}", src, out)
    assert out.getvalue() == expected
