"""Pack cache trees into tar.zst and unpack them, checking every file against a manifest.

Layout of an archive: two concatenated zstd frames that together are one tar stream, so
`tar --zstd -xf` opens it like any other:

    frame 1: the member artifact.json (the manifest: every file's size and sha256)
    frame 2: the cache files, then the end-of-archive blocks

The manifest comes first so that extraction can check each member as it streams by, and it
sits in its own frame so it can be rewritten (timings added after verify) without
recompressing the files. One header reader (_Inflated.header) serves both reading the manifest
and extracting. Leaf module: imports nothing from warmer but the error base and warmer.untrusted.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import re
import shutil
import stat
import tarfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

import zstandard

from warmer.atomic import atomic_write
from warmer.errors import UntrustedInput
from warmer.untrusted import MAX_INT, Fields, InvalidDocument

MANIFEST_MEMBER = "artifact.json"
CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE
# Keep the permission bits, never setuid/setgid/sticky: the files are code a server will load.
MODE_MASK = 0o755


_HEX64 = re.compile(r"[0-9a-f]{64}")


class ArchiveError(UntrustedInput):
    """The archive is unreadable, or does not match its manifest."""


class FileEntry(NamedTuple):  # a tuple: an artifact's files are made again on every walk (FileList)
    path: str
    size: int
    sha256: str
    mode: int
    mtime_ns: int

    def to_dict(self) -> dict:
        return {
            "path": self.path,
            "size": self.size,
            "sha256": self.sha256,
            "mode": self.mode,
            "mtime_ns": self.mtime_ns,
        }

    @classmethod
    def _well_formed(cls, d) -> FileEntry | None:
        """d as an entry when every field is as it should be, else None (from_json names what is wrong)."""
        if type(d) is not dict:
            return None
        path, sha, size, mode, mtime_ns = (
            d.get("path"),
            d.get("sha256"),
            d.get("size"),
            d.get("mode"),
            d.get("mtime_ns"),
        )
        if (
            type(path) is str
            and type(sha) is str
            and type(size) is int
            and type(mode) is int
            and type(mtime_ns) is int
            and _HEX64.fullmatch(sha)
            and 0 <= size <= MAX_INT
            and 0 <= mode <= 0o7777
            and 0 <= mtime_ns <= MAX_INT
            and cls._well_formed_path(path)
        ):
            return cls(path, size, sha, mode, mtime_ns)
        return None

    @staticmethod
    def _well_formed_path(path: str) -> bool:
        if len(path) > 4096 or "\0" in path:
            return False
        try:
            _safe_name(path)
        except ArchiveError:
            return False
        return True

    @classmethod
    def from_json(cls, f: Fields) -> FileEntry:
        """One entry of artifact.json's files, refused unless every field is what extraction may use."""
        path = f.str("path", max_len=4096)
        try:
            _safe_name(path)
        except ArchiveError as e:
            raise InvalidDocument(f"{f.where}.path: {e}") from None
        sha = f.str("sha256", max_len=64)
        if not _HEX64.fullmatch(sha):
            raise InvalidDocument(f"{f.where}.sha256 must be 64 lower-case hex digits")
        # mtime_ns: what os.utime takes (a signed 64-bit count of nanoseconds, up to the year 2262).
        return cls(
            path,
            f.int("size", low=0, high=MAX_INT),
            sha,
            f.int("mode", low=0, high=0o7777),
            f.int("mtime_ns", low=0, high=MAX_INT),
        )


# One entry of artifact.json's files as canonical() writes it: sorted keys, no spaces, ASCII.
_ENTRY = re.compile(
    rb'\{"mode":(0|[1-9][0-9]{0,3}),"mtime_ns":(0|[1-9][0-9]{0,18}),'
    rb'"path":"([^"\\]*(?:\\.[^"\\]*)*)","sha256":"([0-9a-f]{64})","size":(0|[1-9][0-9]{0,18})\}(,?)'
)
# The same, for a path of printable ASCII that _safe_name takes as it is (no escapes, no empty,
# "." or ".." parts): nearly every entry, checked by this match alone.
_SAFE_ENTRY = re.compile(
    rb'\{"mode":(0|[1-9][0-9]{0,3}),"mtime_ns":(0|[1-9][0-9]{0,18}),"path":"('
    rb'(?:(?!\.\.?/)[ !#-.0-\[\]-~\x7f]+/)*(?!\.\.?")[ !#-.0-\[\]-~\x7f]+'
    rb')","sha256":"[0-9a-f]{64}","size":(0|[1-9][0-9]{0,18})\}(,?)'
)
_PATH_SIZE = re.compile(rb'"path":"([^"\\]*(?:\\.[^"\\]*)*)","sha256":"[^"]{64}","size":([0-9]+)')
_PLAIN = re.compile(rb"[ !#-\[\]-~]*")  # printable ASCII but quote and backslash: the path, unescaped


