"""Where a path really lives: the mount table (/proc/PID/mountinfo) read, and what each kind of
filesystem means for a cache (wiped with the pod, RAM, persistent, shared over the network).
Leaf module: takes mountinfo as text, so recorded samples stand in for a real pod in tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OVERLAY_FS = ("overlay", "overlayfs", "aufs", "fuse.fuse-overlayfs")
RAM_FS = ("tmpfs", "ramfs")
NETWORK_FS = (
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "9p",
    "ceph",
    "glusterfs",
    "lustre",
    "fuse.s3fs",
    "fuse.gcsfuse",
    "fuse.mountpoint-s3",
    "fuse.juicefs",
    "fuse.sshfs",
    "virtiofs",
)
DISK_FS = ("ext4", "ext3", "ext2", "xfs", "btrfs", "zfs", "f2fs")


@dataclass(frozen=True)
class Mount:
    mount_point: str
    root: str  # the path inside its filesystem that is mounted (a bind mount's source)
    fstype: str
    source: str
    options: tuple[str, ...]

    @property
    def read_only(self) -> bool:
        return "ro" in self.options


_ESCAPE = re.compile(r"\\([0-7]{3})")


def unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\040, \\011, \\012, \\134."""
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """/proc/PID/mountinfo: `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE
    SUPEROPTIONS` (proc(5)). The optional fields vary in number, so the fs type is found after
    the lone '-'."""
    out = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 9 or "-" not in fields[6:]:
            continue  # not a mountinfo line
        sep = fields.index("-", 6)
        if len(fields) < sep + 3:
            continue
        # Per-mount options and the filesystem's own (super) options: "ro" in either means read-only.
        options = set(fields[5].split(",")) | set(fields[sep + 3].split(",") if len(fields) > sep + 3 else ())
        out.append(
            Mount(
                mount_point=unescape(fields[4]),
                root=unescape(fields[3]),
                fstype=fields[sep + 1],
                source=unescape(fields[sep + 2]),
                options=tuple(sorted(options)),
            )
        )
    return out


def under(path: str, prefix: str) -> bool:
    return prefix == "/" or path == prefix or path.startswith(prefix.rstrip("/") + "/")


def mount_of(path: str, mounts: list[Mount]) -> Mount | None:
    """The mount holding path: the longest mount point above it; on a tie the later (upper) one."""
    best = None
    for m in mounts:
        if under(path, m.mount_point) and (best is None or len(m.mount_point) >= len(best.mount_point)):
            best = m
    return best


def classify(m: Mount | None) -> tuple[str, str]:
    """(kind, what it means for a cache) of a mount."""
    if m is None:
        return "unknown", "no mount found for it"
    if m.fstype in RAM_FS:  # an emptyDir with medium Memory looks like any tmpfs from inside
        return (
            "tmpfs",
            "tmpfs (RAM, e.g. an emptyDir with medium: Memory): wiped with the pod or on "
            "reboot, and every byte counts against the memory limit",
        )
    if m.fstype in OVERLAY_FS or (m.fstype.startswith("fuse.") and "overlay" in m.fstype):
        if m.mount_point == "/":
            return "container-root", "the container's own overlay root: wiped with every pod"
        return "overlay", "an overlay filesystem: wiped with its container"
    if "kubernetes.io~empty-dir" in m.root:
        return "emptydir", "an emptyDir: survives container restarts, not a new pod"
    if m.fstype in NETWORK_FS or m.fstype.startswith("fuse."):
        return (
            "network",
            f"a network filesystem ({m.fstype}): persistent, but JIT locks and ninja mtimes are unreliable there",
        )
    if re.search(r"kubernetes\.io~(csi|aws-ebs|gce-pd|azure-disk|local-volume)", m.root):
        return "volume", "a persistent volume"
    if m.fstype in DISK_FS or m.source.startswith("/dev/"):
        return "disk", "a node-local disk (a hostPath or the host's own filesystem): persistent"
    return "other", f"a {m.fstype} filesystem"
