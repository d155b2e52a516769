"""A store that stalls or trickles ends a fetch as a miss within its deadline, saying each retry,
and SIGTERM stops a download within 2 s: S3 (moto behind the fault proxy) and an OCI registry
(CNCF distribution behind it), through the CLI as an init container runs it and through the API.

The proxy's `stall` takes a request and never answers; `trickle` sends the true headers and then
16 bytes a second, which no read timeout ever trips."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO, time_cap, tiny_recipe, write_tiny_recipe
from tests.integration.conftest import pack_with_big_file
from warmer import api, build, restore
from warmer.deadline import Deadline, DeadlineExceeded
from warmer.store import open_store

DEADLINE = 8.0  # seconds: its read timeout (2 s) and low-speed window (2 s) leave room for retries
SLACK = 2.0     # what the issue allows past the deadline


def is_blob_get(r):
    """A ranged read of the artifact's blob (an OCI config is a blob too, read whole: not this)."""
    return r.method == "GET" and r.is_blob and "range" in r.headers


def everything(r):
    return True


@pytest.fixture
def s3_published(tmp_path, s3_url, proxy):
    packed = pack_with_big_file(tmp_path, 1 << 20)
    build.publish(open_store(s3_url), packed["artifact"])
    return {"store": s3_url, "options": {"endpoint_url": proxy.url}, "cli": ["--endpoint-url", proxy.url],
            "proxy": proxy}


@pytest.fixture
def oci_published(tmp_path, oci_registry, oci_env, oci_proxy):
    packed = pack_with_big_file(tmp_path, 1 << 20)
    repo = oci_registry.repo()
    build.publish(open_store(oci_registry.url(repo)), packed["artifact"])
    port = oci_proxy.url.rsplit(":", 1)[1]
    return {"store": f"oci://127.0.0.1:{port}/{repo}", "options": {}, "cli": [], "proxy": oci_proxy}


@pytest.fixture(params=["s3", "oci"])
def published(request):
    return request.getfixturevalue(f"{request.param}_published")


def _node_root(tmp_path):
    """A root an earlier (missed) fetch prepared: a fetch that gives up must leave it as it is."""
    root = tmp_path / "node-root"
    restore.prepare(root)
    (root / "vllm" / "previous.json").write_text("previous cache")
    return root


def _unchanged(root) -> bool:
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir())
    staging = [p for p in root.parent.iterdir() if ".staging-" in p.name]
    return files == sorted([restore.PREPARED, "vllm/previous.json"]) and not staging


def _miss_within_the_deadline(published, root, caplog):
    """api.fetch with DEADLINE: a miss, within DEADLINE + SLACK, its log lines in caplog."""
    caplog.set_level(logging.INFO, logger="warmer")
    t0 = time.monotonic()
    with time_cap(60):
        got = api.fetch(tiny_recipe(), published["store"], root, deadline=DEADLINE, **published["options"])
    took = time.monotonic() - t0
    assert got.status == "miss" and not got.hit, got.warnings
    assert took < DEADLINE + SLACK, f"{took:.1f} s for a {DEADLINE} s deadline"
    return got


@pytest.mark.parametrize("where,what", [("index", everything), ("blob", is_blob_get)], ids=["stalled-store",
                                                                                           "stalled-blob"])
def test_a_stalled_store_is_a_miss_within_the_deadline(published, tmp_path, caplog, where, what):
    published["proxy"].inject("stall", what, times=None)
    root = _node_root(tmp_path)
    got = _miss_within_the_deadline(published, root, caplog)
    assert any(f"deadline of {DEADLINE:.0f} s" in w and "passed while" in w for w in got.warnings), got.warnings
    retries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("retrying ")]
    assert retries and all(" in " in m and "s: " in m for m in retries), caplog.text
    assert _unchanged(root)


