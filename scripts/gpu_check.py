"""The prepared GPU check: warm, restart warm, pack, delete, restore, and prove the restored start
redoes no more than a warm restart on the build root does.

    python scripts/gpu_check.py [--cpu] [--quick] [--negative[=CHECK]] [--reuse] [--checks A,B]

(scripts/gpu-check.sh installs the carried wheels first, then runs this.)

1. Cold: each check runs in its own process with every cache env var under ROOT (warmer's
   cache_env), HOME, XDG_CACHE_HOME and TMPDIR in fresh directories, nvcc reachable only through a
   shadow CUDA toolkit whose bin/nvcc logs each call and runs the real one.
2. Warm restart (the control): each check again in a fresh process on ROOT itself, the same
   environment (nvcc still reachable), fresh HOME, XDG_CACHE_HOME and TMPDIR. What it redoes, every
   start redoes: no cache removes it.
3. `python -m warmer pack ROOT`, ROOT deleted, `python -m warmer restore` to the same path.
4. Restored: each check again in a fresh process with fresh HOME, XDG_CACHE_HOME and TMPDIR, and the
   shadow toolkit's bin/nvcc now a script that logs each call and exits 1.
5. One line per check: CHECK name: cold X s, warm restart W s, restored Y s (R x the warm restart),
   compiles N (warm restart N'), new files M (warm restart M'), PASS|FAIL. compiles counts what a
   process had to build or tune (Inductor FX-graph and AOTAutograd misses, AOT recompiles, Triton
   kernels compiled, Inductor benchmarks, FlashInfer autotune profiles, nvcc and host-compiler
   calls); new files counts files it wrote in ROOT and in its fresh HOME, XDG_CACHE_HOME and TMPDIR
   (lock files and the files warmer's components exclude by rule are not counted). A check passes
   only if its cold run compiled, its warm restart compiled less than the cold run on some counter
   (a cache removed something), its restored run compiled no more than the warm restart on every
   counter and wrote no file the warm restart did not, and all three computed the right numbers.
   Under a passing line, what the warm restart still redid: "every start redoes this: a cache does
   not remove it", each counter with its cost in seconds. Then a phase table per check and phase:
   interpreter start, import torch, CUDA context, work, exit.

--negative[=CHECK] deletes the cache CHECK depends on (default flashinfer-jit: the flashinfer
component) after the restore, before the restored run only (the warm restart ran on the intact
root); CHECK must then FAIL. Exit status: 0 all passed; 1 a check failed (expected with --negative),
or on a GPU a check was skipped; 2 the check could not run; 3 --negative did not make its check fail.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORK_SCRIPT = Path(__file__).resolve().parent / "gpu_check_work.py"
RECIPE = Path(__file__).resolve().parent / "gpu-check.toml"
try:  # the installed warmer (the carried wheel) when there is one, as on a node; else this checkout
    from warmer import components
except ImportError:
    sys.path.append(str(REPO))
    from warmer import components

CHECKS = ("torch-compile", "aot-compile", "flashinfer-jit", "flashinfer-autotune", "triton-autotune")
ALL_LINES = CHECKS + ("cuda-ptx",)
# What --negative=CHECK deletes: the env var warmer points at the cache, and a part under it.
NEGATIVE = {
    "torch-compile": ("TORCHINDUCTOR_CACHE_DIR", ""),
    "aot-compile": ("VLLM_CACHE_ROOT", "torch_compile_cache"),
    "flashinfer-jit": ("FLASHINFER_WORKSPACE_BASE", ""),
    "flashinfer-autotune": ("VLLM_CACHE_ROOT", "flashinfer_autotune_cache"),
    "triton-autotune": ("TRITON_CACHE_DIR", ""),
    "cuda-ptx": ("CUDA_CACHE_PATH", ""),
}
DEFAULT_NEGATIVE = "flashinfer-jit"
MARKER = ".warmer-gpu-check"
HOST_COMPILERS = ("gcc", "g++", "cc", "c++", "clang", "clang++")
NVCC_PROBES = {"--version", "-V", "--list-gpu-arch", "--list-gpu-code", "--help", "-h"}
HOST_PROBES = {"--version", "-v", "-V", "-dumpversion", "-dumpfullversion", "-dumpmachine", "-dumpspecs"}
IGNORED = ("*.lock", "*/locks/*", "locks/*", "*.tmp", "*.tmp.*", "*.partial")
EXIT_FAIL, EXIT_SETUP, EXIT_NEGATIVE_INEFFECTIVE = 1, 2, 3
SPAWN_ENV = "WARMER_GPU_CHECK_SPAWN_TS"   # gpu_check_work.py reads it: time.time() at the spawn
PHASES = ("cold", "warm", "restored")
PHASE_NAMES = {"cold": "cold", "warm": "warm restart", "restored": "restored"}
REDONE = "every start redoes this: a cache does not remove it"


class SetupError(Exception):
    """The check cannot run here (no toolkit, unusable work dir, ...)."""


# ---------------------------------------------------------------------------------------- tools

def _which(name: str, path: str) -> str | None:
    found = shutil.which(name, path=path)
    return os.path.realpath(found) if found else None


def real_toolkit(env: dict) -> Path | None:
    """The CUDA toolkit FlashInfer would use without the shadow: CUDA_HOME or CUDA_PATH, the
    toolkit of the nvcc on PATH, /usr/local/cuda; the first that has bin/nvcc and the CUDA headers."""
    cands = [env.get("CUDA_HOME"), env.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc", path=env.get("PATH", ""))
    if nvcc:
        cands += [os.path.dirname(os.path.dirname(nvcc)),
                  os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    cands.append("/usr/local/cuda")
    for cand in cands:
        if (cand and Path(cand, "bin", "nvcc").exists() and Path(cand, "include", "cuda_runtime.h").exists()
                and not Path(cand, MARKER).exists()):
            return Path(cand)
    return None


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def make_shadow_toolkit(shadow: Path, real: Path | None) -> None:
    """CUDA_HOME for both phases: the real toolkit's headers and libraries, and a bin/ with nvcc only."""
    if shadow.exists():
        shutil.rmtree(shadow)
    (shadow / "bin").mkdir(parents=True)
    (shadow / MARKER).write_text("a shadow CUDA toolkit made by scripts/gpu_check.py\n")
    if real is not None:
        for entry in ("include", "lib", "lib64", "targets", "extras"):
            if (real / entry).exists():
                (shadow / entry).symlink_to(os.path.realpath(real / entry))


