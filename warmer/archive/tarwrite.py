"""Writing an archive: the files as tar members in one zstd frame (pack_body), artifact.json in a
frame of its own before them (manifest_frame), and the two put together (assemble,
replace_manifest). Members are written in the order given, the largest file last.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, BinaryIO, NamedTuple

import zstandard

from warmer.archive.common import BLOCK, CHUNK, H_CHKSUM, H_IDS_SIZE_MTIME, MANIFEST_MEMBER, MODE_MASK, ArchiveError
from warmer.archive.filelist import FileEntry
from warmer.atomic import atomic_write


def sha256_file(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return copy_hashed(f)[0]


def copy_hashed(src: IO[bytes], dst: IO[bytes] | None = None, size: int | None = None) -> tuple[str, int]:
    """(sha256, bytes) of what src holds from its position (size bytes at most, all when None),
    copied onto dst on the way when given: one read for both the digest and the copy."""
    h, n = hashlib.sha256(), 0
    while size is None or n < size:
        chunk = src.read(CHUNK if size is None else min(CHUNK, size - n))
        if not chunk:
            break
        h.update(chunk)
        if dst is not None:
            dst.write(chunk)
        n += len(chunk)
    return h.hexdigest(), n


def _member_header(name: str, size: int, mode: int, mtime_ns: int) -> bytes:
    mtime = mtime_ns // 1_000_000_000
    if len(name) <= 100 and name.isascii() and 0 <= size < 8**11 and 0 <= mtime < 8**11:
        # The ustar block tarfile writes when no pax record is needed, byte for byte, without
        # its per-member cost (tens of microseconds, thousands of members).
        block = bytearray(_USTAR_TEMPLATE)
        block[0 : len(name)] = name.encode("ascii")
        block[H_IDS_SIZE_MTIME] = b"%07o\0%s%011o\0%011o\0" % (mode & MODE_MASK, b"0000000\0" * 2, size, mtime)
        block[H_CHKSUM.start : H_CHKSUM.stop - 1] = b"%06o\0" % sum(block)
        return bytes(block)
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = mode & MODE_MASK
    info.mtime = mtime
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


# A regular file's ustar header with the checksum field blank (spaces) and no name, mode,
# ids, size or mtime yet: the fields _member_header fills in.
_USTAR_TEMPLATE = bytes(148) + b" " * 8 + tarfile.REGTYPE + bytes(100) + tarfile.POSIX_MAGIC + bytes(BLOCK - 265)


def _padding(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)


class Frame(NamedTuple):
    """One layer of a body: a zstd frame of one group's tar members, at offset in the body."""

    name: str
    offset: int
    size: int
    sha256: str


# The end-of-archive blocks, as the frame that closes a layered body: a node that assembles an
# archive from some of its layers ends it with these bytes.
END_FRAME = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(b"\0" * (2 * BLOCK))


def pack_body(root: Path, relpaths: Iterable[str], out: BinaryIO, level: int = 3) -> list[FileEntry]:
    """Write the files as tar members in one zstd frame; return their manifest entries.

    Digests are computed from the very bytes that go into the archive, in the same pass, while
    zstd's worker threads compress the bytes written before.
    """
    entries: list[FileEntry] = []
    cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True)
    buf = memoryview(bytearray(CHUNK))  # the compressor copies what it is given: one buffer will do
    with cctx.stream_writer(out, closefd=False) as w:
        _members(root, relpaths, w, buf, entries)
        w.write(b"\0" * (2 * BLOCK))  # end of archive
    return entries


def pack_layers(
    root: Path, groups: Sequence[tuple[str, Sequence[str]]], out: BinaryIO, level: int = 3
) -> tuple[list[FileEntry], list[Frame]]:
    """pack_body, one zstd frame per group (a layer: one cache component's files), then END_FRAME.
    Together they are one tar stream (`tar --zstd -xf` reads it); each frame alone is a layer a
    store keeps once, named by its sha256. out must be a file (offsets are taken from it)."""
    entries: list[FileEntry] = []
    frames = []
    cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True)
    buf = memoryview(bytearray(CHUNK))
    base = out.tell()
    for name, rels in groups:
        start = out.tell()
        with cctx.stream_writer(out, closefd=False) as w:
            _members(root, rels, w, buf, entries)
        out.flush()
        end = out.tell()
        frames.append(Frame(name, start - base, end - start, _sha256_range(out, start, end)))
    out.write(END_FRAME)
    return entries, frames


