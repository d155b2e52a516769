"""Failures between boto3 and S3 (a fault-injecting proxy): retried, or refused cleanly.

Whatever the wire does, a node either activates exactly the published bytes or keeps the cache
it had: no corrupt artifact is ever activated, and nothing is left behind.
"""

from __future__ import annotations

import hashlib

import boto3
import pytest

from tests.conftest import tiny_recipe
from tests.integration.conftest import pack_with_big_file
from warmer import build, fetch, restore
from warmer.entry import IndexEntry
from warmer.store import StoreError, blob_path
from warmer.store.s3 import S3Store

MiB = 1 << 20


def is_part(r):
    return r.method == "PUT" and "partNumber=" in r.path


def is_blob_get(r):
    return r.method == "GET" and r.is_blob


@pytest.fixture
def artifact(tmp_path):
    return pack_with_big_file(tmp_path, 11 * MiB)


@pytest.fixture
def published(artifact, s3_url):
    build.publish(S3Store(s3_url, part_size=5 * MiB), artifact["artifact"])
    return artifact


@pytest.fixture
def node_root(tmp_path):
    """A node that already serves an older cache, which a failed fetch must leave alone."""
    root = tmp_path / "node-root"
    restore.prepare(root)  # warmer's root (an earlier fetch missed), so a fetch may replace it
    (root / "vllm" / "previous.json").write_text("previous cache")
    return root


def assert_unchanged(root):
    assert (root / "vllm" / "previous.json").read_text() == "previous cache"
    assert not (root / restore.MARKER).exists()
    # fetch still prepares the (empty) cache directories for vLLM, but not one file came in
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir()) == \
        sorted([restore.PREPARED, "vllm/previous.json"])
    assert not [p for p in root.parent.iterdir() if ".staging-" in p.name or p.name.startswith(".warmer-blob")]


def test_publish_survives_throttling_500s_and_resets(artifact, s3_url, bucket, proxy):
    rules = [
        proxy.inject("503", lambda r: r.method == "HEAD" and r.is_blob),
        proxy.inject("500", lambda r: r.method == "POST" and r.path.endswith("?uploads")),
        proxy.inject("503", is_part),
        proxy.inject("reset", is_part),
        proxy.inject("reset-after", is_part),  # stored, but the answer is lost
        proxy.inject("reset-after", lambda r: r.method == "POST" and "uploadId=" in r.path),
        # The entry is created, the answer lost; the retry meets If-None-Match and must know
        # that the entry there is its own.
        proxy.inject("reset-after", lambda r: r.method == "PUT" and r.is_index),
    ]
    result = build.publish(S3Store(s3_url, endpoint_url=proxy.url, part_size=5 * MiB), artifact["artifact"])
    assert [r.fired for r in rules] == [1] * len(rules)
    assert result.status == "published" and result.blob_uploaded
    s3 = boto3.client("s3")
    blob = s3.get_object(Bucket=bucket, Key="fleet/caches/" + blob_path(artifact["sha256"]))["Body"].read()
    assert hashlib.sha256(blob).hexdigest() == artifact["sha256"]
    key = artifact["doc"].key
    entry = IndexEntry.read(S3Store(s3_url).get_index("tiny", key), "tiny", key)
    assert entry.blob.sha256 == artifact["sha256"]


def test_fetch_survives_throttling_resets_and_cut_bodies(published, s3_url, proxy, node_root):
    rules = [
        proxy.inject("503", lambda r: r.method == "GET" and r.is_index),
        proxy.inject("truncate", lambda r: r.method == "GET" and r.is_index),
        proxy.inject("truncate", is_blob_get),
        proxy.inject("reset", is_blob_get),
        proxy.inject("500", is_blob_get),
        proxy.inject("503", is_blob_get),
    ]
    got = fetch.fetch(tiny_recipe(), S3Store(s3_url, endpoint_url=proxy.url, part_size=1 * MiB), node_root)
    assert [r.fired for r in rules] == [1] * len(rules)
    assert got.status == "hit", got.warnings
    for rel, content in published["files"].items():
        assert (node_root / rel).read_bytes() == content
    assert not (node_root / "vllm" / "previous.json").exists()  # replaced whole