def set_nvcc(shadow: Path, real: Path | None, phase: str, version_file: Path | None) -> None:
    """bin/nvcc: in the cold phase it logs and runs the real nvcc; in the restored phase it logs and fails.

    version_file (CPU runs only): torch has no CUDA version there for FlashInfer to fall back on
    when nvcc fails, so `nvcc --version` is answered with what the real nvcc printed cold. No other
    call is answered: nothing can be compiled."""
    log = 'printf \'%s\\n\' "$*" >> "${WARMER_GPU_CHECK_LOG:-/dev/null}/nvcc.log" 2>/dev/null\n'
    if phase == "cold":   # the cold run and the warm restart
        if real is None:
            body = 'echo "gpu-check: no CUDA toolkit on this machine" >&2\nexit 1\n'
        else:
            body = _timed_call(shlex.quote(str(real / "bin" / "nvcc")), "nvcc.times", "")
    else:
        body = ""
        if version_file is not None:
            body += (f'if [ "$*" = "--version" ]; then cat {shlex.quote(str(version_file))}; exit 0; fi\n')
        body += ('echo "nvcc is unreachable in the restored phase of warmer\'s gpu-check: $*" >&2\nexit 1\n')
    _script(shadow / "bin" / "nvcc", f"#!/bin/sh\n# gpu-check nvcc, {phase} phase\n{log}{body}")


def _timed_call(real: str, times_file: str, prefix: str) -> str:
    """Shell lines that run real with the shim's arguments and log 'START END ARGS' to times_file."""
    return ('t0=$(date +%s.%N)\n'
            f'{real} "$@"\nrc=$?\n'
            f'printf \'%s %s {prefix}%s\\n\' "$t0" "$(date +%s.%N)" "$*" '
            f'>> "${{WARMER_GPU_CHECK_LOG:-/dev/null}}/{times_file}" 2>/dev/null\n'
            'exit $rc\n')


def make_host_compiler_shims(shims: Path, path: str) -> list[str]:
    """gcc, g++, cc, c++ (those present): log each call, then run the real compiler. Both phases."""
    if shims.exists():
        shutil.rmtree(shims)
    shims.mkdir(parents=True)
    made = []
    for name in HOST_COMPILERS:
        real = _which(name, path)
        if real:
            _script(shims / name, "#!/bin/sh\n"
                    f'printf \'{name} %s\\n\' "$*" >> "${{WARMER_GPU_CHECK_LOG:-/dev/null}}/cc.log" 2>/dev/null\n'
                    + _timed_call(shlex.quote(real), "cc.times", f"{name} "))
            made.append(name)
    return made


def _nvcc_probe(args: list[str]) -> bool:
    return bool(args) and set(args) <= NVCC_PROBES


def _host_probe(args: list[str]) -> bool:
    return "-E" in args or (bool(args) and set(args) <= HOST_PROBES) or any(a.startswith("-print-") for a in args)


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The wall time covered by (start, end) spans: parallel or nested calls (ninja's jobs, the
    host compiler nvcc runs) are counted once."""
    total, reach = 0.0, None
    for t0, t1 in sorted(spans):
        if reach is None or t0 > reach:
            total += max(t1 - t0, 0.0)
            reach = t1
        elif t1 > reach:
            total += t1 - reach
            reach = t1
    return round(total, 3)


def _compile_seconds(path: Path, probe, skip_name: bool) -> float:
    """Wall seconds spent in compiles (not probes) from a shim's 'START END ARGS' log."""
    spans = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            try:
                t0, t1 = float(parts[0]), float(parts[1])
            except (IndexError, ValueError):   # a date without %N, or a torn line
                continue
            if not probe(parts[3:] if skip_name else parts[2:]):
                spans.append((t0, t1))
    return busy_seconds(spans)


def read_calls(log_dir: Path) -> dict:
    """Compiler calls from the shims' logs: compiles and probes (version queries, preprocessing),
    and the seconds the compiles took (where the shim ran the real compiler)."""
    out = {"nvcc_compiles": 0, "nvcc_probes": 0, "host_compiles": 0, "host_probes": 0, "examples": []}
    nvcc = log_dir / "nvcc.log"
    if nvcc.exists():
        for line in nvcc.read_text().splitlines():
            if _nvcc_probe(line.split()):
                out["nvcc_probes"] += 1
            else:
                out["nvcc_compiles"] += 1
                out["examples"].append(f"nvcc {line}"[:300])
    cc = log_dir / "cc.log"
    if cc.exists():
        for line in cc.read_text().splitlines():
            if _host_probe(line.split()[1:]):
                out["host_probes"] += 1
            else:
                out["host_compiles"] += 1
                out["examples"].append(line[:300])
    out["examples"] = out["examples"][:5]
    out["nvcc_compile_s"] = _compile_seconds(log_dir / "nvcc.times", _nvcc_probe, False)
    out["host_compile_s"] = _compile_seconds(log_dir / "cc.times", _host_probe, True)
    return out


# --------------------------------------------------------------------------------------- census

