"""Pack cache trees into tar.zst and unpack them, checking every file against a manifest.

Layout of an archive: two concatenated zstd frames that together are one tar stream, so
`tar --zstd -xf` opens it like any other:

    frame 1: the member artifact.json (the manifest: every file's size and sha256)
    frame 2: the cache files, then the end-of-archive blocks

The manifest comes first so that extraction can check each member as it streams by, and it
sits in its own frame so it can be rewritten (timings added after verify) without
recompressing the files. One header reader (tarread._Inflated.header) serves both reading the
manifest and extracting.

    filelist       artifact.json's files list: its entries, kept as their bytes (FileList)
    manifest       artifact.json's bytes around that list, never made whole (Canonical)
    tarwrite       pack_body, pack_layers (a frame per layer), manifest_frame, assemble, replace_manifest
    tarread        read_manifest, extract, check: the limits a hostile archive meets
    extractwriter  the threads that write and hash what extract reads
    common         the error, the sizes, a tar header's layout

A leaf package: it imports nothing from warmer but the error base, warmer.untrusted and
warmer.atomic.
"""

from warmer.archive import manifest
from warmer.archive.common import (
    BLOCK,
    CHUNK,
    H_CHKSUM,
    H_IDS_SIZE_MTIME,
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
from warmer.archive.extractwriter import WRITERS
from warmer.archive.filelist import FileEntry, FileList
from warmer.archive.tarread import (
    MANIFEST_LIMIT,
    PAX_HEADER_LIMIT,
    PAX_HEADERS_PER_MEMBER,
    Extracted,
    check,
    extract,
    read_manifest,
)
from warmer.archive.tarwrite import (
    END_FRAME,
    Frame,
    assemble,
    copy_hashed,
    first_frame_size,
    manifest_frame,
    pack_body,
    pack_layers,
    replace_manifest,
    sha256_file,
)

__all__ = [
    "BLOCK",
    "END_FRAME",
    "Frame",
    "pack_layers",
    "CHUNK",
    "H_CHKSUM",
    "H_IDS_SIZE_MTIME",
    "H_MAGIC",
    "H_MODE",
    "H_NAME",
    "H_PREFIX",
    "H_SIZE",
    "H_TYPE",
    "MANIFEST_LIMIT",
    "MANIFEST_MEMBER",
    "MODE_MASK",
    "PAX_HEADERS_PER_MEMBER",
    "PAX_HEADER_LIMIT",
    "WRITERS",
    "ArchiveError",
    "Extracted",
    "FileEntry",
    "FileList",
    "assemble",
    "check",
    "copy_hashed",
    "extract",
    "first_frame_size",
    "manifest",
    "manifest_frame",
    "pack_body",
    "read_manifest",
    "replace_manifest",
    "sha256_file",
]
