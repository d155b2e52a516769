"""A real S3 API on loopback: moto's server, started here, reached over HTTP by unmodified boto3.

One server for the session; each test gets its own bucket, dummy credentials from the
environment (the same chain a node uses), and no AWS config files of this machine.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.integration.faultproxy import FaultProxy

SECRET = "warmer-test-secret-must-never-be-printed"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """A pytest killed before its teardown must not leave the server running (Linux)."""
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    try:
        import moto.server  # noqa: F401
    except ImportError:
        pytest.fail("moto's server is not installed: pip install -e '.[test]' (it brings moto[server])")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:  # poll until it answers HTTP
        if proc.poll() is not None:
            pytest.fail(f"moto server exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1)
            break
        except urllib.error.HTTPError:
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto server did not answer on {url} in 30 s: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def aws_env(monkeypatch, tmp_path, moto_endpoint):
    """Dummy credentials in the environment, boto3's endpoint from AWS_ENDPOINT_URL."""
    for var in list(os.environ):
        if var.startswith("AWS_") or var.startswith("WARMER_S3_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDWARMERTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return moto_endpoint


@pytest.fixture
def bucket(aws_env) -> str:
    import boto3

    name = f"warmer-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=aws_env).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_url(bucket) -> str:
    return f"s3://{bucket}/fleet/caches"


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