def _path_of(raw: bytes) -> str | None:
    """A path as canonical() writes it, or None (an escape json.dumps would not have written)."""
    if _PLAIN.fullmatch(raw):
        return raw.decode("ascii")
    try:
        path = json.loads(b'"' + raw + b'"')
    except ValueError:
        return None
    return path if json.dumps(path).encode() == b'"' + raw + b'"' else None


class _NotCanonical(Exception):
    pass


# Bytes of the shortest entry with the five fields (an empty path): a list of n bytes, in any
# JSON form, holds at most n // 118 entries that pass the checks.
_MIN_ENTRY = 118


class _Hashes:
    """A set of 64-bit hashes in one buffer, 8 bytes a slot and half of the slots free: a path
    listed twice is found without an int object per file (40 bytes each, and pinned arenas after)."""

    def __init__(self, most: int):
        self.mask = (1 << (2 * most + 1).bit_length()) - 1
        self.slots = memoryview(bytearray(8 * (self.mask + 1))).cast("Q")
        self.room = most + 1

    def add(self, h: int) -> bool:
        """Add h; whether it was there already."""
        self.room -= 1
        if self.room < 0:  # never with `most` right; a full table would probe forever
            raise InvalidDocument("a files list holds more entries than its bytes can")
        h = h & 0xFFFF_FFFF_FFFF_FFFF or 1  # 0 marks a free slot
        i = h & self.mask
        while slot := self.slots[i]:
            if slot == h:
                return True
            i = (i + 1) & self.mask
        self.slots[i] = h
        return False


