"""Restore an artifact into a root without ever exposing a half-written or unverified cache.

Extract into a staging directory beside the root, check every file against artifact.json,
then swap it in with one atomic rename. A lock beside the root makes concurrent restores
(pods of one node sharing a hostPath) take turns; the second finds the work done.

The directory beside the root is shared with every pod on the node (a hostPath), so nothing
found there is trusted: the lock is opened without following links and must be a regular file
of ours, a lock held too long is reported with its holder instead of waited on forever,
leftovers are touched only when they are our own directories, and a root warmer did not
create is not replaced unless asked (force).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO, Callable, ContextManager, Iterator

from warmer import archive, artifact, components, signing
from warmer.artifact import Artifact, ArtifactError
from warmer.atomic import atomic_write
from warmer.store import BlobCorrupt, BlobStream, StoreError
from warmer.store.progress import Progress
from warmer.errors import WarmerError
from warmer.untrusted import Fields, InvalidDocument, load_json

MARKER = ".warmer-artifact.json"   # in an active root: which artifact it holds
PREPARED = ".warmer-root"          # in a root warmer prepared for vLLM to compile into (a miss)
DEFAULT_MAX_BYTES = 256 << 30
DEFAULT_LOCK_TIMEOUT = 900.0       # a restore of a large artifact on a slow disk takes minutes
MAX_MARKER_BYTES = archive.MANIFEST_LIMIT + (1 << 20)


class RestoreError(WarmerError):
    """The artifact was not activated; the root holds what it held before."""


def not_activated(root: Path, why: str) -> RestoreError:
    return RestoreError(f"not activated, {root} is unchanged: {why}")


# -- the marker ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Marker:
    """What an active root holds: its artifact.json (and its signature, when it was checked)."""
    artifact: Artifact
    archive_sha256: str
    restored_at: str
    signature: signing.Signature | None

    def to_bytes(self) -> bytes:
        return b"".join(self.pieces())

    def pieces(self) -> Iterator[bytes]:
        """The marker's bytes, artifact.json spliced in as its canonical bytes (the marker's id
        check needs them exact), in pieces: written without being made whole."""
        yield (f'{{"artifact_id":"{self.artifact.id}","key":"{self.artifact.key}",'
               f'"recipe":"{self.artifact.recipe.name}","archive_sha256":"{self.archive_sha256}",'
               f'"restored_at":"{self.restored_at}",').encode()
        yield b'"signature":' + json.dumps(self.signature.to_json() if self.signature else None).encode()
        head, tail = self.artifact.around_files
        yield _ARTIFACT_KEY + head
        yield from self.artifact.files.pieces()
        yield tail.removesuffix(b"\n") + b"}"  # canonical() ends with a newline, not a marker's copy

    @classmethod
    def from_bytes(cls, data: bytes, where: str, expect: Artifact | None = None) -> "Marker":
        """expect: the artifact the caller hopes is active. A marker that ends with its canonical
        bytes holds it: only the marker's head is parsed (a no-op fetch skips re-reading 10,000 entries)."""
        at = _ends_with_artifact(data, expect) if expect is not None and len(data) <= MAX_MARKER_BYTES else None
        if at is not None:
            f = Fields(load_json(data[:at] + b"}", what=where, max_bytes=MAX_MARKER_BYTES), where)
            art = expect
        else:
            doc, files = artifact.load(data, where, MAX_MARKER_BYTES, inside=("artifact",))
            f = Fields(doc, where)
            art = Artifact.from_json(f.obj("artifact").doc, files, f"{where}.artifact")
        if f.str("artifact_id", max_len=64) != art.id:
            raise InvalidDocument(f"{where}: its artifact_id does not match its artifact.json")
        return cls(art, f.str("archive_sha256", max_len=64), f.str("restored_at", max_len=64),
                   signing.Signature.from_json(f.raw("signature"), f"{where}.signature"))


_ARTIFACT_KEY = b',"artifact":'


def _ends_with_artifact(data: bytes, art: Artifact) -> int | None:
    """Where the marker's head ends, if data ends with art's canonical bytes as pieces() writes
    them: found from their sha256 (art.id), so that art's bytes are never made whole."""
    size = art.canonical_size - 1  # canonical() ends with a newline, the marker's copy does not
    at = len(data) - 1 - size - len(_ARTIFACT_KEY)
    if at < 0 or not data.endswith(b"}") or data[at:at + len(_ARTIFACT_KEY)] != _ARTIFACT_KEY:
        return None
    digest = hashlib.sha256(memoryview(data)[len(data) - 1 - size:-1])
    digest.update(b"\n")
    return at if digest.hexdigest() == art.id else None