def snapshot(top: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under top, by relative path: the census verify takes."""
    from warmer.verify import snapshot as census  # warmer comes from PYTHONPATH or the wheels

    return census(top)


def _ignored(rel: str) -> bool:
    return any(fnmatch.fnmatch(rel, p) for p in IGNORED)


def _excluded_by_component(rel: str) -> bool:
    """A file its component's own rules name as not cache (FlashInfer's log and lock dir, vLLM's
    dummy_cache ...). A file in a component's directory that the component merely does not take
    (say, scratch in the root's TMPDIR beside Inductor's headers) is counted: warmer would lose it."""
    head, _, inner = rel.partition("/")
    comp = next((c for c in components.ALL if c.subdir == head), None)
    return comp is not None and any(fnmatch.fnmatch(inner, p) for p in getattr(comp, "exclude", ()))


def root_delta(before: dict, after: dict) -> list[str]:
    changed = [p for p in after if p not in before or after[p] != before[p]]
    return sorted(p for p in changed if not _ignored(p) and not _excluded_by_component(p))


def fresh_files(dirs: dict[str, Path]) -> list[str]:
    found = []
    for label, d in dirs.items():
        found += [f"${label}/{rel}" for rel in snapshot(d) if not _ignored(rel)]
    return sorted(found)


# ------------------------------------------------------------------------------------------ run

class Runner:
    def __init__(self, opts):
        self.opts = opts
        self.device = "cpu" if opts.cpu else "cuda"
        self.work = opts.work
        self.root = self.work / "root"
        self.shadow = self.work / "cuda"
        self.shims = self.work / "shims"
        self.stub = self.work / "stub"
        self.nvcc_version = self.work / "nvcc-version.txt"
        self.deadline = time.monotonic() + opts.budget
        self.base_env = dict(os.environ)
        self.real_cuda = real_toolkit(self.base_env)
        self.cache_env = components.cache_env(self.root)
        self.tool_path = self._tool_path()

    def _tool_path(self) -> str:
        """PATH without any directory holding nvcc; the interpreter's own bin first, as in a venv."""
        dirs = [d for d in self.base_env.get("PATH", "").split(os.pathsep)
                if d and not os.path.exists(os.path.join(d, "nvcc"))]
        py_bin = os.path.dirname(sys.executable)
        if not os.path.exists(os.path.join(py_bin, "nvcc")):
            dirs = [py_bin] + [d for d in dirs if d != py_bin]
        return os.pathsep.join(dirs)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    # --- environment
    def env(self, run_dir: Path | None, *, log: bool = True) -> dict:
        env = dict(self.base_env)
        for var in list(self.cache_env) + ["CUDA_HOME", "CUDA_PATH", "FLASHINFER_NVCC", "XDG_CONFIG_HOME",
                                           "XDG_DATA_HOME", "XDG_STATE_HOME", "TRITON_HOME"]:
            env.pop(var, None)
        env.update(self.cache_env)
        env["CUDA_HOME"] = str(self.shadow)
        env["PATH"] = os.pathsep.join([str(self.shims), str(self.shadow / "bin"), self.tool_path])
        # Every Triton compile in the measured process, where the compilation listener sees it; the
        # setting is not in Inductor's cache key (it is on its ignore list).
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        if self.device == "cpu":
            env.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
            flags = env.get("FLASHINFER_EXTRA_LDFLAGS", "")
            env["FLASHINFER_EXTRA_LDFLAGS"] = f"{flags} -L{self.stub}".strip()
        if run_dir is not None:
            fresh = self.fresh_dirs(run_dir)
            for d in fresh.values():
                d.mkdir(parents=True, exist_ok=True)
            env["HOME"] = str(fresh["HOME"])
            env["XDG_CACHE_HOME"] = str(fresh["XDG_CACHE_HOME"])
            if "TMPDIR" in fresh:
                env["TMPDIR"] = str(fresh["TMPDIR"])
            if log:
                (run_dir / "log").mkdir(parents=True, exist_ok=True)
                env["WARMER_GPU_CHECK_LOG"] = str(run_dir / "log")
        return env

    def fresh_dirs(self, run_dir: Path) -> dict[str, Path]:
        dirs = {"HOME": run_dir / "home", "XDG_CACHE_HOME": run_dir / "xdg-cache"}
        # warmer points TMPDIR under the root (Inductor's precompiled headers live there); then the
        # restored TMPDIR is the restored one, as fresh as the artifact, and the root census covers it.
        if "TMPDIR" not in self.cache_env:
            dirs["TMPDIR"] = run_dir / "tmp"
        return dirs

    # --- set-up
    def prepare(self) -> None:
        work = self.work
        if work.exists() and any(work.iterdir()) and not (work / MARKER).exists():
            raise SetupError(f"{work} is not empty and was not made by gpu-check: choose another --work")
        work.mkdir(parents=True, exist_ok=True)
        (work / MARKER).write_text("work directory of scripts/gpu_check.py\n")
        make_shadow_toolkit(self.shadow, self.real_cuda)
        self.host_compilers = make_host_compiler_shims(self.shims, self.tool_path)
        if self.device == "cpu":
            self.stub.mkdir(exist_ok=True)
            cc = _which("gcc", self.tool_path) or _which("cc", self.tool_path)
            if cc is None:
                raise SetupError("no C compiler to build the libcuda stub a GPU-less link needs")
            subprocess.run([cc, "-shared", "-o", str(self.stub / "libcuda.so"), "-x", "c", "/dev/null"], check=True)
            if self.real_cuda is not None:
                out = subprocess.run([str(self.real_cuda / "bin" / "nvcc"), "--version"], capture_output=True,
                                     text=True)
                self.nvcc_version.write_text(out.stdout)

    def applicable(self) -> dict[str, str]:
        """Checks that cannot run here, with the reason (they are reported SKIP)."""
        skip = {}
        if self.device == "cpu":
            skip["flashinfer-autotune"] = "the autotuner profiles kernels on a GPU (--cpu)"
        if self.real_cuda is None:
            for c in ("flashinfer-jit", "flashinfer-autotune"):
                skip.setdefault(c, "no CUDA toolkit (nvcc) on this machine for FlashInfer's JIT")
        try:
            import importlib.util
            if importlib.util.find_spec("flashinfer") is None:
                for c in ("flashinfer-jit", "flashinfer-autotune"):
                    skip.setdefault(c, "flashinfer is not installed (make gpu-wheels, then carry .whl)")
        except (ImportError, ValueError):
            pass
        return skip

    # --- one check in one process
    def run_check(self, phase: str, check: str) -> dict:
        run_dir = self.work / "runs" / phase / check
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        env = self.env(run_dir)
        result_file = run_dir / "result.json"
        cmd = [sys.executable, str(WORK_SCRIPT), check, "--device", self.device, "--out", str(result_file)]
        if self.opts.quick:
            cmd.append("--quick")
        timeout = self.left()
        if timeout < 10:
            return {"error": f"out of time: the run's budget of {self.opts.budget:.0f} s is spent", "wall_s": 0.0}
        before = snapshot(self.root)
        t0 = time.monotonic()
        env[SPAWN_ENV] = repr(time.time())   # the child's interpreter start is measured from here
        with open(run_dir / "output.log", "w") as log:
            try:
                proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                      cwd=str(run_dir))
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = None
        exited = time.time()
        wall = round(time.monotonic() - t0, 2)
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        phases = result.setdefault("phases", {})
        if isinstance(result.get("end_ts"), (int, float)):
            phases["exit_s"] = round(exited - result["end_ts"], 3)
        if rc is None:
            result["error"] = f"out of time after {wall:.0f} s (budget {self.opts.budget:.0f} s)"
        elif rc != 0 and "error" not in result:
            result["error"] = f"exit status {rc}"
        if "error" in result:
            result["output_tail"] = (run_dir / "output.log").read_text()[-3000:]
        result["wall_s"] = wall
        result["calls"] = read_calls(run_dir / "log")
        result["root_new_files"] = root_delta(before, snapshot(self.root))
        result["outside_new_files"] = fresh_files(self.fresh_dirs(run_dir))
        return result

    # --- warmer
    def warmer(self, *args: str) -> dict:
        env = self.env(None, log=False)
        env["PYTHONPATH"] = os.pathsep.join([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
                                            + [str(REPO)])
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "warmer", *args, "--json"], env=env, capture_output=True,
                                  text=True, timeout=max(self.left(), 30))
        except subprocess.TimeoutExpired as e:   # a SetupError: the runs so far are still reported
            raise SetupError(f"warmer {args[0]} ran past the budget ({e.timeout:.0f} s)") from None
        wall = round(time.monotonic() - t0, 2)
        if proc.returncode != 0:
            raise SetupError(f"warmer {args[0]} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
        doc = json.loads(proc.stdout)
        doc["wall_s"] = wall
        return doc


# ---------------------------------------------------------------------------------------- judge

def compiles(r: dict) -> dict:
    """Everything one process built or tuned, by kind."""
    replayed = r.get("replayed", {}).get("inductor", {})   # what an FX-graph-cache hit adds back, not work
    ind = {k: v - replayed.get(k, 0) for k, v in r.get("counters", {}).get("inductor", {}).items()}
    aot = r.get("counters", {}).get("aot_autograd", {})
    calls = r.get("calls", {})
    tunings = (ind.get("select_algorithm_autotune", 0) + ind.get("coordesc_tuning_bench", 0)
               + sum(v for k, v in ind.items() if k.startswith("benchmarking.")))
    parts = {
        "fxgraph_cache_miss": ind.get("fxgraph_cache_miss", 0),
        "fxgraph_cache_bypass": ind.get("fxgraph_cache_bypass", 0),   # compiled, and not cacheable
        "autograd_cache_miss": aot.get("autograd_cache_miss", 0),
        "autograd_cache_bypass": aot.get("autograd_cache_bypass", 0),
        "aot_recompiled": r.get("aot_compiled", 0),
        "triton_kernels_compiled": r.get("triton", {}).get("compiled", 0),
        "inductor_benchmarks": tunings,
        "inductor_precompiles": ind.get("select_algorithm_num_precompiles", 0),
        "flashinfer_autotune_profiles": r.get("autotune_profiles_tuned", 0),
        "triton_autotune_benchmarks": r.get("triton_autotune_benchmarks", 0),
        "nvcc_compiles": calls.get("nvcc_compiles", 0),
        "host_compiles": calls.get("host_compiles", 0),
    }
    return {k: v for k, v in parts.items() if v}


def written(r: dict) -> list[str]:
    """The files one process wrote: in ROOT (relative) and in its fresh dirs ($HOME/..., ...)."""
    return list(r.get("root_new_files", [])) + list(r.get("outside_new_files", []))


# What a counter cost, from what the process measured: (where from, seconds). Inductor's sections
# nest (precompiling inside compile_fx_inner), so the costs of different counters may overlap.
def cost(r: dict, counter: str) -> tuple[str, float | None]:
    timings = r.get("timings", {})

    def sections(*suffixes: str) -> float | None:
        found = [v for k, v in timings.items() if k.endswith(suffixes)]
        return round(sum(found), 3) if found else None
    if counter in ("inductor_benchmarks", "inductor_precompiles"):
        return "Inductor's autotuning and precompiling sections", sections("_template_autotuning",
                                                                         "_template_precompiling")
    if counter in ("fxgraph_cache_miss", "fxgraph_cache_bypass", "autograd_cache_miss", "autograd_cache_bypass"):
        return "compile_fx_inner", sections("compile_fx_inner")
    if counter == "triton_kernels_compiled":
        return "Triton's compile times", r.get("triton", {}).get("compile_s")
    if counter == "aot_recompiled":
        return "aot_compile", r.get("aot_compile_s")
    if counter == "flashinfer_autotune_profiles":
        return "the autotune block", r.get("autotune_s")
    if counter == "triton_autotune_benchmarks":
        return "the first launch", r.get("triton_autotune_s")
    if counter in ("nvcc_compiles", "host_compiles"):
        return "the compiler shim", r.get("calls", {}).get(counter.replace("compiles", "compile_s"))
    return "not measured", None


def cause(counter: str, r: dict) -> str | None:
    """Why every start redoes a kind of work, read from the source of the version that ran it."""
    if counter == "flashinfer_autotune_profiles":
        if str(r.get("flashinfer", "")).startswith("0.7.0"):
            return ("FlashInfer 0.7.0's AutoTuner.search_cache ignores the loaded file in tune mode when a "
                    "config asks for another profiling policy than the default (\"Persisted v1 entries do not "
                    "record per-entry replay/L2 policy\": use_file_config = not (self.is_tuning_mode and "
                    "requested_policy != default_policy)); mm_bf16 tunes with use_cold_l2_cache=True, and "
                    "vLLM 0.32 calls autotune(tune_mode=True) on every start (kernel_warmup.py), file or not")
        return ("FlashInfer's cuBLASLt runner keys a result by the exact M it was measured at "
                "(gemm_base.py, CublasltBf16GemmRunner.get_cache_key_extras: a.shape[0]) while tune mode looks "
                "each bucket up with the caller's M, so only the bucket equal to the call's M is found in the "
                "loaded file; vLLM 0.32 calls autotune(tune_mode=True) on every start (kernel_warmup.py)")
    if counter in ("inductor_benchmarks", "inductor_precompiles") and not r.get("replays_kept_apart"):
        return ("possibly not work: on an FX-graph-cache hit Inductor adds back the counters recorded at "
                "compile time (codecache.py, FxGraphCache.cache_hit_post_compile), and this torch could not "
                "be hooked to keep them apart")
    return None


def rework(warm: dict | None, restored: dict | None = None) -> list[dict]:
    """What the warm restart on the build root redid (so every start redoes it, and no cache can
    remove it): counter, count and seconds, with the restored run's for comparison."""
    if not warm:
        return []
    done = compiles(restored or {})
    out = []
    for counter, n in compiles(warm).items():
        source, seconds = cost(warm, counter)
        item = {"counter": counter, "count": n, "seconds": seconds, "cost_from": source,
                "cause": cause(counter, warm)}
        if restored is not None:
            item["restored_count"] = done.get(counter, 0)
            item["restored_seconds"] = cost(restored, counter)[1] if done.get(counter) else 0.0
        out.append(item)
    return out


def rework_line(item: dict) -> str:
    sec = f"{item['seconds']:.1f} s" if isinstance(item.get("seconds"), (int, float)) else "seconds not measured"
    line = f"{item['counter']} {item['count']}, {sec}"
    if "restored_count" in item:
        rs = item.get("restored_seconds")
        line += f" (restored {item['restored_count']}" + (f", {rs:.1f} s)" if isinstance(rs, (int, float)) else ")")
    return line


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["?"])[0][:300]