class FileList:
    """artifact.json's files, kept as the bytes of their list, compressed (zstd -1: 45,000 files
    take 2.8 MB instead of 9.7 MB of JSON and 45 MB of objects), and parsed again in pieces each
    time they are walked: a fetch's memory then does not grow with the number of files. A list in
    another form than canonical() writes (a field a newer warmer added) is walked with json."""

    __slots__ = ("_frame", "_canonical", "nbytes", "count", "total_bytes", "unsafe")

    @staticmethod
    def span_end(buf: bytes, start: int) -> int | None:
        """Where the list that starts at buf[start] ("[") ends, if it is in canonical form; else None."""
        if buf[start : start + 2] == b"[]":
            return start + 2
        at, match = start + 1, _ENTRY.match
        while (m := match(buf, at)) is not None and (b"\\" not in m[3] or _path_of(m[3]) is not None):
            at = m.end()
            if not m[6]:
                return at + 1 if buf[at : at + 1] == b"]" else None
        return None

    @classmethod
    def parse(cls, buf: bytes, start: int, end: int, where: str) -> FileList:
        """The JSON list at buf[start:end], every entry checked as extraction will use it:
        InvalidDocument names the first bad field, or a path listed twice."""
        self = cls.__new__(cls)
        # level 1: 3.5x on 45,000 files in 18 ms (level 3: 3.2x in 40 ms); a context per call, for
        # threads. compress() leaves its output at the input's size: copied out at the frame's own.
        self._frame = bytes(memoryview(zstandard.ZstdCompressor(level=1).compress(memoryview(buf)[start:end])))
        self.nbytes, self.unsafe = end - start, None
        try:
            self._canonical = True
            repeats = self._check_canonical(buf, start, end, where)
        except _NotCanonical:
            self._canonical = False
            seen, repeats = _Hashes(most=(end - start) // _MIN_ENTRY), False
            self.count = self.total_bytes = 0
            for e in self._walk(where):
                self.count += 1
                self.total_bytes += e.size
                if e.mode & ~MODE_MASK and self.unsafe is None:
                    self.unsafe = e
                repeats = seen.add(hash(e.path)) or repeats
        if repeats:  # two paths with one hash: are they one path?
            paths: set[str] = set()
            for e in self:
                if e.path in paths:
                    raise InvalidDocument(f"{where} lists {e.path!r} twice")
                paths.add(e.path)
        return self

    def _check_canonical(self, buf: bytes, start: int, end: int, where: str) -> bool:
        """parse, for a list in canonical form (else _NotCanonical): the count, the bytes, the
        first unsafe mode, and whether two paths' bytes share a hash (a path has one canonical form)."""
        at, closed, count, total, repeats = start + 1, False, 0, 0, False
        seen = _Hashes(most=(end - start) // _MIN_ENTRY)
        while at < end - 1:
            if closed:
                raise _NotCanonical
            m = _SAFE_ENTRY.match(buf, at)
            if (
                m is not None
                and len(m[3]) <= 4096
                and (mode := int(m[1])) <= 0o7777
                and (len(m[2]) < 19 or int(m[2]) <= MAX_INT)
                and (len(m[4]) < 19 or int(m[4]) <= MAX_INT)
            ):
                raw, size, comma = m[3], int(m[4]), m[5]
            else:  # an escape, an unsafe path or a field out of range: checked field by field
                m = _ENTRY.match(buf, at)
                if m is None or (path := _path_of(m[3])) is None:
                    raise _NotCanonical
                mode, mtime_ns, size = int(m[1]), int(m[2]), int(m[5])
                if not (
                    mode <= 0o7777 and mtime_ns <= MAX_INT and size <= MAX_INT and FileEntry._well_formed_path(path)
                ):
                    FileEntry.from_json(
                        Fields(
                            {"path": path, "size": size, "sha256": m[4].decode(), "mode": mode, "mtime_ns": mtime_ns},
                            f"{where}[{count}]",
                        )
                    )  # raises, naming the field
                raw, comma = m[3], m[6]
            if mode & ~MODE_MASK and self.unsafe is None:
                self.unsafe = next(self._entries(buf, at, end))
            at, closed = m.end(), not comma
            count += 1
            total += size
            repeats = seen.add(hash(raw)) or repeats
        if not (at == end - 1 and buf[at:end] == b"]" and (closed or count == 0)):
            raise _NotCanonical
        self.count, self.total_bytes = count, total
        return repeats

    def json(self) -> bytes:
        """The list's bytes, whole (artifact.json's canonical form needs them: a marker, a signature)."""
        return zstandard.ZstdDecompressor().decompress(self._frame)

    def pieces(self) -> Iterator[bytes]:
        """The list's bytes in pieces of about 1 MiB, each cut after an entry in canonical form
        ("},{" + '"mode"' is never inside a canonical string): a walk holds one piece at a time."""
        carry = b""
        for data in zstandard.ZstdDecompressor().read_to_iter(self._frame, write_size=CHUNK):
            data = carry + data
            cut = data.rfind(b'},{"mode":') + 1 if self._canonical else 0
            if cut:
                yield data[:cut]
                carry = data[cut:]
            else:
                carry = data
        if carry:
            yield carry

    def _walk(self, where: str | None = None):
        """The entries; with where, each one checked (a list parse could not take as canonical)."""
        if not self._canonical:
            for i, d in enumerate(json.loads(self.json())):
                yield FileEntry._well_formed(d) or FileEntry.from_json(Fields(d, f"{where}[{i}]"))
            return
        for piece in self.pieces():
            yield from self._entries(piece, 0, len(piece))

    @staticmethod
    def _entries(buf: bytes, at: int, end: int):
        for m in _ENTRY.finditer(buf, at, end):
            mode, mtime_ns, path, sha, size, _ = m.groups()
            yield FileEntry(
                path.decode() if b"\\" not in path else json.loads(b'"' + path + b'"'),
                int(size),
                sha.decode(),
                int(mode),
                int(mtime_ns),
            )

    def sizes(self) -> Iterator[tuple[str, int]]:
        """(path, size) of each entry: what a no-op fetch checks, read faster than whole entries."""
        if not self._canonical:
            yield from ((e.path, e.size) for e in self)
            return
        for piece in self.pieces():
            for path, size in _PATH_SIZE.findall(piece):
                yield path.decode() if b"\\" not in path else json.loads(b'"' + path + b'"'), int(size)

    def any_under(self, prefix: str) -> bool:
        """Whether a path starts with prefix: a search of the bytes, not a walk, in canonical form."""
        if not self._canonical:
            return any(e.path.startswith(prefix) for e in self)
        needle = b'"path":"' + json.dumps(prefix)[1:-1].encode()
        return any(needle in piece for piece in self.pieces())

    @classmethod
    def of(cls, entries: Iterable[FileEntry]) -> FileList:
        """entries as artifact.json lists them."""
        buf = cls.json_of(entries)
        return cls.parse(buf, 0, len(buf), "files")

    @staticmethod
    def json_of(entries: Iterable[FileEntry]) -> bytes:
        """entries as canonical() writes them, a thousand at a time: not a dict per file at once."""
        out, it = [], iter(entries)
        while chunk := [e.to_dict() for e in itertools.islice(it, 1000)]:
            out.append(json.dumps(chunk, sort_keys=True, separators=(",", ":"))[1:-1].encode())
        return b"[" + b",".join(out) + b"]"

    def __iter__(self):
        return self._walk()

    def __len__(self) -> int:
        return self.count

    def by_path(self) -> dict[str, FileEntry]:
        return {e.path: e for e in self}

    def __eq__(self, other) -> bool:
        return isinstance(other, FileList) and self.nbytes == other.nbytes and self.json() == other.json()

    __hash__ = None

    def __repr__(self) -> str:
        return f"FileList({self.count} files, {self.total_bytes} bytes)"


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


# The fields of a ustar header block (POSIX.1-1988, as pax extends it): byte ranges in its 512 bytes.
H_NAME = slice(0, 100)
H_MODE = slice(100, 108)
H_IDS_SIZE_MTIME = slice(100, 148)  # mode, uid, gid, size, mtime: written together
H_SIZE = slice(124, 136)
H_CHKSUM = slice(148, 156)
H_TYPE = slice(156, 157)
H_MAGIC = slice(257, 265)
H_PREFIX = slice(345, 500)


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


def pack_body(root: Path, relpaths: Iterable[str], out: BinaryIO, level: int = 3) -> list[FileEntry]:
    """Write the files as tar members in one zstd frame; return their manifest entries.

    Digests are computed from the very bytes that go into the archive, in the same pass, while
    zstd's worker threads compress the bytes written before.
    """
    entries = []
    cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True)
    buf = memoryview(bytearray(CHUNK))  # the compressor copies what it is given: one buffer will do
    with cctx.stream_writer(out, closefd=False) as w:
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
        w.write(b"\0" * (2 * BLOCK))  # end of archive
    return entries


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


# artifact.json travels whole in a store's index entry too, which warmer.store caps at
# MAX_INDEX_BYTES (64 MiB, about 300,000 files; 45,000 take 9.7 MB): one larger could never be
# published. Its header's declared size is checked against this before a byte of it is read.
MANIFEST_LIMIT = 64 << 20
# A pax extended header holds a path (4 KiB at most) and a few records (size, mtime): 64 KiB is
# room to spare. Tools write one per member; each is refused on its header block, past either
# cap, so a member's headers hold at most 128 KiB, parsed as at most 13,000 records.
PAX_HEADER_LIMIT = 64 << 10
PAX_HEADERS_PER_MEMBER = 2
# Threads that create and write the files of an extraction: file creation is mostly kernel
# time, and it scales past one core. More than the machine's cores only adds switching.
WRITERS = max(1, min(4, os.cpu_count() or 1))


def read_manifest(raw: BinaryIO) -> bytes:
    """artifact.json from the head of an archive, without reading the files after it."""
    stream = _Inflated(
        zstandard.ZstdDecompressor().stream_reader(raw, read_size=64 << 10, read_across_frames=True), MANIFEST_LIMIT
    )
    try:
        return b"".join(_manifest(stream))
    except (zstandard.ZstdError, EOFError, UnicodeError) as e:
        raise ArchiveError(f"unreadable archive: {e}") from e


def _manifest(stream: _Inflated) -> Iterator[memoryview]:
    """The first member, which must be artifact.json, in the pieces it comes in: a reader that
    knows what to expect compares them and holds none (8 MiB at 45,000 files)."""
    first = stream.header()
    if first is None or first.name != MANIFEST_MEMBER or first.type not in _REGULAR:
        raise ArchiveError(f"the first member is not {MANIFEST_MEMBER}; was it made by warmer pack?")
    if first.size > MANIFEST_LIMIT:  # whitespace or not, unread
        raise ArchiveError(
            f"{MANIFEST_MEMBER} declares {first.size} bytes, over the {MANIFEST_LIMIT} a store's "
            "index entry can hold: refused (decompression bomb or corrupt archive)"
        )
    stream.claim(first.size)
    left = first.size
    while left:
        p = stream.piece(left)
        left -= len(p)
        yield p
    stream.exact(-first.size % BLOCK)


def _safe_name(name: str) -> str:
    if not name or name.startswith("/") or "\\" in name or "\0" in name:
        raise ArchiveError(f"member {name!r}: absolute or malformed path refused")
    parts = name.split("/")
    if "" in parts or "." in parts or ".." in parts:
        raise ArchiveError(f"member {name!r}: path with '..', '.' or empty parts refused")
    return name


@dataclass
class Extracted:
    files: int
    bytes: int
    archive_sha256: str
    archive_bytes: int


_ZERO_BLOCK = bytes(BLOCK)
_KINDS = {
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink",
    tarfile.CHRTYPE: "character device",
    tarfile.BLKTYPE: "block device",
    tarfile.FIFOTYPE: "FIFO",
    tarfile.DIRTYPE: "directory",
    tarfile.CONTTYPE: "contiguous file",
    tarfile.GNUTYPE_SPARSE: "sparse file",
    tarfile.GNUTYPE_LONGNAME: "GNU long-name header",
    tarfile.GNUTYPE_LONGLINK: "GNU long-link header",
    tarfile.XGLTYPE: "global pax header",
}


def _pax_records(data: bytes) -> dict[str, str]:
    """The records of a pax extended header: "LENGTH KEY=VALUE\\n" each."""
    out, pos = {}, 0
    try:
        while pos < len(data) and data[pos]:
            space = data.index(b" ", pos)
            end = pos + int(data[pos:space])
            if end <= space or data[end - 1 : end] != b"\n":
                raise ValueError("bad record length")
            key, eq, value = data[space + 1 : end - 1].partition(b"=")
            if not eq:
                raise ValueError("record without '='")
            out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
            pos = end
    except ValueError as e:
        raise ArchiveError(f"malformed pax header: {e}") from None
    return out


_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE)


