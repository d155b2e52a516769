"""scripts/gpu-check.sh on this CPU machine (--cpu: the same flow, FlashInfer modules built by the
real nvcc but not run), its negative controls, and the wheel set `make gpu-wheels` carries to the
GPU machine, installed offline into an environment that holds only that machine's packages."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402

LINE = re.compile(r"^CHECK (?P<name>[a-z-]+): cold (?P<cold>[\d.]+|-) s, warm restart (?P<warm>[\d.]+|-) s, "
                  r"restored (?P<restored>[\d.]+|-) s \((?P<ratio>[\d.]+|-)x the warm restart\), "
                  r"compiles (?P<compiles>\d+|-) \(warm restart (?P<warm_compiles>\d+|-)\), "
                  r"new files (?P<new>\d+|-) \(warm restart (?P<warm_new>\d+|-)\), (?P<verdict>PASS|FAIL|N/A|SKIP)$")
HAVE_CPU_FLOW = (shutil.which("g++") is not None and importlib.util.find_spec("torch") is not None
                 and importlib.util.find_spec("flashinfer") is not None and gpu_check.real_toolkit(os.environ))
MIB = 1024 * 1024


def lines_of(out: str) -> dict[str, dict]:
    found = {}
    for line in out.splitlines():
        m = LINE.match(line)
        if m:
            found[m["name"]] = m.groupdict()
    return found


def gpu_check_sh(work: Path, *args: str, python: str = sys.executable, env: dict | None = None,
                 timeout: int = 900) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {}), "PYTHON": python, "WARMER_GPU_CHECK_DIR": str(work),
            "OUT": str(work.parent / "out")}
    full.setdefault("WARMER_GPU_WHEELS", str(work.parent / "no-wheels"))   # never a stray .whl/ here
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), *args], cwd=str(REPO), env=full,
                          capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------ pure helpers

def test_compiler_calls_are_told_from_probes(tmp_path):
    (tmp_path / "nvcc.log").write_text("--version\n--generate-dependencies-with-compile -c a.cu -o a.o\n")
    (tmp_path / "cc.log").write_text("g++ --version\ng++ -v\ng++ x.hpp -E -o x.i\ng++ k.cpp -shared -o k.so\n"
                                     "cc -print-file-name=libcuda.so\n")
    calls = gpu_check.read_calls(tmp_path)
    assert (calls["nvcc_compiles"], calls["nvcc_probes"]) == (1, 1)
    assert (calls["host_compiles"], calls["host_probes"]) == (1, 4)


def test_census_counts_cache_files_not_locks_or_excluded_logs():
    before = {"inductor/aa/c1.so": (10, 1)}
    after = {**before, "inductor/aa/c2.so": (5, 2), "inductor/locks/c2.lock": (0, 2),
             "flashinfer/.cache/flashinfer/0.7.2.post1/90a/flashinfer_jit.log": (3, 2),
             "flashinfer/.cache/flashinfer/0.7.2.post1/90a/cached_ops/tmp/m.lock": (0, 2),
             "triton/KEY/k.cubin": (7, 2)}
    assert gpu_check.root_delta(before, after) == ["inductor/aa/c2.so", "triton/KEY/k.cubin"]
    assert gpu_check.root_delta(before, {"inductor/aa/c1.so": (11, 3)}) == ["inductor/aa/c1.so"]  # rewritten
    # Scratch in the root's TMPDIR, which the headers component does not take, is counted.
    assert gpu_check.root_delta({}, {"tmp/torchinductor_root/precompiled_headers/c.h.gch": (1, 1),
                                     "tmp/scratch.bin": (1, 1)}) == [
        "tmp/scratch.bin", "tmp/torchinductor_root/precompiled_headers/c.h.gch"]


def test_compiler_calls_are_timed_once_however_they_overlap(tmp_path):
    """The shims log START END ARGS; the cost is wall time: ninja's parallel nvcc jobs and the host
    compiler nvcc runs inside them are not added up, probes are not counted."""
    (tmp_path / "nvcc.log").write_text("--version\n-c a.cu\n-c b.cu\n")
    (tmp_path / "nvcc.times").write_text("100.0 100.5 --version\n100.0 110.0 -c a.cu\n105.0 112.0 -c b.cu\n")
    (tmp_path / "cc.log").write_text("g++ -c x.cpp\n")
    (tmp_path / "cc.times").write_text("10.0 12.5 g++ -c x.cpp\n20.0 21.0 g++ --version\nN N g++ -c torn\n")
    calls = gpu_check.read_calls(tmp_path)
    assert calls["nvcc_compile_s"] == 12.0 and calls["host_compile_s"] == 2.5
    assert gpu_check.busy_seconds([(0, 10), (2, 3), (5, 12), (20, 21)]) == 13.0
    assert gpu_check.busy_seconds([]) == 0.0


def test_the_shims_log_times_and_keep_the_exit_status(tmp_path):
    real = tmp_path / "real-cc"
    real.write_text("#!/bin/sh\necho ran \"$@\"\nexit 3\n")
    real.chmod(0o755)
    shim = tmp_path / "shim"
    shim.write_text("#!/bin/sh\n" + gpu_check._timed_call(str(real), "cc.times", "g++ "))
    shim.chmod(0o755)
    proc = subprocess.run([str(shim), "-c", "x.cpp"], env={**os.environ, "WARMER_GPU_CHECK_LOG": str(tmp_path)},
                          capture_output=True, text=True)
    assert proc.returncode == 3 and proc.stdout == "ran -c x.cpp\n"
    start, end, *args = (tmp_path / "cc.times").read_text().split()
    assert float(end) >= float(start) > 0 and args == ["g++", "-c", "x.cpp"]


NOTHING = {"calls": {}, "counters": {}, "root_new_files": [], "outside_new_files": []}


def run(**kw) -> dict:
    return {**NOTHING, **kw}


def inductor(**counters) -> dict:
    return {"counters": {"inductor": counters}}


# What the H200 showed for torch-compile (FlashInfer 0.7.2.post1, torch 2.11): the second run on one
# root hit the FX graph cache and still ran 11 Inductor benchmarks and 4 precompiles.
GPU_COLD = run(**inductor(fxgraph_cache_miss=1, select_algorithm_autotune=1, **{"benchmarking.bench_gpu": 10},
                          select_algorithm_num_precompiles=4), triton={"compiled": 9, "compile_s": 6.0},
               triton_listener=True, max_err=0.001, tolerance=0.02)
GPU_WARM = run(**inductor(fxgraph_cache_hit=1, select_algorithm_autotune=1, **{"benchmarking.bench_gpu": 10},
                          select_algorithm_num_precompiles=4), triton={"compiled": 0},
               timings={"mm_template_autotuning": 2.5, "mm_template_precompiling": 1.25, "compile_fx_inner": 9.0},
               max_err=0.001, tolerance=0.02, wall_s=8.0)


def test_a_check_whose_cold_run_compiled_nothing_cannot_pass():
    verdict, reasons = gpu_check.judge("torch-compile", "cpu", run(), run(), run())
    assert verdict == "FAIL" and "compiled nothing" in reasons[0]
    cold = run(**inductor(fxgraph_cache_miss=1))
    assert gpu_check.judge("torch-compile", "cpu", cold, run(), run()) == ("PASS", [])
    assert gpu_check.judge("torch-compile", "cpu", cold, run(), run(outside_new_files=["$HOME/.x"]))[0] == "FAIL"
    assert gpu_check.judge("torch-compile", "cpu", cold, run(), run(max_err=1.0, tolerance=1e-4))[0] == "FAIL"
    # Wrong numbers in the warm restart fail too, and a phase that computed nothing to compare.
    assert gpu_check.judge("torch-compile", "cpu", {**cold, "max_err": 0.0, "tolerance": 1e-4},
                           run(max_err=1.0, tolerance=1e-4), run(max_err=0.0, tolerance=1e-4))[0] == "FAIL"
    verdict, reasons = gpu_check.judge("torch-compile", "cpu", {**cold, "max_err": 0.0, "tolerance": 1e-4},
                                       run(max_err=0.0, tolerance=1e-4), run())
    assert verdict == "FAIL" and "restored computed nothing" in reasons[0]
    # Without a warm restart or a restored run there is nothing to judge.
    assert gpu_check.judge("torch-compile", "cpu", cold, None, run())[0] == "FAIL"
    assert gpu_check.judge("torch-compile", "cpu", cold, run(), None)[0] == "FAIL"
    verdict, reasons = gpu_check.judge("torch-compile", "cpu", cold, run(error="RuntimeError: boom\nmore"), run())
    assert verdict == "FAIL" and reasons[0] == "warm restart run failed: RuntimeError: boom"


def test_a_restored_run_that_redoes_what_the_warm_restart_redoes_passes_with_the_rework_listed():
    restored = {**GPU_WARM, "wall_s": 8.4, "timings": {"mm_template_autotuning": 2.0, "mm_template_precompiling": 1.0}}
    assert gpu_check.judge("torch-compile", "cuda", GPU_COLD, GPU_WARM, restored) == ("PASS", [])
    items = gpu_check.rework(GPU_WARM, restored)
    by = {i["counter"]: i for i in items}
    assert set(by) == {"inductor_benchmarks", "inductor_precompiles"}   # not the FX graph: the cache removed it
    assert by["inductor_benchmarks"]["count"] == 11 and by["inductor_precompiles"]["count"] == 4
    assert by["inductor_benchmarks"]["seconds"] == 3.75 and by["inductor_benchmarks"]["restored_seconds"] == 3.0
    assert by["inductor_benchmarks"]["restored_count"] == 11
    assert gpu_check.rework_line(by["inductor_benchmarks"]) == "inductor_benchmarks 11, 3.8 s (restored 11, 3.0 s)"
    line = gpu_check.check_line("torch-compile", "cuda", {**GPU_COLD, "wall_s": 30.0}, GPU_WARM, restored)
    assert line["ratio"] == 1.05 and line["compiles"] == line["warm_compiles"] == 15
    assert "1.05x the warm restart" in gpu_check.summary_line(line) and line["verdict"] == "PASS"
    assert LINE.match(gpu_check.summary_line(line))


def test_the_restored_run_may_not_compile_more_than_the_warm_restart_on_any_counter():
    more = run(**inductor(fxgraph_cache_hit=1, select_algorithm_autotune=1, **{"benchmarking.bench_gpu": 11},
                          select_algorithm_num_precompiles=4), max_err=0.001, tolerance=0.02)
    verdict, reasons = gpu_check.judge("torch-compile", "cuda", GPU_COLD, GPU_WARM, more)
    assert verdict == "FAIL" and reasons == [
        "the restored run compiled more than the warm restart: inductor_benchmarks 12 (warm restart 11)"]
    # A different kind of work is more, even when the total is less.
    swapped = run(**inductor(fxgraph_cache_miss=1), max_err=0.001, tolerance=0.02)
    verdict, reasons = gpu_check.judge("torch-compile", "cuda", GPU_COLD, GPU_WARM, swapped)
    assert verdict == "FAIL" and "fxgraph_cache_miss 1 (warm restart 0)" in reasons[0]


def test_the_restored_run_may_write_only_what_the_warm_restart_wrote():
    cold = run(**inductor(fxgraph_cache_miss=1))
    warm = run(root_new_files=["inductor/autotune/a.best_config"])
    assert gpu_check.judge("torch-compile", "cpu", cold, warm, dict(warm))[0] == "PASS"
    verdict, reasons = gpu_check.judge("torch-compile", "cpu", cold, warm, run(root_new_files=["inductor/b.so"]))
    assert verdict == "FAIL" and "1 the warm restart did not, e.g. inductor/b.so" in reasons[0]
    both = run(root_new_files=["inductor/autotune/a.best_config"], outside_new_files=["$HOME/.triton/x"])
    assert gpu_check.judge("torch-compile", "cpu", cold, warm, both)[0] == "FAIL"


def test_a_check_whose_warm_restart_redoes_everything_proves_nothing():
    """If no cache removed any of the cold run's work, a restored run that redoes it all again would
    pass the comparison: the check must fail instead."""
    cold = run(autotune_profiles_tuned=8, autotune_saved=True, autotune_loaded=False, max_err=0.0, tolerance=0.05)
    warm = run(autotune_profiles_tuned=8, autotune_saved=True, autotune_loaded=True, max_err=0.0, tolerance=0.05)
    verdict, reasons = gpu_check.judge("flashinfer-autotune", "cuda", cold, warm, dict(warm))
    assert verdict == "FAIL" and "no cache removed any of it" in reasons[0]
    # The JIT module the cold run built and the restarts load is something a cache removed; the
    # autotuner's re-tuning is then the re-work every start pays, listed with its seconds.
    cold = {**cold, "calls": {"nvcc_compiles": 2, "nvcc_compile_s": 40.0}}
    warm = {**warm, "autotune_s": 6.5}
    assert gpu_check.judge("flashinfer-autotune", "cuda", cold, warm, {**warm, "autotune_s": 6.0}) == ("PASS", [])
    [item] = gpu_check.rework({**warm, "flashinfer": "0.7.0.post1"}, {**warm, "autotune_s": 6.0})
    assert item.pop("cause").startswith("FlashInfer 0.7.0's AutoTuner.search_cache ignores the loaded file")
    assert item == {"counter": "flashinfer_autotune_profiles", "count": 8, "seconds": 6.5,
                    "cost_from": "the autotune block", "restored_count": 8, "restored_seconds": 6.0}
    # 0.7.2 reads the file per entry; what it still re-tunes has another cause.
    assert "get_cache_key_extras" in gpu_check.rework({**warm, "flashinfer": "0.7.2.post1"})[0]["cause"]


def test_what_an_fx_graph_cache_hit_adds_back_is_not_counted_as_work():
    """torch re-adds the compile-time counters on an FX-graph-cache hit (FxGraphCache.
    cache_hit_post_compile): the H200's "11 benchmarks, 4 precompiles" on every restart. The work
    process keeps those apart ("replayed"); compiles() counts only what ran."""
    counters = {"inductor": {"fxgraph_cache_hit": 1, "select_algorithm_autotune": 1, "benchmarking.Foo.bar": 10,
                             "select_algorithm_num_precompiles": 4}}
    hit = run(counters=counters, replayed={"inductor": {"select_algorithm_autotune": 1, "benchmarking.Foo.bar": 10,
                                                        "select_algorithm_num_precompiles": 4}})
    assert gpu_check.compiles(hit) == {}
    # Without the hook the same counters read as work, and the cause says they may be replays.
    assert gpu_check.compiles(run(counters=counters)) == {"inductor_benchmarks": 11, "inductor_precompiles": 4}
    assert "adds back the counters" in gpu_check.rework(run(counters=counters))[0]["cause"]
    # A real first-launch autotune on top of the replay still counts.
    more = run(counters={"inductor": {**counters["inductor"], "benchmarking.Foo.bar": 13}}, replayed=hit["replayed"])
    assert gpu_check.compiles(more) == {"inductor_benchmarks": 3}


def test_the_triton_autotune_check_needs_a_cold_benchmark_kept_on_disk():
    cold = run(triton_autotune_benchmarks=3, triton_autotune_cache=True, triton={"compiled": 3}, max_err=0.0,
               tolerance=1e-5)
    warm = run(triton_autotune_benchmarks=0, triton_autotune_cache=True, triton={"cache_hit": 1}, max_err=0.0,
               tolerance=1e-5)
    assert gpu_check.judge("triton-autotune", "cuda", cold, warm, dict(warm)) == ("PASS", [])
    # --negative=triton-autotune: Triton's cache is gone before the restored run.
    verdict, reasons = gpu_check.judge("triton-autotune", "cuda", cold, warm, dict(cold))
    assert verdict == "FAIL" and "triton_autotune_benchmarks 3 (warm restart 0)" in reasons[0]
    # Without TRITON_CACHE_AUTOTUNING nothing is kept: the check says so rather than passing.
    verdict, reasons = gpu_check.judge("triton-autotune", "cuda", {**cold, "triton_autotune_cache": False}, warm, warm)
    assert verdict == "FAIL" and "TRITON_CACHE_AUTOTUNING" in reasons[0]


def test_the_autotune_check_needs_the_restored_file_loaded():
    cold = run(autotune_profiles_tuned=8, autotune_saved=True, calls={"nvcc_compiles": 2})
    warm = run(autotune_profiles_tuned=7, autotune_saved=True, autotune_loaded=True)
    assert gpu_check.judge("flashinfer-autotune", "cuda", cold, warm, dict(warm))[0] == "PASS"
    # --negative=flashinfer-autotune: the file is gone before the restored run only.
    gone = run(autotune_profiles_tuned=8, autotune_saved=True, autotune_loaded=False)
    verdict, reasons = gpu_check.judge("flashinfer-autotune", "cuda", cold, warm, gone)
    assert verdict == "FAIL"
    assert reasons == ["the restored run compiled more than the warm restart: flashinfer_autotune_profiles 8 "
                       "(warm restart 7)", "the restored run found no autotune file to load"]
    resaved = run(autotune_profiles_tuned=7, autotune_saved=True, autotune_loaded=True)
    quiet_warm = {**warm, "autotune_saved": False}
    assert "re-saved" in gpu_check.judge("flashinfer-autotune", "cuda", cold, quiet_warm, resaved)[1][-1]


def test_negative_controls_still_fail_against_an_intact_warm_restart():
    """--negative deletes a cache before the restored run only; the warm restart ran on the intact
    root and compiled nothing, so whatever the restored run rebuilds is more."""
    cold = run(calls={"nvcc_compiles": 3}, max_err=0.0, tolerance=0.01)
    warm = run(max_err=0.0, tolerance=0.01)
    refused = run(calls={"nvcc_compiles": 3}, error="RuntimeError: Ninja build failed", root_new_files=["f/a.o"])
    verdict, reasons = gpu_check.judge("flashinfer-jit", "cuda", cold, warm, refused)
    assert verdict == "FAIL" and reasons[0].startswith("restored run failed")
    assert "nvcc_compiles 3 (warm restart 0)" in reasons[1]
    cold = run(**inductor(fxgraph_cache_miss=1))
    rebuilt = run(**inductor(fxgraph_cache_miss=1), root_new_files=["inductor/x.so"])
    assert gpu_check.judge("torch-compile", "cpu", cold, run(), rebuilt)[0] == "FAIL"
    aot_cold = run(aot_compiled=1, **inductor(fxgraph_cache_miss=1))
    aot_again = run(aot_compiled=1, aot_loaded=0)
    verdict, reasons = gpu_check.judge("aot-compile", "cpu", aot_cold, run(aot_loaded=1), aot_again)
    assert verdict == "FAIL" and any("loaded no AOT-compiled function" in r for r in reasons)


def test_costs_come_from_what_each_process_measured():
    r = run(timings={"mm_template_autotuning": 1.0, "addmm_template_precompiling": 0.5, "compile_fx_inner": 4.0},
            triton={"compiled": 2, "compile_s": 3.25}, aot_compile_s=7.5, autotune_s=2.0,
            calls={"nvcc_compile_s": 11.0, "host_compile_s": 1.5})
    assert gpu_check.cost(r, "inductor_benchmarks") == ("Inductor's autotuning and precompiling sections", 1.5)
    assert gpu_check.cost(r, "fxgraph_cache_miss")[1] == 4.0
    assert gpu_check.cost(r, "triton_kernels_compiled")[1] == 3.25
    assert gpu_check.cost(r, "aot_recompiled")[1] == 7.5
    assert gpu_check.cost(r, "flashinfer_autotune_profiles")[1] == 2.0
    assert gpu_check.cost(r, "nvcc_compiles")[1] == 11.0 and gpu_check.cost(r, "host_compiles")[1] == 1.5
    assert gpu_check.cost(run(), "inductor_benchmarks")[1] is None
    assert gpu_check.rework_line({"counter": "x", "count": 2, "seconds": None}) == "x 2, seconds not measured"


def test_the_phase_table_has_a_row_per_check_and_phase():
    def proc(wall, cuda=None):
        return {"wall_s": wall, "phases": {"interpreter_s": 0.05, "import_s": 2.0, "cuda_s": cuda, "work_s": 3.0,
                                           "exit_s": 0.5}}
    line = gpu_check.check_line("aot-compile", "cuda", {**proc(20.0, 1.5), "aot_compiled": 1}, proc(7.0, 1.25),
                                proc(7.5, 1.0))
    assert list(line["phases"]) == ["cold", "warm", "restored"]
    assert line["phases"]["warm"] == {"start": 0.05, "torch": 2.0, "cuda": 1.25, "work": 3.0, "exit": 0.5,
                                      "wall": 7.0}
    table = gpu_check.phase_table([line])
    assert table[0].split() == ["PHASES", "(s)", "start", "torch", "cuda", "work", "exit", "wall"]
    assert table[2].split() == ["aot-compile", "warm", "restart", "0.05", "2.00", "1.25", "3.00", "0.50", "7.00"]
    cpu = gpu_check.phase_row(proc(7.0), "cpu")
    assert cpu["cuda"] == "n/a"
    assert gpu_check.phase_table([{"name": "x", "phases": {"cold": cpu}}])[1].split()[4] == "n/a"
    assert gpu_check.ratio(8.4, 8.0) == 1.05 and gpu_check.ratio(1.0, None) is None and gpu_check.ratio(1.0, 0) is None


def test_the_ptx_check_is_na_unless_a_cold_run_left_driver_jit_entries(tmp_path):
    env = {"CUDA_CACHE_PATH": str(tmp_path / "cuda")}
    none = {"a": {"root_new_files": ["inductor/x.py", "cuda/index"]}}
    assert gpu_check.judge_ptx(env, tmp_path, none, {"a": {}}, "cuda")["verdict"] == "N/A"
    cold = {"a": {"root_new_files": ["cuda/index", "cuda/ab/cd"]}}
    assert gpu_check.judge_ptx(env, tmp_path, cold, {"a": {"root_new_files": []}}, "cuda")["verdict"] == "PASS"
    again = gpu_check.judge_ptx(env, tmp_path, cold, {"a": {"root_new_files": ["cuda/ab/cd"]}}, "cuda")
    assert (again["verdict"], again["compiles"]) == ("FAIL", 1)
    # What the warm restart also JIT-compiled, every start does.
    warm = {"a": {"root_new_files": ["cuda/ab/cd"]}}
    assert gpu_check.judge_ptx(env, tmp_path, cold, {"a": {"root_new_files": ["cuda/ab/cd"]}}, "cuda",
                               warm)["verdict"] == "PASS"
    assert gpu_check.judge_ptx(env, tmp_path, cold, {}, "cpu")["verdict"] == "N/A"


def test_summary_line_format():
    line = gpu_check.summary_line({"name": "aot-compile", "cold_s": 12.34, "warm_s": 3.2, "restored_s": 3.0,
                                   "ratio": 0.9375, "compiles": 0, "warm_compiles": 0, "new_files": 0,
                                   "warm_new_files": 1, "verdict": "PASS"})
    assert line == ("CHECK aot-compile: cold 12.3 s, warm restart 3.2 s, restored 3.0 s (0.94x the warm restart), "
                    "compiles 0 (warm restart 0), new files 0 (warm restart 1), PASS")
    assert LINE.match(line)
    skip = gpu_check.summary_line({"name": "flashinfer-autotune", "cold_s": None, "restored_s": None,
                                   "compiles": None, "new_files": None, "verdict": "SKIP"})
    assert LINE.match(skip)["verdict"] == "SKIP"


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="no .venv here (`make install`)")
def test_cpu_mode_picks_the_venv_as_gpu_accept_does(tmp_path):
    """After `make install`, --cpu runs on .venv/bin/python (zstandard and warmer's other deps are
    there), not on whatever python3 the PATH finds first."""
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "python3").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'system-python3.log'}\nexit 97\n")
    (shims / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(PATH=f"{shims}:{env['PATH']}", WARMER_GPU_CHECK_DIR=str(tmp_path / "work"),
               WARMER_GPU_WHEELS=str(tmp_path / "no-wheels"))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--cpu", "--help"], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: gpu-check" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "system-python3.log").exists()
    # Without --cpu (the GPU machine, which has no .venv) it is still python3, or PYTHON.
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), "--help"], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 97 and (tmp_path / "system-python3.log").exists()


# --------------------------------------------------------------------------- the CPU flow

cpu_flow = pytest.mark.skipif(not HAVE_CPU_FLOW, reason="needs g++, torch, flashinfer and a CUDA toolkit (nvcc)")


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu-check") / "work"
    proc = gpu_check_sh(work, "--cpu")
    return work, proc


@pytest.mark.slow
@cpu_flow
def test_cpu_run_passes_every_check_that_can_run_here(cpu_run):
    work, proc = cpu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = lines_of(proc.stdout)
    assert list(lines) == ["torch-compile", "aot-compile", "flashinfer-jit", "flashinfer-autotune", "triton-autotune",
                           "cuda-ptx"]
    for name in ("torch-compile", "aot-compile", "flashinfer-jit"):
        assert lines[name]["verdict"] == "PASS", proc.stdout
        assert (lines[name]["compiles"], lines[name]["new"]) == ("0", "0")
        # On the CPU a warm restart on the build root redoes nothing either.
        assert (lines[name]["warm_compiles"], lines[name]["warm_new"]) == ("0", "0")
        assert float(lines[name]["ratio"]) > 0
    assert lines["flashinfer-autotune"]["verdict"] == "SKIP" and lines["cuda-ptx"]["verdict"] == "N/A"
    assert lines["triton-autotune"]["verdict"] == "SKIP"
    report = json.loads((work.parent / "out" / "gpu-check.json").read_text())
    by_name = {c["name"]: c for c in report["checks"]}
    # The phase table: a row per check and phase, on the CPU without a CUDA context.
    assert len(report["phase_table"]) == 1 + 3 * 3 and "PHASES" in proc.stdout
    for name in ("torch-compile", "aot-compile", "flashinfer-jit"):
        phases = by_name[name]["phases"]
        assert list(phases) == ["cold", "warm", "restored"]
        for row in phases.values():
            assert row["cuda"] == "n/a" and 0 < row["start"] < row["wall"] and row["torch"] > 0 and row["exit"] > 0
            assert row["start"] + row["torch"] + row["work"] + row["exit"] <= row["wall"] + 0.5
        assert by_name[name]["rework"] == [] and by_name[name]["warm"]["wall_s"] > 0
    # What the cold runs built, and where: everything under the root, nothing outside it.
    assert by_name["flashinfer-jit"]["compiled_cold"]["nvcc_compiles"] >= 3
    assert by_name["torch-compile"]["compiled_cold"]["fxgraph_cache_miss"] >= 1
    # The restarts hit the FX-graph cache, and what the hit added back to Inductor's counters (torch
    # 2.13 on CPU: extern_calls) was kept apart as a replay, not counted as work.
    for phase in ("warm", "restored"):
        ran = by_name["torch-compile"][phase]
        assert ran["replays_kept_apart"] and ran["counters"]["inductor"]["fxgraph_cache_hit"] == 1
        assert ran["replayed"]["inductor"] and all(
            ran["counters"]["inductor"][k] >= v for k, v in ran["replayed"]["inductor"].items())
    assert by_name["aot-compile"]["cold"]["aot_compiled"] == 1 and by_name["aot-compile"]["restored"]["aot_loaded"] == 1
    for name in ("torch-compile", "aot-compile", "flashinfer-jit"):
        assert by_name[name]["cold"]["outside_new_files"] == []
    assert report["flashinfer_ninja_dry_run"]["clean"] is True
    # The restored FlashInfer run reached only the failing nvcc, and only for its version.
    restored_calls = by_name["flashinfer-jit"]["restored"]["calls"]
    assert restored_calls["nvcc_compiles"] == 0 and restored_calls["host_compiles"] == 0


@pytest.mark.slow
@cpu_flow
@pytest.mark.parametrize("negative", ["flashinfer-jit", "torch-compile", "aot-compile"])
def test_negative_control_fails_the_check_whose_cache_was_deleted(cpu_run, negative):
    """The default negative runs every check: the others must still pass. The rest reuse the runs of
    their own check only (--checks, as scripts/gpu-device-run.sh calls it on the GPU machine)."""
    work, first = cpu_run
    assert first.returncode == 0, first.stdout + first.stderr
    args = ["--negative"] if negative == gpu_check.DEFAULT_NEGATIVE else [f"--negative={negative}",
                                                                         f"--checks={negative}"]
    proc = gpu_check_sh(work, "--cpu", "--reuse", *args)
    assert proc.returncode == gpu_check.EXIT_FAIL, proc.stdout + proc.stderr
    assert "reusing the cold runs, warm restarts" in proc.stdout
    lines = lines_of(proc.stdout)
    assert lines[negative]["verdict"] == "FAIL", proc.stdout
    assert int(lines[negative]["compiles"]) > 0 and int(lines[negative]["new"]) > 0
    assert (lines[negative]["warm_compiles"], lines[negative]["warm_new"]) == ("0", "0")   # the intact root
    assert f"NEGATIVE CONTROL {negative}: FAIL as expected" in proc.stdout
    if negative != gpu_check.DEFAULT_NEGATIVE:
        assert set(lines) == {negative, "cuda-ptx"}, proc.stdout
        return
    # Only the deleted cache's check fails: the others still hit.
    for other in {"torch-compile", "aot-compile", "flashinfer-jit"} - {negative}:
        assert lines[other]["verdict"] == "PASS", proc.stdout


def test_the_device_run_stopped_by_its_budget_still_returns_its_logs(tmp_path):
    """The lent machine kills a command at 600 s, and what it had not packed with it: gpu-device-run.sh
    stops the check at its own budget (here 3 s, into the cold runs), packs what it has, and fails."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WARMER_GPU_CHECK_DIR": str(tmp_path / "work"),
           "WARMER_GPU_WHEELS": str(tmp_path / "no-wheels"), "WARMER_DEVICE_BUDGET_S": "3"}
    (tmp_path / "out").mkdir()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu-device-run.sh"), "--cpu"], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "gpu-device-run: FAIL" in proc.stdout, proc.stdout + proc.stderr
    with tarfile.open(tmp_path / "out" / "gpu-run.tar.gz") as tar:
        summary = tar.extractfile("./summary.txt").read().decode()
        assert "./check.log" in tar.getnames()
    assert "ran past the budget of 3 s" in summary and "NOT RUN" not in summary
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["gpu-run.tar.gz"]



