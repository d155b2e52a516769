"""scripts/gpu-check.sh on this CPU machine (--cpu: the same flow, FlashInfer modules built by the
real nvcc but not run), its negative controls, and the wheel set `make gpu-wheels` carries to the
GPU machine, installed offline into an environment that holds only that machine's packages."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402
import gpu_wheels  # noqa: E402

LINE = re.compile(r"^CHECK (?P<name>[a-z-]+): cold (?P<cold>[\d.]+|-) s, restored (?P<restored>[\d.]+|-) s, "
                  r"compiles (?P<compiles>\d+|-), new files (?P<new>\d+|-), (?P<verdict>PASS|FAIL|N/A|SKIP)$")
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


def test_a_check_whose_cold_run_compiled_nothing_cannot_pass():
    nothing = {"calls": {}, "counters": {}, "root_new_files": [], "outside_new_files": []}
    verdict, reasons = gpu_check.judge("torch-compile", "cpu", nothing, dict(nothing))
    assert verdict == "FAIL" and "compiled nothing" in reasons[0]
    cold = {**nothing, "counters": {"inductor": {"fxgraph_cache_miss": 1}}}
    assert gpu_check.judge("torch-compile", "cpu", cold, dict(nothing)) == ("PASS", [])
    assert gpu_check.judge("torch-compile", "cpu", cold, {**nothing, "outside_new_files": ["$HOME/.x"]})[0] == "FAIL"
    assert gpu_check.judge("torch-compile", "cpu", cold, {**nothing, "max_err": 1.0, "tolerance": 1e-4})[0] == "FAIL"


def test_the_ptx_check_is_na_unless_a_cold_run_left_driver_jit_entries(tmp_path):
    env = {"CUDA_CACHE_PATH": str(tmp_path / "cuda")}
    none = {"a": {"root_new_files": ["inductor/x.py", "cuda/index"]}}
    assert gpu_check.judge_ptx(env, tmp_path, none, {"a": {}}, "cuda")["verdict"] == "N/A"
    cold = {"a": {"root_new_files": ["cuda/index", "cuda/ab/cd"]}}
    assert gpu_check.judge_ptx(env, tmp_path, cold, {"a": {"root_new_files": []}}, "cuda")["verdict"] == "PASS"
    again = gpu_check.judge_ptx(env, tmp_path, cold, {"a": {"root_new_files": ["cuda/ab/cd"]}}, "cuda")
    assert (again["verdict"], again["compiles"]) == ("FAIL", 1)
    assert gpu_check.judge_ptx(env, tmp_path, cold, {}, "cpu")["verdict"] == "N/A"


def test_summary_line_format():
    line = gpu_check.summary_line({"name": "aot-compile", "cold_s": 12.34, "restored_s": 3.0, "compiles": 0,
                                   "new_files": 0, "verdict": "PASS"})
    assert line == "CHECK aot-compile: cold 12.3 s, restored 3.0 s, compiles 0, new files 0, PASS"
    assert LINE.match(line)


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
    assert list(lines) == ["torch-compile", "aot-compile", "flashinfer-jit", "flashinfer-autotune", "cuda-ptx"]
    for name in ("torch-compile", "aot-compile", "flashinfer-jit"):
        assert lines[name]["verdict"] == "PASS", proc.stdout
        assert (lines[name]["compiles"], lines[name]["new"]) == ("0", "0")
    assert lines["flashinfer-autotune"]["verdict"] == "SKIP" and lines["cuda-ptx"]["verdict"] == "N/A"
    report = json.loads((work.parent / "out" / "gpu-check.json").read_text())
    by_name = {c["name"]: c for c in report["checks"]}
    # What the cold runs built, and where: everything under the root, nothing outside it.
    assert by_name["flashinfer-jit"]["compiled_cold"]["nvcc_compiles"] >= 3
    assert by_name["torch-compile"]["compiled_cold"]["fxgraph_cache_miss"] >= 1
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
    work, first = cpu_run
    assert first.returncode == 0, first.stdout + first.stderr
    args = ["--negative"] if negative == gpu_check.DEFAULT_NEGATIVE else [f"--negative={negative}"]
    proc = gpu_check_sh(work, "--cpu", "--reuse", *args)
    assert proc.returncode == gpu_check.EXIT_FAIL, proc.stdout + proc.stderr
    assert "reusing the cold runs" in proc.stdout
    lines = lines_of(proc.stdout)
    assert lines[negative]["verdict"] == "FAIL", proc.stdout
    assert int(lines[negative]["compiles"]) > 0 and int(lines[negative]["new"]) > 0
    assert f"NEGATIVE CONTROL {negative}: FAIL as expected" in proc.stdout
    # Only the deleted cache's check fails: the others still hit.
    for other in {"torch-compile", "aot-compile", "flashinfer-jit"} - {negative}:
        assert lines[other]["verdict"] == "PASS", proc.stdout


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
    assert names["flashinfer_python"] == "flashinfer_python-0.7.2.post1-py3-none-any.whl"
    for dist in ("apache_tvm_ffi", "zstandard", "rpds_py"):
        tags = names[dist][:-len(".whl")].split("-")
        assert tags[2] == "cp312" and tags[3] in ("cp312", "abi3") and "manylinux" in tags[4] and "x86_64" in tags[4]
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
from flashinfer.autotuner import AutoTuner, autotune
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
    assert got["version"] == "0.7.2.post1"
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