def judge(check: str, device: str, cold: dict, warm: dict | None, restored: dict | None) -> tuple[str, list[str]]:
    """(verdict, reasons). PASS only when: the cold run compiled (what the check is about); the warm
    restart on the build root compiled less than the cold run on some counter (a cache removed
    something); the restored run compiled no more than the warm restart on every counter and wrote
    no file the warm restart did not; and every phase computed the right numbers."""
    reasons = []
    for phase, r in (("cold", cold), ("warm", warm), ("restored", restored)):
        if r is not None and "error" in r:
            reasons.append(f"{PHASE_NAMES[phase]} run failed: {_first_line(r['error'])}")
    if "error" in cold:
        return "FAIL", reasons
    cc = compiles(cold)
    if not cc:
        reasons.append("the cold run compiled nothing, so a restored run that compiles nothing proves nothing")
    if check == "torch-compile" and device == "cuda":
        ind = cold.get("counters", {}).get("inductor", {})
        if not ind.get("select_algorithm_autotune"):
            reasons.append("max-autotune made no benchmarked kernel choice in the cold run")
        if not cold.get("triton", {}).get("compiled"):
            reasons.append("the cold run compiled no Triton kernel" + ("" if cold.get("triton_listener")
                                                                         else " (no Triton compilation listener)"))
    if check == "aot-compile" and not cold.get("aot_compiled"):
        reasons.append("the cold run did not AOT-compile (an AOT file was already there?)")
    if check == "flashinfer-jit" and not cold.get("calls", {}).get("nvcc_compiles"):
        reasons.append("the cold run called nvcc for no compile: FlashInfer built nothing")
    if check == "flashinfer-autotune" and not (cold.get("autotune_profiles_tuned") and cold.get("autotune_saved")):
        reasons.append("the cold run tuned and saved nothing")
    if check == "triton-autotune" and not (
            cold.get("triton_autotune_benchmarks") and cold.get("triton_autotune_cache")):
        reasons.append("the cold run benchmarked no config, or Triton's autotuner kept no results on disk "
                       "(TRITON_CACHE_AUTOTUNING, which vLLM 0.32 sets)")
    if warm is None:
        reasons.append("no warm restart")
    if restored is None:
        reasons.append("no restored run")
    if warm is None or restored is None:
        return "FAIL", reasons
    for phase, r in (("warm", warm), ("restored", restored)):
        if r.get("skipped") and not cold.get("skipped"):
            reasons.append(f"the {PHASE_NAMES[phase]} skipped what the cold run did: {r['skipped']}")
    wc, rc = compiles(warm), compiles(restored)
    if cc and "error" not in warm and not any(v > wc.get(k, 0) for k, v in cc.items()):
        reasons.append("the warm restart redid everything the cold run compiled ("
                       + ", ".join(f"{k} {v}" for k, v in cc.items()) + "): no cache removed any of it")
    more = {k: v for k, v in rc.items() if v > wc.get(k, 0)}
    if more:
        reasons.append("the restored run compiled more than the warm restart: "
                       + ", ".join(f"{k} {v} (warm restart {wc.get(k, 0)})" for k, v in more.items()))
        reasons += [f"  {e}" for e in restored.get("calls", {}).get("examples", [])[:2]]
    new_r, new_w = written(restored), set(written(warm))
    extra = sorted(set(new_r) - new_w)
    if extra or len(new_r) > len(new_w):
        reasons.append(f"the restored run wrote {len(new_r)} file(s) (warm restart {len(new_w)}), "
                       f"{len(extra)} the warm restart did not, e.g. {', '.join(extra[:3]) or '-'}")
    if check == "aot-compile" and not restored.get("aot_loaded"):
        reasons.append("the restored run loaded no AOT-compiled function: "
                       + restored.get("aot_load_failure", "there was no file to load"))
    if check == "flashinfer-autotune":
        if not restored.get("autotune_loaded"):
            reasons.append("the restored run found no autotune file to load")
        if restored.get("autotune_saved") and not warm.get("autotune_saved"):
            reasons.append("the restored run re-saved the autotune file and the warm restart did not")
    for phase, r in (("cold", cold), ("warm", warm), ("restored", restored)):
        if "max_err" in cold and "max_err" not in r and "error" not in r:
            reasons.append(f"the {PHASE_NAMES[phase]} computed nothing to compare with the eager reference")
        if "max_err" in r and not r["max_err"] <= r.get("tolerance", 0):
            reasons.append(f"{PHASE_NAMES[phase]} results differ from the eager reference: max error "
                           f"{r['max_err']:.3g}")
    return ("FAIL" if reasons else "PASS"), reasons