def test_a_corrupted_download_is_fetched_again(published, s3_url, proxy, node_root):
    rule = proxy.inject("corrupt", is_blob_get)
    got = fetch.fetch(tiny_recipe(), S3Store(s3_url, endpoint_url=proxy.url, part_size=1 * MiB), node_root)
    assert rule.fired == 1
    assert got.status == "hit", got.warnings
    parts = -(-published["artifact"].stat().st_size // MiB)
    assert len([r for r in proxy.requests if is_blob_get(r)]) == 2 * parts  # the whole blob, twice
    assert restore.active(node_root).archive_sha256 == published["sha256"]


@pytest.mark.parametrize("action", ["corrupt", "short"])
def test_bytes_that_never_match_are_never_activated(published, s3_url, proxy, node_root, action):
    rule = proxy.inject(action, is_blob_get, times=None)
    got = fetch.fetch(tiny_recipe(), S3Store(s3_url, endpoint_url=proxy.url, part_size=1 * MiB), node_root)
    assert rule.fired > 0
    assert got.status == "error"
    # Wrong bytes are seen only by the blob's digest, after three downloads; a short body by its
    # length, and that range alone is asked for again (five times, then the fetch gives up).
    expected = ("hashed to", "each of 3 downloads") if action == "corrupt" else ("was cut short 5 times",)
    assert any("not activated" in w and "unchanged" in w and all(e in w for e in expected)
               for w in got.warnings), got.warnings
    assert_unchanged(node_root)


def test_a_store_that_keeps_failing_fails_cleanly(published, s3_url, proxy, node_root, monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")  # keep the test short; the default is 8
    rule = proxy.inject("500", is_blob_get, times=None)
    got = fetch.fetch(tiny_recipe(), S3Store(s3_url, endpoint_url=proxy.url), node_root)
    assert rule.fired >= 3  # each ranged GET in flight is tried 3 times
    assert got.status == "error"
    assert any("not activated" in w and "failed: InternalError" in w and "after 3 attempts" in w
               for w in got.warnings), got.warnings
    assert_unchanged(node_root)


def test_a_blob_missing_from_the_store_is_reported(published, s3_url, bucket, node_root):
    boto3.client("s3").delete_object(Bucket=bucket, Key="fleet/caches/" + blob_path(published["sha256"]))
    got = fetch.fetch(tiny_recipe(), S3Store(s3_url), node_root)
    assert got.status == "error"
    assert any("is missing from" in w and "publish the artifact again" in w for w in got.warnings)
    assert_unchanged(node_root)


def test_a_denied_kms_key_is_named_as_s3_names_it(published, s3_url, proxy, node_root):
    """An SSE-KMS bucket, a node role without the key's kms:Decrypt: S3 answers 403 AccessDenied and
    says which action was denied. The miss must pass that on, not only ask for s3:GetObject again."""
    proxy.inject("kms-denied", lambda r: r.is_index, times=None)
    got = fetch.fetch(tiny_recipe(), S3Store(s3_url, endpoint_url=proxy.url), node_root)
    assert got.status == "miss" and any("not authorized to perform: kms:Decrypt" in w for w in got.warnings), \
        got.warnings


def test_a_node_clock_off_is_named_not_blamed_on_iam(published, s3_url, proxy, node_root):
    """S3 refuses a request signed over 15 minutes off its clock with 403 RequestTimeTooSkewed: the
    miss said "access denied" and asked for IAM grants; it names the clock."""
    proxy.inject("skewed", lambda r: r.is_index, times=None)
    got = fetch.fetch(tiny_recipe(), S3Store(s3_url, endpoint_url=proxy.url), node_root)
    assert got.status == "miss" and any("this machine's clock is off" in w and "NTP" in w for w in got.warnings), \
        got.warnings
    assert not any("grant the credentials" in w for w in got.warnings)


@pytest.mark.parametrize("answer, said", [
    ("no-chunked", "aws-chunked is not supported.): set AWS_REQUEST_CHECKSUM_CALCULATION=when_required"),
    ("no-conditional", "not implemented): warmer needs S3 conditional writes (If-None-Match)"),
])
def test_a_501_says_the_stores_own_words_and_the_fix_that_goes_with_them(artifact, s3_url, proxy, answer, said):
    """A store answering 501 to the index entry's write was always told it lacks conditional writes:
    one that refuses boto3's aws-chunked upload encoding (OpenStack Swift's S3 layer) was sent to
    upgrade the store, where a setting fixes it."""
    proxy.inject(answer, lambda r: r.method == "PUT" and r.is_index, times=None)
    with pytest.raises(StoreError) as e:
        build.publish(S3Store(s3_url, endpoint_url=proxy.url), artifact["artifact"])
    assert said in str(e.value), str(e.value)


def test_a_bucket_in_another_region_is_reached_through_s3s_redirect(artifact, s3_url, proxy, node_root):
    """The client's region (us-east-1) is not the bucket's: S3 answers 301 with the bucket's region,
    and botocore sends the request again signed for it. warmer's retry handler must leave that
    answer to botocore's redirect (before, every publish and fetch failed: PermanentRedirect)."""
    from tests.integration.faultproxy import signed_for

    proxy.bucket_region = "eu-west-1"  # the proxy checks the signature's region as S3 does
    published = build.publish(S3Store(s3_url, endpoint_url=proxy.url, part_size=5 * MiB), artifact["artifact"])
    assert published.status == "published" and published.blob_uploaded
    got = fetch.fetch(tiny_recipe(), S3Store(s3_url, endpoint_url=proxy.url, part_size=1 * MiB), node_root)
    assert got.status == "hit", got.warnings
    for rel, content in artifact["files"].items():
        assert (node_root / rel).read_bytes() == content
    regions = [signed_for(r.headers) for r in proxy.requests]
    assert "us-east-1" in regions and regions[-1] == "eu-west-1"  # redirected, then signed for the bucket


def test_an_endpoint_that_ignores_range_is_named_not_blamed_on_the_blob(published, s3_url, proxy, node_root):
    """A proxy before S3 that drops Range answers every part with the whole object. Read as part k,
    those bytes hash wrong, and the blob was refused as "corrupt in the store" after three whole
    downloads; the cause is the endpoint, said once, and the root is untouched."""
    rule = proxy.inject("ignore-range", is_blob_get, times=None)
    got = fetch.fetch(tiny_recipe(), S3Store(s3_url, endpoint_url=proxy.url, part_size=1 * MiB), node_root)
    assert rule.fired > 0
    assert got.status == "error"
    assert any("ignores Range" in w and "not activated" in w for w in got.warnings), got.warnings
    assert not any("corrupt" in w for w in got.warnings), got.warnings
    assert_unchanged(node_root)
