"""An S3-compatible store that is not AWS: s3rver (npm) over TLS, through unmodified boto3.

botocore 1.36 and later wrap every upload in aws-chunked with a CRC32 trailer by default. Stores
that do not decode it keep the wrapping in the object (s3rver over TLS does, as some vendors' stores
do) or refuse it with 501. warmer asks for checksums only where they are required at an endpoint
outside AWS, and a publish reads back what it wrote: a store that kept other bytes is said so,
with the setting that fixes it, and nothing it wrote is left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, run_warmer, write_tiny_recipe
from tests.s3server import start_on_its_own_port, wait_until_it_answers

S3RVER = REPO / ".s3rver" / "node_modules" / ".bin" / "s3rver"
BUCKET = "fleet"


@pytest.fixture(scope="module")
def s3rver_tls(tmp_path_factory):
    """s3rver on loopback over HTTPS with a self-signed certificate: (endpoint, CA bundle, data dir)."""
    if not S3RVER.exists() or not shutil.which("openssl"):
        why = "s3rver (npm) and openssl are needed: `make test` installs s3rver into .s3rver"
        if os.environ.get("CI") == "true":
            pytest.fail(why + " (CI must run these tests, not skip them)", pytrace=False)
        pytest.skip(why)
    top = tmp_path_factory.mktemp("s3rver")
    cert, key = top / "cert.pem", top / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True, timeout=60)
    data = top / "data"
    data.mkdir()
    proc, port = start_on_its_own_port([str(S3RVER), "-d", str(data), "-a", "127.0.0.1", "-p", "0", "--key", str(key),
                                        "--cert", str(cert), "--configure-bucket", BUCKET, "--silent"],
                                       rb"listening on 127\.0\.0\.1:(\d+)", top / "s3rver.log", "s3rver")
    url = f"https://127.0.0.1:{port}"
    import ssl
    wait_until_it_answers(proc, url, "s3rver", top / "s3rver.log", ssl.create_default_context(cafile=str(cert)))
    yield url, cert, data
    proc.terminate()
    proc.wait(timeout=10)


def _env(endpoint: str, cert: Path, tmp_path: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "WARMER_"))}
    return {**env, "AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint, "AWS_CA_BUNDLE": str(cert), "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"), **more}


def test_publish_and_fetch_through_a_store_outside_aws(s3rver_tls, packed, tmp_path):
    """The defaults publish what nodes can read: the stored objects are the bytes sent."""
    endpoint, cert, data = s3rver_tls
    env = _env(endpoint, cert, tmp_path)
    a = packed("a")
    url = f"s3://{BUCKET}/ok"
    out = run_warmer("publish", a.path, "--store", url, env=env)
    assert out.returncode == 0 and "published" in out.stdout + out.stderr, out.stderr
    [stored] = (data / BUCKET / "ok" / "blobs").rglob("*._S3rver_object")
    assert stored.stat().st_size == a.path.stat().st_size
    got = run_warmer("fetch", write_tiny_recipe(tmp_path / "tiny.toml"), "--store", url, "--root", tmp_path / "node",
                     "--require", env=env)
    assert got.returncode == 0 and "hit" in got.stderr, got.stderr


def test_a_store_that_keeps_the_upload_encoding_is_named_with_the_setting_that_fixes_it(s3rver_tls, packed,
                                                                                        tmp_path):
    """With the checksums botocore sends by default asked for again, s3rver keeps the aws-chunked
    wrapping in each object: publish said `published`, every node missed, and every later publish
    said `already-published`. The publish fails, names the setting, and leaves no entry or blob."""
    endpoint, cert, data = s3rver_tls
    env = _env(endpoint, cert, tmp_path, AWS_REQUEST_CHECKSUM_CALCULATION="when_supported")
    a = packed("a")
    url = f"s3://{BUCKET}/chunked"
    out = run_warmer("publish", a.path, "--store", url, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"not the {a.path.stat().st_size} sent" in out.stderr, out.stderr
    assert "AWS_REQUEST_CHECKSUM_CALCULATION=when_required" in out.stderr and "Traceback" not in out.stderr
    assert not list((data / BUCKET).rglob("chunked/**/*._S3rver_object"))  # nothing left behind

    fixed = _env(endpoint, cert, tmp_path, AWS_REQUEST_CHECKSUM_CALCULATION="when_required")
    assert run_warmer("publish", a.path, "--store", url, env=fixed).returncode == 0
    got = run_warmer("fetch", write_tiny_recipe(tmp_path / "tiny.toml"), "--store", url, "--root", tmp_path / "node",
                     "--require", env=fixed)
    assert got.returncode == 0 and "hit" in got.stderr, got.stderr


def test_blank_checksum_settings_are_unset_not_a_traceback(s3rver_tls, packed, tmp_path, monkeypatch):
    """An empty ConfigMap key sets AWS_REQUEST_CHECKSUM_CALCULATION="": botocore refused it with a
    traceback, and the init container failed where it would have started cold. Blank is unset, as
    for warmer's own variables: outside AWS, checksums where required; at AWS, botocore's default."""
    endpoint, cert, _ = s3rver_tls
    env = _env(endpoint, cert, tmp_path, AWS_REQUEST_CHECKSUM_CALCULATION="", AWS_RESPONSE_CHECKSUM_VALIDATION=" ")
    a = packed("a")
    url = f"s3://{BUCKET}/blank"
    out = run_warmer("publish", a.path, "--store", url, env=env)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    got = run_warmer("fetch", write_tiny_recipe(tmp_path / "tiny.toml"), "--store", url, "--root", tmp_path / "node",
                     "--require", env=env)
    assert got.returncode == 0 and "hit" in got.stderr, got.stderr

    from warmer.store.s3 import S3Store
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    at_aws = S3Store("s3://bucket/fleet", endpoint_url="https://s3.us-east-1.amazonaws.com")
    assert at_aws._client.meta.config.request_checksum_calculation == "when_supported"