def judge_ptx(cache_env: dict, root: Path, cold: dict, restored: dict, device: str,
              warm: dict | None = None) -> dict:
    """(e) The CUDA driver's PTX JIT cache: applicable only if a cold run left entries in it. The
    restored runs may JIT-compile only what the warm restarts also did."""
    path = cache_env.get("CUDA_CACHE_PATH")
    line = {"name": "cuda-ptx", "cold_s": None, "warm_s": None, "restored_s": None, "compiles": None,
            "new_files": None}
    if device != "cuda":
        return {**line, "verdict": "N/A", "reasons": ["no CUDA driver (--cpu)"]}
    if not path:
        return {**line, "verdict": "N/A", "reasons": ["warmer sets no CUDA_CACHE_PATH"]}
    rel = os.path.relpath(path, root)

    def entries(runs: dict) -> list[str]:   # the driver's index file alone is no JIT-compiled kernel
        return sorted({f for r in runs.values() for f in r.get("root_new_files", [])
                       if f.startswith(rel + "/") and f != f"{rel}/index"})
    cold_entries = entries(cold)
    if not cold_entries:
        return {**line, "verdict": "N/A", "compiles": 0, "new_files": 0,
                "reasons": ["the driver JIT-compiled no PTX in the cold runs (CUDA_CACHE_PATH stayed empty): "
                            "every kernel above carried SASS for this GPU"]}
    again = entries(warm or {})
    new = [f for f in entries(restored) if f not in again]
    return {**line, "compiles": len(new), "new_files": len(new), "cold_entries": len(cold_entries),
            "warm_entries": len(again), "verdict": "FAIL" if new else "PASS",
            "reasons": [f"the driver JIT-compiled PTX again: {', '.join(new[:3])}"] if new else []}