def test_a_check_that_cannot_pack_still_reports_the_runs_before_it(tmp_path):
    """The device run is one shot: when `warmer pack` fails (here: the root holds nothing, as when
    every cold run failed), the report still holds what the cold runs and warm restarts did, and
    each process's log comes back beside it."""
    proc = gpu_check_sh(tmp_path / "work", "--cpu", "--checks", "triton-autotune", timeout=300)
    assert proc.returncode == gpu_check.EXIT_SETUP, proc.stdout + proc.stderr
    assert "warmer pack failed" in proc.stderr
    out = tmp_path / "out"
    report = json.loads((out / "gpu-check.json").read_text())
    assert "warmer pack failed" in report["error"] and report["exit_code"] == gpu_check.EXIT_SETUP
    assert set(report["cold"]) == set(report["warm"]) == {"triton-autotune"}
    for phase in ("cold", "warm"):
        assert (out / "gpu-check-logs" / phase / "triton-autotune" / "output.log").is_file()


def test_the_device_run_returns_each_processs_logs_when_the_check_wrote_no_report(tmp_path):
    """A check stopped by the budget or crashed copies no log beside a report: gpu-device-run.sh takes
    each process's output, result and compiler logs from the work dir itself. (Here the interpreter
    runs the check, then drops its report and exits as a killed process does.)"""
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\n"
                  f'{shlex.quote(sys.executable)} "$@"\nrc=$?\n'
                  'case "$1" in *gpu_check.py) rm -rf "$OUT/gpu-check.json" "$OUT/gpu-check-logs"; exit 137;; esac\n'
                  "exit $rc\n")
    py.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WARMER_GPU_CHECK_DIR": str(tmp_path / "work"),
           "WARMER_GPU_WHEELS": str(tmp_path / "no-wheels"), "PYTHON": str(py)}
    (tmp_path / "out").mkdir()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu-device-run.sh"), "--cpu", "--checks", "triton-autotune"],
                          cwd=str(REPO), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "the check exited 137" in proc.stdout, proc.stdout + proc.stderr
    with tarfile.open(tmp_path / "out" / "gpu-run.tar.gz") as tar:
        names = set(tar.getnames())
    for phase in ("cold", "warm"):
        assert f"./check/gpu-check-logs/{phase}/triton-autotune/output.log" in names, sorted(names)
        assert f"./check/gpu-check-logs/{phase}/triton-autotune/result.json" in names


