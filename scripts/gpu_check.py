"""The prepared GPU check: warm, pack, delete, restore, and prove the restored start compiles nothing.

    python scripts/gpu_check.py [--cpu] [--quick] [--negative[=CHECK]] [--reuse] [--checks A,B]

(scripts/gpu-check.sh installs the carried wheels first, then runs this.)

1. Cold: each check runs in its own process with every cache env var under ROOT (warmer's
   cache_env), HOME, XDG_CACHE_HOME and TMPDIR in fresh directories, nvcc reachable only through a
   shadow CUDA toolkit whose bin/nvcc logs each call and runs the real one.
2. `python -m warmer pack ROOT`, ROOT deleted, `python -m warmer restore` to the same path.
3. Restored: each check runs again in a fresh process with fresh HOME, XDG_CACHE_HOME and TMPDIR,
   and the shadow toolkit's bin/nvcc now a script that logs each call and exits 1.
4. One line per check: CHECK name: cold X s, restored Y s, compiles N, new files M, PASS|FAIL.
   compiles counts everything the restored process had to build or tune (Inductor FX-graph and
   AOTAutograd misses, AOT recompiles, Triton kernels compiled, Inductor benchmarks, FlashInfer
   autotune profiles, nvcc and host-compiler calls); new files counts files the restored process
   wrote in ROOT and in its fresh HOME, XDG_CACHE_HOME and TMPDIR (lock files and the files
   warmer's components exclude by rule are not counted). A check passes only if its cold run did
   compile (else the restored zero proves nothing), and its restored run compiled nothing, wrote
   nothing, and computed the right numbers.

--negative[=CHECK] deletes the cache CHECK depends on (default flashinfer-jit: the flashinfer
component) after the restore; CHECK must then FAIL. Exit status: 0 all passed; 1 a check failed
(expected with --negative), or on a GPU a check was skipped; 2 the check could not run; 3 --negative
did not make its check fail.
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

CHECKS = ("torch-compile", "aot-compile", "flashinfer-jit", "flashinfer-autotune")
ALL_LINES = CHECKS + ("cuda-ptx",)
# What --negative=CHECK deletes: the env var warmer points at the cache, and a part under it.
NEGATIVE = {
    "torch-compile": ("TORCHINDUCTOR_CACHE_DIR", ""),
    "aot-compile": ("VLLM_CACHE_ROOT", "torch_compile_cache"),
    "flashinfer-jit": ("FLASHINFER_WORKSPACE_BASE", ""),
    "flashinfer-autotune": ("VLLM_CACHE_ROOT", "flashinfer_autotune_cache"),
    "cuda-ptx": ("CUDA_CACHE_PATH", ""),
}
DEFAULT_NEGATIVE = "flashinfer-jit"
MARKER = ".warmer-gpu-check"
HOST_COMPILERS = ("gcc", "g++", "cc", "c++", "clang", "clang++")
NVCC_PROBES = {"--version", "-V", "--list-gpu-arch", "--list-gpu-code", "--help", "-h"}
HOST_PROBES = {"--version", "-v", "-V", "-dumpversion", "-dumpfullversion", "-dumpmachine", "-dumpspecs"}
IGNORED = ("*.lock", "*/locks/*", "locks/*", "*.tmp", "*.tmp.*", "*.partial")
EXIT_FAIL, EXIT_SETUP, EXIT_NEGATIVE_INEFFECTIVE = 1, 2, 3


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
    if phase == "cold":
        if real is None:
            body = 'echo "gpu-check: no CUDA toolkit on this machine" >&2\nexit 1\n'
        else:
            body = f"exec {shlex.quote(str(real / 'bin' / 'nvcc'))} \"$@\"\n"
    else:
        body = ""
        if version_file is not None:
            body += (f'if [ "$*" = "--version" ]; then cat {shlex.quote(str(version_file))}; exit 0; fi\n')
        body += ('echo "nvcc is unreachable in the restored phase of warmer\'s gpu-check: $*" >&2\nexit 1\n')
    _script(shadow / "bin" / "nvcc", f"#!/bin/sh\n# gpu-check nvcc, {phase} phase\n{log}{body}")


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
                    f"exec {shlex.quote(real)} \"$@\"\n")
            made.append(name)
    return made


def read_calls(log_dir: Path) -> dict:
    """Compiler calls from the shims' logs: compiles and probes (version queries, preprocessing)."""
    out = {"nvcc_compiles": 0, "nvcc_probes": 0, "host_compiles": 0, "host_probes": 0, "examples": []}
    nvcc = log_dir / "nvcc.log"
    if nvcc.exists():
        for line in nvcc.read_text().splitlines():
            args = line.split()
            if args and set(args) <= NVCC_PROBES:
                out["nvcc_probes"] += 1
            else:
                out["nvcc_compiles"] += 1
                out["examples"].append(f"nvcc {line}"[:300])
    cc = log_dir / "cc.log"
    if cc.exists():
        for line in cc.read_text().splitlines():
            args = line.split()[1:]
            if "-E" in args or (args and set(args) <= HOST_PROBES) or any(a.startswith("-print-") for a in args):
                out["host_probes"] += 1
            else:
                out["host_compiles"] += 1
                out["examples"].append(line[:300])
    out["examples"] = out["examples"][:5]
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
        with open(run_dir / "output.log", "w") as log:
            try:
                proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                      cwd=str(run_dir))
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = None
        wall = round(time.monotonic() - t0, 2)
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
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
        proc = subprocess.run([sys.executable, "-m", "warmer", *args, "--json"], env=env, capture_output=True,
                              text=True, timeout=max(self.left(), 30))
        wall = round(time.monotonic() - t0, 2)
        if proc.returncode != 0:
            raise SetupError(f"warmer {args[0]} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
        doc = json.loads(proc.stdout)
        doc["wall_s"] = wall
        return doc


# ---------------------------------------------------------------------------------------- judge

def compiles(r: dict) -> dict:
    """Everything one process built or tuned, by kind."""
    ind = r.get("counters", {}).get("inductor", {})
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
        "flashinfer_autotune_profiles": r.get("autotune_profiles_tuned", 0),
        "nvcc_compiles": calls.get("nvcc_compiles", 0),
        "host_compiles": calls.get("host_compiles", 0),
    }
    return {k: v for k, v in parts.items() if v}


