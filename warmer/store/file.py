"""A store in a local (or shared, POSIX) directory: the embedded default.

Whoever can write the directory can plant anything in it, so every read opens without
following a final symlink and without blocking, and refuses what is not a regular file (a FIFO
would hang a node, a device would feed it without end).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import BinaryIO

from warmer.deadline import Deadline, unbounded
from warmer.errors import UsageError
from warmer.store import (
    Blob,
    BlobCorrupt,
    BlobMissing,
    BlobStream,
    NotARegularFile,
    Scrap,
    Store,
    StoreError,
    blob_path,
    index_path,
    parse_blob_path,
    parse_index_path,
)

CHUNK = 1 << 20
MiB = 1 << 20
INCOMING = ".incoming-"  # a copy on its way in: linked to its name once whole


def open_regular(path: str | os.PathLike, what: str) -> BinaryIO | None:
    """path opened for reading if it is a regular file; None if absent; StoreError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
            raise NotARegularFile(
                f"{what} at {path} is a symlink: refused (a store holds regular files only)"
            ) from None
        raise StoreError(f"cannot read {what} at {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotARegularFile(
            f"{what} at {path} is not a regular file (mode {stat.filemode(st.st_mode)}): refused; "
            "remove it from the store"
        )
    os.set_blocking(fd, True)
    return open(fd, "rb")


class FileStore(Store):
    def __init__(self, path: str, *, deadline: Deadline | None = None):
        if not path or not os.path.isabs(path):
            raise UsageError(f"file store path {path!r} must be absolute, e.g. file:///var/lib/warmer/store")
        self.base = Path(path)
        self.url = "file://" + path
        self.deadline = deadline or unbounded()  # a shared directory (NFS) can stall too

    def prepare(self) -> None:
        _mkdirs(self.base)

    def _must_exist(self) -> None:
        """A store directory that is not there is a wrong URL or an unmounted share, not an empty
        store: said as S3 says a missing bucket. Publishing creates it."""
        if not self.base.is_dir():
            raise StoreError(
                f"store directory {self.base} does not exist (or is not a directory): fix the store "
                "URL or mount the share; `warmer publish` creates it"
            )

    def _blob(self, sha256: str) -> Path:
        return self.base / blob_path(sha256)

    def _create_once(self, target: Path, write) -> bool:
        """Write to a uniquely named file beside target, then link it in: fails if target exists."""
        _mkdirs(target.parent)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f"{INCOMING}{uuid.uuid4().hex[:8]}-")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, target)
            except FileExistsError:
                return False
            return True
        finally:
            os.unlink(tmp)

    def has_blob(self, sha256: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self._blob(sha256)).st_mode)
        except FileNotFoundError:
            return False

    def _upload_blob(self, path: str, sha256: str) -> None:
        def copy(out: BinaryIO) -> None:
            with open(path, "rb") as src:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    self.deadline.check(f"copying blob {sha256[:12]} to {self.url}")  # a slow NFS mount

        self._create_once(self._blob(sha256), copy)

    def stream_blob(self, sha256: str, size: int | None = None) -> BlobStream:
        """The blob read in place (no copy), in parallel ranges a little ahead of the reader, and
        hashed on the way: one pass over the file for both the digest and the extraction."""
        f = open_regular(self._blob(sha256), f"blob {sha256[:16]}")
        if f is None:
            raise BlobMissing(
                f"blob {sha256} is missing from {self.url}: the store is damaged; publish the artifact again"
            )
        try:
            fd = f.fileno()
            total = os.fstat(fd).st_size
            if size is not None and size != total:
                raise BlobCorrupt(
                    f"blob {sha256} in {self.url} is {total} bytes, its index entry says {size}: not used"
                )
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            # A local file does not change by being read again: one attempt.
            return BlobStream(
                sha256,
                lambda start, end: _Pread(fd, start, end, total),
                size=total,
                where=self.url,
                part_size=4 * MiB,
                threads=2,
                window_bytes=16 * MiB,
                attempts=1,
                on_close=f.close,
                deadline=self.deadline,
            )
        except BaseException:
            f.close()
            raise

    def _create_index(self, rel: str, entry: bytes) -> bool:
        return self._create_once(self.base / rel, lambda f: f.write(entry))

    def _read_index(self, rel: str, limit: int) -> bytes | None:
        self._must_exist()
        f = open_regular(self.base / rel, f"index entry {rel}")
        if f is None:
            return None
        with f:
            return f.read(limit)

    def list_index(self, recipe: str | None = None) -> list[tuple[str, str]]:
        self._must_exist()
        base = self.base / "index"
        dirs = [base / recipe] if recipe else [base / d.name for d in _entries(base) if d.is_dir()]
        found = (parse_index_path(f"index/{d.name}/{f.name}") for d in dirs for f in _entries(d))
        return [rk for rk in found if rk]

    def list_blobs(self) -> list[Blob]:
        self._must_exist()
        out = []
        top = self.base / "blobs" / "sha256"
        for d in _entries(top):
            for f in _entries(top / d.name) if d.is_dir() else ():
                sha = parse_blob_path(f"blobs/sha256/{d.name}/{f.name}")
                st = _lstat(Path(f.path))
                if sha and st and stat.S_ISREG(st.st_mode):
                    out.append(Blob(sha, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC)))
        return out

    def list_scraps(self) -> list[Scrap]:
        """The copies _create_once left half-written (a publisher killed mid-copy): a whole
        artifact's bytes each, under a name no listing shows."""
        self._must_exist()
        out = []
        # where _create_once writes: not the rest of the directory (lost+found, someone's own files)
        walks = (os.walk(self.base / d, onerror=_unlistable) for d in ("index", "blobs", "audit"))
        for top, _, files in (found for walk in walks for found in walk):
            for name in sorted(files):
                f = Path(top, name)
                st = _lstat(f) if name.startswith(INCOMING) else None
                if st and stat.S_ISREG(st.st_mode):
                    out.append(
                        Scrap(f.relative_to(self.base).as_posix(), st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))
                    )
        return out

    def delete_scrap(self, scrap: Scrap) -> None:
        path = self.base / scrap.path
        if path.name.startswith(INCOMING):  # nothing else, whatever a caller passes
            path.unlink(missing_ok=True)

    def delete_index(self, recipe: str, key: str) -> None:
        (self.base / index_path(recipe, key)).unlink(missing_ok=True)

    def delete_blob(self, sha256: str) -> None:
        self._blob(sha256).unlink(missing_ok=True)