def test_a_negative_control_the_budget_stops_makes_the_run_incomplete_not_failed(tmp_path):
    """A negative control killed by the budget proved nothing either way: it is said STOPPED and the
    run ends INCOMPLETE, not FAIL ("a cache's counters are blind"). (Here the interpreter passes the
    check at once, and each negative control outlasts a budget of 4 s.)"""
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\n"
                  'case "$*" in *gpu_check.py*--negative*) exec sleep 60;; *gpu_check.py*) echo "gpu-check: PASS"; '
                  "exit 0;; esac\n"
                  f'exec {shlex.quote(sys.executable)} "$@"\n')
    py.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WARMER_GPU_CHECK_DIR": str(tmp_path / "work"),
           "WARMER_GPU_WHEELS": str(tmp_path / "no-wheels"), "PYTHON": str(py), "WARMER_DEVICE_BUDGET_S": "4",
           "WARMER_DEVICE_NEGATIVE_S": "2"}
    (tmp_path / "out").mkdir()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu-device-run.sh"), "--cpu"], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "negative torch-compile: STOPPED by the budget of 4 s" in proc.stdout, proc.stdout
    assert "gpu-device-run: INCOMPLETE" in proc.stdout and "WRONG" not in proc.stdout, proc.stdout


def test_a_negative_control_of_a_check_not_run_is_refused_before_any_work(tmp_path):
    proc = gpu_check_sh(tmp_path / "work", "--cpu", "--checks", "flashinfer-jit", "--negative=torch-compile",
                        timeout=60)
    assert proc.returncode == 2 and "--negative=torch-compile deletes a cache of a check --checks leaves out" \
        in proc.stderr, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------- the wheels