class _Member(NamedTuple):
    """What extraction needs of a tar header."""

    name: str
    type: bytes
    mode: int
    size: int


def _octal(field: bytes) -> int:
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _parse_header(block: bytes) -> _Member:
    """A header block: the plain ustar regular-file header (all warmer writes but pax records)
    read directly, a few times faster than tarfile; anything else, and any doubt, by tarfile."""
    if (
        block[H_TYPE] == tarfile.REGTYPE
        and block[H_MAGIC] == tarfile.POSIX_MAGIC
        and not (block[H_MODE.start] | block[H_SIZE.start] | block[H_CHKSUM.start]) & 0x80
    ):  # no base-256
        try:
            checksum, mode, size = _octal(block[H_CHKSUM]), _octal(block[H_MODE]), _octal(block[H_SIZE])
        except ValueError:
            checksum = -1
        if checksum == 256 + sum(block[: H_CHKSUM.start]) + sum(block[H_CHKSUM.stop :]):
            name = block[H_NAME].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            prefix = block[H_PREFIX].split(b"\0", 1)[0]
            if prefix:
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
            return _Member(name, tarfile.REGTYPE, mode, size)
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except (tarfile.TarError, ValueError, UnicodeError) as e:
        raise ArchiveError(f"unreadable tar header: {e}") from None
    return _Member(info.name, info.type, info.mode, info.size)


