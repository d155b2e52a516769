"""Write a file so that readers see the old one or the new one, never a part.

The temporary file beside the target gets a unique name (uuid), as huggingface_hub's
_download_to_tmp_and_move does: two writers of one path, or a planted `NAME.tmp`, never meet.
Leaf module.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO


def temp_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")


@contextmanager
def atomic_write(path: str | os.PathLike, mode: int = 0o644, durable: bool = True) -> Iterator[BinaryIO]:
    """Open a new file beside path for writing; on success it replaces path (fsync, then rename).
    durable=False skips the fsync, for a file whose reader checks it whole anyway: readers still
    see the old file or the new one, but after a power loss the new one may be torn."""
    path = Path(path)
    if in_place(path):
        with _open_in_place(path) as f:
            yield f
        return
    tmp = temp_beside(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        raise _naming(e, tmp, path) from None
    try:
        with open(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        try:
            os.replace(tmp, path)
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            # path is a mount point (a file bind-mounted into a container): it is written, never replaced
            with open(tmp, "rb") as src, _open_in_place(path) as dst:
                shutil.copyfileobj(src, dst)
                dst.flush()
                if durable:
                    os.fsync(dst.fileno())
            tmp.unlink()
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _naming(e, tmp, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# A process's own open files: /dev/stdout leads through /proc/self/fd/1 to whatever the shell gave it.
_OPEN_FILES = ("/proc/", "/dev/fd/", "/dev/stdout", "/dev/stderr")


def own_stream(path: Path) -> int | None:
    """1 or 2 when path is this process's stdout or stderr (/dev/stdout). It is written through a dup
    of that descriptor: at its own offset, after what was printed there, where a second open of a
    redirected file would write over it; and a pipe the container runtime made (root's, 0600) is
    writable through it by a process that may not open it again."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    for std in (1, 2):
        try:
            if os.path.samestat(os.fstat(std), st):
                return std
        except OSError:
            continue
    return None


def in_place(path: Path) -> bool:
    """Whether path is written into rather than replaced: /dev/null, a FIFO, or whatever /dev/stdout
    or /proc/self/fd/N leads to (a pipe, a terminal, a file a shell redirected into). Replaced by a
    rename, the device or link itself would become a file (as root: the node's /dev/null)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False  # absent: created, atomically
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return True
    link = os.readlink(path) if os.path.islink(path) else ""
    return str(path.absolute()).startswith(_OPEN_FILES) or link.startswith(_OPEN_FILES)


@contextmanager
def _open_in_place(path: Path) -> Iterator[BinaryIO]:
    """path opened to write, truncated as a shell's `>` does. A FIFO without a reader is an error at
    once, not a wait for one that may never come."""
    std = own_stream(path)
    if std is not None:
        with suppress(OSError, ValueError):  # what was printed goes first; a closed sys.stdout has nothing
            (sys.stdout if std == 1 else sys.stderr).flush()
        fd = os.dup(std)
    else:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise OSError(e.errno, "a FIFO that no process reads", str(path)) from None
            raise
        os.set_blocking(fd, True)
    with open(fd, "wb") as f:
        yield f


def _naming(e: OSError, tmp: Path, path: Path) -> OSError:
    """e about path, which the caller named, not about the temporary file (a name nobody knows)."""
    if e.filename not in (None, str(tmp), tmp):
        return e
    return OSError(e.errno, e.strerror, str(path)) if e.errno is not None else e


def write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    with atomic_write(path, mode) as f:
        f.write(data)
