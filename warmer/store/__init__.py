"""Where artifacts live: content-addressed blobs plus one small index entry per recipe and key.

    blobs/sha256/<2 hex>/<sha256>.tar.zst   the archive, named by its own digest
    index/<recipe>/<key>.json               {"recipe", "key", "blob": {"sha256", "size"},
                                             "artifact": artifact.json, "published_at"}
    audit/<UTC time>-<action>-<recipe>-<key16>.json   who removed what (warmer rm)

A blob goes up first and its index entry last, created only if absent: the first publisher
wins and a published artifact never changes. A node needs one index read and one blob read.
The behaviour every backend shares (skip a blob the store has, cap what an index read takes)
lives in Store; a backend implements the primitive operations. Leaf package: imports nothing
from warmer outside it but the error base, warmer.names and warmer.deadline.
"""

from __future__ import annotations

import abc
from datetime import datetime
from typing import NamedTuple

from warmer.deadline import Deadline
from warmer.errors import StoreError, UntrustedInput, UsageError
from warmer.names import HEX64, MAX_INDEX_BYTES, NAME
from warmer.store.stream import BlobCorrupt, BlobMissing, BlobStream, window_from_env

# An index entry holds artifact.json, about 200 bytes per cached file: 64 MiB is ~300,000 files,
# far beyond any real cache, and keeps a hostile entry from being read whole into memory.

__all__ = [
    "Blob",
    "BlobCorrupt",
    "BlobMissing",
    "BlobStream",
    "HEX64",
    "MAX_INDEX_BYTES",
    "NAME",
    "Store",
    "StoreError",
    "blob_path",
    "index_path",
    "open_store",
    "parse_blob_path",
    "parse_index_path",
    "Scrap",
    "UnreadableEntry",
]


class NotARegularFile(UntrustedInput):
    """Where a store should hold a regular file, something else is (a link, a FIFO, a device)."""


class IndexTooLarge(UntrustedInput):
    """An index entry larger than MAX_INDEX_BYTES: refused before it is read whole."""


class UnreadableEntry(UntrustedInput):
    """An index entry the store holds that cannot be read as one (malformed, a part corrupt or
    missing, or a newer warmer's): listed as unreadable, removable with `warmer rm`."""


class Blob(NamedTuple):
    sha256: str
    size: int
    modified: datetime  # timezone-aware, UTC


class Scrap(NamedTuple):
    """What a writer that died left in a store, which no listing shows (a file store's half-copied
    blob): its path in the store, its bytes, and when it was last written."""

    path: str
    size: int
    modified: datetime  # timezone-aware, UTC


def blob_path(sha256: str) -> str:
    if not HEX64.match(sha256):
        raise StoreError(f"{sha256!r} is not a sha256 hex digest")
    return f"blobs/sha256/{sha256[:2]}/{sha256}.tar.zst"


def index_path(recipe: str, key: str) -> str:
    if not NAME.match(recipe) or not HEX64.match(key):
        raise StoreError(f"bad index name {recipe!r}/{key!r}")
    return f"index/{recipe}/{key}.json"


def parse_index_path(rel: str) -> tuple[str, str] | None:
    """(recipe, key) of an index path, or None for anything else found under index/."""
    parts = rel.split("/")
    if len(parts) == 3 and parts[0] == "index" and parts[2].endswith(".json"):
        recipe, key = parts[1], parts[2][: -len(".json")]
        if NAME.match(recipe) and HEX64.match(key):
            return recipe, key
    return None


def parse_blob_path(rel: str) -> str | None:
    """The sha256 of a blob path, or None for anything else found under blobs/."""
    parts = rel.split("/")
    if len(parts) == 4 and parts[:2] == ["blobs", "sha256"] and parts[3].endswith(".tar.zst"):
        sha = parts[3][: -len(".tar.zst")]
        if HEX64.match(sha) and parts[2] == sha[:2]:
            return sha
    return None