class _Inflated:
    """The decompressed tar stream, read in big pieces: headers are cut from them and file data
    is handed on as views, without copies. Declared sizes count against a limit before they are
    read, so that a hostile archive cannot inflate without end (a decompression bomb)."""

    def __init__(self, reader, limit: int):
        self.reader = reader
        self.limit = limit
        self.total = 0
        self.buf = memoryview(b"")

    def claim(self, n: int) -> None:
        if n < 0:  # a negative size would read backwards forever
            raise ArchiveError(f"a member declares a negative size ({n}): corrupt or hostile archive")
        self.total += n
        if self.total > self.limit:
            raise ArchiveError(
                f"the archive inflates past {self.limit} bytes, more than its manifest "
                "declares: refused (decompression bomb or corrupt archive)"
            )

    def at_end(self) -> bool:
        if not self.buf:
            self.buf = memoryview(self.reader.read(CHUNK))
        return not self.buf

    def piece(self, n: int) -> memoryview:
        """At most n bytes of what comes next, at least one (claimed by the caller)."""
        if self.at_end():
            raise EOFError("the archive ends inside a member (truncated)")
        got = self.buf[:n]
        self.buf = self.buf[len(got) :]
        return got

    def exact(self, n: int) -> bytes:
        self.claim(n)
        parts = []
        while n:
            p = self.piece(n)
            parts.append(p)
            n -= len(p)
        return b"".join(parts)

    def header(self) -> _Member | None:
        """The next member's header with its pax records applied; None at the end of the archive.

        Only a pax header's payload is read here, capped on its block. Any other kind ends the
        loop on its block alone (a GNU long name or link, a global pax header): the caller
        refuses it as no regular file, its payload unread."""
        pax: dict[str, str] = {}
        headers = 0
        while True:
            if self.at_end() and not pax:
                return None  # no end-of-archive blocks: as tarfile; files missing are found after
            block = self.exact(BLOCK)
            if block == _ZERO_BLOCK:
                return None
            info = _parse_header(block)
            if info.size < 0:
                raise ArchiveError(f"member {info.name!r}: negative size {info.size}: corrupt or hostile archive")
            if info.type != tarfile.XHDTYPE:
                break
            headers += 1
            if info.size > PAX_HEADER_LIMIT:
                raise ArchiveError(
                    f"a pax extended header of {info.size} bytes inflates past the {PAX_HEADER_LIMIT} "
                    "one may take: refused (decompression bomb or corrupt archive)"
                )
            if headers > PAX_HEADERS_PER_MEMBER:
                raise ArchiveError(
                    f"more than {PAX_HEADERS_PER_MEMBER} pax extended headers before one member: "
                    "refused (decompression bomb or corrupt archive)"
                )
            pax.update(_pax_records(self.exact(info.size)))
            self.exact(-info.size % BLOCK)
        if any(k.startswith("GNU.sparse.") for k in pax):
            raise ArchiveError(f"member {pax.get('path', info.name)!r}: a sparse file; only regular files are allowed")
        if "path" in pax:
            info = info._replace(name=pax["path"])
        if "size" in pax:
            size = pax["size"]
            if not size.isdigit() or len(size) > 19:  # pax sizes are decimal; no sign, no 10^19 bytes
                raise ArchiveError(f"member {info.name!r}: malformed pax size {size!r}")
            info = info._replace(size=int(size))
        return info


