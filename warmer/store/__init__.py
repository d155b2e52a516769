"""Where artifacts live: content-addressed blobs plus one small index entry per recipe and key.

    blobs/sha256/<2 hex>/<sha256>.tar.zst   the archive, named by its own digest
    index/<recipe>/<key>.json               {"recipe", "key", "blob": {"sha256", "size"},
                                             "artifact": artifact.json, "published_at"}

A blob goes up first and its index entry last, created only if absent: the first publisher
wins and a published artifact never changes. A node needs one index read and one blob read.
Leaf package: imports nothing from warmer outside it.
"""

from __future__ import annotations

from typing import BinaryIO, Protocol


class StoreError(Exception):
    """The store cannot be used as given; the message says how to fix it."""


class Store(Protocol):
    url: str

    def has_blob(self, sha256: str) -> bool: ...
    def put_blob(self, path: str, sha256: str) -> bool: ...
    def open_blob(self, sha256: str) -> BinaryIO: ...
    def put_index(self, recipe: str, key: str, entry: bytes) -> bool: ...
    def get_index(self, recipe: str, key: str) -> bytes | None: ...
    def list_index(self, recipe: str | None = None) -> list[tuple[str, str]]: ...


def open_store(url: str) -> Store:
    """file:///abs/dir (or a plain directory path)."""
    from warmer.store.file import FileStore

    if url.startswith("file://"):
        return FileStore(url[len("file://"):])
    if "://" not in url:
        return FileStore(url)
    scheme = url.split("://", 1)[0]
    raise StoreError(f"store {url!r}: scheme {scheme}:// is not supported; use file:///path/to/dir")