def test_a_trickling_blob_is_cut_retried_and_a_miss_within_the_deadline(published, tmp_path, caplog):
    rule = published["proxy"].inject("trickle", is_blob_get, times=None)
    root = _node_root(tmp_path)
    got = _miss_within_the_deadline(published, root, caplog)
    assert rule.fired >= 2, "the trickle was never asked for again"
    assert any("deadline" in w and "blob" in w for w in got.warnings), got.warnings
    assert any("a trickle" in r.getMessage() and r.getMessage().startswith("retrying part")
               for r in caplog.records), caplog.text
    assert _unchanged(root)


def _cli(published, tmp_path, *extra) -> list[str]:
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    return [sys.executable, "-m", "warmer", "fetch", str(recipe), "--store", published["store"], *published["cli"],
            "--root", str(tmp_path / "node-root"), *extra]


def test_the_cli_says_each_retry_and_the_deadline_and_require_makes_it_exit_3(published, tmp_path):
    published["proxy"].inject("stall", everything, times=None)
    _node_root(tmp_path)
    t0 = time.monotonic()
    metrics = tmp_path / "warmer.prom"
    out = subprocess.run(_cli(published, tmp_path, "--require", "--metrics-file", str(metrics)), capture_output=True,
                         text=True, timeout=60, cwd=REPO, env={**os.environ, "WARMER_DEADLINE": str(DEADLINE)})
    took = time.monotonic() - t0
    assert out.returncode == 3, out.stderr
    assert took < DEADLINE + SLACK + 1.0, f"{took:.1f} s (the process's start included)"
    assert "warmer: retrying " in out.stderr and f"deadline of {DEADLINE:.0f} s" in out.stderr, out.stderr
    # the time the miss held the pod, as fetch --all gives it per recipe (it said 0: nothing was restored)
    prom = dict(line.rsplit(" ", 1) for line in metrics.read_text().splitlines() if not line.startswith("#"))
    assert prom['warmer_fetch_status{recipe="tiny",status="miss"}'] == "1", prom
    # (a retry that no longer fits ends it up to a backoff and a second early: Registry.backoff)
    assert DEADLINE / 2 <= float(prom['warmer_fetch_seconds{recipe="tiny"}']) <= took, prom
    quiet = subprocess.run(_cli(published, tmp_path, "--deadline", "3", "-q"), capture_output=True, text=True,
                           timeout=60, cwd=REPO)
    assert quiet.returncode == 0 and "retrying" not in quiet.stderr, quiet.stderr


@pytest.mark.parametrize("fault", ["trickle", "stall"])
def test_sigterm_stops_a_download_within_two_seconds(published, tmp_path, fault):
    """A pod's grace period is 30 s: a fetch that is told to stop must stop, however slow the store."""
    rule = published["proxy"].inject(fault, is_blob_get, times=None)
    root = _node_root(tmp_path)
    proc = subprocess.Popen(_cli(published, tmp_path, "--deadline", "600"), stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    _stopped_within_two_seconds(proc, published["proxy"], rule, requests=1)
    assert _unchanged(root)


def test_sigterm_stops_a_fetch_while_it_lists_a_stalled_registry_for_the_nearest_artifact(
        tmp_path, oci_registry, oci_env, oci_proxy):
    """No artifact under this node's key (the recipe was edited): fetch reads the manifest of each of
    the recipe's tags for the nearest artifact, and the registry never answers those reads. The
    listing ran on a thread pool, whose workers the interpreter joins at exit: the process outlived
    SIGTERM by the rest of its deadline (and a passed deadline by a read timeout or more)."""
    from warmer.store.oci.store import index_tag

    packed = pack_with_big_file(tmp_path, 1 << 10)
    repo = oci_registry.repo()
    build.publish(open_store(oci_registry.url(repo)), packed["artifact"])
    published = f"/manifests/{index_tag('tiny', packed['doc'].key)}"
    rule = oci_proxy.inject("stall", lambda r: r.method == "GET" and r.path.endswith(published), times=None)
    edited = write_tiny_recipe(tmp_path / "tiny.toml", max_model_len=256)  # another key: its own tag is absent
    port = oci_proxy.url.rsplit(":", 1)[1]
    proc = subprocess.Popen([sys.executable, "-m", "warmer", "fetch", str(edited), "--store",
                             f"oci://127.0.0.1:{port}/{repo}", "--root", str(tmp_path / "node-root"),
                             "--deadline", "600"], stderr=subprocess.PIPE, text=True, cwd=REPO)
    _stopped_within_two_seconds(proc, oci_proxy, rule, requests=1)


def test_ls_ends_at_its_deadline_on_a_store_that_never_answers_its_entries(s3_published):
    """The listing answers, each entry's GET never does. ls said the deadline had passed, then ran on
    for minutes: its entries were read on a thread pool the interpreter joins at exit, each GET
    retried 8 times with a 20 s read timeout by a store opened without the ls deadline."""
    s3_published["proxy"].inject("stall", lambda r: r.method == "GET" and r.is_index, times=None)
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "warmer", "ls", "--store", s3_published["store"],
                          *s3_published["cli"], "--deadline", str(int(DEADLINE))],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    took = time.monotonic() - t0
    assert out.returncode != 0 and f"ls deadline of {DEADLINE:.0f} s" in out.stderr, out.stderr
    assert took < DEADLINE + SLACK + 2, f"{took:.1f} s for a {DEADLINE} s deadline"  # 2: the interpreter's start