class _SmallFiles(NamedTuple):
    batch: list  # (rel, view, sha256, mode, mtime_ns) of files each whole in one view


class _Open(NamedTuple):
    rel: str
    want: str  # the sha256 artifact.json gives


class _Data(NamedTuple):
    view: memoryview


class _Close(NamedTuple):
    mode: int
    mtime_ns: int


class _Writer:
    """Hashes, creates and writes the files in threads of their own: those system calls and
    the digests are most of a restore's time, and they overlap decompressing and parsing what
    comes next. Each file goes whole to one thread, the one with the least waiting (small files
    in batches); all of them together hold at most BUDGET bytes. A file is checked against its
    sha256 before it gets its mode and mtime; the first error (a digest that differs, a full
    disk) stops all threads and is raised by the next put() or by close(), so extract() never
    returns with a file unchecked."""

    FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    # Bytes handed to the threads and not yet written: the memory an extraction holds, whatever
    # the artifact's size. Shared by all threads, so that one busy with a big file does not stop
    # the others from taking the small files after it.
    BUDGET = 16 << 20
    ITEM = 4096  # what an item counts for besides its data: bounds how many small files wait
    BATCH = 256 << 10  # small files go to a thread together, up to this many bytes
    DIRS = 4096  # directories remembered: members come grouped by directory, and one forgotten costs a stat

    def __init__(self, dest: Path, threads: int):
        self.dest = os.fspath(dest)
        self.error: BaseException | None = None
        self.abort = False
        self.dirs: set[str] = set()  # made here, or known to exist; forgotten past DIRS
        self.queues = [queue.SimpleQueue() for _ in range(threads)]
        self.pending = [0] * threads  # bytes waiting, per thread
        self.held = 0
        self.room = threading.Condition()
        self.lane = 0
        self.batch: list[tuple] = []
        self.batch_bytes = 0
        self.threads = [
            threading.Thread(target=self._run, args=(i,), name="warmer-extract-writer", daemon=True)
            for i in range(threads)
        ]
        for t in self.threads:
            t.start()

    def put(self, item: tuple, nbytes: int = 0) -> None:
        cost = nbytes + self.ITEM
        with self.room:
            while self.error is None and self.held and self.held + cost > self.BUDGET:
                self.room.wait()
            if self.error is not None:
                raise self.error
            if isinstance(item, (_SmallFiles, _Open)):  # new files: to the thread with the least to do
                self.lane = min(range(len(self.pending)), key=self.pending.__getitem__)
            self.held += cost
            self.pending[self.lane] += cost
        self.queues[self.lane].put((item, cost))

    def small_file(self, rel: str, view, want: str, mode: int, mtime_ns: int) -> None:
        """A file whole in one view: batched with the next ones (one hand-over for many)."""
        self.batch.append((rel, view, want, mode, mtime_ns))
        self.batch_bytes += len(view) + self.ITEM
        if self.batch_bytes >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        if self.batch:
            batch, nbytes = self.batch, self.batch_bytes
            self.batch, self.batch_bytes = [], 0
            self.put(_SmallFiles(batch), nbytes)

    def close(self, ok: bool) -> None:
        """Wait for every write and check; with ok=False, drop what is left."""
        if ok:
            self.flush()
        self.abort = not ok
        for q in self.queues:
            q.put((None, 0))
        for t in self.threads:
            t.join()
        self.threads = []
        if ok and self.error is not None:
            raise self.error

    def _open(self, rel: str) -> int:
        parent = rel.rpartition("/")[0]
        if parent and parent not in self.dirs:
            os.makedirs(os.path.join(self.dest, parent), exist_ok=True)
            if len(self.dirs) >= self.DIRS:  # memory flat in the number of directories
                self.dirs.clear()
            while parent and parent not in self.dirs:
                self.dirs.add(parent)
                parent = parent.rpartition("/")[0]
        return os.open(os.path.join(self.dest, rel), self.FLAGS, 0o600)

    @staticmethod
    def _write(fd: int, view) -> None:
        while view:
            view = view[os.write(fd, view) :]

    @staticmethod
    def _finish(fd: int, mode: int, mtime_ns: int) -> None:
        os.fchmod(fd, mode)
        os.utime(fd, ns=(mtime_ns, mtime_ns))

    def _run(self, lane: int) -> None:
        f = _OpenFile()  # the file this thread is writing
        while True:
            item, cost = self.queues[lane].get()
            if item is None:
                break
            try:
                if self.error is None and not self.abort:  # else: keep taking items, so put() never waits
                    self._do(item, f)
            except BaseException as e:  # handed to the main thread, which raises it
                if self.error is None:
                    self.error = e
                f.close()
            finally:
                with self.room:
                    self.held -= cost
                    self.pending[lane] -= cost
                    self.room.notify()
        f.close()

    def _do(self, item: tuple, f: _OpenFile) -> None:
        if isinstance(item, _Data):
            f.sha256.update(item.view)
            self._write(f.fd, item.view)
        elif isinstance(item, _Open):
            f.rel, f.want = item
            f.sha256 = hashlib.sha256()
            f.fd = self._open(f.rel)
        elif isinstance(item, _SmallFiles):  # most files
            for f.rel, view, f.want, mode, mtime_ns in item.batch:
                f.sha256 = hashlib.sha256(view)
                f.fd = self._open(f.rel)
                self._write(f.fd, view)
                self._check_and_close(f, mode, mtime_ns)
        else:
            self._check_and_close(f, item.mode, item.mtime_ns)

    def _check_and_close(self, f: _OpenFile, mode: int, mtime_ns: int) -> None:
        if f.sha256.hexdigest() != f.want:
            raise ArchiveError(f"member {f.rel!r}: sha256 differs from {MANIFEST_MEMBER}; the artifact is corrupt")
        self._finish(f.fd, mode, mtime_ns)
        f.close()


