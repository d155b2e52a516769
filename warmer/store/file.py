"""A store in a local (or shared, POSIX) directory: the embedded default."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import BinaryIO

from warmer.store import StoreError

HEX64 = re.compile(r"^[0-9a-f]{64}$")
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")


def _check(sha256: str) -> str:
    if not HEX64.match(sha256):
        raise StoreError(f"{sha256!r} is not a sha256 hex digest")
    return sha256


class FileStore:
    def __init__(self, path: str):
        if not path or not os.path.isabs(path):
            raise StoreError(f"file store path {path!r} must be absolute, e.g. file:///var/lib/warmer/store")
        self.base = Path(path)
        self.url = "file://" + path

    def _blob(self, sha256: str) -> Path:
        return self.base / "blobs" / "sha256" / sha256[:2] / f"{_check(sha256)}.tar.zst"

    def _index(self, recipe: str, key: str) -> Path:
        if not NAME.match(recipe) or not HEX64.match(key):
            raise StoreError(f"bad index name {recipe!r}/{key!r}")
        return self.base / "index" / recipe / f"{key}.json"

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

    def open_blob(self, sha256: str) -> BinaryIO:
        try:
            return open(self._blob(sha256), "rb")
        except FileNotFoundError:
            raise StoreError(f"blob {sha256} is missing from {self.url}: the store is damaged; "
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
        return [(d.name, f.stem) for d in dirs for f in sorted(d.glob("*.json"))]
