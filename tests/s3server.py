"""A real S3 API on loopback: moto's server, started here, reached over HTTP by unmodified boto3.

One server for the session; each test gets its own bucket, dummy credentials from the
environment (the same chain a node uses), and no AWS config files of this machine. A pytest
plugin (tests/conftest.py's pytest_plugins): the integration and e2e tests both use it.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

SECRET = "warmer-test-secret-must-never-be-printed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_on_its_own_port(argv: list[str], listening: bytes, log_path, what: str) -> tuple[subprocess.Popen, int]:
    """Start a server told to listen on port 0, and return it with the port it bound, read from the
    line it prints (listening: a regex whose group 1 is the port). A port picked here and bound
    there a second later can be taken in between, by any connection this machine makes. What it
    prints goes on to log_path, for as long as it runs (a full pipe would stop it)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    found: list[int] = []
    said = threading.Event()

    def tee():
        with open(log_path, "wb") as out:
            for line in proc.stdout:
                out.write(line)
                out.flush()
                if not found and (m := re.search(listening, line)):
                    found.append(int(m[1]))
                    said.set()
        said.set()  # it exited: found stays empty

    threading.Thread(target=tee, daemon=True).start()
    if not said.wait(60) or not found:
        proc.kill()
        pytest.fail(f"{what} did not say where it listens: {Path(log_path).read_text(errors='replace')[-2000:]}")
    return proc, found[0]


def die_with_parent() -> None:
    """A pytest killed before its teardown must not leave a server it started running (Linux)."""
    if sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def wait_until_it_answers(proc: subprocess.Popen, url: str, what: str, log_path, context=None) -> None:
    """Poll url until the server started as proc answers HTTP (any status), for 30 s at most."""
    deadline = time.monotonic() + 30
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=1, context=context)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{what} did not answer on {url} in 30 s: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory):
    try:
        import moto.server  # noqa: F401
    except ImportError:
        pytest.fail("moto's server is not installed: pip install -e '.[test]' (it brings moto[server])")
    log_path = tmp_path_factory.mktemp("moto") / "server.log"
    proc, port = start_on_its_own_port([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                                       rb"Running on http://127\.0\.0\.1:(\d+)", log_path, "moto server")
    url = f"http://127.0.0.1:{port}"
    wait_until_it_answers(proc, url + "/moto-api/", "moto server", log_path)
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