class _OpenFile:
    __slots__ = ("fd", "rel", "want", "sha256")

    def __init__(self):
        self.fd: int | None = None
        self.rel, self.want, self.sha256 = "", "", None

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


class _Checker:
    """The writer's interface without writing: hashes every file in this thread and compares it
    with artifact.json (what publish runs before an artifact may enter a store)."""

    threads: list = []

    def __init__(self):
        self.f = _OpenFile()

    def small_file(self, rel: str, view, want: str, mode: int, mtime_ns: int) -> None:
        if hashlib.sha256(view).hexdigest() != want:
            raise ArchiveError(f"member {rel!r}: sha256 differs from {MANIFEST_MEMBER}; the artifact is corrupt")

    def put(self, item, nbytes: int = 0) -> None:
        if isinstance(item, _Open):
            self.f.rel, self.f.want = item
            self.f.sha256 = hashlib.sha256()
        elif isinstance(item, _Data):
            self.f.sha256.update(item.view)
        elif self.f.sha256.hexdigest() != self.f.want:
            raise ArchiveError(f"member {self.f.rel!r}: sha256 differs from {MANIFEST_MEMBER}; the artifact is corrupt")

    def flush(self) -> None:
        pass

    def close(self, ok: bool) -> None:
        pass


def check(
    raw: BinaryIO, manifest_entries: Callable[[Iterator[memoryview]], FileList], max_total_bytes: int
) -> Extracted:
    """Read a whole archive as extract() does, every member checked, and write nothing."""
    return extract(raw, None, manifest_entries, max_total_bytes)


