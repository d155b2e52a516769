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
import dataclasses
import errno
import fcntl
import functools
import glob
import io
import json
import logging
import os
import pwd
import shutil
import signal
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO

from warmer import archive, compat, components, signing, workspace
from warmer.artifact import Artifact, ArtifactError, Layer
from warmer.deadline import Deadline, DeadlineExceeded
from warmer.errors import Terminated, UsageError, WarmerError
from warmer.fingerprint import Fingerprint
from warmer.mounts import parse_mountinfo
from warmer.store import BlobCorrupt, BlobStream, StoreError
from warmer.store.progress import Progress
from warmer.untrusted import Fields, InvalidDocument, load_json

# Opens an archive's bytes: a local file, or a store's BlobStream (read, read1, drain ...).
Opener = Callable[[], AbstractContextManager[Any]]

MARKER = ".warmer-artifact.json"  # in an active root: which artifact it holds
PREPARED = ".warmer-root"  # in a root warmer prepared for vLLM to compile into (a miss)
DEFAULT_MAX_BYTES = 256 << 30
DEFAULT_LOCK_TIMEOUT = 900.0  # a restore of a large artifact on a slow disk takes minutes
MAX_MARKER_BYTES = archive.MANIFEST_LIMIT + (1 << 20)
log = logging.getLogger("warmer")


class Rollback(WarmerError):
    """The offered artifact is older than the signed one active for the same key."""


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
    # A partial hit: the components restored (the rest of the artifact was left out, as not fitting
    # this node); None: the whole artifact.
    components: tuple[str, ...] | None = None

    def holds(self, rel: str) -> bool:
        """Whether the root holds rel of the artifact (a partial hit holds its components' files)."""
        return self.components is None or _in_components(rel, self.components)

    def holds_component(self, name: str) -> bool:
        return _holds(self.components, name)

    @property
    def bytes_held(self) -> int:
        """The bytes of the artifact's files the root holds (a partial hit's components' alone)."""
        if self.components is None:
            return self.artifact.total_bytes
        return sum(size for path, size in self.artifact.files.sizes() if self.holds(path))

    def to_bytes(self) -> bytes:
        return b"".join(self.pieces())

    def pieces(self) -> Iterator[bytes]:
        """The marker's bytes, artifact.json spliced in as its canonical bytes (the marker's id
        check needs them exact), in pieces: written without being made whole."""
        yield (
            f'{{"artifact_id":"{self.artifact.id}","key":"{self.artifact.key}",'
            f'"recipe":"{self.artifact.recipe.name}","archive_sha256":"{self.archive_sha256}",'
            f'"restored_at":"{self.restored_at}",'
        ).encode()
        yield (
            b'"components":'
            + json.dumps(list(self.components) if self.components is not None else None).encode()
            + b","
        )
        yield b'"signature":' + json.dumps(self.signature.to_json() if self.signature else None).encode()
        yield from archive.manifest.as_last_field(self.artifact.form, _ARTIFACT_KEY)

    @classmethod
    def from_bytes(cls, data: bytes, where: str, expect: Artifact | None = None) -> Marker:
        """expect: the artifact the caller hopes is active. A marker that ends with its canonical
        bytes holds it: only the marker's head is parsed (a no-op fetch skips re-reading 10,000 entries)."""
        if (
            expect is not None
            and len(data) <= MAX_MARKER_BYTES
            and (head := archive.manifest.without_last_field(data, expect.form, _ARTIFACT_KEY)) is not None
        ):
            f = Fields(load_json(head, what=where, max_bytes=MAX_MARKER_BYTES), where)
            art = expect
        else:
            doc, files = archive.manifest.load(data, where, MAX_MARKER_BYTES, inside=("artifact",))
            f = Fields(doc, where)
            art = Artifact.from_json(f.obj("artifact").doc, files, f"{where}.artifact")
        if f.text("artifact_id", max_len=64) != art.id:
            raise InvalidDocument(f"{where}: its artifact_id does not match its artifact.json")
        return cls(
            art,
            f.text("archive_sha256", max_len=64),
            f.text("restored_at", max_len=64),
            signing.Signature.from_json(f.raw("signature"), f"{where}.signature"),
            f.str_list("components") if f.raw("components") is not None else None,
        )


def _holds(names: tuple[str, ...] | None, component: str) -> bool:
    """Whether a restore of names (None: the whole artifact) holds component."""
    return names is None or component in names


def _in_components(rel: str, names: tuple[str, ...]) -> bool:
    owner = components.of_path(rel)
    return owner is not None and owner.name in names


_ARTIFACT_KEY = "artifact"  # the marker's last field: artifact.json's canonical bytes, as they are


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
    distrust = distrusted(marker, trusted_keys)
    if distrust:
        return distrust
    shared = workspace.Workspace.of(marker.artifact, root) if marker.holds_component("flashinfer") else None
    if shared is not None:  # its FlashInfer files are the shared workspace's units, from any artifact of its key
        if not shared.linked(root):
            return f"{root}/{components.flashinfer.SUBDIR} is not the link to {shared.path}"
        lost = shared.missing(
            marker.artifact.files, hashed=False, trusted_keys=tuple(trusted_keys), known=marker.artifact
        )
        if lost:
            return f"the shared FlashInfer workspace {shared.path} lacks {len(lost)} of its unit(s) ({lost[0]})"
    return _lacking(marker, root, shared is not None)


def distrusted(marker: Marker, trusted_keys) -> str | None:
    """Why, with trusted keys, the artifact a marker names is not to be served; None when it is."""
    if trusted_keys:
        try:
            signing.verify(marker.artifact.canonical, marker.signature, list(trusted_keys))
        except signing.SignatureError as e:
            return f"its marker's artifact.json is not signed by a trusted key ({e})"
    return None


def unfit(marker: Marker, node: Fingerprint | None) -> str | None:
    """Why the artifact a marker names must not be loaded on node (compat.UNSAFE_TO_LOAD: a driver
    older than the build's, another ISA on a CPU backend, another compute capability; for a partial
    hit, among the fields its layers take); None when it may, or node is unknown. Any other misfit
    only misses, and the root still serves what fits."""
    if node is None:
        return None
    art, identity = marker.artifact, marker.artifact.recipe.identity
    bad = compat.unsafe_to_load(art.fingerprint, node, identity)
    if bad and marker.components is not None:  # a partial hit: only what the layers it holds check
        checked = {d.field for d in compat.held_misfits(art.fingerprint, node, identity, marker.components)}
        bad = [d for d in bad if d.field in checked]
    return f"it is not safe to load on this node ({'; '.join(d.line() for d in bad)})" if bad else None


def _lacking(marker: Marker, root: Path, shared: bool) -> str | None:
    """Why root does not hold the files marker lists (of its components; shared: but the shared
    FlashInfer workspace's, checked on their own); None when it does. One lstat per file."""
    base = str(root)
    for path, size in marker.artifact.files.sizes():
        if not marker.holds(path) or (shared and path.startswith(workspace.PREFIX)):
            continue
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