def active(root: Path, expect: Artifact | None = None) -> Marker | None:
    """The marker of the artifact active in root, if any (None for a malformed one too);
    expect as Marker.from_bytes takes it."""
    f = _open_regular(Path(root) / MARKER)
    if f is None:
        return None
    with f:
        data = f.read(MAX_MARKER_BYTES + 1)
    try:
        return Marker.from_bytes(data, f"{root}/{MARKER}", expect)
    except (InvalidDocument, ArtifactError):
        return None


def _open_regular(path: Path) -> BinaryIO | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return open(fd, "rb")


def still_intact(marker: Marker, root: Path, trusted_keys=()) -> str | None:
    """Why an active root cannot be taken as the artifact it claims to hold; None when it can.

    Cheap enough for every no-op fetch: a signature check of artifact.json (with trusted keys)
    and one lstat per file, sizes compared."""
    if trusted_keys:
        try:
            signing.verify(marker.artifact.canonical, marker.signature, list(trusted_keys))
        except signing.SignatureError as e:
            return f"its marker's artifact.json is not signed by a trusted key ({e})"
    base = str(root)
    for path, size in marker.artifact.files.sizes():
        try:
            st = os.lstat(os.path.join(base, path))  # not pathlib: 10,000 of them
        except OSError:
            return f"{path} is missing"
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return f"{path} is not the file artifact.json lists (size or kind differs)"
    return None


# -- the lock -------------------------------------------------------------------------------------

def lock_path(root: Path) -> Path:
    return root.parent / f".{root.name}.warmer.lock"


def _holders(fd: int) -> list[int]:
    """Processes holding a lock on the file open as fd, from /proc/locks (Linux)."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (or "->" for waiters)
                if len(fields) >= 6 and fields[1] != "->" and fields[5] == want and fields[4].isdigit():
                    pids.append(int(fields[4]))
    except OSError:
        pass
    return pids


def _describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    return f"pid {pid}" + (f" ({cmd[:120]})" if cmd else "")


@contextmanager
def locked(root: Path, timeout: float = DEFAULT_LOCK_TIMEOUT):
    """Hold the lock beside root; RestoreError after timeout seconds, naming the holder."""
    path = lock_path(root)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise not_activated(root, f"the lock {path} is a symbolic link, which warmer never creates: "
                                      "someone planted it; remove it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_activated(root, f"the lock {path} is not a regular file ({stat.filemode(st.st_mode)}): "
                                      "someone planted it; remove it")
        if st.st_uid not in (os.geteuid(), 0):
            raise not_activated(root, f"the lock {path} belongs to uid {st.st_uid}, not to this user "
                                      f"({os.geteuid()}) or root: restore as its owner, or remove it")
        deadline = time.monotonic() + timeout
        delay = 0.01
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not said:  # a person watching a pod's log should know why nothing moves
                    holders = ", ".join(_describe(p) for p in _holders(fd) if p != os.getpid()) or "another process"
                    print(f"warmer: waiting up to {timeout:.0f} s for the lock {path}, held by {holders}",
                          file=sys.stderr, flush=True)
                    said = True
                if time.monotonic() >= deadline:
                    holders = ", ".join(_describe(p) for p in _holders(fd) if p != os.getpid()) or "an unknown process"
                    raise not_activated(root, f"the lock {path} is still held after {timeout:.0f} s by {holders}; "
                                              "another restore may be running (wait, or stop it), or a process "
                                              "holds the lock file open: stop it, or remove the lock") from None
                time.sleep(delay)  # polling the lock with a deadline (flock has no timeout)
                delay = min(delay * 2, 0.5)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# -- staging and activation -----------------------------------------------------------------------

def _exchange(a: Path, b: Path) -> None:
    """Swap two paths atomically (renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _activate(staging: Path, root: Path) -> None:
    """Make staging the root; the previous root, if any, ends up at staging."""
    if not root.exists():
        os.rename(staging, root)
        return
    try:
        _exchange(staging, root)
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EINVAL):
            raise
        # Filesystems without RENAME_EXCHANGE: two renames; a crash between them leaves the
        # old tree at .old, which the next restore moves back before anything else.
        old = staging.with_name(staging.name + ".old")
        os.rename(root, old)
        os.rename(staging, root)
        os.rename(old, staging)


