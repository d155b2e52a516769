"""artifact.json's files list: its entries, and the bytes canonical() writes them as.

The list is kept as its bytes, compressed, and cut by regular expressions in canonical form
(json for any other): the one place that knows how a list of entries is spelled. Paths are
checked here as extraction will use them (safe_name), before a member is read.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import zstandard

from warmer.archive.common import CHUNK, MODE_MASK, ArchiveError
from warmer.untrusted import MAX_INT, Fields, InvalidDocument

_HEX64 = re.compile(r"[0-9a-f]{64}")


class FileEntry(NamedTuple):  # a tuple: an artifact's files are made again on every walk (FileList)
    path: str
    size: int
    sha256: str
    mode: int
    mtime_ns: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "sha256": self.sha256,
            "mode": self.mode,
            "mtime_ns": self.mtime_ns,
        }

    @classmethod
    def _well_formed(cls, d: Any) -> FileEntry | None:
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
            safe_name(path)
        except ArchiveError:
            return False
        return True

    @classmethod
    def from_json(cls, f: Fields) -> FileEntry:
        """One entry of artifact.json's files, refused unless every field is what extraction may use."""
        path = f.text("path", max_len=4096)
        try:
            safe_name(path)
        except ArchiveError as e:
            raise InvalidDocument(f"{f.where}.path: {e}") from None
        sha = f.text("sha256", max_len=64)
        if not _HEX64.fullmatch(sha):
            raise InvalidDocument(f"{f.where}.sha256 must be 64 lower-case hex digits")
        # mtime_ns: what os.utime takes (a signed 64-bit count of nanoseconds, up to the year 2262).
        return cls(
            path,
            f.integer("size", low=0, high=MAX_INT),
            sha,
            f.integer("mode", low=0, high=0o7777),
            f.integer("mtime_ns", low=0, high=MAX_INT),
        )


# One entry of artifact.json's files as canonical() writes it: sorted keys, no spaces, ASCII.
_ENTRY = re.compile(
    rb'\{"mode":(0|[1-9][0-9]{0,3}),"mtime_ns":(0|[1-9][0-9]{0,18}),'
    rb'"path":"([^"\\]*(?:\\.[^"\\]*)*)","sha256":"([0-9a-f]{64})","size":(0|[1-9][0-9]{0,18})\}(,?)'
)
# The same, for a path of printable ASCII that safe_name takes as it is (no escapes, no empty,
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

    def __init__(self, most: int) -> None:
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
    _frame: bytes  # the list's bytes, one zstd frame
    _canonical: bool  # in the form canonical() writes: cut by the regular expressions, not json
    nbytes: int  # the list's bytes, uncompressed
    count: int
    total_bytes: int
    unsafe: FileEntry | None  # the first entry with a mode extraction refuses

    @staticmethod
    def span_end(buf: bytes | memoryview, start: int) -> int | None:
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
    def parse(cls, buf: bytes | memoryview, start: int, end: int, where: str) -> FileList:
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

    def _check_canonical(self, buf: bytes | memoryview, start: int, end: int, where: str) -> bool:
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

    def _walk(self, where: str | None = None) -> Iterator[FileEntry]:
        """The entries; with where, each one checked (a list parse could not take as canonical)."""
        if not self._canonical:
            try:  # bytes from a marker or a store: a stray byte is their fault, said as such
                items = json.loads(self.json())
            except ValueError as e:
                raise InvalidDocument(f"{where or 'the file list'}: not JSON ({e})") from None
            if not isinstance(items, list):
                raise InvalidDocument(f"{where or 'the file list'}: not a list of files")
            for i, d in enumerate(items):
                yield FileEntry._well_formed(d) or FileEntry.from_json(Fields(d, f"{where}[{i}]"))
            return
        for piece in self.pieces():
            yield from self._entries(piece, 0, len(piece))

    @staticmethod
    def _entries(buf: bytes | memoryview, at: int, end: int) -> Iterator[FileEntry]:
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

    def __iter__(self) -> Iterator[FileEntry]:
        return self._walk()

    def __len__(self) -> int:
        return self.count

    def by_path(self) -> dict[str, FileEntry]:
        return {e.path: e for e in self}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FileList) and self.nbytes == other.nbytes and self.json() == other.json()

    __hash__ = None  # type: ignore[assignment]  # equal by bytes, and not frozen: unhashable

    def __repr__(self) -> str:
        return f"FileList({self.count} files, {self.total_bytes} bytes)"


def safe_name(name: str) -> str:
    if not name or name.startswith("/") or "\\" in name or "\0" in name:
        raise ArchiveError(f"member {name!r}: absolute or malformed path refused")
    parts = name.split("/")
    if "" in parts or "." in parts or ".." in parts:
        raise ArchiveError(f"member {name!r}: path with '..', '.' or empty parts refused")
    return name
