"""Pack cache trees into tar.zst and unpack them, checking every file against a manifest.

Layout of an archive: two concatenated zstd frames that together are one tar stream, so
`tar --zstd -xf` opens it like any other:

    frame 1: the member artifact.json (the manifest: every file's size and sha256)
    frame 2: the cache files, then the end-of-archive blocks

The manifest comes first so that extraction can check each member as it streams by, and it
sits in its own frame so it can be rewritten (timings added after verify) without
recompressing the files. Leaf module: imports nothing from warmer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterable

import zstandard

MANIFEST_MEMBER = "artifact.json"
CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE
# Keep the permission bits, never setuid/setgid/sticky: the files are code a server will load.
MODE_MASK = 0o755


class ArchiveError(Exception):
    """The archive is unreadable, or does not match its manifest."""


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str
    mode: int
    mtime_ns: int

    def to_dict(self) -> dict:
        return {"path": self.path, "size": self.size, "sha256": self.sha256,
                "mode": self.mode, "mtime_ns": self.mtime_ns}

    @classmethod
    def from_dict(cls, d: dict) -> "FileEntry":
        return cls(str(d["path"]), int(d["size"]), str(d["sha256"]), int(d["mode"]), int(d["mtime_ns"]))


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _member_header(name: str, size: int, mode: int, mtime_ns: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = mode & MODE_MASK
    info.mtime = mtime_ns // 1_000_000_000
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def _padding(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)


def pack_body(root: Path, relpaths: Iterable[str], out: BinaryIO, level: int = 3) -> list[FileEntry]:
    """Write the files as tar members in one zstd frame; return their manifest entries.

    Digests are computed from the very bytes that go into the archive, in the same pass.
    """
    entries = []
    cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True)
    with cctx.stream_writer(out, closefd=False) as w:
        for rel in relpaths:
            path = root / rel
            st = os.lstat(path)
            if not os.path.isfile(path) or os.path.islink(path):
                raise ArchiveError(f"{rel}: not a regular file; only regular files are packed")
            w.write(_member_header(rel, st.st_size, st.st_mode, st.st_mtime_ns))
            h = hashlib.sha256()
            n = 0
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
                    w.write(chunk)
                    n += len(chunk)
            if n != st.st_size:
                raise ArchiveError(f"{rel}: changed while it was packed ({st.st_size} -> {n} bytes); "
                                   "pack only after the warm-up process has exited")
            w.write(_padding(n))
            entries.append(FileEntry(rel, n, h.hexdigest(), st.st_mode & MODE_MASK, st.st_mtime_ns))
        w.write(b"\0" * (2 * BLOCK))  # end of archive
    return entries


def manifest_frame(manifest: bytes, level: int = 3) -> bytes:
    """The first frame: artifact.json as a tar member."""
    member = _member_header(MANIFEST_MEMBER, len(manifest), 0o644, 0) + manifest + _padding(len(manifest))
    return zstandard.ZstdCompressor(level=level, write_checksum=True).compress(member)


def assemble(manifest: bytes, body: BinaryIO, out: BinaryIO) -> None:
    """Write an archive: the manifest frame, then the body frame copied as it is."""
    out.write(manifest_frame(manifest))
    shutil.copyfileobj(body, out, CHUNK)


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
    tmp = path.with_name(path.name + ".tmp")
    with open(path, "rb") as src:
        src.seek(first_frame_size(src))
        with open(tmp, "wb") as dst:
            assemble(manifest, src, dst)
            dst.flush()
            os.fsync(dst.fileno())
    os.replace(tmp, path)


class _HashingReader:
    """Reads through to a stream while hashing every byte that passes."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.sha256.update(data)
        self.bytes += len(data)
        return data


class _LimitedReader:
    """Caps the decompressed bytes, so that a hostile archive cannot inflate without end
    (tar headers, pax records included, are read into memory before any check can see them)."""

    def __init__(self, raw, limit: int):
        self.raw = raw
        self.limit = limit
        self.bytes = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.bytes += len(data)
        if self.bytes > self.limit:
            raise ArchiveError(f"the archive inflates past {self.limit} bytes, more than its manifest "
                               "declares: refused (decompression bomb or corrupt archive)")
        return data


MANIFEST_LIMIT = 256 << 20  # artifact.json of a million files stays far below this


def _open_stream(raw: BinaryIO):
    hashing = _HashingReader(raw)
    limited = _LimitedReader(zstandard.ZstdDecompressor().stream_reader(hashing, read_across_frames=True),
                             MANIFEST_LIMIT)
    try:
        return hashing, limited, tarfile.open(fileobj=limited, mode="r|")
    except (tarfile.TarError, zstandard.ZstdError) as e:
        raise ArchiveError(f"not a tar.zst archive: {e}") from e