def test_a_map_abandoned_at_its_deadline_begins_no_more_items():
    """A fetch that gave up looking for the nearest artifact at its deadline left 8 threads parsing
    the rest of 400 entries (a second each at 45,000 files) beside the kept root's check."""
    from warmer.deadline import map_on_daemon_threads

    bound, begun = Deadline(None), []

    def judge(i):
        begun.append(i)
        bound.cancel()  # the deadline passes while the first item is judged

    with pytest.raises(DeadlineExceeded, match="stopped while judging entries"):
        map_on_daemon_threads(judge, list(range(400)), 1, bound, "judging entries")
    assert begun == [0]


def test_publish_stops_a_slow_upload_at_its_deadline(tmp_path, s3_url, proxy):
    """Every part of a multipart upload answered, slowly: no timeout ever trips. The upload ran to
    its end, far past --deadline, and publish then failed before the entry, the whole blob left for
    gc. It stops at the deadline, and the multipart upload is aborted: no blob, no entry."""
    from warmer.store.s3 import S3Store

    packed = pack_with_big_file(tmp_path, 50 << 20)
    rule = proxy.inject("slow", lambda r: r.method == "PUT" and "partNumber=" in r.path, times=None)
    deadline = Deadline(3.0, "publish")
    store = S3Store(s3_url, endpoint_url=proxy.url, part_size=5 << 20, concurrency=1, deadline=deadline)
    t0 = time.monotonic()
    with time_cap(60), pytest.raises(DeadlineExceeded, match="publish deadline of 3 s"):
        build.publish(store, packed["artifact"], deadline=deadline)
    took = time.monotonic() - t0
    assert took < 3.0 + SLACK, f"{took:.1f} s for a 3 s deadline"
    assert 1 <= rule.fired < 8, rule.fired  # stopped partway: 11 parts in all
    assert open_store(s3_url).list_blobs() == [] and open_store(s3_url).list_index() == []


def test_a_registry_publish_waits_for_racers_no_longer_than_its_deadline(tmp_path, oci_registry, oci_env):
    """After tagging, an OCI publish waits for racing publishers to land (settle_s, or twice the
    time the tag took on a slow registry): never past the deadline, which then says so."""
    from warmer.store.oci import OCIStore

    packed = pack_with_big_file(tmp_path, 1 << 10)
    deadline = Deadline(2.0, "publish")
    store = OCIStore(oci_registry.url(oci_registry.repo()), settle_s=60.0, deadline=deadline)
    t0 = time.monotonic()
    with time_cap(60), pytest.raises(DeadlineExceeded, match="publish deadline of 2 s"):
        build.publish(store, packed["artifact"], deadline=deadline)
    took = time.monotonic() - t0
    assert took < 2.0 + SLACK, f"{took:.1f} s for a 2 s deadline"