def _holders(fd: int) -> list[tuple[int, str]]:
    """(pid, READ or WRITE) of each process holding a lock on the file open as fd, from /proc/locks (Linux)."""
    st = os.fstat(fd)
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (or "->" for waiters)
                if len(fields) >= 6 and fields[1] != "->" and fields[5] == want and fields[4].isdigit():
                    out.append((int(fields[4]), fields[3]))
    except OSError:
        pass
    return [(pid, kind) for pid, kind in out if pid != os.getpid()]


def _describe(pid: int) -> str:
    """pid N (its command line), since when it runs: who holds a lock, for the person waiting."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    since = ""
    try:  # field 22 of /proc/PID/stat: start time in clock ticks after boot
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
        boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
        since = f", running since {datetime.fromtimestamp(started, UTC):%Y-%m-%d %H:%M:%S} UTC"
    except (OSError, ValueError, IndexError):
        pass
    return f"pid {pid}" + (f" ({cmd[:120]})" if cmd else "") + since


# warmer takes the lock exclusively: a shared holder is not a restore (any process that could open
# the file can take LOCK_SH), so it is waited on this long at most, not the whole lock timeout.
FOREIGN_HOLDER_WAIT_S = 10.0
LOCK_MODE = 0o600  # only the root's owner (and root) may open, and so lock, the lock file


@contextmanager
def locked(
    root: Path,
    timeout: float = DEFAULT_LOCK_TIMEOUT,
    owner: tuple[int, int] | None = None,
    deadline: Deadline | None = None,
):
    """Hold the lock beside root; RestoreError after timeout seconds (FOREIGN_HOLDER_WAIT_S for a
    shared holder, which is never a restore), naming the holder and since when it runs. owner:
    the lock is handed to it, as the root is, so that its later fetches can lock it. deadline: a
    fetch's; past it (or cancelled) DeadlineExceeded, whatever the timeout."""
    path = lock_path(root)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, LOCK_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise not_activated(
                root, f"the lock {path} is a symbolic link, which warmer never creates: someone planted it; remove it"
            ) from None
        # the lock alone in the way (its directory writable): the fix is the lock's, not the directory's
        denied = e.errno in (errno.EACCES, errno.EPERM)
        if denied and os.access(path.parent, os.W_OK | os.X_OK, effective_ids=True) and (st := _lstat(path)):
            raise not_activated(
                root,
                f"{e.strerror}: the lock {path} belongs to uid {st.st_uid} with mode {stat.filemode(st.st_mode)}, which this "
                f"user (uid {os.geteuid()}) cannot open (a fetch run as root without --owner made it): as root, "
                f"`chown {os.geteuid()}:GID {path}`, or remove it",
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_activated(
                root,
                f"the lock {path} is not a regular file ({stat.filemode(st.st_mode)}): someone planted it; remove it",
            )
        allowed = {os.geteuid(), 0} | ({owner[0]} if owner else set())
        if st.st_uid not in allowed:
            raise not_activated(
                root,
                f"the lock {path} belongs to uid {st.st_uid}, not to this user "
                f"({os.geteuid()}) or root: restore as its owner, or remove it",
            )
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != LOCK_MODE:
            os.fchmod(fd, LOCK_MODE)  # a lock an older warmer made 0644: any user could take LOCK_SH on it
        if owner and os.geteuid() == 0 and (st.st_uid, st.st_gid) != owner:
            os.fchown(fd, *owner)
        _wait_for(fd, root, path, timeout, deadline)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _wait_for(fd: int, root: Path, path: Path, timeout: float, deadline: Deadline | None) -> None:
    """Take the lock on fd, polling (flock has no timeout) until timeout, or FOREIGN_HOLDER_WAIT_S
    while only shared holders (never a restore) hold it."""
    began = time.monotonic()
    delay, said = 0.01, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holders = _holders(fd)
            shared = bool(holders) and all(kind == "READ" for _, kind in holders)
            limit = min(timeout, FOREIGN_HOLDER_WAIT_S) if shared else timeout
            who = ", ".join(_describe(p) for p, _ in holders) or "another process"
            if not said:  # a person watching a pod's log should know why nothing moves
                log.info(
                    "waiting up to %.0f s for the lock %s, held%s by %s", limit, path, " shared" if shared else "", who
                )
                said = True
            if deadline is not None and deadline.expired():
                raise deadline.error(f"waiting for the lock {path}, held by {who}") from None
            if time.monotonic() - began >= limit:
                what = "held shared (warmer takes it exclusively: this is not a restore)" if shared else "still held"
                raise not_activated(
                    root,
                    f"the lock {path} is {what} after {limit:.0f} s by {who}; another "
                    "restore may be running (wait, or stop it), or a process holds the "
                    "lock file open: stop it, or remove the lock",
                ) from None
            time.sleep(delay)  # polling the lock with a deadline (flock has no timeout)
            delay = min(delay * 2, 0.5)


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
        # Filesystems without RENAME_EXCHANGE (NFS): two renames; a crash between them leaves the
        # old tree at .old, which the next restore moves back before anything else. SIGTERM (a pod
        # deleted) waits for the pair: raised between them, it left no root and removed the new tree.
        old = staging.with_name(staging.name + ".old")
        with signals_held():
            os.rename(root, old)
            try:
                os.rename(staging, root)
            except OSError:
                os.rename(old, root)
                raise
            os.rename(old, staging)


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGTERM and Ctrl-C are handled after the block, not inside it. Their Python handlers run in
    the main thread whichever thread the kernel gives the signal (a download's readers), so the
    handlers are swapped, not the signal mask; a restore in another thread is never interrupted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    before = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for signum in dict.fromkeys(got):
            signal.raise_signal(signum)  # to the handler it had, now


def _ours(path: Path, owner: tuple[int, int] | None = None) -> bool:
    """A real directory (not a link) owned by this user, or by the owner it hands roots to:
    something a restore of ours left."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (st.st_uid == os.geteuid() or bool(owner and st.st_uid == owner[0]))


def _clean_leftovers(root: Path, owner: tuple[int, int] | None = None) -> None:
    """Under the lock no other restore is running: staging dirs left behind are from crashes.
    Anything else by those names (a link, another user's directory) is left alone: never followed,
    never renamed into place."""
    for p in root.parent.glob(f"{glob.escape(f'.{root.name}')}.staging-*"):  # a [ in a root's name matches others'
        if not _ours(p, owner):
            continue
        if p.name.endswith(".old") and not os.path.lexists(root) and (p / MARKER).is_file():
            os.rename(p, root)
        else:
            shutil.rmtree(p, ignore_errors=True)


def check_root(root: Path) -> Path:
    root = Path(os.path.abspath(root))
    # os.path's tests, not Path's: a directory above the root this user cannot search (0750 root:root)
    # is no usage error, the root's writability check names it and vLLM starts cold
    if os.path.islink(root):
        raise UsageError(linked_root(root))
    if os.path.exists(root) and not os.path.isdir(root):
        raise UsageError(f"root {root} exists and is not a directory: choose a directory")
    if mount_point_at(root):
        raise UsageError(_mount_point(root))
    return root


def linked_root(root: Path) -> str:
    """What a root that is a symlink costs, and the fixes: one path where the build's was this one
    (the real path then differs from the build's root, and its path-bound caches rebuild too)."""
    return (
        f"root {root} is a symlink to {os.path.realpath(root)}: FlashInfer's ninja rebuilds what it finds "
        f"through a link; pass the real path as --root, or, where the build's root was {root}, make that a "
        f"real directory: mount the volume at {root.parent} (a link above it is resolved too)"
    )


def mount_point_at(root: Path) -> bool:
    """Whether root is the top of a mount: it lies on another mount than its parent. The kernel's
    mount id of each (not st_dev, which a btrfs subvolume changes, nor the mount table, which lists
    mounts that later ones hide); where /proc gives none (gVisor), the mount table. A root not there
    yet, or no /proc: not one (the swap's EBUSY says it)."""
    try:
        ids = {_mount_id(root), _mount_id(root.parent)}
        if None in ids:
            table = os.fsdecode(Path("/proc/self/mountinfo").read_bytes())  # paths are bytes: never a decode error
            return any(m.mount_point == os.path.realpath(root) for m in parse_mountinfo(table))
    except OSError:
        return False
    return len(ids) == 2


def _mount_id(path: Path) -> int | None:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            return next((int(line.split()[1]) for line in info if line.startswith("mnt_id:")), None)
    finally:
        os.close(fd)


def _mount_point(root: Path) -> str:
    return (
        f"root {root} is a mount point: a restore builds the new root beside it and renames it into "
        f"place, which a mount point refuses (every fetch would start cold); {mount_point_fix(root)}"
    )


def mount_point_fix(root: Path) -> str:
    """A volume mounted at the root: a directory in it is the root (a mount at / is no pod's)."""
    inside = (
        f"keep the volume and give a directory in it as the root (--root {root}/RECIPE, as the shipped "
        "manifests do; the build's root is then that path too)"
    )
    if root.parent == Path(root.anchor):
        return inside
    return f"{inside}, or mount the volume one level up (at {root.parent}) and keep --root {root}"


# -- ownership: the serving user must write the root ------------------------------------------------


def check_owner(owner: tuple[int, int] | None) -> None:
    """An owner (uid, gid) this process can hand a root to: it must be root, or be that user."""
    if owner is not None and os.geteuid() != 0 and owner != (os.geteuid(), os.getegid()):
        raise UsageError(
            f"--owner {owner[0]}:{owner[1]} needs root (it changes the restored files' owner); this is "
            f"uid {os.geteuid()}: run the fetch as root, or as uid {owner[0]} without --owner"
        )


def _chown_tree(top: Path, owner: tuple[int, int]) -> None:
    """Hand top and everything under it to owner, each through its directory's fd (os.fwalk), no link
    followed: lchown by path follows a directory above the file that a pod swaps for a link meanwhile
    (the shared FlashInfer workspace is the pods'), and root would hand the pod's pick of a file of the
    node (/etc/shadow) to it."""
    os.chown(top, *owner, follow_symlinks=False)
    for _, dirs, files, fd in os.fwalk(top):
        for name in dirs + files:
            with suppress(FileNotFoundError):  # gone meanwhile (a running FlashInfer's temporary file)
                os.chown(name, *owner, dir_fd=fd, follow_symlinks=False)


def _owned_otherwise(top: Path, owner: tuple[int, int]) -> bool:
    """Whether top or anything under it is not owner's (uid and gid); links are not followed."""
    st = os.lstat(top)
    if (st.st_uid, st.st_gid) != owner:
        return True
    for _, dirs, files, fd in os.fwalk(top):
        for name in dirs + files:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:  # gone meanwhile (a running FlashInfer's temporary file)
                continue
            if (st.st_uid, st.st_gid) != owner:
                return True
    return False


def _writes_into(root: Path) -> list[Path]:
    """The directories vLLM and torch write into under root, even on a full hit: the root and every
    directory the cache env names (Inductor's locks, vLLM's modelinfos, TMPDIR's rendezvous file)."""
    return [root, *dict.fromkeys(Path(p) for p in components.cache_env(root).values())]


def unwritable(
    root: Path, owner: tuple[int, int] | None = None, dirs: list[Path] | None = None, *, creatable: bool = False
) -> str | None:
    """Why the serving user (owner's uid, or this process) cannot write what vLLM writes into root
    (dirs: _writes_into(root), when the caller has them); None when it can. creatable: a directory
    that does not exist counts as one the user can make (prepare, or vLLM), judged by the nearest
    directory above it that does, as mkdir is; when root itself exists."""
    dirs = dirs or _writes_into(root)
    if creatable and os.path.isdir(root):
        dirs = list(dict.fromkeys(_nearest_existing(d) for d in dirs))
    other = owner if owner is not None and owner[0] != os.geteuid() else None
    for d in dirs:
        try:
            st = os.stat(d)
        except FileNotFoundError:
            return f"{d} does not exist"
        except PermissionError:  # stat needs only the way there: a directory above that this user cannot search
            blocked = blocked_above(d, (os.geteuid(), os.getegid()))
            if blocked is None:
                return f"{d}: permission denied"
            return _no_way_through(blocked, os.stat(blocked), os.geteuid())
        except OSError as e:
            return f"{d}: {e.strerror}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{d} is not a directory"
        if other is None:
            # this user as vLLM's writes will be judged: its effective ids, groups, ACLs and capabilities
            ok = os.access(d, os.W_OK | os.X_OK, effective_ids=True)
        else:
            ok = _may(other, st, 0o3)
        if not ok:
            if os.statvfs(d).f_flag & os.ST_RDONLY:
                return f"{d} is on a read-only filesystem"
            return f"{d} is owned by {st.st_uid}:{st.st_gid} with mode {stat.filemode(st.st_mode)}"
    if other is not None:  # and the way there: each directory above, searched (the kernel checks it too)
        for d in dirs:
            if (p := blocked_above(d, other)) is not None:
                return _no_way_through(p, os.stat(p), other[0])
    return None


def _no_way_through(p: Path, st: os.stat_result, uid: int) -> str:
    return (
        f"{p} (above it) is owned by {st.st_uid}:{st.st_gid} with mode {stat.filemode(st.st_mode)}: "
        f"uid {uid} cannot get through it"
    )


def blocked_above(root: Path, owner: tuple[int, int]) -> Path | None:
    """The first directory above root that owner (uid, gid) may not search (this process: as the
    kernel judges it; another user: by the mode bits, as _may), where no chown of the root helps;
    None when there is none."""
    for p in reversed(root.parents):
        try:
            if owner[0] == os.geteuid():
                if not os.path.exists(p):  # made later, by mkdir: judged by the one above, which passed
                    return None
                if not os.access(p, os.X_OK, effective_ids=True):
                    return p
            elif not _may(owner, os.stat(p), 0o1):
                return p
        except OSError:  # one above it already blocks, or it is gone: judged by that one
            return None
    return None


def _nearest_existing(d: Path) -> Path:
    while not d.exists() and d != d.parent:
        d = d.parent
    return d


def _may(owner: tuple[int, int], st: os.stat_result, bits: int) -> bool:
    """Whether owner (uid, gid), without capabilities, has bits (1 search, 2 write, 4 read) on a
    file, as the kernel decides from its mode: the owner's class, else the group's (gid, or a group
    this machine's group database gives the uid), else others'."""
    uid, gid = owner
    shift = 6 if st.st_uid == uid else 3 if st.st_gid in _groups(uid, gid) else 0
    return uid == 0 or (st.st_mode >> shift) & bits == bits


@functools.cache
def _groups(uid: int, gid: int) -> frozenset[int]:
    """gid and the supplementary groups of uid's user here (an image's vLLM user); only gid for a
    uid without a passwd entry (a pod's groups come from its spec, which no file here holds)."""
    try:
        return frozenset(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except (KeyError, OSError):
        return frozenset({gid})


def ownership_fix(root: Path, owner: tuple[int, int]) -> str:
    """The commands that hand root to owner (uid, gid), for a message: the directory above it too,
    where a fetch as that user makes its lock, its staging directory and the new root; on a read-only
    filesystem, or past a directory above it owner may not search, where no chown helps, that."""
    uid, gid = owner
    try:
        read_only = bool(os.statvfs(_nearest_existing(root)).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        return "Fix: the filesystem is mounted read-only: mount it read-write, or choose a root on a writable volume"
    blocked = blocked_above(root, owner)
    if blocked is not None:  # no chown of the root helps, nor --owner
        return f"Fix: `chmod o+x {blocked}`, or a root under directories uid {uid} can search"
    parent = root.parent
    if parent == Path(root.anchor):  # never hand / over: a directory of roots instead
        chown = (
            f"a root in a directory of its own (`install -d -o {uid} -g {gid} /cache`, then --root /cache/{root.name})"
        )
    elif not os.path.lexists(parent):
        chown = f"`install -d -o {uid} -g {gid} {parent}` as root"
    elif os.path.lexists(root):
        lock = f" {lock_path(root)}" if os.path.lexists(lock_path(root)) else ""
        chown = f"`chown {uid}:{gid} {parent} && chown -R {uid}:{gid} {root}{lock}` as root"
    else:
        chown = f"`chown {uid}:{gid} {parent}` as root"
    return (
        f"Fix: fetch as root with `--owner {uid}:{gid}` (warmer hands the root over), or {chown} (a fetch as "
        f'uid {uid} makes its lock and the new root in {parent}), or run it on a directory uid {uid} owns (README, "Ownership")'
    )


def _roots_inside(root: Path) -> str | None:
    """Why root is no root: it holds warmer roots (--root /cache for --root /cache/RECIPE), which a
    restore there would replace, every recipe's warmed cache; None when it holds none."""
    try:
        names = sorted(p.name for p in root.iterdir() if (p / MARKER).is_file() or (p / PREPARED).is_file())
    except OSError:  # absent, or no directory: the checks after this one say so
        return None
    if not names:
        return None
    if names == [root.name]:  # ROOT/ROOT: a restore once given the root's own path twice
        return f"{root} holds a warmer root of its own name, {root / root.name}: remove that one, then restore again"
    shown = ", ".join(names[:3]) + (", …" if len(names) > 3 else "")
    return (
        f"{root} holds warmer roots ({shown}): it is a directory of roots, not a root (not even with "
        f"--force): pass --root {root}/RECIPE (fetch: or --all with --root-base {root})"
    )


def _replaceable(root: Path) -> str | None:
    """Why root may not be replaced without force: None when it is absent, empty, or warmer's."""
    if not root.exists():
        return None
    if (root / MARKER).is_file() or (root / PREPARED).is_file():
        return None
    # empty, or only the cache directories warmer points vLLM at: its mark lost (a cleaner of old files)
    names = {p.name for p in root.iterdir()}
    if names <= {c.subdir.split("/")[0] for c in components.ALL}:
        return None
    return (
        f"{root} holds files warmer did not put there (no {MARKER} or {PREPARED}): a restore would replace "
        "them: remove them, or choose another root (`warmer restore` replaces them with --force)"
    )


def prepare(root: Path, owner: tuple[int, int] | None = None) -> str | None:
    """Mark root as warmer's and create every cache directory (a TMPDIR that does not exist is
    silently replaced by /tmp); with owner (as root), hand what vLLM writes into to it. Returns
    why the serving user (owner's uid, or this process) still cannot write it (unwritable)."""
    root.mkdir(parents=True, exist_ok=True)
    if not (root / MARKER).exists():
        (root / PREPARED).touch()
    dirs = _writes_into(root)
    # root and, when root's flashinfer/ is the link warmer makes, the shared workspace's top: another
    # link (a pod can plant one in its own root, at any depth) is not followed, and nothing above them
    # is touched: this may run as root, and the pod would be handed what the link points at.
    shared = workspace.Workspace.linked_from(root)
    tops = [root, *([shared.top] if shared else [])]
    mine = [d for d in dirs if _linkless(d, tops)]
    for d in mine:
        d.mkdir(parents=True, exist_ok=True)
    if owner and os.geteuid() == 0:  # each directory from a top down to every cache directory
        for path in {p for d in mine for p in (d, *d.parents) if any(p.is_relative_to(t) for t in tops)}:
            os.lchown(path, *owner)
    return unwritable(root, owner, dirs)


def _linkless(d: Path, tops: list[Path]) -> bool:
    """Whether d lies under one of tops with no link from that top down to it."""
    for top in tops:
        if d.is_relative_to(top):
            p = top
            for part in d.relative_to(top).parts:
                p = p / part
                if p.is_symlink():
                    return False
            return True
    return False


def _os_error(e: OSError, root: Path) -> RestoreError:
    where = e.filename or root.parent
    if e.errno == errno.ENOSPC:
        fix = "free space on that filesystem or choose a root on a larger one"
    elif e.errno in (errno.EACCES, errno.EPERM):
        fix = f"run as a user who may write to {root.parent}, or choose a writable root"
    elif e.errno == errno.EROFS:
        fix = "the filesystem is read-only: choose a root on a writable volume"
    elif e.errno == errno.EBUSY:  # a mount point mount_point_at could not see (no /proc)
        return not_activated(root, f"{e.strerror} ({where}): {_mount_point(root)}")
    elif e.errno == errno.EXDEV:
        fix = (
            f"{root} cannot be renamed within {root.parent}: it is on another filesystem, or in an overlay's "
            "lower layer (a directory baked into the image); give a root in a directory of a volume"
        )
    else:
        fix = "see the error above"
    return not_activated(root, f"{e.strerror or e} ({where}): {fix}")


@dataclass(frozen=True)
class RestoreResult:
    status: str  # "restored" or "already-active"
    root: str
    key: str
    seconds: float
    files: int | None = None
    bytes: int | None = None
    archive_bytes: int | None = None  # what was read from the store (0 for a layer found on the node)
    # Layers taken from this node (another root, the shared FlashInfer workspace), not downloaded.
    reused: tuple[str, ...] | None = None
    replaced_recipe: str | None = None  # the other recipe whose artifact the root held: one root, two models
    warnings: tuple[str, ...] | None = None  # restore FILE: what the serving user will meet there

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items() if v is not None}


def restore(
    art: Artifact,
    open_archive: Opener,
    root: Path,
    *,
    archive_sha256: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    trusted_keys=(),
    signature: signing.Signature | None = None,
    force: bool = False,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    owner: tuple[int, int] | None = None,
    progress: bool = False,
    deadline: Deadline | None = None,
    refuse_rollback: bool = False,
    components: tuple[str, ...] | None = None,
    open_layer: LayerOpener | None = None,
) -> RestoreResult:
    """Activate art in root; a no-op when it is already active and intact.

    open_archive opens the archive's bytes (a local file or a store's blob). The archive's own
    artifact.json must equal art, every file must match it, and, when given, the archive must
    hash to archive_sha256. Anything else leaves root as it was. signature (already verified by
    the caller) is kept in the marker, so a later no-op can check it again. owner (uid, gid): the
    new tree is handed to it before it is swapped in (this process must be root: check_owner).
    refuse_rollback: raise Rollback when art is older than the intact signed artifact active for the
    same key (decided under the lock, from the one read of the marker). components: a partial hit,
    only these components' files are activated (every file is still checked on the way).
    open_layer: a layered artifact's store: each layer activated is read on its own (only those of
    components), or taken from another root of this node that holds it (no download). An artifact
    built in the shared FlashInfer workspace beside root (warmer/workspace.py) has its FlashInfer
    files moved there, and root's flashinfer/ linked to it.
    """
    root = check_root(root)
    check_owner(owner)
    t0 = time.perf_counter()
    staging = root.parent / f".{root.name}.staging-{uuid.uuid4().hex[:12]}"
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        with locked(root, lock_timeout, owner, deadline):
            _clean_leftovers(root, owner)
            marker = active(root, expect=art)
            if (
                marker
                and marker.artifact.id == art.id
                and marker.components == components
                and still_intact(marker, root, trusted_keys) is None
            ):
                if owner and os.geteuid() == 0:
                    # restored by root before: hand it over now; the whole tree is looked at, as a miss
                    # in between (activate's prepare) hands over the root's top directories alone
                    if _owned_otherwise(root, owner):
                        _chown_tree(root, owner)
                    shared = workspace.Workspace.of(art, root) if marker.holds_component("flashinfer") else None
                    # and its FlashInfer files, as a restore hands them over; only when one is not the
                    # owner's (an lstat each): a pod's start need not wait for the workspace's lock
                    if shared is not None and _owned_otherwise(shared.top, owner):
                        shared.real_dir(shared.path)
                        with locked(shared.top, lock_timeout, owner, deadline):
                            _chown_tree(shared.top, owner)  # vLLM takes FlashInfer's module locks there
                return RestoreResult("already-active", str(root), art.key, round(time.perf_counter() - t0, 3))
            older = _rolls_back(art, signature, marker, root, trusted_keys) if refuse_rollback and marker else None
            if marker and older:
                raise Rollback(
                    f"not activated: the store offers an artifact {older}, older than the "
                    f"signed one active in {root} (created {marker.artifact.created_at}) for the same key: "
                    "a rollback, refused (anyone who may write the store could put an older signed build back). "
                    "To leave the active build on purpose, `warmer rm` the slot's entry and build again: "
                    "`warmer build` signs a newer artifact of this key, which nodes take"
                )
            # --force replaces foreign files, never a directory of other roots (every recipe's cache)
            why = None if marker else _roots_inside(root) or (None if force else _replaceable(root))
            if why:
                raise not_activated(root, why)
            other = marker.artifact.recipe.name if marker and marker.artifact.recipe.name != art.recipe.name else None
            need = (  # a partial hit of a layered artifact reads its components' layers alone
                sum(c.bytes for name, c in art.components.items() if name in components)
                if components is not None and open_layer is not None and art.layers
                else art.total_bytes
            )
            free = shutil.disk_usage(root.parent).free
            if need > free:
                raise not_activated(
                    root,
                    f"what is restored unpacks to {need / 1e6:.1f} MB but {root.parent} has "
                    f"{free / 1e6:.1f} MB free: free space or choose another root",
                )
            try:
                staging.mkdir()
                bar = Progress(f"restore {art.key[:12]}", art.total_bytes) if progress else None
                shared = workspace.Workspace.of(art, root) if _holds(components, "flashinfer") else None
                try:
                    reused: tuple[str, ...] = ()
                    if open_layer is not None and art.layers:
                        got, reused = _extract_layers(
                            art, open_layer, root, staging, components, max_bytes, bar, shared, tuple(trusted_keys)
                        )
                    else:
                        got = _extract(art, open_archive, staging, archive_sha256, max_bytes, bar)
                        if components is not None:
                            got = _keep_only(art, components, staging, got)
                finally:
                    if bar:
                        bar.close()
                if shared is not None:
                    _into_workspace(shared, art, staging, signature, tuple(trusted_keys), lock_timeout, owner, deadline)
                elif _holds(components, "flashinfer"):  # FlashInfer's links, which an archive never holds
                    workspace.make_links(staging / workspace.PREFIX, art.path_contract.flashinfer, staging)
                done = Marker(
                    art, got.archive_sha256, datetime.now(UTC).isoformat(timespec="seconds"), signature, components
                )
                # Each file was checked as it landed; a retried layer or anyone on the node could have
                # removed one since. An lstat per file, as on every no-op fetch, before the swap.
                if (why := _lacking(done, staging, shared is not None)) is not None:
                    raise archive.ArchiveError(f"the staging directory is incomplete: {why}")
                with open(staging / MARKER, "xb") as f:  # staging is ours alone until the swap: no temp file
                    f.writelines(done.pieces())
                if owner and os.geteuid() == 0:
                    _chown_tree(staging, owner)
                _activate(staging, root)
            finally:
                # After a swap this holds the previous root; after a failure, the partial extraction.
                if _ours(staging, owner):
                    shutil.rmtree(staging, ignore_errors=True)
    except DeadlineExceeded:
        raise  # the caller says it: a slow store, not a bad artifact
    except (archive.ArchiveError, ArtifactError, StoreError) as e:
        raise not_activated(root, str(e)) from e
    except OSError as e:
        raise _os_error(e, root) from e
    return RestoreResult(
        "restored",
        str(root),
        art.key,
        round(time.perf_counter() - t0, 3),
        got.files,
        got.bytes,
        got.archive_bytes,
        reused or None,
        other,
    )


# An active artifact created further ahead than this of the node's clock was built on a machine whose
# clock ran ahead: every rebuild would be refused as older until that time came (README: rm and rebuild).
CLOCK_SLACK = timedelta(minutes=10)


def _rolls_back(
    offered: Artifact, signature: signing.Signature | None, marker: Marker, root: Path, trusted_keys
) -> str | None:
    """How offered is older than the intact, signed artifact of the same key active in root (said
    for the message); None when it is not."""
    active = marker.artifact
    if active.key != offered.key or active.id == offered.id:
        return None
    a, b = offered.created(), active.created()
    if a is None or b is None or a > b:
        return None
    if b > datetime.now(UTC) + CLOCK_SLACK:  # its builder's clock ran ahead: its date orders nothing
        return None
    older = f"created {offered.created_at}"
    if a == b:  # SOURCE_DATE_EPOCH dates every build of one commit alike: when the key signed each decides
        keys = list(trusted_keys)
        held = signing.signed_time(active.canonical, marker.signature, keys)
        mine = signing.signed_time(offered.canonical, signature, keys)
        if held is None or (mine is not None and mine > held):
            return None
        older += (
            f" and signed {mine.isoformat()}"
            if mine
            else " and signed with no time (by a warmer before signed times: rebuild it with this one)"
        ) + f" (the active one signed {held.isoformat()})"
    return older if still_intact(marker, root, trusted_keys) is None else None


# The statuses of an activation that leave vLLM pointed at the offered artifact: a fetch's hits.
ACTIVE = ("hit", "already-active")
# Some of its components active (those that fit this node), restored now or before.
PARTIAL = "partial"


@dataclass(frozen=True)
class Activation:
    """What a node's fetch left in root for vLLM. status: hit, already-active, partial, unwritable (active,
    but the serving user cannot write root), miss (past the deadline), rollback, error; None when
    nothing was offered. vllm_root: where vLLM compiles (root, or a cold directory of its own when
    root is not writable by it: vLLM writes lock files there even on a full hit)."""

    status: str | None
    vllm_root: Path
    restored: RestoreResult | None = None
    warnings: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        """Whether vLLM is pointed at the offered artifact (or, on a partial hit, at its fitting part)."""
        return self.status in ACTIVE or self.status == PARTIAL


def activate(
    root: Path,
    art: Artifact | None,
    open_archive: Opener,
    *,
    recipe: str,
    owner: tuple[int, int] | None = None,
    ready: Callable[[], None] | None = None,
    node: Fingerprint | None = None,
    **options,
) -> Activation:
    """Restore art (when offered) into root, then ready root for vLLM either way: a miss or a
    refused artifact still leaves a root vLLM compiles into. options: restore()'s. The operator's
    own errors (UsageError, a recipe that fails its check: ready, called before the root is
    prepared) and interrupts are raised; anything else that stops the restore is said, and root is
    as it was. recipe: its name, for the cold directory. node: this node, when known: an artifact
    the root holds that does not fit it is not served (unfit)."""
    status, restored, warnings = None, None, []
    if art is not None:
        try:
            restored = restore(art, open_archive, root, owner=owner, **options)
            status = "hit" if restored.status == "restored" else restored.status
            if restored.replaced_recipe:
                warnings.append(
                    f"{root} held recipe {restored.replaced_recipe}'s artifact, now replaced by recipe {art.recipe.name}'s: "
                    "give each served model a root of its own (--root-base), or every start of one replaces the "
                    "other's cache under it"
                )
            if options.get("components") is not None:
                status = PARTIAL
        except (KeyboardInterrupt, SystemExit, Terminated, UsageError):
            raise
        except Exception as e:  # the README's promise: whatever went wrong, the pod starts (slowly)
            status = "rollback" if isinstance(e, Rollback) else "miss" if isinstance(e, DeadlineExceeded) else "error"
            warnings.append(_not_activated(e, root))
    if ready is not None:
        ready()
    uid = owner[0] if owner else os.geteuid()
    cold = cold_root(recipe, uid)
    try:
        foreign = _roots_inside(root) or _replaceable(root)
    except OSError:  # a root this user cannot look into, or a file: prepare below says why
        foreign = None
    if foreign is not None:  # marked as warmer's (prepare), the next fetch would replace what it holds
        said = any(foreign in w for w in warnings)  # the restore refused it for this
        warnings.append(
            f"{root} is left as it is (not warmer's), and the env points vLLM at {cold} (a cold start)"
            if said
            else f"{foreign}; it is left as it is, and the env points vLLM at {cold} (a cold start)"
        )
        return Activation(status, cold, restored, tuple(warnings))
    held = active(root) if status not in (*ACTIVE, PARTIAL) else None
    # restored before the keys were set or rotated, or before the node changed (a driver rolled
    # back, an image baked on another CPU): what it holds is not to be loaded
    refused = (distrusted(held, options.get("trusted_keys")) or unfit(held, node)) if held else None
    if held and refused:
        warnings.append(
            f"{root} holds artifact {held.artifact.id[:12]}, but {refused}: it is left as it is (an "
            f"artifact restored later replaces it), and the env points vLLM at {cold} (a cold start)"
        )
        return Activation(status, cold, restored, tuple(warnings))
    try:
        problem = prepare(root, owner)
    except OSError as e:
        problem = f"cannot prepare it ({e.strerror}: {e.filename or root})"
    if problem is None:
        return Activation(status, root, restored, tuple(warnings))
    warnings.append(
        f"{root} is not writable by uid {uid}, the user vLLM runs as: {problem}; vLLM would crash on its lock "
        f"files there, so the env points it at {cold} (a cold start). "
        f"{ownership_fix(root, owner or (os.geteuid(), os.getegid()))}"
    )
    return Activation("unwritable" if status in (*ACTIVE, PARTIAL) else status, cold, restored, tuple(warnings))


def _not_activated(e: Exception, root: Path) -> str:
    """The one line for what stopped an activation."""
    if isinstance(e, Rollback):
        return str(e)
    if isinstance(e, DeadlineExceeded):  # a slow or silent store: a slow start, said in one line
        return f"{e}: not activated, {root} is unchanged; vLLM will compile from cold"
    detail = str(e) if isinstance(e, WarmerError) else f"unexpected {type(e).__name__}: {e}"
    if not detail.startswith("not activated"):
        detail = f"not activated, {root} is unchanged: {detail}"
    return f"{detail}; vLLM will compile from cold"


def cold_root(recipe: str, uid: int) -> Path:
    """Where vLLM compiles from cold when the root is not writable by it: a directory of the serving
    user's own in the temporary directory (vLLM and torch create what they need under it)."""
    return Path(tempfile.gettempdir()) / f"warmer-cold-{recipe}-{uid}"


def own_cold_root(recipe: str) -> Path:
    """cold_root for this process's user, readied: made by it (0700), or found as it makes it. A
    directory of that name that another user made first (a shared /tmp: the systemd path) would
    hold the kernels vLLM loads and runs, so a fresh one of a random name is taken instead."""
    path = cold_root(recipe, os.geteuid())
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        st = os.lstat(path)
        if not (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077):
            path = Path(tempfile.mkdtemp(prefix=f"{path.name}-"))
    prepare(path)
    return path


def _extract(
    art: Artifact,
    open_archive,
    staging: Path,
    archive_sha256: str | None,
    max_bytes: int,
    bar=None,
    files: archive.FileList | None = None,
) -> archive.Extracted:
    """Unpack and check into staging, then add what the root needs besides the files.

    A store's stream (BlobStream) is extracted as it downloads. Bytes that fail (a member's
    sha256, zstd, the blob's digest at the end) are either what the store holds (the artifact is
    bad: refused at once) or were damaged on the way (read again, as many times as the store
    allows, after removing what the read wrote: a layer's files alone, the layers before it stay):
    drain() finishes the download to tell which."""
    attempt, start = 0, bar.done if bar else 0
    while True:
        attempt += 1
        with open_archive() as stream:
            blob = getattr(stream, "blob", stream)  # a layer comes framed (_Framed)
            streamed = isinstance(blob, BlobStream)
            try:
                got = archive.extract(
                    stream,
                    staging,
                    (lambda manifest: files) if files is not None else (lambda manifest: _files_of(art, manifest)),
                    max_bytes,
                    on_file=bar,
                )
                break
            except BlobCorrupt:
                if not streamed or not blob.checked:
                    raise
            except (archive.ArchiveError, ArtifactError):
                # Finish the download (hashing only) to learn whether these were the blob's bytes;
                # bounded: a blob larger than what it may unpack to is refused without it.
                if (
                    not streamed
                    or blob.attempts == 1
                    or blob.size > max_bytes + (max_bytes >> 6) + (64 << 20)
                    or blob.drain()
                ):
                    raise
            if attempt >= blob.attempts:
                raise blob.refused(attempt)
        # Damaged on the way: read again, without what this read wrote.
        if files is None:
            shutil.rmtree(staging)
            staging.mkdir()
        else:  # a layer: the layers before it are in staging too, and stay
            for e in files:
                (staging / e.path).unlink(missing_ok=True)
        if bar:
            bar(start - bar.done)
    if archive_sha256 and got.archive_sha256 != archive_sha256:
        raise archive.ArchiveError(
            f"the archive hashes to {got.archive_sha256}, expected {archive_sha256}: corrupt or truncated download"
        )
    for c in components.ALL:  # e.g. TMPDIR must exist, or it is silently replaced by /tmp
        (staging / c.subdir).mkdir(exist_ok=True)
    return got


# Opens one layer's blob (a store's BlobStream, hashed to the layer's sha256 as it is read).
LayerOpener = Callable[[Layer], BlobStream]
_LAYER_HEAD = archive.manifest_frame(b"{}")  # a layer is extracted as an archive: a head, the layer, the end


class _Framed:
    """A layer's blob read as a whole archive: a manifest frame before it (its files are the signed
    artifact.json's, given to extract directly) and the end-of-archive frame after it."""

    hashes_itself = False

    def __init__(self, blob: BlobStream):
        self.blob = blob
        self._parts: list[Any] = [io.BytesIO(_LAYER_HEAD), blob, io.BytesIO(archive.END_FRAME)]

    def read(self, n: int = -1) -> bytes:
        while self._parts:
            data = self._parts[0].read(n)
            if data:
                return data
            self._parts.pop(0)
        return b""

    def __enter__(self) -> _Framed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.blob.close()


def _extract_layers(
    art: Artifact,
    open_layer: LayerOpener,
    root: Path,
    staging: Path,
    names: tuple[str, ...] | None,
    max_bytes: int,
    bar=None,
    shared: workspace.Workspace | None = None,
    trusted_keys: tuple = (),
) -> tuple[archive.Extracted, tuple[str, ...]]:
    """The layers of art (those of names, or all) into staging, each from another root of this node
    that holds it intact, or else read from the store on its own. shared: the workspace the
    FlashInfer layer goes to; when it holds every unit of the layer intact, nothing is read."""
    by_component: dict[str, list[archive.FileEntry]] = {}
    for e in art.files:
        owner = components.of_path(e.path)
        by_component.setdefault(owner.name if owner else "", []).append(e)
    chosen = [layer for layer in art.layers if names is None or layer.component in names]
    total = sum(e.size for layer in chosen for e in by_component.get(layer.component, []))
    if total > max_bytes:  # each layer's extraction is capped too; this is the cap on them together
        raise archive.ArchiveError(
            f"the artifact unpacks to {total} bytes, over the limit of {max_bytes}; raise --max-bytes if this is expected"
        )
    files = nbytes = downloaded = 0
    reused = []
    others = _other_roots(root)
    for layer in chosen:
        entries = by_component.get(layer.component, [])
        into = shared if layer.component == components.flashinfer.COMPONENT.name else None
        if into is not None and into.holds(entries, trusted_keys=trusted_keys, known=art):
            reused.append(layer.component)  # W holds every unit intact, built for any recipe of its key
        elif into is None and _from_node(others, layer, entries, staging):
            reused.append(layer.component)
        else:
            part = archive.FileList.of(entries)
            _extract(art, lambda layer=layer: _Framed(open_layer(layer)), staging, None, max_bytes, bar, files=part)
            downloaded += layer.size
        files, nbytes = files + len(entries), nbytes + sum(e.size for e in entries)
    for c in components.ALL:
        (staging / c.subdir).mkdir(exist_ok=True)
    return archive.Extracted(files, nbytes, "layers", downloaded), tuple(reused)


def _into_workspace(
    shared: workspace.Workspace,
    art: Artifact,
    staging: Path,
    signature: signing.Signature | None,
    trusted_keys: tuple,
    lock_timeout: float,
    owner: tuple[int, int] | None,
    deadline: Deadline | None,
) -> None:
    """art's FlashInfer files, extracted into staging, moved into the shared workspace where it
    lacks them (under its lock: two recipes restore at once), and staging's flashinfer/ made the
    link to it. ArchiveError, and nothing activated, when it still lacks a unit of art (but one that
    a running vLLM is building: said, and moved in by the next fetch)."""
    staged = staging / components.flashinfer.SUBDIR
    shared.real_dir(shared.path)
    with locked(shared.top, lock_timeout, owner, deadline):
        building = shared.adopt(staged, art, signature, trusted_keys)
        workspace.make_links(shared.path, art.path_contract.flashinfer, shared.top.parent)
        lost = [
            u
            for u in shared.missing(art.files, hashed=False, trusted_keys=trusted_keys, known=art)
            if u not in building
        ]
        for unit in building:
            log.warning(
                "%s: a running FlashInfer holds its lock (it is building it): left to that build, which has "
                "the same commands; the next fetch moves this artifact's copy in",
                unit,
            )
        if owner and os.geteuid() == 0:
            _chown_tree(shared.top, owner)  # vLLM writes there: FlashInfer's locks, its log, new modules
    if lost:
        raise archive.ArchiveError(f"the shared FlashInfer workspace {shared.path} lacks {lost[0]} after the restore")
    shutil.rmtree(staged, ignore_errors=True)
    staged.symlink_to(workspace.target(shared.top.name))


def _other_roots(root: Path) -> list[tuple[Path, Marker]]:
    """The roots beside root (a root base: one root per recipe) with an active artifact, each marker read once."""
    try:
        siblings = sorted(p for p in root.parent.iterdir() if p != root and not p.name.startswith("."))
    except OSError:
        return []
    return [(p, m) for p in siblings if (m := active(p)) is not None]


def _from_node(
    others: list[tuple[Path, Marker]], layer: Layer, entries: list[archive.FileEntry], staging: Path
) -> bool:
    """Copy layer's files from another root of this node whose active artifact holds the same layer
    (the same sha256), each checked against entries (this artifact's signed list) as it is copied:
    a sibling root is shared with every pod of the node, so nothing in it is trusted. False, and
    nothing left in staging, when no root has it intact."""
    for other, marker in others:
        held = next((x for x in marker.artifact.layers if x.component == layer.component), None)
        if held is None or held.sha256 != layer.sha256 or not marker.holds_component(layer.component):
            continue
        done: list[Path] = []
        try:
            for e in entries:
                done.append(_copy_checked(other / e.path, staging / e.path, e))
            return True
        except (OSError, archive.ArchiveError) as why:
            log.info("layer %s not taken from %s: %s", layer.component, other, why)
            for path in done:
                path.unlink(missing_ok=True)
    return False


def _copy_checked(src: Path, dst: Path, e: archive.FileEntry) -> Path:
    """src copied to dst (a regular file, not through a link), hashed on the way: ArchiveError unless
    it is e (size and sha256); dst gets e's mode and mtime, as extraction gives them."""
    if e.mode & ~archive.MODE_MASK:  # what extraction refuses, refused here too
        raise archive.ArchiveError(f"artifact.json gives {e.path!r} mode {e.mode:o}: refused")
    f = _open_regular(src)  # no link, no FIFO: a sibling root is anyone's on the node
    if f is None:
        raise archive.ArchiveError(f"{src} is not a regular file")
    with f:
        if (size := os.fstat(f.fileno()).st_size) != e.size:  # grown, say: not copied until the disk is full
            raise archive.ArchiveError(f"{src} is {size} bytes, artifact.json lists {e.size}")
        dst.parent.mkdir(parents=True, exist_ok=True)
        out = open(dst, "xb")
        try:
            with out:
                digest, n = archive.copy_hashed(f, out, e.size)
            if n != e.size or digest != e.sha256:
                raise archive.ArchiveError(f"{src} is not the file artifact.json lists")
            os.chmod(dst, e.mode)
            os.utime(dst, ns=(e.mtime_ns, e.mtime_ns))
        except BaseException:  # a full disk, say: the layer is downloaded into this very path next
            dst.unlink(missing_ok=True)
            raise
    return dst


def _keep_only(art: Artifact, names: tuple[str, ...], staging: Path, got: archive.Extracted) -> archive.Extracted:
    """A partial hit: the files of components other than names removed from staging (they were
    checked with the rest, but do not fit this node), and the counts of what stays."""
    dropped, dropped_bytes, parents = 0, 0, set()
    for path, size in art.files.sizes():
        if not _in_components(path, names):
            os.unlink(staging / path)
            dropped, dropped_bytes = dropped + 1, dropped_bytes + size
            parents.add(os.path.dirname(path))
    for rel in sorted(parents, key=lambda p: p.count("/"), reverse=True):  # the emptied directories
        while rel and "/" in rel:
            try:
                os.rmdir(staging / rel)
            except OSError:
                break
            rel = os.path.dirname(rel)
    return dataclasses.replace(got, files=got.files - dropped, bytes=got.bytes - dropped_bytes)


def _files_of(art: Artifact, manifest: Iterator[memoryview]) -> archive.FileList:
    """art's files, once the archive's artifact.json (in pieces) is found to be art: its canonical
    bytes compared as they stream by, neither side held whole, or another byte form of the same
    artifact.json, parsed (archive.manifest.other_bytes)."""
    rest = archive.manifest.other_bytes(art.form, manifest)
    if rest is not None and Artifact.from_bytes(rest).id != art.id:
        raise archive.ArchiveError(
            "the archive's artifact.json is not the one this restore "
            "was asked for (the store's index and blob disagree)"
        )
    return art.files


def read_artifact_file(path: Path) -> Artifact:
    """The artifact.json at the head of a local artifact file."""
    try:
        with open(path, "rb") as f:
            return Artifact.from_bytes(archive.read_manifest(f), f"{path}: artifact.json")
    except FileNotFoundError:
        raise RestoreError(f"artifact file {path} does not exist") from None
    except IsADirectoryError:
        raise RestoreError(f"{path} is a directory, not an artifact file") from None


def restore_file(
    path: Path,
    root: Path,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    trusted_keys=(),
    signature: signing.Signature | None = None,
    force: bool = False,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    owner: tuple[int, int] | None = None,
    progress: bool = False,
) -> RestoreResult:
    """Restore from a local artifact file (image builds, air-gapped nodes).

    With trusted_keys, the file must be signed by one of them (signature, or FILE.sig)."""
    try:
        art = read_artifact_file(path)
        if trusted_keys:
            signature = signature or signing.read_sidecar(signing.sidecar(path))
            signing.verify(art.canonical, signature, list(trusted_keys))
    except (archive.ArchiveError, ArtifactError, signing.SignatureError) as e:
        raise RestoreError(f"not activated: {path}: {e}") from e
    result = restore(
        art,
        lambda: open(path, "rb"),
        root,
        max_bytes=max_bytes,
        trusted_keys=trusted_keys,
        signature=signature,
        force=force,
        lock_timeout=lock_timeout,
        owner=owner,
        progress=progress,
    )
    # As fetch readies a root (activate): every cache directory made, and handed to owner. An
    # artifact holds none that is empty (FlashInfer's autotune dir on CPU), and `warmer serve` sends
    # vLLM to a cold directory of its own when one is missing: a baked image would start cold.
    problem = prepare(root, owner)
    if problem is not None:  # an image that ships so starts cold on every pod: said at its build
        who = owner or (os.geteuid(), os.getegid())
        # a warning, not a failure: the modes are all this judges by, and the serving process may have
        # more (a capability, a group the pod's spec gives it that no file here lists)
        result = dataclasses.replace(
            result,
            warnings=(
                f"{root} is restored, but by its modes uid {who[0]}, the user vLLM runs as, cannot write it: "
                f"{problem}; vLLM would crash on its lock files there (`warmer serve` starts it cold instead). "
                f"{ownership_fix(root, who)}",
            ),
        )
    return result