def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def summary_line(c: dict) -> str:
    ratio = c.get("ratio")
    return (f"CHECK {c['name']}: cold {_fmt(c['cold_s'])} s, warm restart {_fmt(c.get('warm_s'))} s, "
            f"restored {_fmt(c['restored_s'])} s ({'-' if ratio is None else f'{ratio:.2f}'}x the warm restart), "
            f"compiles {_fmt(c['compiles'])} (warm restart {_fmt(c.get('warm_compiles'))}), "
            f"new files {_fmt(c['new_files'])} (warm restart {_fmt(c.get('warm_new_files'))}), {c['verdict']}")


def ratio(restored_s, warm_s) -> float | None:
    """The restored run's wall time over the warm restart's."""
    if not isinstance(restored_s, (int, float)) or not isinstance(warm_s, (int, float)) or warm_s <= 0:
        return None
    return round(restored_s / warm_s, 3)


PHASE_COLUMNS = (("interpreter_s", "start"), ("import_s", "torch"), ("cuda_s", "cuda"), ("work_s", "work"),
                 ("exit_s", "exit"))


def phase_row(r: dict, device: str) -> dict:
    """One process's phases in seconds: interpreter start, import torch, CUDA context ('n/a' on the
    CPU), work, exit, and the wall time the parent measured around it."""
    ph = r.get("phases", {})
    row = {label: ph.get(key) for key, label in PHASE_COLUMNS}
    if device != "cuda":
        row["cuda"] = "n/a"
    row["wall"] = r.get("wall_s")
    return row


def phase_table(lines: list[dict]) -> list[str]:
    """Where each check's processes spend their time, compactly: one row per check and phase."""
    heads = [label for _, label in PHASE_COLUMNS] + ["wall"]
    out = [f"{'PHASES (s)':<36}" + "".join(f"{h:>7}" for h in heads)]
    for c in lines:
        for phase, row in c.get("phases", {}).items():
            cells = "".join(f"{(f'{v:.2f}' if isinstance(v, (int, float)) else (v or '-')):>7}"
                            for v in (row.get(h) for h in heads))
            out.append(f"{c['name'] + ' ' + PHASE_NAMES[phase]:<36}{cells}")
    return out


