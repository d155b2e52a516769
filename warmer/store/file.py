"""A store in a local (or shared, POSIX) directory: the embedded default."""

from __future__ import annotations

import os
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from warmer.store import (Blob, BlobMissing, StoreError, blob_path, index_path, parse_blob_path,
                          parse_index_path)


class FileStore:
    def __init__(self, path: str):
        if not path or not os.path.isabs(path):
            raise StoreError(f"file store path {path!r} must be absolute, e.g. file:///var/lib/warmer/store")
        self.base = Path(path)
        self.url = "file://" + path

    def _blob(self, sha256: str) -> Path:
        return self.base / blob_path(sha256)

    def _index(self, recipe: str, key: str) -> Path:
        return self.base / index_path(recipe, key)

    def _create_once(self, target: Path, write) -> bool:
        """Write to a temporary file beside target, then link it in: fails if target exists."""
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".incoming-")
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, target)
            except FileExistsError:
                return False
            return True
        finally:
            os.unlink(tmp)

    def has_blob(self, sha256: str) -> bool:
        return self._blob(sha256).is_file()

    def put_blob(self, path: str, sha256: str) -> bool:
        if self.has_blob(sha256):
            return False

        def copy(out: BinaryIO) -> None:
            with open(path, "rb") as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
        return self._create_once(self._blob(sha256), copy)

    def open_blob(self, sha256: str, spool_dir: str | os.PathLike | None = None) -> BinaryIO:
        # A local file needs no spool: restore reads it in place and checks its digest.
        try:
            return open(self._blob(sha256), "rb")
        except FileNotFoundError:
            raise BlobMissing(f"blob {sha256} is missing from {self.url}: the store is damaged; "
                              "publish the artifact again") from None

    def put_index(self, recipe: str, key: str, entry: bytes) -> bool:
        return self._create_once(self._index(recipe, key), lambda f: f.write(entry))

    def get_index(self, recipe: str, key: str) -> bytes | None:
        try:
            return self._index(recipe, key).read_bytes()
        except FileNotFoundError:
            return None

    def list_index(self, recipe: str | None = None) -> list[tuple[str, str]]:
        base = self.base / "index"
        dirs = [base / recipe] if recipe else sorted(p for p in base.glob("*") if p.is_dir())
        found = (parse_index_path(f"index/{d.name}/{f.name}") for d in dirs for f in sorted(d.glob("*.json")))
        return [rk for rk in found if rk]

    def list_blobs(self) -> list[Blob]:
        out = []
        for f in sorted((self.base / "blobs" / "sha256").glob("*/*.tar.zst")):
            sha = parse_blob_path(f.relative_to(self.base).as_posix())
            if sha:
                st = f.stat()
                out.append(Blob(sha, st.st_size, datetime.fromtimestamp(st.st_mtime, timezone.utc)))
        return out

    def delete_index(self, recipe: str, key: str) -> None:
        self._index(recipe, key).unlink(missing_ok=True)

    def delete_blob(self, sha256: str) -> None:
        self._blob(sha256).unlink(missing_ok=True)