def judge(check: str, device: str, cold: dict, restored: dict | None) -> tuple[str, list[str]]:
    """(verdict, reasons): PASS only when the cold run compiled and the restored run neither compiled,
    nor wrote, nor computed wrong numbers."""
    reasons = []
    for phase, r in (("cold", cold), ("restored", restored)):
        if r is None:
            continue
        if "error" in r:
            first = r["error"].strip().splitlines()[0] if r["error"].strip() else "?"
            reasons.append(f"{phase} run failed: {first[:300]}")
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
    if restored is None:
        return "FAIL", reasons + ["no restored run"]
    rc = compiles(restored)
    if rc:
        reasons.append("the restored run compiled: " + ", ".join(f"{k} {v}" for k, v in rc.items()))
        reasons += [f"  {e}" for e in restored.get("calls", {}).get("examples", [])[:2]]
    new = restored.get("root_new_files", []) + restored.get("outside_new_files", [])
    if new:
        reasons.append(f"the restored run wrote {len(new)} file(s), e.g. {', '.join(new[:3])}")
    if check == "aot-compile" and not restored.get("aot_loaded"):
        reasons.append("the restored run loaded no AOT-compiled function: "
                       + restored.get("aot_load_failure", "there was no file to load"))
    if check == "flashinfer-autotune":
        if not restored.get("autotune_loaded"):
            reasons.append("the restored run found no autotune file to load")
        if restored.get("autotune_saved"):
            reasons.append("the restored run re-saved the autotune file (it tuned again)")
    for phase, r in (("cold", cold), ("restored", restored)):
        if "max_err" in r and not r["max_err"] <= r.get("tolerance", 0):
            reasons.append(f"{phase} results differ from the eager reference: max error {r['max_err']:.3g}")
    return ("FAIL" if reasons else "PASS"), reasons


def judge_ptx(cache_env: dict, root: Path, cold: dict, restored: dict, device: str) -> dict:
    """(e) The CUDA driver's PTX JIT cache: applicable only if a cold run left entries in it."""
    path = cache_env.get("CUDA_CACHE_PATH")
    line = {"name": "cuda-ptx", "cold_s": None, "restored_s": None, "compiles": None, "new_files": None}
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
    new = entries(restored)
    return {**line, "compiles": len(new), "new_files": len(new), "cold_entries": len(cold_entries),
            "verdict": "FAIL" if new else "PASS",
            "reasons": [f"the driver JIT-compiled PTX again: {', '.join(new[:3])}"] if new else []}


def _fmt(v, unit: str = "") -> str:
    if v is None:
        return "-"
    return f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}"


def summary_line(c: dict) -> str:
    return (f"CHECK {c['name']}: cold {_fmt(c['cold_s'])} s, restored {_fmt(c['restored_s'])} s, "
            f"compiles {_fmt(c['compiles'])}, new files {_fmt(c['new_files'])}, {c['verdict']}")


