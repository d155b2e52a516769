"""Drive vLLM in a child process with every cache under the root, and read its log.

vLLM is never imported here: warmer.workload runs in the child, after the env is set.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from warmer import components
from warmer.recipe import Recipe


class WarmupError(Exception):
    """The engine did not start or the workload failed; the message carries the log's tail."""


# vLLM 0.32.0 format strings (research/vllm-caches.md §3), tolerant of older wordings.
TIMINGS = {
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    "compilation_s": r"\(compilation: ([\d.]+) s",
    "load_weights_s": r"Loading weights took ([\d.]+) seconds",
    "model_loading_s": r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds",
    "torch_compile_s": r"torch\.compile (?:and initial profiling/warmup run together )?(?:took|takes) ([\d.]+) s in total",
    "dynamo_s": r"Dynamo bytecode transform time: ([\d.]+) s",
    "profiling_warmup_s": r"Initial profiling/warmup run took ([\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) secs",
}
EVENTS = {
    # evidence of compiling
    "aot_load_failure": r"Compiling model again due to a load failure",
    "graph_compiled": r"Compiling a graph for (?:compile range|dynamic shape)",
    "aot_saved": r"saved AOT compiled function to",
    "flashinfer_autotune": r"Running FlashInfer autotune with",
    # evidence of hits
    "aot_loaded": r"Directly load AOT compilation from path",
    "graph_loaded": r"Directly load the compiled graph",
}
RECOMPILE_EVENTS = ("aot_load_failure", "graph_compiled", "aot_saved")
STAMP = r"(\d\d-\d\d \d\d:\d\d:\d\d)"


def parse_log(text: str) -> dict:
    """Phase timings (seconds, the last value of each) and event counts from a vLLM log."""
    timings = {}
    for name, pattern in TIMINGS.items():
        found = re.findall(pattern, text)
        if found:
            timings[name] = float(found[-1])
    # The CPU runner logs its compile warm-up as two lines; their timestamps give its length.
    start = re.search(STAMP + r".*Warming up model for the compilation", text)
    done = re.search(STAMP + r".*Warming up done", text)
    if start and done:
        t0, t1 = (datetime.strptime(m.group(1), "%m-%d %H:%M:%S") for m in (start, done))
        timings["cpu_compile_warmup_s"] = (t1 - t0).total_seconds()
    events = {name: len(re.findall(pattern, text)) for name, pattern in EVENTS.items()}
    return {"timings": timings, "events": events}


def serve_env(recipe: Recipe, root: Path) -> dict[str, str]:
    """What vLLM must start with, at build and at serve time alike: caches under root, recipe env."""
    env = components.cache_env(root)
    # TMPDIR points under the root (for Inductor's precompiled headers), and vLLM's IPC sockets
    # would follow it: under a long root their paths overflow the 107-byte limit of a Unix
    # socket. VLLM_RPC_BASE_PATH moves them back and is outside vLLM's compile key.
    env["VLLM_RPC_BASE_PATH"] = "/tmp"
    env.update(recipe.env)
    return env


def serving_environ(recipe: Recipe, root: Path) -> dict[str, str]:
    """This process's environment as vLLM will see it: what tools run on vLLM's behalf use."""
    return {**os.environ, **serve_env(recipe, root)}


def prepare_root(root: Path) -> None:
    """Create every cache directory: a TMPDIR that does not exist is silently replaced by /tmp."""
    for var, path in components.cache_env(root).items():
        Path(path).mkdir(parents=True, exist_ok=True)


@dataclass
class EngineRun:
    result: dict        # what the child measured (import, engine init, workload)
    log: dict           # parse_log of its output
    wall_s: float       # process start to exit
    log_path: Path


def run_engine(recipe: Recipe, root: Path, workdir: Path, label: str) -> EngineRun:
    """Start vLLM on root in a fresh process, run the workload, and return what was measured."""
    prepare_root(root)
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path, log_path = (workdir / f"{label}.{ext}" for ext in ("spec.json", "result.json", "log"))
    spec = {"model": recipe.model, "engine": dict(recipe.engine), "workload": recipe.workload.spec()}
    if recipe.revision:
        spec["engine"].setdefault("revision", recipe.revision)
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path.unlink(missing_ok=True)
    env = {**serving_environ(recipe, root), "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "warmer.workload", str(spec_path), str(result_path)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=recipe.workload.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise WarmupError(f"{label}: the engine ran past workload.timeout_s={recipe.workload.timeout_s}; "
                              f"log: {log_path}") from None
        finally:
            # vLLM's spawned workers must not outlive the run.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    wall = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    if rc != 0 or not result_path.exists():
        tail = "\n".join(text.splitlines()[-25:])
        raise WarmupError(f"{label}: the engine exited with code {rc}; log: {log_path}\n{tail}")
    return EngineRun(json.loads(result_path.read_text()), parse_log(text), round(wall, 3), log_path)


def timings(run: EngineRun) -> dict:
    """One flat record of a run's timings, for artifact.json and reports."""
    return {"process_s": run.wall_s, **run.result, **run.log["timings"]}
