"""What the writer, the reader and the file list share: the error, the sizes, a tar header's layout."""

from __future__ import annotations

import tarfile

from warmer.errors import UntrustedInput

MANIFEST_MEMBER = "artifact.json"
CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE
# Keep the permission bits, never setuid/setgid/sticky: the files are code a server will load.
MODE_MASK = 0o755


class ArchiveError(UntrustedInput):
    """The archive is unreadable, or does not match its manifest."""


# The fields of a ustar header block (POSIX.1-1988, as pax extends it): byte ranges in its 512 bytes.
H_NAME = slice(0, 100)
H_MODE = slice(100, 108)
H_IDS_SIZE_MTIME = slice(100, 148)  # mode, uid, gid, size, mtime: written together
H_SIZE = slice(124, 136)
H_CHKSUM = slice(148, 156)
H_TYPE = slice(156, 157)
H_MAGIC = slice(257, 265)
H_PREFIX = slice(345, 500)
