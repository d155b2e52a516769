"""Restore an artifact into a root without ever exposing a half-written or unverified cache.

Extract into a staging directory beside the root, check every file against artifact.json,
then swap it in with one atomic rename. A lock beside the root makes concurrent restores
(pods of one node sharing a hostPath) take turns; the second finds the work done.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO, Callable, ContextManager

from warmer import archive, artifact, components, signing

MARKER = ".warmer-artifact.json"
DEFAULT_MAX_BYTES = 256 << 30


class RestoreError(Exception):
    """The artifact was not activated; the root holds what it held before."""


def artifact_id(doc: dict) -> str:
    """Identifies one artifact.json exactly (files, digests and timings)."""
    return hashlib.sha256(artifact.dumps(doc)).hexdigest()


def active(root: Path) -> dict | None:
    """The marker of the artifact active in root, if any."""
    try:
        return json.loads((root / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None


@contextmanager
def _locked(root: Path):
    lock_path = root.parent / f".{root.name}.warmer.lock"
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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


def _clean_leftovers(root: Path) -> None:
    """Under the lock no other restore is running: staging dirs left behind are from crashes."""
    for p in root.parent.glob(f".{root.name}.staging-*"):
        if p.name.endswith(".old") and not root.exists():
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
    return RestoreError(f"not activated, {root} is unchanged: {e.strerror or e} ({where}): {fix}")


def restore(doc: dict, open_archive: Callable[[], ContextManager[BinaryIO]], root: Path, *,
            archive_sha256: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> dict:
    """Activate the artifact described by doc in root; a no-op when it is already active.

    open_archive opens the archive's bytes (a local file or a store's blob). The archive's own
    artifact.json must equal doc, every file must match it, and, when given, the archive must
    hash to archive_sha256. Anything else leaves root as it was.
    """
    root = check_root(root)
    want = artifact_id(doc)
    t0 = time.perf_counter()
    staging = root.parent / f".{root.name}.staging-{os.getpid()}"
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        with _locked(root):
            _clean_leftovers(root)
            marker = active(root)
            if marker and marker.get("artifact_id") == want:
                return {"status": "already-active", "root": str(root), "key": doc["key"],
                        "seconds": round(time.perf_counter() - t0, 3)}
            need = artifact.total_bytes(doc)
            free = shutil.disk_usage(root.parent).free
            if need > free:
                raise RestoreError(f"the artifact unpacks to {need / 2**30:.2f} GiB but {root.parent} has "
                                   f"{free / 2**30:.2f} GiB free: free space or choose another root")
            try:
                staging.mkdir()
                got = _extract(doc, want, open_archive, staging, archive_sha256, max_bytes)
                _activate(staging, root)
            finally:
                # After a swap this holds the previous root; after a failure, the partial extraction.
                shutil.rmtree(staging, ignore_errors=True)
    except (archive.ArchiveError, artifact.ArtifactError) as e:
        raise RestoreError(f"not activated, {root} is unchanged: {e}") from e
    except OSError as e:
        raise _os_error(e, root) from e
    return {"status": "restored", "root": str(root), "key": doc["key"], "files": got.files,
            "bytes": got.bytes, "archive_bytes": got.archive_bytes,
            "seconds": round(time.perf_counter() - t0, 3)}


def _extract(doc: dict, want: str, open_archive, staging: Path, archive_sha256: str | None,
             max_bytes: int) -> archive.Extracted:
    """Unpack and check into staging, then add what the root needs besides the files."""
    def expected(manifest: bytes) -> dict:
        # Bytes that hash to want are doc, written by artifact.dumps: no need to parse and
        # re-serialize 12k file entries (0.1 s) to see it; anything else gets the full check.
        if hashlib.sha256(manifest).hexdigest() != want and artifact_id(artifact.loads(manifest)) != want:
            raise archive.ArchiveError("the archive's artifact.json is not the one this restore "
                                       "was asked for (the store's index and blob disagree)")
        return artifact.entries(doc)

    with open_archive() as stream:
        got = archive.extract(stream, staging, expected, max_bytes)
    if archive_sha256 and got.archive_sha256 != archive_sha256:
        raise archive.ArchiveError(f"the archive hashes to {got.archive_sha256}, expected "
                                   f"{archive_sha256}: corrupt or truncated download")
    for c in components.ALL:  # e.g. TMPDIR must exist, or it is silently replaced by /tmp
        (staging / c.subdir).mkdir(exist_ok=True)
    (staging / MARKER).write_text(json.dumps({
        "artifact_id": want, "key": doc["key"], "recipe": doc["recipe"]["name"],
        "archive_sha256": got.archive_sha256,
        "restored_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "artifact": doc}))  # compact: json's C encoder; indent=1 takes the pure-Python one
    return got


def restore_file(path: Path, root: Path, *, max_bytes: int = DEFAULT_MAX_BYTES, trusted_keys=(),
                 signature: dict | None = None) -> dict:
    """Restore from a local artifact file (image builds, air-gapped nodes).

    With trusted_keys, the file must be signed by one of them (signature, or FILE.sig)."""
    try:
        with open(path, "rb") as f:
            manifest = archive.read_manifest(f)
        doc = artifact.loads(manifest)
        if trusted_keys:
            signing.check(manifest, signature or signing.read_sidecar(path), list(trusted_keys))
    except FileNotFoundError:
        raise RestoreError(f"artifact file {path} does not exist") from None
    except (archive.ArchiveError, artifact.ArtifactError, signing.SignatureError) as e:
        raise RestoreError(f"not activated: {path}: {e}") from e
    return restore(doc, lambda: open(path, "rb"), root, max_bytes=max_bytes)


def render_env(env: dict[str, str], fmt: str) -> str:
    """shell: `export K=V` lines to source; dotenv: K=V lines (docker --env-file, systemd)."""
    lines = []
    for k, v in env.items():
        if "\n" in v:
            raise RestoreError(f"env {k} holds a newline; it cannot be written as {fmt}")
        lines.append(f"export {k}={shlex.quote(v)}" if fmt == "shell" else f"{k}={v}")
    return "\n".join(lines) + "\n"