def read_manifest(raw: BinaryIO) -> bytes:
    """artifact.json from the head of an archive, without reading the files after it."""
    _, _, tf = _open_stream(raw)
    try:
        member = tf.next()
    except (tarfile.TarError, zstandard.ZstdError) as e:
        raise ArchiveError(f"unreadable archive: {e}") from e
    if member is None or member.name != MANIFEST_MEMBER or not member.isreg():
        raise ArchiveError(f"the first member is not {MANIFEST_MEMBER}; was it made by warmer pack?")
    return tf.extractfile(member).read()


def _safe_name(name: str) -> str:
    if not name or name.startswith("/") or "\\" in name or "\0" in name:
        raise ArchiveError(f"member {name!r}: absolute or malformed path refused")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ArchiveError(f"member {name!r}: path with '..', '.' or empty parts refused")
    return name


@dataclass
class Extracted:
    manifest: bytes
    files: int
    bytes: int
    archive_sha256: str
    archive_bytes: int


def extract(raw: BinaryIO, dest: Path, manifest_entries: Callable[[bytes], dict[str, FileEntry]],
            max_total_bytes: int) -> Extracted:
    """Unpack into dest (a new, empty directory), refusing anything the manifest does not list.

    manifest_entries turns the embedded artifact.json into the expected files (and may refuse
    it). Each file is written as it streams by, hashed, and compared with the manifest; a
    mismatch raises and leaves dest for the caller to discard.
    """
    hashing, limited, tf = _open_stream(raw)
    try:
        first = tf.next()
        if first is None or first.name != MANIFEST_MEMBER or not first.isreg():
            raise ArchiveError(f"the first member is not {MANIFEST_MEMBER}; was it made by warmer pack?")
        manifest = tf.extractfile(first).read()
        expected = manifest_entries(manifest)
        total_expected = sum(e.size for e in expected.values())
        if total_expected > max_total_bytes:
            raise ArchiveError(f"the artifact unpacks to {total_expected} bytes, over the limit of "
                               f"{max_total_bytes}; raise --max-bytes if this is expected")
        # Headers and padding take at most a few blocks per member beyond the files' bytes.
        limited.limit = limited.bytes + total_expected + (len(expected) + 4) * 8 * BLOCK
        unsafe = [e.path for e in expected.values() if e.mode & ~MODE_MASK]
        if unsafe:
            raise ArchiveError(f"{MANIFEST_MEMBER} gives {unsafe[0]!r} mode {expected[unsafe[0]].mode:o}: "
                               "setuid, setgid, sticky and group/world-writable modes are refused")
        seen: set[str] = set()
        written = 0
        while (member := tf.next()) is not None:
            name = _safe_name(member.name)
            if not member.isreg():
                kind = {tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hardlink", tarfile.CHRTYPE: "character device",
                        tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "FIFO", tarfile.DIRTYPE: "directory"}
                raise ArchiveError(f"member {name!r}: a {kind.get(member.type, f'type {member.type!r}')}; "
                                   "only regular files are allowed")
            if member.mode & 0o7000:
                raise ArchiveError(f"member {name!r}: setuid/setgid/sticky mode {member.mode:o} refused")
            if name in seen:
                raise ArchiveError(f"member {name!r}: appears twice")
            entry = expected.get(name)
            if entry is None:
                raise ArchiveError(f"member {name!r}: not listed in {MANIFEST_MEMBER}")
            if member.size != entry.size:
                raise ArchiveError(f"member {name!r}: {member.size} bytes, {MANIFEST_MEMBER} says {entry.size}")
            seen.add(name)
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            h = hashlib.sha256()
            src = tf.extractfile(member)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            if h.hexdigest() != entry.sha256:
                raise ArchiveError(f"member {name!r}: sha256 differs from {MANIFEST_MEMBER}; the artifact is corrupt")
            os.chmod(target, entry.mode & MODE_MASK)
            os.utime(target, ns=(entry.mtime_ns, entry.mtime_ns))
            written += entry.size
        # Drain what follows the end-of-archive blocks, so the archive's digest covers every byte.
        while hashing.read(CHUNK):
            pass
    except (tarfile.TarError, zstandard.ZstdError, EOFError, UnicodeError) as e:
        raise ArchiveError(f"unreadable or truncated archive: {e}") from e
    missing = sorted(set(expected) - seen)
    if missing:
        raise ArchiveError(f"{len(missing)} file(s) listed in {MANIFEST_MEMBER} are missing from the "
                           f"archive, first {missing[0]!r}; the artifact is truncated")
    return Extracted(manifest, len(seen), written, hashing.sha256.hexdigest(), hashing.bytes)