def _ours(path: Path) -> bool:
    """A real directory (not a link) owned by this user: something a restore of ours left."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _clean_leftovers(root: Path) -> None:
    """Under the lock no other restore is running: staging dirs left behind are from crashes.
    Anything else by those names (a link, another user's directory) is left alone: never followed,
    never renamed into place."""
    for p in root.parent.glob(f".{root.name}.staging-*"):
        if not _ours(p):
            continue
        if p.name.endswith(".old") and not os.path.lexists(root) and (p / MARKER).is_file():
            os.rename(p, root)
        else:
            shutil.rmtree(p, ignore_errors=True)


def check_root(root: Path) -> Path:
    root = Path(os.path.abspath(root))
    if root.is_symlink():
        raise RestoreError(f"root {root} is a symlink to {os.path.realpath(root)}: pass the real path "
                           "(FlashInfer's ninja rebuilds what it finds through a link)")
    if root.exists() and not root.is_dir():
        raise RestoreError(f"root {root} exists and is not a directory")
    return root


def _replaceable(root: Path) -> str | None:
    """Why root may not be replaced without force: None when it is absent, empty, or warmer's."""
    if not root.exists():
        return None
    if (root / MARKER).is_file() or (root / PREPARED).is_file():
        return None
    if not any(root.iterdir()):
        return None
    return (f"{root} holds files warmer did not put there (no {MARKER} or {PREPARED}): a restore would replace "
            "them; pass --force if that is intended, or choose another root")


def prepare(root: Path) -> None:
    """Mark root as warmer's and create every cache directory (a TMPDIR that does not exist is
    silently replaced by /tmp)."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / MARKER).exists():
        (root / PREPARED).touch()
    for path in components.cache_env(root).values():
        Path(path).mkdir(parents=True, exist_ok=True)


def _os_error(e: OSError, root: Path) -> RestoreError:
    where = e.filename or root.parent
    if e.errno == errno.ENOSPC:
        fix = "free space on that filesystem or choose a root on a larger one"
    elif e.errno in (errno.EACCES, errno.EPERM):
        fix = f"run as a user who may write to {root.parent}, or choose a writable root"
    elif e.errno == errno.EROFS:
        fix = "the filesystem is read-only: choose a root on a writable volume"
    else:
        fix = "see the error above"
    return not_activated(root, f"{e.strerror or e} ({where}): {fix}")


@dataclass(frozen=True)
class RestoreResult:
    status: str         # "restored" or "already-active"
    root: str
    key: str
    seconds: float
    files: int | None = None
    bytes: int | None = None
    archive_bytes: int | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


def restore(art: Artifact, open_archive: Callable[[], ContextManager[BinaryIO]], root: Path, *,
            archive_sha256: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES, trusted_keys=(),
            signature: signing.Signature | None = None, force: bool = False,
            lock_timeout: float = DEFAULT_LOCK_TIMEOUT, progress: bool = False) -> RestoreResult:
    """Activate art in root; a no-op when it is already active and intact.

    open_archive opens the archive's bytes (a local file or a store's blob). The archive's own
    artifact.json must equal art, every file must match it, and, when given, the archive must
    hash to archive_sha256. Anything else leaves root as it was. signature (already verified by
    the caller) is kept in the marker, so a later no-op can check it again.
    """
    root = check_root(root)
    t0 = time.perf_counter()
    staging = root.parent / f".{root.name}.staging-{uuid.uuid4().hex[:12]}"
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        with locked(root, lock_timeout):
            _clean_leftovers(root)
            marker = active(root, expect=art)
            if marker and marker.artifact.id == art.id and still_intact(marker, root, trusted_keys) is None:
                return RestoreResult("already-active", str(root), art.key, round(time.perf_counter() - t0, 3))
            why = None if force or marker else _replaceable(root)
            if why:
                raise not_activated(root, why)
            need, free = art.total_bytes, shutil.disk_usage(root.parent).free
            if need > free:
                raise not_activated(root, f"the artifact unpacks to {need / 2**30:.2f} GiB but {root.parent} has "
                                          f"{free / 2**30:.2f} GiB free: free space or choose another root")
            try:
                staging.mkdir()
                bar = Progress(f"restore {art.key[:12]}", art.total_bytes) if progress else None
                try:
                    got = _extract(art, open_archive, staging, archive_sha256, max_bytes, bar)
                finally:
                    if bar:
                        bar.close()
                done = Marker(art, got.archive_sha256, datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                signature)
                with atomic_write(staging / MARKER) as f:
                    f.writelines(done.pieces())
                _activate(staging, root)
            finally:
                # After a swap this holds the previous root; after a failure, the partial extraction.
                if _ours(staging):
                    shutil.rmtree(staging, ignore_errors=True)
    except (archive.ArchiveError, ArtifactError, StoreError) as e:
        raise not_activated(root, str(e)) from e
    except OSError as e:
        raise _os_error(e, root) from e
    return RestoreResult("restored", str(root), art.key, round(time.perf_counter() - t0, 3), got.files, got.bytes,
                         got.archive_bytes)


def _extract(art: Artifact, open_archive, staging: Path, archive_sha256: str | None,
             max_bytes: int, bar=None) -> archive.Extracted:
    """Unpack and check into staging, then add what the root needs besides the files.

    A store's stream (BlobStream) is extracted as it downloads. Bytes that fail (a member's
    sha256, zstd, the blob's digest at the end) are either what the store holds (the artifact is
    bad: refused at once) or were damaged on the way (read again into a fresh staging dir, as
    many times as the store allows): drain() finishes the download to tell which."""
    attempt = 0
    while True:
        attempt += 1
        with open_archive() as stream:
            streamed = isinstance(stream, BlobStream)
            try:
                got = archive.extract(stream, staging, lambda manifest: _files_of(art, manifest), max_bytes, on_file=bar)
                break
            except BlobCorrupt:
                if not streamed or not stream.checked:
                    raise
            except (archive.ArchiveError, ArtifactError):
                # Finish the download (hashing only) to learn whether these were the blob's bytes;
                # bounded: a blob larger than what it may unpack to is refused without it.
                if (not streamed or stream.attempts == 1
                        or stream.size > max_bytes + (max_bytes >> 6) + (64 << 20) or stream.drain()):
                    raise
            if attempt >= stream.attempts:
                raise stream.refused(attempt)
        shutil.rmtree(staging)  # damaged on the way: start again in an empty staging dir
        staging.mkdir()
        if bar:
            bar(-bar.done)
    if archive_sha256 and got.archive_sha256 != archive_sha256:
        raise archive.ArchiveError(f"the archive hashes to {got.archive_sha256}, expected "
                                   f"{archive_sha256}: corrupt or truncated download")
    for c in components.ALL:  # e.g. TMPDIR must exist, or it is silently replaced by /tmp
        (staging / c.subdir).mkdir(exist_ok=True)
    return got


def _files_of(art: Artifact, manifest: Iterator[memoryview]) -> archive.FileList:
    """art's files, once the archive's artifact.json (in pieces) is found to be art. Its canonical
    bytes are compared as they stream by, and neither side is held whole; another byte form of
    the same artifact.json is parsed."""
    expect, at = _Cursor(art.canonical_pieces()), 0
    for piece in manifest:
        if expect.take(len(piece)) != piece:
            rest = b"".join((art.canonical[:at], piece, *manifest))
            break
        at += len(piece)
    else:
        rest = None if not expect.take(1) else art.canonical[:at]
    if rest is not None and Artifact.from_bytes(rest).id != art.id:
        raise archive.ArchiveError("the archive's artifact.json is not the one this restore "
                                   "was asked for (the store's index and blob disagree)")
    return art.files


class _Cursor:
    """Bytes that come in pieces, taken n at a time whatever the pieces' bounds."""

    def __init__(self, pieces: Iterator[bytes]):
        self.pieces, self.left = iter(pieces), memoryview(b"")

    def take(self, n: int) -> bytes:
        out = []
        while n:
            if not self.left:
                piece = next(self.pieces, None)
                if piece is None:
                    break
                self.left = memoryview(piece)
                continue
            out.append(self.left[:n])
            n -= len(out[-1])
            self.left = self.left[len(out[-1]):]
        return b"".join(out)


