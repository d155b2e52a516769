"""Integration fixtures: the fault proxy in front of the S3 server (tests/s3server.py), and
artifacts big enough to take the multipart and ranged paths."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.integration.faultproxy import FaultProxy

@pytest.fixture
def proxy(moto_endpoint):
    host, port = moto_endpoint.removeprefix("http://").split(":")
    p = FaultProxy((host, int(port)))
    yield p
    p.close()


def add_big_file(root: Path, size: int) -> None:
    """Incompressible bytes in the inductor cache, so the blob is size bytes or more."""
    path = root / "inductor" / "ab" / "big-kernel.so"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))


def pack_with_big_file(tmp_path: Path, size: int, **pack_kw) -> dict:
    """The tiny recipe's artifact of a cache tree plus add_big_file(size): multipart-sized.
    Returns the artifact file, its artifact.json, the packed files and the blob's sha256."""
    from tests.conftest import make_cache_tree, tiny_recipe
    from warmer import build

    root = tmp_path / "build-root"
    files = make_cache_tree(root)
    add_big_file(root, size)
    files["inductor/ab/big-kernel.so"] = (root / "inductor/ab/big-kernel.so").read_bytes()
    art = tmp_path / "tiny.tar.zst"
    doc = build.pack_root(root, tiny_recipe(), art, **pack_kw)
    return {"artifact": art, "doc": doc, "files": files, "sha256": hashlib.sha256(art.read_bytes()).hexdigest()}
