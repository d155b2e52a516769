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


# -- a real OCI registry (tests/integration/oci_registry.py) ----------------------------------------

@pytest.fixture(scope="session")
def oci_registry(tmp_path_factory):
    """CNCF distribution on loopback, no auth."""
    from tests.integration.oci_registry import start_registry

    reg = start_registry(tmp_path_factory.mktemp("oci-plain"))
    yield reg
    reg.stop()


@pytest.fixture(scope="session")
def oci_htpasswd_registry(tmp_path_factory):
    """CNCF distribution with htpasswd (Basic) auth."""
    from tests.integration.oci_registry import start_registry

    reg = start_registry(tmp_path_factory.mktemp("oci-htpasswd"), auth="htpasswd")
    yield reg
    reg.stop()


@pytest.fixture(scope="session")
def oci_token_registry(tmp_path_factory):
    """CNCF distribution with `auth: token`: Bearer challenges, tokens from a loopback issuer."""
    from tests.integration.oci_registry import start_registry

    reg = start_registry(tmp_path_factory.mktemp("oci-token"), auth="token")
    yield reg
    reg.stop()


@pytest.fixture
def oci_env(monkeypatch, tmp_path):
    """No registry credentials of this machine: an empty DOCKER_CONFIG, no REGISTRY_AUTH_FILE."""
    for var in ("REGISTRY_AUTH_FILE", "XDG_RUNTIME_DIR", "WARMER_OCI_CHUNK_MIB", "WARMER_OCI_MAX_ATTEMPTS"):
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path / "no-docker-config"
    empty.mkdir()
    monkeypatch.setenv("DOCKER_CONFIG", str(empty))
    return empty


@pytest.fixture
def oci_proxy(oci_registry):
    """The fault proxy in front of the no-auth registry."""
    p = FaultProxy(("127.0.0.1", oci_registry.port))
    yield p
    p.close()
