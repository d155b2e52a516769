"""Write a file so that readers see the old one or the new one, never a part.

The temporary file beside the target gets a unique name (uuid), as huggingface_hub's
_download_to_tmp_and_move does: two writers of one path, or a planted `NAME.tmp`, never meet.
Leaf module.
"""

from __future__ import annotations

import os
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
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
    if is_stream(path):  # /dev/stdout, /dev/null, a FIFO: written into, never replaced by a file (as root)
        with open(path, "wb") as f:
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
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _naming(e, tmp, path) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def is_stream(path: Path) -> bool:
    """Whether path (its links followed) names something other than a file or a directory."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _naming(e: OSError, tmp: Path, path: Path) -> OSError:
    """e about path, which the caller named, not about the temporary file (a name nobody knows)."""
    if e.filename not in (None, str(tmp), tmp):
        return e
    return OSError(e.errno, e.strerror, str(path)) if e.errno is not None else e


def write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    with atomic_write(path, mode) as f:
        f.write(data)