def read_artifact_file(path: Path) -> Artifact:
    """The artifact.json at the head of a local artifact file."""
    try:
        with open(path, "rb") as f:
            return Artifact.from_bytes(archive.read_manifest(f), f"{path}: artifact.json")
    except FileNotFoundError:
        raise RestoreError(f"artifact file {path} does not exist") from None
    except IsADirectoryError:
        raise RestoreError(f"{path} is a directory, not an artifact file") from None


def restore_file(path: Path, root: Path, *, max_bytes: int = DEFAULT_MAX_BYTES, trusted_keys=(),
                 signature: signing.Signature | None = None, force: bool = False,
                 lock_timeout: float = DEFAULT_LOCK_TIMEOUT, progress: bool = False) -> RestoreResult:
    """Restore from a local artifact file (image builds, air-gapped nodes).

    With trusted_keys, the file must be signed by one of them (signature, or FILE.sig)."""
    try:
        art = read_artifact_file(path)
        if trusted_keys:
            signature = signature or signing.read_sidecar(signing.sidecar(path))
            signing.verify(art.canonical, signature, list(trusted_keys))
    except (archive.ArchiveError, ArtifactError, signing.SignatureError) as e:
        raise RestoreError(f"not activated: {path}: {e}") from e
    return restore(art, lambda: open(path, "rb"), root, max_bytes=max_bytes, trusted_keys=trusted_keys,
                   signature=signature, force=force, lock_timeout=lock_timeout, progress=progress)
