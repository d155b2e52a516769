"""Reading an archive: its tar headers (pax records applied, every size bounded before it is read),
artifact.json at its head (read_manifest), and every file after it checked against artifact.json
as it streams by (extract, check). The limits here are what a hostile archive meets.
"""

from __future__ import annotations

import hashlib
import itertools
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple, cast

import zstandard

from warmer.archive.common import (
    BLOCK,
    CHUNK,
    H_CHKSUM,
    H_MAGIC,
    H_MODE,
    H_NAME,
    H_PREFIX,
    H_SIZE,
    H_TYPE,
    MANIFEST_MEMBER,
    MODE_MASK,
    ArchiveError,
)
from warmer.archive.extractwriter import WRITERS, Checker, Close, Data, Open, Writer
from warmer.archive.filelist import FileEntry, FileList, safe_name


class _HashingReader:
    """Reads through to a stream while hashing every byte that passes."""

    def __init__(self, raw: BinaryIO) -> None:
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

    def __init__(self, reader: zstandard.ZstdDecompressionReader, limit: int) -> None:
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
    # It has what _HashingReader has: read, sha256 and bytes.
    hashing = cast(_HashingReader, raw) if getattr(raw, "hashes_itself", False) else _HashingReader(raw)
    stream = _Inflated(
        zstandard.ZstdDecompressor().stream_reader(
            hashing,  # type: ignore[arg-type]  # zstandard calls read() alone
            read_size=CHUNK,
            read_across_frames=True,
        ),
        MANIFEST_LIMIT,
    )
    writer: Writer | Checker | None = None
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
        writer = Writer(dest, WRITERS) if dest is not None else Checker()
        while (member := stream.header()) is not None:
            name = safe_name(member.name)
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
                writer.put(Open(name, entry.sha256))
                writer.put(Data(view), len(view))
                while left:
                    view = stream.piece(left)
                    writer.put(Data(view), len(view))
                    left -= len(view)
                writer.put(Close(mode, entry.mtime_ns))
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
