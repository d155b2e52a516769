"""scripts/gpu-accept.sh --cpu: the GPU acceptance script's whole flow on vLLM's CPU build.

Build, fetch into the same root, serve with the nvcc shim and a census outside the root, and the
negative control (a different raw CUDA_HOME on an AOT-on copy of the recipe): six engine starts,
several minutes on a 2-core machine.
"""

import json
import os
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

try:
    import vllm  # noqa: F401  (only to know whether the engine is installed)
    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM (the `cpu` extra) is not installed")
def test_gpu_accept_script_passes_on_vllms_cpu_build(tmp_path):
    import sys

    env = {**os.environ, "WARMER_ACCEPT_DIR": str(tmp_path / "work"), "OUT": str(tmp_path / "out"),
           "PYTHON": sys.executable}
    env.pop("WARMER_TINY_MODEL", None)  # the script generates its own models
    out = subprocess.run(["bash", "scripts/gpu-accept.sh", "--cpu"], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=3600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("CHECK ")]
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-6000:]}\n{out.stderr[-3000:]}"
    assert lines and all(ln.endswith(", PASS") for ln in lines), "\n".join(lines)

    summary = json.loads((tmp_path / "out" / "gpu-accept.json").read_text())
    assert summary["passed"] is True and summary["mode"] == "cpu" and summary["failed"] == []
    checks = {c["name"]: c for c in summary["checks"]}
    assert len(checks) == len(lines)
    # The positive side (AOT off: Inductor's cache only) and the negative control (AOT on) both ran.
    for name in ("tiny-llama-cpu/build", "tiny-llama-cpu/fetch", "tiny-llama-cpu/no-compile",
                 "tiny-llama-cpu/no-new-files", "tiny-llama-cpu/nvcc-not-called", "tiny-llama-cpu/start-time",
                 "tiny-llama-cpu/other-cuda-home-prediction", "tiny-llama-cpu-aot-on/negative-predicted-miss",
                 "tiny-llama-cpu-aot-on/negative-vllm-misses", "gpu-recipes-parse"):
        assert checks[name]["ok"], checks.get(name)
    serve = summary["steps"]["tiny-llama-cpu.serve"]
    assert serve["new_files"] == 0 and serve["requests"] >= 2
    assert set(serve["census"]) == {"root", "home", "xdg_cache", "tmpdir", "model"}
    negative = summary["steps"]["tiny-llama-cpu-aot-on-other-cuda-home.serve"]
    assert negative["new_kernels"] and len(negative["cache_dirs"]) == 2  # vLLM's key moved: a second folder