class _Pread:
    """Bytes [start, end) of an open file, as a store's answer to a ranged read."""

    whole = False

    def __init__(self, fd: int, start: int, end: int, total: int):
        self.fd, self.pos, self.end, self.total = fd, start, min(end, total), total

    def readinto(self, view: memoryview) -> int:
        n = os.preadv(self.fd, [view[: self.end - self.pos]], self.pos) if self.pos < self.end else 0
        self.pos += n
        return n

    def close(self) -> None:
        pass


def _mkdirs(d: Path) -> None:
    """d and its missing parents, each one made readable by all as the files in them are (0644): under
    a publisher's umask 077, nodes and gc running as another user could not list what it publishes."""
    missing = []
    while not d.is_dir() and d != d.parent:
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        try:
            m.mkdir()
        except FileExistsError:  # another publisher made it meanwhile: theirs
            continue
        os.chmod(m, stat.S_IMODE(m.stat().st_mode) | 0o755)


def _unlistable(e: OSError) -> None:
    if not isinstance(e, FileNotFoundError):  # gone since its parent was listed: nothing in it to list
        raise StoreError(
            f"cannot list {e.filename} in the store: {e.strerror}; give this user read and search access to "
            "the whole store directory (e.g. chmod -R a+rX on it)"
        )


def _entries(d: Path) -> list[os.DirEntry]:
    """d's entries by name ([] when d is absent). One that cannot be read is an error, not an empty
    directory: gc would take every blob its entries name for an orphan and delete it."""
    try:
        with os.scandir(d) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as e:
        _unlistable(e)
        return []


def _lstat(path: Path) -> os.stat_result | None:
    """None for a file gone since the listing named it (a publish's part renamed, a blob gc'd)."""
    try:
        return path.lstat()
    except FileNotFoundError:
        return None