def check_line(check: str, device: str, cold: dict, warm: dict | None, restored: dict | None) -> dict:
    """The report of one check: its verdict against the warm restart, the re-work, the phases."""
    verdict, reasons = judge(check, device, cold, warm, restored)
    w, r = warm or {}, restored or {}
    return {"name": check, "cold_s": cold.get("wall_s"), "warm_s": w.get("wall_s"), "restored_s": r.get("wall_s"),
            "ratio": ratio(r.get("wall_s"), w.get("wall_s")),
            "compiles": sum(compiles(r).values()), "new_files": len(written(r)),
            "warm_compiles": sum(compiles(w).values()), "warm_new_files": len(written(w)),
            "verdict": verdict, "reasons": reasons, "rework": rework(warm, restored),
            "compiled_cold": compiles(cold), "compiled_warm": compiles(w), "compiled_restored": compiles(r),
            "phases": {p: phase_row(x, device) for p, x in (("cold", cold), ("warm", warm), ("restored", restored))
                       if x},
            "cold": cold, "warm": w, "restored": r}


# ----------------------------------------------------------------------------------------- main

def parse(argv: list[str]):
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on this CPU (FlashInfer modules built, not run)")
    p.add_argument("--quick", action="store_true", help="smaller work: no prefill op (aims at <= 4.5 minutes)")
    p.add_argument("--negative", nargs="?", const=DEFAULT_NEGATIVE, choices=ALL_LINES, metavar="CHECK",
                   help=f"delete CHECK's cache after the restore; CHECK must FAIL (default {DEFAULT_NEGATIVE})")
    p.add_argument("--reuse", action="store_true",
                   help="reuse the cold runs, warm restarts and artifact a previous run left in --work (same "
                   "mode, the same checks or some of them)")
    p.add_argument("--checks", help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--work", type=Path,
                   default=Path(os.environ.get("WARMER_GPU_CHECK_DIR")
                                or os.path.join(os.environ.get("TMPDIR", "/tmp"), "warmer-gpu-check")))
    p.add_argument("--budget", type=float, help="seconds for the whole run (default 420, --quick 240, --cpu 900)")
    p.add_argument("--json", dest="json_out", type=Path, help="also write the report here "
                   "(default: $OUT/gpu-check.json when OUT is set)")
    opts = p.parse_args(argv)
    opts.work = opts.work.absolute()
    if opts.budget is None:
        opts.budget = 900.0 if opts.cpu else (240.0 if opts.quick else 420.0)
    checks = CHECKS if not opts.checks else tuple(c.strip() for c in opts.checks.split(",") if c.strip())
    bad = [c for c in checks if c not in CHECKS]
    if bad:
        p.error(f"unknown check(s) {bad}; choose from {', '.join(CHECKS)}")
    if opts.negative in CHECKS and opts.negative not in checks:  # said before the work, not after it
        p.error(f"--negative={opts.negative} deletes a cache of a check --checks leaves out: add it to --checks")
    opts.check_list = checks
    return opts