class Store(abc.ABC):
    """A store: the shared rules here, the transport in each backend."""

    url: str
    # Bounds every request and retry of this store (warmer.deadline), each store its own; a fetch sets it.
    deadline: Deadline
    # list_blobs names every blob the store holds; False: only those this handle's deletes released
    lists_blobs = True

    # -- what every store does the same way ---------------------------------------------------

    def put_blob(self, path: str, sha256: str) -> bool:
        """Upload the file at path as blob sha256, unless the store has it (a blob's name is its
        content). True when this call uploaded it."""
        if self.has_blob(sha256):
            return False
        self._upload_blob(path, sha256)
        return True

    def put_index(self, recipe: str, key: str, entry: bytes) -> bool:
        """Create the index entry only if it is absent; False: another publisher was first."""
        if len(entry) > MAX_INDEX_BYTES:
            raise StoreError(
                f"index entry {recipe}/{key} is {len(entry)} bytes, over the {MAX_INDEX_BYTES} "
                "bytes nodes accept: the artifact lists too many files"
            )
        return self._create_index(index_path(recipe, key), entry)

    def get_index(self, recipe: str, key: str) -> bytes | None:
        """The entry's bytes, or None when there is none; at most MAX_INDEX_BYTES are read."""
        data = self._read_index(index_path(recipe, key), MAX_INDEX_BYTES + 1)
        if data is not None and len(data) > MAX_INDEX_BYTES:
            raise IndexTooLarge(
                f"index entry {recipe}/{key} in {self.url} is larger than {MAX_INDEX_BYTES} "
                "bytes: refused (not written by warmer); remove it with `warmer rm`"
            )
        return data

    def prepare(self) -> None:
        """Ready the store for a publisher: a file store creates its directory (the first publish
        to file:///new makes it); a bucket or a registry must exist already (said on first use)."""

    def write_audit(self, name: str, record: bytes) -> None:
        """Keep a small record of a destructive action (warmer rm) in the store itself."""
        self._create_index(f"audit/{name}.json", record)

    # -- what each backend implements ---------------------------------------------------------

    @abc.abstractmethod
    def has_blob(self, sha256: str) -> bool: ...

    @abc.abstractmethod
    def _upload_blob(self, path: str, sha256: str) -> None: ...

    @abc.abstractmethod
    def stream_blob(self, sha256: str, size: int | None = None) -> BlobStream:
        """The blob's bytes in order, read in parallel ranges while the caller reads (a window of
        them in memory, whatever the size), hashed on the way: at the end, BlobCorrupt unless they
        hash to sha256. size: what the index entry says (a store that holds another size is
        refused at once). BlobMissing when the store does not hold it."""

    @abc.abstractmethod
    def _create_index(self, rel: str, entry: bytes) -> bool:
        """Create rel with entry only if absent (atomically); False when it exists."""

    @abc.abstractmethod
    def _read_index(self, rel: str, limit: int) -> bytes | None:
        """At most limit bytes of rel; None when absent. Anything but a regular object is refused."""

    @abc.abstractmethod
    def list_index(self, recipe: str | None = None) -> list[tuple[str, str]]: ...

    @abc.abstractmethod
    def list_blobs(self) -> list[Blob]: ...

    @abc.abstractmethod
    def delete_index(self, recipe: str, key: str) -> None: ...

    @abc.abstractmethod
    def delete_blob(self, sha256: str) -> None: ...

    def refuses_delete(self, recipe: str, key: str) -> str | None:
        """Why delete_index would refuse this entry (a registry tag that holds another tool's image,
        or whose manifest another tag names), asked before rm says or does anything; None: it would not."""
        return None

    def pinned_by(self, recipe: str, key: str) -> str | None:
        """A name outside warmer's own that deleting the entry would delete too (a registry tag
        someone added to its manifest); gc keeps such an entry. None where a store has no such names."""
        return None

    def list_scraps(self) -> list[Scrap]:
        """Leftovers of writers that died, for gc; none where the service keeps them itself (S3's
        incomplete multipart uploads are a lifecycle rule's, a registry expires its upload sessions)."""
        return []

    def delete_scrap(self, scrap: Scrap) -> None:
        raise NotImplementedError(f"{type(self).__name__} lists no scraps")


def open_store(
    url: str,
    *,
    endpoint_url: str | None = None,
    path_style: bool | None = None,
    progress: bool = False,
    insecure_registry: bool = False,
    deadline: Deadline | None = None,
) -> Store:
    """file:///abs/dir (or a plain absolute directory path), s3://bucket[/prefix], or
    oci://registry/repository. A URL that names no store is the operator's mistake: UsageError,
    before anything is read (a fetch would otherwise take it for a miss on every pod).

    endpoint_url and path_style apply to s3:// only, insecure_registry (plain HTTP to a registry
    that is not on loopback) to oci:// only; progress draws upload and download bars on stderr
    (the caller decides: a terminal, and not --json); deadline bounds every request and retry
    (warmer.deadline; the caller may set store.deadline later).
    """
    if not isinstance(url, str) or not url.strip():
        raise UsageError("no store given: pass --store URL (or set WARMER_STORE), e.g. s3://bucket/prefix")
    window_from_env()  # the node's WARMER_FETCH_WINDOW_MIB: a typo said now, not a miss in every restore
    if url.startswith("oci://"):
        if endpoint_url or path_style:
            raise UsageError(f"--endpoint-url and --s3-path-style apply to s3:// stores, not to {url}")
        from warmer.store.oci import OCIStore

        return OCIStore(url, insecure_registry=insecure_registry, progress=progress, deadline=deadline)
    if insecure_registry:
        raise UsageError(f"--insecure-registry applies to oci:// stores, not to {url}")
    if url.startswith("s3://"):
        from warmer.store.s3 import S3Store

        return S3Store(url, endpoint_url=endpoint_url, path_style=path_style, progress=progress, deadline=deadline)
    if endpoint_url:
        raise UsageError(f"--endpoint-url {endpoint_url} applies to s3:// stores, not to {url}")
    from warmer.store.file import FileStore

    if url.startswith("file://"):
        return FileStore(url[len("file://") :], deadline=deadline)
    if "://" not in url:
        return FileStore(url, deadline=deadline)
    scheme = url.split("://", 1)[0]
    raise UsageError(
        f"store {url!r}: scheme {scheme}:// is not supported; "
        "use file:///path/to/dir, s3://bucket/prefix or oci://registry/repository"
    )