def _sha256_range(f: BinaryIO, start: int, end: int) -> str:
    """The digest of bytes [start, end) of f, read back (a layer is hashed as it lies on disk)."""
    f.seek(start)
    digest, n = copy_hashed(f, size=end - start)
    if n != end - start:
        raise ArchiveError("the body ended while it was being hashed")
    return digest


def _members(root: Path, relpaths: Iterable[str], w: BinaryIO, buf: memoryview, entries: list[FileEntry]) -> None:
    """The files as tar members onto w, the largest last; their entries appended to entries."""
    for rel in _largest_last(root, relpaths):
        path = os.path.join(root, rel)
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ArchiveError(f"{rel}: not a regular file; only regular files are packed")
        w.write(_member_header(rel, st.st_size, st.st_mode, st.st_mtime_ns))
        h = hashlib.sha256()
        n = 0
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb", buffering=0) as f:
            while k := f.readinto(buf):
                h.update(buf[:k])
                w.write(buf[:k])
                n += k
        if n != st.st_size:
            raise ArchiveError(
                f"{rel}: changed while it was packed ({st.st_size} -> {n} bytes); "
                "pack only after the warm-up process has exited"
            )
        w.write(_padding(n))
        entries.append(FileEntry(rel, n, h.hexdigest(), st.st_mode & MODE_MASK, st.st_mtime_ns))


def _largest_last(root: Path, relpaths: Iterable[str]) -> list[str]:
    """The paths in the order given, but for the largest file, which comes last.

    A fetch unpacks as the bytes arrive, so what is left when the last byte lands is the end of
    the archive: the last piece of one big file (written and hashed at disk speed) rather than
    hundreds of small ones (a create, write, chmod, utime and close each). One lstat per file
    (50 ms at 11,000 files, 2% of their pack): the order is a choice, pack_body stats each file again."""
    rels = list(relpaths)
    sizes = [os.lstat(os.path.join(root, rel)).st_size for rel in rels]
    if sizes:
        rels.append(rels.pop(sizes.index(max(sizes))))
    return rels


def manifest_frame(manifest: bytes, level: int = 3) -> bytes:
    """The first frame: artifact.json as a tar member."""
    member = _member_header(MANIFEST_MEMBER, len(manifest), 0o644, 0) + manifest + _padding(len(manifest))
    return zstandard.ZstdCompressor(level=level, write_checksum=True).compress(member)


def assemble(manifest: bytes, body: BinaryIO, out: BinaryIO) -> None:
    """Write an archive: the manifest frame, then the body frame copied as it is."""
    out.write(manifest_frame(manifest))
    _copy_rest(body, out)


def _copy_rest(src: BinaryIO, dst: BinaryIO) -> None:
    """src from its position to its end onto dst: inside the kernel (copy_file_range, a reflink where
    the filesystem shares blocks) when both are files, else through a buffer."""
    dst.flush()
    try:
        src_off, dst_off, src_fd, dst_fd = src.tell(), dst.tell(), src.fileno(), dst.fileno()
        copied = os.copy_file_range(src_fd, dst_fd, 1 << 30, src_off, dst_off)
    except (AttributeError, OSError, ValueError):  # not files, or a kernel or filesystem without it
        shutil.copyfileobj(src, dst, CHUNK)
        return
    while copied:
        src_off, dst_off = src_off + copied, dst_off + copied
        copied = os.copy_file_range(src_fd, dst_fd, 1 << 30, src_off, dst_off)
    src.seek(src_off)
    dst.seek(dst_off)


def first_frame_size(f: BinaryIO) -> int:
    """Bytes taken by the manifest frame at the start of an archive."""
    head = f.read(18)
    params = zstandard.get_frame_parameters(head)
    if not params.content_size or params.content_size > (64 << 20):
        raise ArchiveError("the archive does not start with a manifest frame; was it made by warmer pack?")
    f.seek(0)
    dobj = zstandard.ZstdDecompressor().decompressobj()
    consumed = 0
    while not dobj.eof:
        chunk = f.read(64 << 10)
        if not chunk:
            raise ArchiveError("the archive ends inside its manifest frame (truncated)")
        dobj.decompress(chunk)
        consumed += len(chunk) - len(dobj.unused_data)
    return consumed


def replace_manifest(path: Path, manifest: bytes) -> None:
    """Swap in a new manifest frame, keeping the body frame's bytes; atomic by rename."""
    with open(path, "rb") as src:
        src.seek(first_frame_size(src))
        with atomic_write(path) as dst:
            assemble(manifest, src, dst)
