"""scripts/gpu-accept.sh --cpu: the GPU acceptance script's whole flow on vLLM's CPU build.

Build, a warm restart on the build root (the restored run's control), fetch into the same root, serve
with the JIT monitor's flags, the nvcc shim and a census outside the root, and the negative control (a
different raw CUDA_HOME on an AOT-on copy of the recipe): seven engine starts, several minutes on a
2-core machine.
"""

import json
import os
import subprocess

import pytest

from tests.conftest import REPO, run_python

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
    # The declared shapes as the warm-up ran them: 2 sampling settings x batch sizes [1, 4] x 2 prompt lengths.
    assert serve["new_files"] == 0 and serve["requests"] == 20
    assert set(serve["census"]) == {"root", "home", "xdg_cache", "tmpdir", "model"}
    negative = summary["steps"]["tiny-llama-cpu-aot-on-other-cuda-home.serve"]
    assert negative["new_kernels"] and len(negative["cache_dirs"]) == 2  # vLLM's key moved: a second folder

    # The JIT-free certificate. The engine's own config line (read back from the restored serve's log)
    # shows the monitor's flags were taken: without --jit-monitor-verbose it reads jit_monitor_verbose=False.
    jit = checks["tiny-llama-cpu/jit-monitor"]
    assert "the engine's config jit_monitor_mode='warn', jit_monitor_verbose=True" in jit["detail"], jit
    assert serve["jit"]["mode"] == "warn" and serve["jit"]["verbose"] is True
    # On CPU it says plainly that the monitor watches nothing: vLLM's CPU worker never activates it.
    assert "'Kernel JIT monitor activated' lines 0" in jit["detail"] and serve["jit"]["activated"] == 0
    notes = [ln for ln in out.stdout.splitlines() if ln.startswith("gpu-accept: tiny-llama-cpu: ")]
    cert = [ln for ln in notes if ln.startswith("gpu-accept: tiny-llama-cpu: certificate: ")]
    assert len(cert) == 1, "\n".join(notes)
    assert "certificate: none on CPU: the JIT monitor watches nothing here: " in cert[0], cert[0]
    assert "(installed without a CPU backend: HAS_TRITON False)" in cert[0], cert[0]
    # Coverage: the shapes the engine admits beyond the workload are named, with the shape.
    assert any("coverage: " in ln and "beyond the workload: prompt lengths 101-248" in ln for ln in notes), notes

    # The warm-restart control: a restart on the build root itself, then the verdict against it.
    assert checks["tiny-llama-cpu/warm-restart/serve"]["ok"]
    verdict = checks["tiny-llama-cpu/restored-vs-warm-restart"]
    assert verdict["ok"] and "(same env True)" in verdict["detail"], verdict
    assert "time ratio restored/warm restart: init " in verdict["detail"], verdict
    assert any("every start redoes this: a cache does not remove it: " in ln for ln in notes), notes
    assert any("control beyond the warm-up, on the warm restart (prompt length 248 at batch 1" in ln for ln in notes)
    warm = summary["steps"]["tiny-llama-cpu-warm-restart.serve"]
    assert warm["control"]["requests"] == 1 and warm["control"]["error"] is None
    assert warm["requests"] == 20 and warm["declared"]["new_files"] == 0


# vLLM's own code renders its monitor's lines in a child process: importing its workers here would
# leave vLLM's imports (and the paths they add) in the test process for every later test.
RENDER_MONITOR_LINES = r"""
import inspect, json
from triton.runtime import autotuner
from vllm.utils import jit_monitor
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

lines = []

class Log:
    def warning(self, msg, *args):
        lines.append("(EngineCore pid=7) WARNING 12-05 04:00:00 [jit_monitor.py:137] " + msg % args)

    warning_once = warning

jit_monitor.logger, jit_monitor._mode, jit_monitor._verbose = Log(), "warn", True
jit_monitor._log_triton_jit_compile("_fwd_kernel", {"compile": {"constants": {}, "signature": {"x": "*bf16"}}})
jit_monitor._log_cutedsl_jit_compile("gemm")
jit_monitor._log_tilelang_jit_compile("topk", "cache_key=1")
print(json.dumps({
    "lines": lines,
    "activate": inspect.getsource(jit_monitor.activate),
    "autotune_print": "Triton autotuning for function {self.base_fn.__name__},\\n" in inspect.getsource(autotuner),
    "gpu_activates": "_maybe_activate_jit_monitor" in inspect.getsource(Worker.compile_or_warm_up_model),
    "cpu_activates": "_maybe_activate_jit_monitor" in inspect.getsource(CPUWorker.compile_or_warm_up_model),
}))
"""


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM (the `cpu` extra) is not installed")
def test_the_jit_monitor_lines_parse_as_vllm_and_triton_write_them(monkeypatch):
    """The certificate reads vLLM's own words: its monitor's message (vllm/utils/jit_monitor.py
    _handle_jit_event), its activation line, Triton's autotune print; and the CPU statement rests on
    the code: only the GPU worker activates the monitor."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import gpu_accept

    from warmer import warmup

    vllm = json.loads(run_python("-c", RENDER_MONITOR_LINES).stdout.splitlines()[-1])
    assert gpu_accept.JIT_ACTIVATED in vllm["activate"] and vllm["autotune_print"]
    lines = [*vllm["lines"], "(EngineCore pid=7) Triton autotuning for function fused_moe_kernel,\nwith key as (1,),\n"]
    raw = "\n".join(lines).encode()
    got = gpu_accept._jit_monitor(raw, {"ready": 0, "declared": len(raw)})["windows"]["declared"]
    assert [(e["kind"], e["kernel"]) for e in got] == [
        ("Triton", "_fwd_kernel"), ("CuTeDSL", "gemm"), ("TileLang", "topk"), ("autotune", "fused_moe_kernel")]
    assert got[0]["detail"].startswith("constexprs={}; signature={x='*bf16'}")
    assert gpu_accept._jit_counts(got) == "1 Triton compiles, 1 Triton autotunes, 1 CuTe DSL compiles, 1 TileLang compiles"
    # warmer verify reads the same lines (warmup.jit_monitor).
    assert warmup.jit_monitor(raw.decode())["events"] == 4

    # On CPU: CPUWorker overrides the warm-up without the activation the GPU worker does.
    assert vllm["gpu_activates"] and not vllm["cpu_activates"]
