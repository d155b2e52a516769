"""artifact.json as bytes, never whole in memory.

canonical() is its one byte form: ids and signatures are over those bytes. Its files list is
nearly all of them (9.7 MB at 45,000 files), so an artifact keeps them as Canonical: the bytes
before the list, the list itself (a FileList, compressed) and the bytes after it. A document read
from a store has the list cut out before json parses the rest (load); a copy of artifact.json
elsewhere (an archive's head, a marker's tail) is compared with Canonical piece by piece, or by
its sha256, rather than made whole (other_bytes, without_last_field).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from warmer.archive.common import ArchiveError
from warmer.archive.filelist import FileEntry, FileList
from warmer.untrusted import Fields, InvalidDocument, load_json

# Stands in for the files list while the rest of artifact.json is parsed (load) or written
# (Canonical.of): the list itself is only ever bytes, as many as a file's entry takes.
_HOLE = "\0warmer:files"
_HOLE_JSON = json.dumps([_HOLE]).encode()


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The one byte form of an artifact.json: its id and signature are over these bytes. Compact, so
    that json's C encoder writes it (indent takes the pure-Python one: 0.1 s at 10,000 files)."""
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


def load(data: bytes, what: str, max_bytes: int, inside: tuple[str, ...] = ()) -> tuple[Any, memoryview | None]:
    """json.loads(data) for a document that holds an artifact.json (at the keys `inside`), except
    that its files list, when written as canonical() writes it, is left unparsed: the document
    holds a stand-in, and the list's bytes come back beside it. (None: it is parsed in place.)
    Parsed, the entries took 3.5 times their bytes, and 5.5 at the parse's peak."""
    start = data.find(b'"files":[') + 8
    end = FileList.span_end(data, start) if start >= 8 and len(data) <= max_bytes else None
    if end is not None:
        doc = load_json(b"".join((data[:start], _HOLE_JSON, data[end:])), what=what, max_bytes=max_bytes)
        art = doc
        for k in inside:
            art = art.get(k) if isinstance(art, dict) else None
        # json.loads keeps the last of two equal keys: the stand-in is where the list was only if it is there now
        if isinstance(art, dict) and art.get("files") == [_HOLE]:
            return doc, memoryview(data)[start:end]
    return load_json(data, what=what, max_bytes=max_bytes), None


def with_files(doc: Mapping[str, Any], entries: Iterable[FileEntry]) -> tuple[dict[str, Any], memoryview]:
    """doc with entries as its files list, as load() returns a document: the stand-in, the list's bytes beside it."""
    return {**doc, "files": [_HOLE]}, memoryview(FileList.json_of(entries))


def canonical_of(doc: Any, files: memoryview | None = None) -> bytes:
    """canonical(doc), or with files (from load) as its files list."""
    if files is None:
        return canonical(doc)
    head, tail = _around_files(doc)
    return b"".join((head, files, tail))


def _around_files(doc: Mapping[str, Any]) -> tuple[bytes, bytes]:
    """canonical() of doc, before and after its files list."""
    head, *tail = canonical({**doc, "files": [_HOLE]}).split(_HOLE_JSON)
    if len(tail) != 1:
        raise InvalidDocument(f"artifact.json holds the string {_HOLE!r}, which warmer reserves: refused")
    return head, tail[0]


@dataclass(frozen=True, eq=False, slots=True)
class Canonical:
    """An artifact.json's canonical bytes: head + the files list + tail, and their sha256 (its id)."""

    head: bytes
    files: FileList
    tail: bytes
    sha256: str

    @classmethod
    def of(cls, doc: Mapping[str, Any], files: bytes | memoryview | None, where: str) -> Canonical:
        """doc's canonical bytes, its files list checked (FileList.parse): files (from load) when doc
        holds the stand-in for it, else doc's own list. InvalidDocument names what is malformed."""
        if files is None:
            files = json.dumps(Fields(doc, where).array("files"), sort_keys=True, separators=(",", ":")).encode()
        head, tail = _around_files(doc)
        listed = FileList.parse(files, 0, len(files), f"{where}.files")
        digest = hashlib.sha256(head)
        digest.update(files)
        digest.update(tail)
        return cls(head, listed, tail, digest.hexdigest())

    def pieces(self) -> Iterator[bytes]:
        yield self.head
        yield from self.files.pieces()
        yield self.tail

    def whole(self) -> bytes:
        """The bytes, whole (9.7 MB at 45,000 files): pieces() does not hold them."""
        return b"".join(self.pieces())

    @property
    def size(self) -> int:
        return len(self.head) + self.files.nbytes + len(self.tail)


def _field(key: str) -> bytes:
    return b',"' + key.encode() + b'":'


def as_last_field(form: Canonical, key: str) -> Iterator[bytes]:
    """form's bytes as the last field of a JSON object that the caller has written up to it, in
    pieces: `,"KEY":`, the bytes (canonical() ends with a newline, a copy inside an object does
    not), then the closing brace."""
    yield _field(key) + form.head
    yield from form.files.pieces()
    yield form.tail.removesuffix(b"\n") + b"}"


def without_last_field(data: bytes, form: Canonical, key: str) -> bytes | None:
    """data's JSON object without its last field (closed again), if that field is form's bytes as
    as_last_field() writes them: found from their sha256, so that form's bytes are never made
    whole. None if it is not."""
    mark = _field(key)
    size = form.size - 1  # without the newline
    at = len(data) - 1 - size - len(mark)
    if at < 0 or not data.endswith(b"}") or data[at : at + len(mark)] != mark:
        return None
    digest = hashlib.sha256(memoryview(data)[len(data) - 1 - size : -1])
    digest.update(b"\n")
    return data[:at] + b"}" if digest.hexdigest() == form.sha256 else None


def other_bytes(form: Canonical, pieces: Iterator[memoryview]) -> bytes | None:
    """None if pieces (artifact.json as it streams out of an archive) are form's bytes: compared as
    they come, neither side held whole. Else all of their bytes, for the caller to parse (another
    byte form of the same artifact.json, or another artifact.json)."""
    expect, at = _Cursor(form.pieces()), 0
    for piece in pieces:
        if expect.take(len(piece)) != piece:
            return _other_form(form, at, piece, pieces)
        at += len(piece)
    return None if not expect.take(1) else form.whole()[:at]


def _other_form(form: Canonical, at: int, piece: memoryview, rest: Iterator[memoryview]) -> bytes:
    """An archive's artifact.json that left form's bytes at `at` (with piece), whole, to be parsed.
    Another form of the same one (indented) is longer by its whitespace: twice form's size and
    64 KiB more is room for that, and all a store writer without the key can make a node hold."""
    most = 2 * form.size + (64 << 10)
    parts: list[bytes | memoryview] = [form.whole()[:at], piece]
    size = at + len(piece)
    while size <= most:
        more = next(rest, None)
        if more is None:
            return b"".join(parts)
        parts.append(more)
        size += len(more)
    raise ArchiveError(
        f"the archive's artifact.json is more than twice the size of the one this "
        f"restore was asked for ({form.size} bytes; the store's index and blob "
        "disagree): refused"
    )


class _Cursor:
    """Bytes that come in pieces, taken n at a time whatever the pieces' bounds."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self.pieces, self.left = iter(pieces), memoryview(b"")

    def take(self, n: int) -> bytes:
        out: list[memoryview] = []
        while n:
            if not self.left:
                piece = next(self.pieces, None)
                if piece is None:
                    break
                self.left = memoryview(piece)
                continue
            out.append(self.left[:n])
            n -= len(out[-1])
            self.left = self.left[len(out[-1]) :]
        return b"".join(out)