def extract(
    raw: BinaryIO,
    dest: Path | None,
    manifest_entries: Callable[[Iterator[memoryview]], FileList],
    max_total_bytes: int,
    on_file: Callable[[int], None] | None = None,
) -> Extracted:
    """Unpack into dest (a new, empty directory), refusing anything the manifest does not list.

    manifest_entries turns the embedded artifact.json, in pieces, into the expected files (and
    may refuse it). Each file is written as it streams by, hashed, and compared with the manifest; a
    mismatch raises and leaves dest for the caller to discard. Returns only once every file is
    written and checked. With dest None, nothing is written (check()).

    Members come in the manifest's order (pack writes them so): each is checked against the
    next entry, and no table of the files is built. An archive in another order is checked
    against one.
    """
    # A store's stream (warmer.store.stream) hashes the blob as it arrives, off this thread: once is enough.
    hashing = raw if getattr(raw, "hashes_itself", False) else _HashingReader(raw)
    stream = _Inflated(
        zstandard.ZstdDecompressor().stream_reader(hashing, read_size=CHUNK, read_across_frames=True), MANIFEST_LIMIT
    )
    writer = None
    try:
        manifest = _manifest(stream)
        expected = manifest_entries(manifest)
        for _ in manifest:  # to the first file, whatever manifest_entries read
            pass
        if expected.total_bytes > max_total_bytes:
            raise ArchiveError(
                f"the artifact unpacks to {expected.total_bytes} bytes, over the limit of "
                f"{max_total_bytes}; raise --max-bytes if this is expected"
            )
        # Headers and padding take at most a few blocks per member beyond the files' bytes.
        stream.limit = stream.total + expected.total_bytes + (len(expected) + 4) * 8 * BLOCK
        if expected.unsafe:
            raise ArchiveError(
                f"{MANIFEST_MEMBER} gives {expected.unsafe.path!r} mode {expected.unsafe.mode:o}: "
                "setuid, setgid, sticky and group/world-writable modes are refused"
            )
        listed = iter(expected)
        by_path: dict[str, FileEntry] | None = None  # once a member is out of the manifest's order
        seen: set[str] = set()
        count = written = 0
        writer = _Writer(dest, WRITERS) if dest is not None else _Checker()
        while (member := stream.header()) is not None:
            name = _safe_name(member.name)
            if member.type not in _REGULAR:
                raise ArchiveError(
                    f"member {name!r}: a {_KINDS.get(member.type, f'type {member.type!r}')}; "
                    "only regular files are allowed"
                )
            if member.mode & 0o7000:
                raise ArchiveError(f"member {name!r}: setuid/setgid/sticky mode {member.mode:o} refused")
            entry = next(listed, None) if by_path is None else None
            if entry is None or entry.path != name:
                if by_path is None:
                    by_path = expected.by_path()
                    seen = set(itertools.islice(by_path, count))  # the ones taken in order so far
                if name in seen:
                    raise ArchiveError(f"member {name!r}: appears twice")
                entry = by_path.get(name)
                if entry is None:
                    raise ArchiveError(f"member {name!r}: not listed in {MANIFEST_MEMBER}")
                seen.add(entry.path)  # the manifest's own string: the header's is not kept
            if member.size != entry.size:
                raise ArchiveError(f"member {name!r}: {member.size} bytes, {MANIFEST_MEMBER} says {entry.size}")
            count += 1
            mode = entry.mode & MODE_MASK
            left = entry.size
            stream.claim(left)
            view = stream.piece(left) if left else b""
            left -= len(view)
            if not left:
                writer.small_file(name, view, entry.sha256, mode, entry.mtime_ns)
            else:
                writer.flush()
                writer.put(_Open(name, entry.sha256))
                writer.put(_Data(view), len(view))
                while left:
                    view = stream.piece(left)
                    writer.put(_Data(view), len(view))
                    left -= len(view)
                writer.put(_Close(mode, entry.mtime_ns))
            stream.exact(-entry.size % BLOCK)
            written += entry.size
            if on_file is not None:
                on_file(entry.size)
        # Drain what follows the end-of-archive blocks, so the archive's digest covers every byte.
        while hashing.read(CHUNK):
            pass
        writer.close(ok=True)  # every file written and its sha256 checked
    except (tarfile.TarError, zstandard.ZstdError, EOFError, UnicodeError) as e:
        raise ArchiveError(f"unreadable or truncated archive: {e}") from e
    finally:
        if writer is not None and writer.threads:
            writer.close(ok=False)
    if count < len(expected):
        first = next(listed).path if by_path is None else min(set(by_path) - seen)
        raise ArchiveError(
            f"{len(expected) - count} file(s) listed in {MANIFEST_MEMBER} are missing from the "
            f"archive, first {first!r}; the artifact is truncated"
        )
    return Extracted(count, written, hashing.sha256.hexdigest(), hashing.bytes)
