"""The loop through s3:// on a real S3 API (moto's server over HTTP, unmodified boto3)."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import socket
import subprocess
import sys

import boto3
import pytest

from tests.conftest import make_cache_tree, publish_at_once, run_python, run_warmer, tiny_recipe, write_tiny_recipe
from tests.integration.conftest import pack_with_big_file
from tests.s3server import SECRET
from warmer import build, fetch, restore
from warmer.entry import BlobRef, IndexEntry
from warmer.errors import UsageError
from warmer.store import StoreError, blob_path, index_path, open_store
from warmer.store.s3 import S3Store

MiB = 1 << 20


def _object(bucket: str, key: str) -> bytes:
    return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.fixture
def packed(tmp_path):
    """An artifact of the tiny recipe (12 MB: three 5 MiB multipart parts) and its files."""
    return pack_with_big_file(tmp_path, 12 * MiB, timings={"build": {"init_engine_s": 30.0}})


def test_the_loop_through_s3(packed, s3_url, bucket, proxy, tmp_path, monkeypatch):
    """pack → publish (multipart, parallel) → fetch (ranged GETs) → restore, then a no-op."""
    # botocore's default on AWS (warmer asks for checksums only where required at other endpoints)
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_supported")
    up = S3Store(s3_url, endpoint_url=proxy.url, part_size=5 * MiB)
    published = build.publish(up, packed["artifact"])
    assert published.status == "published" and published.blob_uploaded
    parts = [r for r in proxy.requests if r.method == "PUT" and "partNumber=" in r.path]
    assert len(parts) == 3  # 12 MiB and more in 5 MiB parts
    assert all("x-amz-checksum-crc32" in r.headers for r in parts)  # S3 checks every part
    key = "fleet/caches/" + blob_path(packed["sha256"])
    assert hashlib.sha256(_object(bucket, key)).hexdigest() == packed["sha256"]
    entry = IndexEntry.read(_object(bucket, "fleet/caches/" + index_path("tiny", packed["doc"].key)), "tiny",
                            packed["doc"].key)
    assert entry.blob == BlobRef(sha256=packed["sha256"], size=packed["artifact"].stat().st_size)

    proxy.clear()
    down = S3Store(s3_url, endpoint_url=proxy.url, part_size=1 * MiB)
    node_root = tmp_path / "node-root"
    got = fetch.fetch(tiny_recipe(), down, node_root)
    assert got.status == "hit", got.warnings
    for rel, content in packed["files"].items():
        assert (node_root / rel).read_bytes() == content
    ranged = [r for r in proxy.requests if r.method == "GET" and r.is_blob]
    assert len(ranged) >= 12 and all(r.headers.get("range", "").startswith("bytes=") for r in ranged)
    again = fetch.fetch(tiny_recipe(), down, node_root)
    assert again.status == "already-active"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".node-root.staging", ".warmer-blob"))]


def test_a_blob_already_there_is_not_uploaded_again(packed, s3_url, proxy):
    store = S3Store(s3_url, endpoint_url=proxy.url, part_size=5 * MiB)
    # A publish stopped between its blob and its entry left the blob: the next one only HEADs it.
    store.put_blob(str(packed["artifact"]), packed["sha256"])
    proxy.clear()
    first = build.publish(store, packed["artifact"])
    assert first.status == "published" and not first.blob_uploaded
    assert [r.method for r in proxy.requests if r.is_blob] == ["HEAD"]
    proxy.clear()
    # A key already published: its entry is read first, and its blob only HEADed (one the store
    # lost would go up again: the publish mends the entry), never uploaded.
    again = build.publish(store, packed["artifact"])
    assert again.status == "already-published" and not again.blob_uploaded
    assert [r.method for r in proxy.requests if r.is_blob] == ["HEAD"]


def test_eight_concurrent_publishers_of_one_key(tmp_path, s3_url, bucket):
    """Eight builders race with different artifacts of the same key: one wins, seven are told."""
    root = tmp_path / "build-root"
    make_cache_tree(root)
    arts = []
    for i in range(8):
        arts.append(tmp_path / f"race{i}.tar.zst")
        build.pack_root(root, tiny_recipe(), arts[-1], timings={"build": {"run": i}})
    stores = [open_store(s3_url) for _ in range(8)]  # one client each, as separate builders have
    results = publish_at_once(stores, arts)
    assert sorted(r.status for r in results) == ["already-published"] * 7 + ["published"]
    winner = next(r for r in results if r.status == "published")
    assert all(r.published_blob == winner.blob for r in results if r is not winner)
    assert len({r.key for r in results}) == 1
    assert stores[0].list_index() == [("tiny", winner.key)]
    entry = IndexEntry.read(stores[0].get_index("tiny", winner.key), "tiny", winner.key)
    assert entry.blob.sha256 == winner.blob
    with stores[0].stream_blob(winner.blob) as f:
        assert hashlib.sha256(f.read()).hexdigest() == winner.blob
    got = fetch.fetch(tiny_recipe(), stores[0], tmp_path / "node-root")
    assert got.status == "hit", got.warnings
    assert restore.active(tmp_path / "node-root").archive_sha256 == winner.blob


def test_an_exact_fetch_costs_one_request_plus_the_blobs_gets(packed, tmp_path, s3_url, proxy):
    """However many artifacts the bucket holds: no listing, one index GET, then the blob's ranged GETs
    (the entry tells the blob's size: no HEAD)."""
    store = S3Store(s3_url, endpoint_url=proxy.url, part_size=1 * MiB)
    build.publish(S3Store(s3_url, endpoint_url=proxy.url, part_size=5 * MiB), packed["artifact"])

    def fetch_requests(root):
        proxy.clear()
        assert fetch.fetch(tiny_recipe(), store, root).status == "hit"
        return list(proxy.requests)

    few = fetch_requests(tmp_path / "r1")
    others = tmp_path / "others"
    make_cache_tree(others)
    for n in range(30):  # thirty more artifacts (other keys) in the bucket
        art = tmp_path / f"other{n}.tar.zst"
        build.pack_root(others, tiny_recipe(max_model_len=256 + n), art)
        build.publish(store, art)
    many = fetch_requests(tmp_path / "r2")

    blob_gets = -(-packed["artifact"].stat().st_size // MiB)
    for reqs in (few, many):
        other = [(r.method, r.is_index, r.is_blob) for r in reqs if not (r.method == "GET" and r.is_blob)]
        assert other == [("GET", True, False)]
        assert len([r for r in reqs if r.method == "GET" and r.is_blob]) == blob_gets
    assert len(store.list_index("tiny")) == 31


def test_a_fetch_all_round_assumes_the_pods_role_once(tmp_path, s3_url, proxy, monkeypatch):
    """IRSA's chain (a role and a web-identity token): fetch --all opened a store per recipe, each
    with a boto3 session of its own, so each assumed the role again: an STS call per recipe, per
    node, per round (moto's STS answers here, behind the recording proxy)."""
    import tomllib

    from tests.integration.test_node_bootstrap import SKUS
    from warmer import api
    from warmer.recipe import parse

    if os.uname().machine != "x86_64":
        pytest.skip("the catalogue's CPU SKU is x86_64")
    manifests = tmp_path / "manifests"
    (manifests / "models").mkdir(parents=True)
    (manifests / "skus.toml").write_text(SKUS)
    src = tmp_path / "src"
    make_cache_tree(src)
    up = S3Store(s3_url, endpoint_url=proxy.url)
    for n, name in enumerate(("alpha", "beta", "gamma")):
        path = manifests / "models" / f"{name}.toml"
        path.write_text(f'name = "{name}"\ntargets = ["cpu-x86_64"]\n[model]\npath = "/models/{name}"\n[engine]\n'
                        f"max_num_seqs = {4 + n}\n[workload]\nprompt_lengths = [8]\n")
        art = tmp_path / f"{name}.tar.zst"
        build.pack_root(src, parse(tomllib.loads(path.read_text()), path), art)
        build.publish(up, art)
    token = tmp_path / "token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQ6d2FybWVyIn0.c2ln")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/warmer-node")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # S3 and STS alike
    proxy.clear()
    outcomes = api.fetch_all(manifests, s3_url, tmp_path / "cache", parallel=3)
    assert sorted(o.status for o in outcomes) == ["hit"] * 3, [o.line() for o in outcomes]
    sts = [r for r in proxy.requests if r.method == "POST" and r.path.split("?")[0] == "/"]
    assert len(sts) == 1, [r.path for r in proxy.requests]


def test_a_rotated_credentials_file_is_read_again_within_one_process(tmp_path, s3_url, proxy, monkeypatch):
    """A release pipeline's one Python process, its keys in the shared credentials file that a
    rotation job rewrites: each store reads static keys anew (one session for every store kept the
    first keys, and every call after the old key's revocation failed)."""
    from warmer import api

    creds = tmp_path / "credentials"
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    signed = []
    for key in ("AKIDFIRSTKEY", "AKIDROTATEDKEY"):
        creds.write_text(f"[default]\naws_access_key_id = {key}\naws_secret_access_key = s3cr3t\n")
        proxy.clear()
        api.ls(s3_url)
        signed.append({r.headers["authorization"].split("Credential=")[1].split("/")[0] for r in proxy.requests})
    assert signed == [{"AKIDFIRSTKEY"}, {"AKIDROTATEDKEY"}]


def test_cli_publish_fetch_ls_inspect_over_s3(packed, tmp_path, s3_url, aws_env):
    """The endpoint from AWS_ENDPOINT_URL, credentials from the environment, never printed."""
    recipe_file = write_tiny_recipe(tmp_path / "tiny.toml")
    pub = run_warmer("publish", packed["artifact"], "--store", s3_url, "--json")
    assert pub.returncode == 0, pub.stderr
    assert json.loads(pub.stdout)["status"] == "published"
    assert "\r" not in pub.stderr  # not a terminal: no progress bar
    node = tmp_path / "node-root"
    got = run_warmer("fetch", recipe_file, "--store", s3_url, "--root", node, "--require", "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["status"] == "hit"
    ls = run_warmer("ls", "--store", s3_url, "--json")
    assert ls.returncode == 0, ls.stderr
    [row] = json.loads(ls.stdout)
    assert row["recipe"] == "tiny" and row["key"] == packed["doc"].key and row["blob"] == packed["sha256"]
    human = run_warmer("ls", "--store", s3_url)
    assert packed["doc"].key[:16] in human.stdout and "1 artifact(s)" in human.stdout
    inspect = run_warmer("inspect", f"{s3_url}/index/tiny/{packed['doc'].key[:16]}", "--json")
    assert inspect.returncode == 0, inspect.stderr
    shown = json.loads(inspect.stdout)
    assert shown["key"] == packed["doc"].key and shown["blob"]["sha256"] == packed["sha256"]
    for out in (pub, got, ls, human, inspect):
        assert SECRET not in out.stdout + out.stderr and "AKIDWARMERTEST" not in out.stdout + out.stderr
    with open(packed["artifact"], "rb") as f:
        assert SECRET.encode() not in f.read()
    assert SECRET.encode() not in S3Store(s3_url).get_index("tiny", packed["doc"].key)


def test_progress_bars_on_a_terminal_only(packed, s3_url, aws_env):
    def publish_on_a_tty(*extra):
        master, slave = pty.openpty()
        proc = subprocess.Popen([sys.executable, "-m", "warmer", "publish", str(packed["artifact"]), "--store",
                                 s3_url, *extra], stdout=subprocess.PIPE, stderr=slave)
        os.close(slave)
        err = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            err += chunk
        os.close(master)
        out = proc.communicate()[0]
        assert proc.returncode == 0, err
        return out.decode(), err.decode()

    out, err = publish_on_a_tty()
    assert "warmer: upload " in err and "100%" in err and "status: published" in out
    S3Store(s3_url).delete_index("tiny", packed["doc"].key)
    S3Store(s3_url).delete_blob(packed["sha256"])
    out, err = publish_on_a_tty("--json")
    assert "upload" not in err and json.loads(out)["status"] == "published"


def test_path_style_addressing_when_asked(s3_url, bucket, proxy, monkeypatch):
    # "localhost" is a host name, so without the knob boto3 would address bucket.localhost.
    endpoint = proxy.url.replace("127.0.0.1", "localhost")
    store = open_store(s3_url, endpoint_url=endpoint, path_style=True)
    assert store.get_index("tiny", "0" * 64) is None
    [req] = proxy.requests
    assert req.path.startswith(f"/{bucket}/fleet/caches/index/") and req.headers["host"].startswith("localhost")
    monkeypatch.setenv("WARMER_S3_ADDRESSING_STYLE", "path")
    assert open_store(s3_url, endpoint_url=endpoint).list_index() == []
    assert proxy.requests[-1].path.startswith(f"/{bucket}?list-type=2")
    monkeypatch.setenv("WARMER_S3_ADDRESSING_STYLE", "sideways")
    with pytest.raises(UsageError, match="use path, virtual or auto"):  # the operator's input: exit 2
        open_store(s3_url)


def test_an_s3_store_caps_malloc_arenas_unless_the_user_chose(aws_env):
    """The S3 steps' memory grew with the artifact through per-thread malloc arenas (BENCHMARKS.md)."""
    code = "from warmer.store import open_store, s3; open_store('s3://b'); print(s3.cap_malloc_arenas())"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    assert run_python("-c", code, env=env).stdout.strip() == "True"  # glibc took the setting
    assert run_python("-c", code, env={**env, "MALLOC_ARENA_MAX": "8"}).stdout.strip() == "False"


def test_clear_errors_without_tracebacks(tmp_path, aws_env, monkeypatch, packed):
    missing = run_warmer("ls", "--store", "s3://no-such-bucket-here/x")
    assert missing.returncode == 1
    assert "bucket no-such-bucket-here does not exist" in missing.stderr and "Traceback" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    nocreds = run_warmer("publish", packed["artifact"], "--store", "s3://any-bucket")
    assert nocreds.returncode == 1 and "Traceback" not in nocreds.stderr
    assert "no usable AWS credentials" in nocreds.stderr and "AWS_PROFILE" in nocreds.stderr

    wrong = run_warmer("publish", packed["artifact"], "--store", f"file://{tmp_path}/store", "--endpoint-url", aws_env)
    assert wrong.returncode == 2 and "applies to s3:// stores" in wrong.stderr  # a usage error


def test_an_unreachable_store_is_a_slow_start_not_a_failed_pod(tmp_path, aws_env, monkeypatch):
    recipe_file = write_tiny_recipe(tmp_path / "tiny.toml")
    with socket.socket() as s:  # a loopback port with nothing listening on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    args = ["fetch", recipe_file, "--store", "s3://fleet/caches", "--root", tmp_path / "r",
            "--endpoint-url", f"http://127.0.0.1:{port}"]
    slow = run_warmer(*args)
    assert slow.returncode == 0, slow.stderr
    assert f"cannot reach the S3 endpoint http://127.0.0.1:{port}" in slow.stderr
    assert "export VLLM_CACHE_ROOT=" in slow.stdout
    assert run_warmer(*args, "--require").returncode == 3


def test_a_layered_artifact_through_s3_uploads_each_layer_once(packed, s3_url, bucket, proxy, tmp_path):
    """publish --layers: a blob per cache component, each uploaded once; a second root of the node
    takes every layer from the first, with no GET of any blob."""
    up = S3Store(s3_url, endpoint_url=proxy.url, part_size=5 * MiB)
    art = packed["doc"]
    published = build.publish(up, packed["artifact"], layers=True)
    assert published.status == "published" and set(published.layers) == set(art.components)
    for layer in art.layers:  # each layer is an object of its own, named by its digest
        assert hashlib.sha256(_object(bucket, "fleet/caches/" + blob_path(layer.sha256))).hexdigest() == layer.sha256

    proxy.clear()
    base = tmp_path / "cache"
    got = fetch.fetch(tiny_recipe(), S3Store(s3_url, endpoint_url=proxy.url), base / "one")
    assert got.status == "hit", got.warnings
    assert got.restore.archive_bytes == sum(layer.size for layer in art.layers)
    for rel, content in packed["files"].items():
        assert (base / "one" / rel).read_bytes() == content
    proxy.clear()
    again = fetch.fetch(tiny_recipe(), S3Store(s3_url, endpoint_url=proxy.url), base / "two")
    assert again.status == "hit" and again.restore.archive_bytes == 0
    assert not [r for r in proxy.requests if r.method == "GET" and r.is_blob]