# ----------------------------------------------------------------------------------------- main

def parse(argv: list[str]):
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on this CPU (FlashInfer modules built, not run)")
    p.add_argument("--quick", action="store_true", help="smaller work: no prefill op (aims at <= 4 minutes)")
    p.add_argument("--negative", nargs="?", const=DEFAULT_NEGATIVE, choices=ALL_LINES, metavar="CHECK",
                   help=f"delete CHECK's cache after the restore; CHECK must FAIL (default {DEFAULT_NEGATIVE})")
    p.add_argument("--reuse", action="store_true",
                   help="reuse the cold runs and artifact a previous run left in --work (same mode)")
    p.add_argument("--checks", help=f"comma-separated subset of {','.join(CHECKS)}")
    p.add_argument("--work", type=Path,
                   default=Path(os.environ.get("WARMER_GPU_CHECK_DIR")
                                or os.path.join(os.environ.get("TMPDIR", "/tmp"), "warmer-gpu-check")))
    p.add_argument("--budget", type=float, help="seconds for the whole run (default 420, --quick 210, --cpu 900)")
    p.add_argument("--json", dest="json_out", type=Path, help="also write the report here "
                   "(default: $OUT/gpu-check.json when OUT is set)")
    opts = p.parse_args(argv)
    opts.work = opts.work.absolute()
    if opts.budget is None:
        opts.budget = 900.0 if opts.cpu else (210.0 if opts.quick else 420.0)
    checks = CHECKS if not opts.checks else tuple(c.strip() for c in opts.checks.split(",") if c.strip())
    bad = [c for c in checks if c not in CHECKS]
    if bad:
        p.error(f"unknown check(s) {bad}; choose from {', '.join(CHECKS)}")
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
    reused = False
    if opts.reuse and state_file.exists() and artifact.exists():
        state = json.loads(state_file.read_text())
        if state.get("mode") == mode:
            cold, report["pack"], reused = state["cold"], state["pack"], True
            print(f"gpu-check: reusing the cold runs and artifact in {opts.work}")
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
            pack = run.warmer("pack", str(run.root), "--recipe", str(RECIPE), "-o", str(artifact))
            report["pack"] = pack
            state_file.write_text(json.dumps({"mode": mode, "cold": cold, "pack": pack}, default=str))
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
                  f"{var}{'/' + sub if sub else ''}) before the restored run", flush=True)
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
        return EXIT_SETUP

    lines = []
    for check in opts.check_list:
        if check in skip:
            lines.append({"name": check, "cold_s": None, "restored_s": None, "compiles": None, "new_files": None,
                          "verdict": "SKIP", "reasons": [skip[check]]})
            continue
        c, r = cold.get(check, {}), restored.get(check)
        if c.get("skipped"):
            lines.append({"name": check, "cold_s": c.get("wall_s"), "restored_s": None, "compiles": None,
                          "new_files": None, "verdict": "SKIP", "reasons": [c["skipped"]], "cold": c})
            continue
        verdict, reasons = judge(check, run.device, c, r)
        r = r or {}
        lines.append({"name": check, "cold_s": c.get("wall_s"), "restored_s": r.get("wall_s"),
                      "compiles": sum(compiles(r).values()),
                      "new_files": len(r.get("root_new_files", [])) + len(r.get("outside_new_files", [])),
                      "verdict": verdict, "reasons": reasons, "compiled_cold": compiles(c),
                      "compiled_restored": compiles(r), "cold": c, "restored": r})
    lines.append(judge_ptx(run.cache_env, run.root, cold, restored, run.device))

    exit_code = 0 if all(c["verdict"] in ("PASS", "N/A", "SKIP") for c in lines) else EXIT_FAIL
    if run.device == "cuda" and any(c["verdict"] == "SKIP" for c in lines):
        exit_code = EXIT_FAIL   # on the GPU machine every check must run: a SKIP there proves nothing
    print()
    for c in lines:
        print(summary_line(c))
        if c["verdict"] != "PASS":
            for reason in c["reasons"][:4]:
                print(f"  {reason}")
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
    report["reused_cold"] = reused
    report["total_s"] = round(time.monotonic() - t_start, 1)
    report["exit_code"] = exit_code
    print(f"gpu-check: {'PASS' if exit_code == 0 else 'FAIL'} in {report['total_s']:.0f} s "
          f"({'cold reused, ' if reused else ''}report {opts.work / 'gpu-check.json'})")
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
    return exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
