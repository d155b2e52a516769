"""Where artifacts live: content-addressed blobs plus one small index entry per recipe and key.

    blobs/sha256/<2 hex>/<sha256>.tar.zst   the archive, named by its own digest
    index/<recipe>/<key>.json               {"recipe", "key", "blob": {"sha256", "size"},
                                             "artifact": artifact.json, "published_at"}

A blob goes up first and its index entry last, created only if absent: the first publisher
wins and a published artifact never changes. A node needs one index read and one blob read.
Leaf package: imports nothing from warmer outside it.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from typing import BinaryIO, NamedTuple, Protocol

HEX64 = re.compile(r"^[0-9a-f]{64}$")
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")


class StoreError(Exception):
    """The store cannot be used as given; the message says how to fix it."""


class BlobMissing(StoreError):
    """An index entry names a blob the store does not hold."""


class BlobCorrupt(StoreError):
    """A blob's bytes do not hash to its name, even after downloading it again."""


class Blob(NamedTuple):
    sha256: str
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
        recipe, key = parts[1], parts[2][:-len(".json")]
        if NAME.match(recipe) and HEX64.match(key):
            return recipe, key
    return None


def parse_blob_path(rel: str) -> str | None:
    """The sha256 of a blob path, or None for anything else found under blobs/."""
    parts = rel.split("/")
    if len(parts) == 4 and parts[:2] == ["blobs", "sha256"] and parts[3].endswith(".tar.zst"):
        sha = parts[3][:-len(".tar.zst")]
        if HEX64.match(sha) and parts[2] == sha[:2]:
            return sha
    return None


class Store(Protocol):
    url: str

    def has_blob(self, sha256: str) -> bool: ...
    def put_blob(self, path: str, sha256: str) -> bool: ...
    def open_blob(self, sha256: str, spool_dir: str | os.PathLike | None = None) -> BinaryIO: ...
    def put_index(self, recipe: str, key: str, entry: bytes) -> bool: ...
    def get_index(self, recipe: str, key: str) -> bytes | None: ...
    def list_index(self, recipe: str | None = None) -> list[tuple[str, str]]: ...
    def list_blobs(self) -> list[Blob]: ...
    def delete_index(self, recipe: str, key: str) -> None: ...
    def delete_blob(self, sha256: str) -> None: ...


def open_store(url: str, *, endpoint_url: str | None = None, path_style: bool | None = None,
               progress: bool = False) -> Store:
    """file:///abs/dir (or a plain directory path), or s3://bucket[/prefix].

    endpoint_url and path_style apply to s3:// only; progress draws upload and download bars
    on stderr (the caller decides: a terminal, and not --json).
    """
    if url.startswith("s3://"):
        from warmer.store.s3 import S3Store

        return S3Store(url, endpoint_url=endpoint_url, path_style=path_style, progress=progress)
    if endpoint_url:
        raise StoreError(f"--endpoint-url {endpoint_url} applies to s3:// stores, not to {url}")
    from warmer.store.file import FileStore

    if url.startswith("file://"):
        return FileStore(url[len("file://"):])
    if "://" not in url:
        return FileStore(url)
    scheme = url.split("://", 1)[0]
    raise StoreError(f"store {url!r}: scheme {scheme}:// is not supported; "
                     "use file:///path/to/dir or s3://bucket/prefix")