def main(argv: list[str]) -> int:
    opts = parse(argv)
    t_start = time.monotonic()
    run = Runner(opts)
    report: dict = {"device": run.device, "quick": opts.quick, "work": str(opts.work), "root": str(run.root),
                    "python": sys.version.split()[0], "warmer": os.path.dirname(components.__file__),
                    "checks": []}
    try:
        run.prepare()
    except SetupError as e:
        print(f"gpu-check: cannot run: {e}", file=sys.stderr)
        return EXIT_SETUP
    report["cuda_toolkit"] = str(run.real_cuda) if run.real_cuda else None
    report["cuda_home_shadow"] = str(run.shadow)
    report["host_compiler_shims"] = run.host_compilers
    report["fresh_dirs"] = sorted(run.fresh_dirs(Path("RUN")))
    skip = run.applicable()
    todo = [c for c in opts.check_list if c not in skip]
    state_file = opts.work / "state.json"
    mode = {"device": run.device, "quick": opts.quick, "checks": list(todo)}
    artifact = opts.work / "artifact.tar.zst"
    cold: dict[str, dict] = {}
    warm: dict[str, dict] = {}
    reused = False
    if opts.reuse and state_file.exists() and artifact.exists():
        state = json.loads(state_file.read_text())
        saved = state.get("mode", {})
        # A subset of the saved run's checks reuses theirs (scripts/gpu-device-run.sh: one negative each).
        if ({k: saved.get(k) for k in ("device", "quick")} == {"device": run.device, "quick": opts.quick}
                and set(todo) <= set(saved.get("checks", ())) and "warm" in state):
            cold = {c: state["cold"][c] for c in todo}
            warm = {c: state["warm"][c] for c in todo}
            report["pack"], reused = state["pack"], True
            print(f"gpu-check: reusing the cold runs, warm restarts and artifact in {opts.work}")
    if opts.reuse and not reused:
        print("gpu-check: nothing to reuse for this mode: running cold")

    try:
        if not reused:
            state_file.unlink(missing_ok=True)
            for d in (run.root, opts.work / "runs"):
                if d.exists():
                    shutil.rmtree(d)
            run.root.mkdir(parents=True)
            # As warmer's warm-up does (warmup.prepare_root): a TMPDIR that does not exist is silently
            # replaced by /tmp, and Inductor's precompiled headers would escape the root.
            for path in run.cache_env.values():
                Path(path).mkdir(parents=True, exist_ok=True)
            set_nvcc(run.shadow, run.real_cuda, "cold", None)
            for check in todo:
                print(f"gpu-check: cold {check} ...", flush=True)
                cold[check] = run.run_check("cold", check)
            # The control: the same work restarted on the build root itself, in the same environment.
            for check in todo:
                print(f"gpu-check: warm restart {check} ...", flush=True)
                warm[check] = run.run_check("warm", check)
            pack = run.warmer("pack", str(run.root), "--recipe", str(RECIPE), "-o", str(artifact))
            report["pack"] = pack
            state_file.write_text(json.dumps({"mode": mode, "cold": cold, "warm": warm, "pack": pack}, default=str))
        print(f"gpu-check: packed {report['pack'].get('files')} files, {report['pack'].get('archive_bytes')} bytes",
              flush=True)
        if run.root.exists():
            shutil.rmtree(run.root)
        report["restore"] = run.warmer("restore", str(artifact), "--root", str(run.root))
        if opts.negative:
            var, sub = NEGATIVE[opts.negative]
            target = Path(run.cache_env[var], sub) if var in run.cache_env else None
            head = os.path.relpath(target, run.root).split(os.sep)[0] if target else None
            comp = next((c for c in components.ALL if c.subdir == head), None)
            if target is None:
                print(f"gpu-check: --negative={opts.negative}: warmer sets no {var}", file=sys.stderr)
                return EXIT_SETUP
            existed = target.exists()
            shutil.rmtree(target, ignore_errors=True)
            report["negative"] = {"check": opts.negative, "deleted": str(target), "existed": existed,
                                  "component": comp.name if comp else None}
            print(f"gpu-check: negative control: deleted {target} (component {comp.name if comp else '?'}, "
                  f"{var}{'/' + sub if sub else ''}) before the restored run (the warm restart had it)", flush=True)
        set_nvcc(run.shadow, run.real_cuda, "restored", run.nvcc_version if run.device == "cpu" else None)
        if "flashinfer-jit" in todo:
            try:
                from warmer.components import flashinfer as fi
                report["flashinfer_ninja_dry_run"] = fi.dry_run(run.root, run.env(None, log=False))
            except Exception as e:  # evidence only; the restored run is the check
                report["flashinfer_ninja_dry_run"] = {"error": str(e)}
        restored: dict[str, dict] = {}
        for check in todo:
            print(f"gpu-check: restored {check} ...", flush=True)
            restored[check] = run.run_check("restored", check)
    except SetupError as e:
        print(f"gpu-check: cannot run: {e}", file=sys.stderr)
        # A pack that failed because every cold run failed (nothing to pack) says nothing of why they
        # did: what each process said, and its logs, are the evidence of a one-shot device run.
        for phase, runs in (("cold", cold), ("warm", warm)):
            for check, r in runs.items():
                if "error" in r:
                    print(f"  {PHASE_NAMES[phase]} {check} failed: {_first_line(r['error'])}")
        report.update({"error": str(e), "cold": cold, "warm": warm, "reused_cold": reused, "exit_code": EXIT_SETUP,
                       "total_s": round(time.monotonic() - t_start, 1)})
        write_report(opts, report)
        return EXIT_SETUP

    lines = []
    for check in opts.check_list:
        if check in skip:
            lines.append({"name": check, "cold_s": None, "restored_s": None, "compiles": None, "new_files": None,
                          "verdict": "SKIP", "reasons": [skip[check]]})
            continue
        c = cold.get(check, {})
        if c.get("skipped"):
            lines.append({"name": check, "cold_s": c.get("wall_s"), "restored_s": None, "compiles": None,
                          "new_files": None, "verdict": "SKIP", "reasons": [c["skipped"]], "cold": c})
            continue
        lines.append(check_line(check, run.device, c, warm.get(check), restored.get(check)))
    lines.append(judge_ptx(run.cache_env, run.root, cold, restored, run.device, warm))

    exit_code = 0 if all(c["verdict"] in ("PASS", "N/A", "SKIP") for c in lines) else EXIT_FAIL
    if run.device == "cuda" and any(c["verdict"] == "SKIP" for c in lines):
        exit_code = EXIT_FAIL   # on the GPU machine every check must run: a SKIP there proves nothing
    print()
    for c in lines:
        print(summary_line(c))
        if c["verdict"] != "PASS":
            for reason in c["reasons"][:4]:
                print(f"  {reason}")
        if c.get("rework"):
            print(f"  {REDONE}: " + "; ".join(rework_line(i) for i in c["rework"]))
            for why in dict.fromkeys(i["cause"] for i in c["rework"] if i.get("cause")):
                print(f"    because {why}")
    table = phase_table(lines)
    if len(table) > 1:
        print()
        print("\n".join(table))
    if opts.negative:
        named = next(c for c in lines if c["name"] == opts.negative)
        if named["verdict"] == "FAIL":
            print(f"NEGATIVE CONTROL {opts.negative}: FAIL as expected with {report['negative']['deleted']} deleted")
            exit_code = EXIT_FAIL
        else:
            print(f"NEGATIVE CONTROL {opts.negative}: {named['verdict']}, not FAIL: its counters did not see "
                  "the missing cache")
            exit_code = EXIT_NEGATIVE_INEFFECTIVE
    report["checks"] = lines
    report["summary_lines"] = [summary_line(c) for c in lines]
    report["phase_table"] = table
    report["reused_cold"] = reused
    report["total_s"] = round(time.monotonic() - t_start, 1)
    report["exit_code"] = exit_code
    print(f"gpu-check: {'PASS' if exit_code == 0 else 'FAIL'} in {report['total_s']:.0f} s "
          f"({'cold reused, ' if reused else ''}report {opts.work / 'gpu-check.json'})")
    write_report(opts, report)
    return exit_code


def write_report(opts, report: dict) -> None:
    """The report into the work dir, and into $OUT (or --json) with each process's logs beside it."""
    text = json.dumps(report, indent=1, default=str)
    (opts.work / "gpu-check.json").write_text(text)
    out = opts.json_out or (Path(os.environ["OUT"]) / "gpu-check.json" if os.environ.get("OUT") else None)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        # Each process's output and compiler-call logs beside the report (small text files).
        logs = out.parent / (out.stem + "-logs")
        for f in sorted((opts.work / "runs").glob("*/*/output.log")) + sorted((opts.work / "runs").glob("*/*/log/*.log")):
            dest = logs / f.relative_to(opts.work / "runs")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