NETWORK_TROUBLE = ("Network is unreachable", "Failed to establish a new connection", "Temporary failure in name",
                   "ConnectionError", "Max retries exceeded", "Read timed out")


def make_gpu_wheels(dest: Path, python_version: str) -> dict:
    proc = subprocess.run(["make", "-s", "gpu-wheels", f"PYTHON={sys.executable}", f"GPU_PYTHON={python_version}",
                           f"GPU_WHEELS_DIR={dest}"], cwd=str(REPO), capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 and any(s in proc.stdout + proc.stderr for s in NETWORK_TROUBLE):
        pytest.skip("PyPI is not reachable from here: " + (proc.stderr.strip().splitlines() or ["?"])[-1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((dest / "SET.json").read_text())


@pytest.fixture(scope="module")
def wheel_sets(tmp_path_factory):
    base = tmp_path_factory.mktemp("wheels")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    gpu = make_gpu_wheels(base / "gpu", "3.12")
    local = gpu if here == "3.12" else make_gpu_wheels(base / "here", here)
    return {"gpu": (base / "gpu", gpu), "here": (base / ("gpu" if here == "3.12" else "here"), local)}


def _names(doc: dict) -> dict[str, str]:
    return {w["file"].split("-")[0]: w["file"] for w in doc["wheels"]}


@pytest.mark.slow
def test_the_gpu_machines_wheel_set_fits_and_holds_what_it_lacks(wheel_sets):
    dest, doc = wheel_sets["gpu"]
    names = _names(doc)
    assert set(names) == {"flashinfer_python", "apache_tvm_ffi", "zstandard", "warmer", "jsonschema",
                          "jsonschema_specifications", "referencing", "rpds_py", "attrs"}
    # What vLLM 0.32's CUDA wheel pins, not the newer FlashInfer warmer's jit extra installs here.
    assert names["flashinfer_python"] == "flashinfer_python-0.7.0.post1-py3-none-any.whl"
    assert names["apache_tvm_ffi"].startswith("apache_tvm_ffi-0.1.11-") and doc["flashinfer"] == "0.7.0.post1"
    for dist in ("apache_tvm_ffi", "zstandard", "rpds_py"):
        tags = names[dist][:-len(".whl")].split("-")
        assert tags[2] in ("cp312", "cp39") and tags[3] in ("cp312", "abi3") and "manylinux" in tags[4]
        assert "x86_64" in tags[4]
    total = sum(p.stat().st_size for p in dest.glob("*.whl"))
    assert total == doc["total_bytes"] <= 60 * MIB
    tree = sum(os.path.getsize(REPO / f) for f in subprocess.run(
        ["git", "ls-files"], cwd=str(REPO), capture_output=True, text=True).stdout.split() if (REPO / f).is_file())
    assert tree + total < 64 * MIB, f"tree {tree / MIB:.1f} MiB + wheels {total / MIB:.1f} MiB"
    # The rewrite kept every file of the PyPI wheel: pip reads the LZMA members back as they were.
    with zipfile.ZipFile(dest / names["flashinfer_python"]) as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_LZMA}
        assert z.testzip() is None
    assert set(doc["left_out"]) >= {"ninja", "nvidia-cutlass-dsl", "nvidia-cudnn-frontend", "cuda-python"}


IMPORTS = """
import json, sys
import flashinfer, tvm_ffi, zstandard, warmer.cli
from flashinfer.jit import env as jit_env
from flashinfer.jit.attention.modules import gen_batch_decode_module
from flashinfer.autotuner import AutoTuner, autotune, set_autotune_process_group
from flashinfer.fused_moe.utils import get_hybrid_num_tokens_buckets
assert tuple(get_hybrid_num_tokens_buckets(128)) == (1, 2, 4, 8, 16, 32, 64, 128)
from flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper, mm_bf16
missing = []
for name in ("boto3", "cryptography", "einops", "cutlass", "cudnn", "click", "tabulate", "vllm"):
    try:
        __import__(name)
    except ImportError:
        missing.append(name)
print(json.dumps({"flashinfer": flashinfer.__file__, "tvm_ffi": tvm_ffi.__file__, "zstandard": zstandard.__file__,
                  "warmer": warmer.cli.__file__, "version": flashinfer.__version__, "absent": missing}))
"""


@pytest.fixture(scope="module")
def device_like(tmp_path_factory, wheel_sets):
    """A venv whose site-packages holds only the GPU machine's packages (linked from this Python), and
    this Python's wheel set installed offline into a target dir beside it."""
    base = tmp_path_factory.mktemp("device")
    subprocess.run([sys.executable, "-m", "venv", str(base / "venv")], check=True, timeout=300)
    py = base / "venv" / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    linked = gpu_wheels.device_site(Path(site))
    dest, _ = wheel_sets["here"]
    target = base / "site"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(target), *map(str, sorted(dest.glob("*.whl")))], check=True, timeout=900)
    return py, target, dest, linked