def _stopped_within_two_seconds(proc: subprocess.Popen, proxy, rule, requests: int) -> None:
    """SIGTERM once the rule has met this many download requests, each in its slow read (a stalled
    answer is from the moment its request is in; a trickled one once its body has begun): exit 143
    within 2 s."""
    def reading() -> bool:
        return rule.fired >= requests and (rule.action != "trickle" or proxy.trickling >= requests)

    with time_cap(60):
        while not reading() and proc.poll() is None:
            time.sleep(0.02)  # polls the proxy for the downloads' progress; nothing signals it
        assert proc.poll() is None, proc.stderr.read()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait()
    took = time.monotonic() - t0
    assert code == 143, proc.stderr.read()
    assert took < 2.0, f"exited {took:.2f} s after SIGTERM"


def test_sigterm_stops_rm_within_two_seconds_though_botocore_wraps_it(tmp_path, s3_url, proxy, packed):
    """SIGTERM during an S3 request of rm or gc (a CronJob's deadline) was wrapped by botocore as a
    connection error and retried: rm went on and said removed, and only SIGKILL stopped a gc."""
    entry = build.publish(open_store(s3_url), packed("a").path)
    rule = proxy.inject("stall", lambda r: r.method == "DELETE", times=None)
    proc = subprocess.Popen([sys.executable, "-m", "warmer", "rm", f"{s3_url}/index/tiny/{entry.key}", "--yes",
                             "--endpoint-url", proxy.url], stderr=subprocess.PIPE, text=True, cwd=REPO)
    _stopped_within_two_seconds(proc, proxy, rule, requests=1)


def test_sigterm_while_an_oci_entry_trickles_in_stops_rm(tmp_path, oci_registry, oci_proxy, oci_env, packed):
    """The registry client read an entry's config again when its read raised anything: SIGTERM too
    (rm reads the entry in its own thread, where the signal lands)."""
    repo = oci_registry.repo()
    entry = build.publish(open_store(oci_registry.url(repo)), packed("a").path)
    rule = oci_proxy.inject("trickle", lambda r: r.method == "GET" and "/blobs/" in r.path, times=None)
    url = f"oci://127.0.0.1:{oci_proxy.url.rsplit(':', 1)[1]}/{repo}"
    proc = subprocess.Popen([sys.executable, "-m", "warmer", "rm", f"{url}/index/tiny/{entry.key}"],
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    _stopped_within_two_seconds(proc, oci_proxy, rule, requests=1)


def test_sigterm_stops_fetch_all_within_two_seconds(tmp_path, s3_url, proxy, packed):
    """The prefetch DaemonSet's fetch --all: the fetches under way are cancelled, each root kept."""
    import tomllib

    from tests.integration.test_node_bootstrap import SKUS, _recipe_text
    from warmer.recipe import parse

    if os.uname().machine != "x86_64":
        pytest.skip("the fixture's CPU SKU is x86_64")
    manifests = tmp_path / "manifests"
    (manifests / "models").mkdir(parents=True)
    (manifests / "skus.toml").write_text(SKUS)
    for name in ("alpha", "beta"):
        path = manifests / "models" / f"{name}.toml"
        path.write_text(_recipe_text(name, ["cpu-x86_64"]))
        recipe = parse(tomllib.loads(path.read_text()), path)
        build.publish(open_store(s3_url), packed(name, recipe=recipe, extra={"inductor/big.so": os.urandom(1 << 20)}).path)
    rule = proxy.inject("trickle", is_blob_get, times=None)
    base = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-m", "warmer", "fetch", "--all", str(manifests), "--store", s3_url,
                             "--endpoint-url", proxy.url, "--root-base", str(base), "--deadline", "600"],
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    _stopped_within_two_seconds(proc, proxy, rule, requests=2)  # both downloads under way
    assert not restore.active(base / "alpha") and not restore.active(base / "beta")
    assert not [p for p in base.iterdir() if ".staging-" in p.name]