@pytest.mark.slow
def test_the_wheel_set_installs_offline_and_imports_beside_only_the_gpu_machines_packages(device_like, tmp_path):
    py, target, _, linked = device_like
    assert "torch" in linked["distributions"] and "flashinfer-python" not in linked["distributions"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([str(py), "-c", IMPORTS], env={**env, "PYTHONPATH": str(target), "HOME": str(tmp_path)},
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("flashinfer", "tvm_ffi", "zstandard", "warmer"):
        assert got[name].startswith(str(target)), got
    assert got["version"] == "0.7.0.post1"
    # What was left out is really absent there, and the imports above did not need it.
    assert set(got["absent"]) == {"boto3", "cryptography", "einops", "cutlass", "cudnn", "click", "tabulate", "vllm"}


@pytest.mark.slow
@cpu_flow
def test_gpu_check_runs_on_the_installed_wheels(device_like, tmp_path):
    """The script's own install path: the set in WARMER_GPU_WHEELS, pip --no-index --no-deps --target,
    FlashInfer's JIT built from the installed wheel, warmer's wheel packing and restoring."""
    py, _, dest, _ = device_like
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = gpu_check_sh(tmp_path / "work", "--cpu", "--checks", "flashinfer-jit", python=str(py),
                        env={**env, "WARMER_GPU_WHEELS": str(dest)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert lines_of(proc.stdout)["flashinfer-jit"]["verdict"] == "PASS"
    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    site = str(tmp_path / "work" / "site")
    assert report["warmer"].startswith(site), report["warmer"]
    cold = report["checks"][0]["cold"]
    assert cold["workspace"].startswith(str(tmp_path / "work" / "root"))


@pytest.mark.slow
def test_a_set_built_from_other_sources_runs_the_checkouts_warmer_not_its_wheel(device_like, tmp_path):
    """A set made before warmer's last change would test another warmer than the one it travels with:
    gpu-check.sh installs the set's other wheels and says so, and the checkout's warmer runs."""
    py, _, dest, _ = device_like
    assert gpu_wheels.stale(dest) is None  # made by `make gpu-wheels` from this checkout
    old = tmp_path / "old-set"
    shutil.copytree(dest, old)
    doc = json.loads((old / "SET.json").read_text())
    (old / "SET.json").write_text(json.dumps({**doc, "warmer_source": "0" * 64}))
    assert "built from other sources" in gpu_wheels.stale(old)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = gpu_check_sh(tmp_path / "work", "--cpu", "--checks", "no-such-check", python=str(py),
                        env={**env, "WARMER_GPU_WHEELS": str(old)})
    assert "this checkout's warmer runs instead" in proc.stderr, proc.stderr
    site = tmp_path / "work" / "site"
    assert (site / "flashinfer").is_dir() and not (site / "warmer").exists()


@pytest.mark.slow
def test_unpack_lays_the_set_out_as_pip_does_and_refuses_foreign_tags(device_like, wheel_sets, tmp_path):
    """gpu-check.sh's fallback for a Python without pip."""
    _, pip_target, dest, _ = device_like
    gpu_wheels.unpack(sorted(dest.glob("*.whl")), tmp_path / "site")

    def files(top: Path) -> set[str]:
        return {str(p.relative_to(top)) for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    ours, pips = files(tmp_path / "site"), files(pip_target)
    differ = {f for f in ours ^ pips if not (f.startswith("bin/") or ".dist-info/" in f)}
    assert not differ, sorted(differ)[:10]
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    if here != "cp312":
        gpu_dest, _ = wheel_sets["gpu"]
        with pytest.raises(gpu_wheels.WheelError, match="not a supported wheel"):
            gpu_wheels.unpack(sorted(gpu_dest.glob("*.whl")), tmp_path / "other")


def test_the_wheel_set_is_vllm_0_32s_flashinfer_and_the_newer_one_is_selectable():
    want = gpu_wheels.wanted()
    assert want == gpu_wheels.WANTED and gpu_wheels.DEFAULT_FLASHINFER == "0.7.0.post1"
    assert want[:2] == ("flashinfer-python==0.7.0.post1", "apache-tvm-ffi==0.1.11")
    other = gpu_wheels.wanted("0.7.2.post1")
    assert other[:2] == ("flashinfer-python==0.7.2.post1", "apache-tvm-ffi==0.1.15.post2")
    assert want[2:] == other[2:] and "zstandard==0.25.0" in want
    with pytest.raises(gpu_wheels.WheelError, match="no wheel set"):
        gpu_wheels.wanted("0.6.0")


# FlashInfer's real AutoTuner, driven as vLLM 0.32 drives it (load_configs, autotune(tune_mode=True),
# autotune(tuning_buckets=hybrid(128), round_up=True), save when dirty), with mm_bf16's tuning config
# and a stand-in runner whose profiling is faked: CPU evidence for what the H200 showed.
AUTOTUNER_PROBE = """
import json, sys
for m in ("cutlass", "cuda.bindings", "cudnn"):
    sys.modules[m] = None          # as on the GPU machine: no CuTe-DSL, so FlashInfer imports on a CPU
import torch
torch.cuda.is_current_stream_capturing = lambda: False
torch.cuda.synchronize = lambda *a, **k: None
import flashinfer
from flashinfer.autotuner import AutoTuner, TunableRunner, autotune
from flashinfer.fused_moe.utils import get_hybrid_num_tokens_buckets
from flashinfer.gemm import gemm_base

class Runner(TunableRunner):
    def get_cache_key_extras(self, inputs):
        return (inputs[0].shape[0],) if sys.argv[2] == "m" else ()   # cuBLASLt's runner keys by M
    def get_valid_tactics(self, inputs, profile):
        return [0, 1, 2]
    def forward(self, inputs, tactic=-1, do_preparation=False, **kw):
        return inputs[0] @ inputs[1]

AutoTuner._profile_single_kernel = lambda self, r, tensors, tactic, cfg, **kw: 1.0 + tactic
AutoTuner._prepare_input_tensors_with_batches = lambda self, tensors, cfg: [tensors]
tuner = AutoTuner.get()
loaded = tuner.load_configs(sys.argv[1]) if __import__("os").path.exists(sys.argv[1]) else None
inputs = [torch.randn(128, 64), torch.randn(64, 32), None, False, torch.empty(128, 32), torch.empty(16)]
with torch.inference_mode(), autotune(tune_mode=True):
    with autotune(tuning_buckets=tuple(get_hybrid_num_tokens_buckets(128)), round_up=True):
        tuner.choose_one("bf16_gemm", [Runner()], gemm_base._BF16_GEMM_SM100_TUNING_CONFIG, inputs)
tuned = sum(tuner.stats.tuned_op_successful_configs.values())
if tuner._dirty:
    tuner.save_configs(sys.argv[1])
print(json.dumps({"version": flashinfer.__version__, "loaded": loaded, "tuned": tuned}))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="no flashinfer here")
def test_the_autotuner_retunes_after_loading_its_file_as_the_h200_showed(tmp_path):
    """FlashInfer 0.7.2.post1: the second start re-tunes 7 of 8 buckets because the cuBLASLt runner's
    cache-key extras hold M: while tuning, every bucket is looked up with the real input's M, so
    only the bucket equal to it hits the loaded file. (0.7.0.post1, what vLLM 0.32 pins, skips v1
    file entries altogether while tuning a cold-L2 config such as mm_bf16's: 8 of 8.)"""
    # Another FlashInfer (its autotuner internals differ) skips; on the measured one (the `jit`
    # extra's pin) a probe that fails is a failure, not a skip.
    installed = importlib.metadata.version("flashinfer-python")
    if installed != "0.7.2.post1":
        pytest.skip(f"measured for flashinfer 0.7.2.post1, not {installed}")

    def start(keyed: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", AUTOTUNER_PROBE, str(tmp_path / f"{keyed}.json"), keyed],
                              capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
        assert proc.returncode == 0, proc.stderr.strip()[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    first = start("m")
    assert first["version"] == "0.7.2.post1"
    assert (first["loaded"], first["tuned"]) == (None, 8)
    assert start("m") == {"version": "0.7.2.post1", "loaded": True, "tuned": 7}
    start("none")
    assert start("none")["tuned"] == 0     # with synthesis-invariant extras the file serves every bucket
