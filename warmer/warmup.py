"""Drive vLLM in a child process with every cache under the root, and read its log.

vLLM is never imported here: warmer.workload runs in the child, after the env is set. The child
runs with HOME and XDG_CACHE_HOME in a sandbox under the build's workdir, so that a cache no
component covers lands somewhere warmer looks: the census lists every file
written outside a component, in the root or in the sandbox.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from warmer import components, restore, serving, vllmkey
from warmer.components import flashinfer
from warmer.errors import UsageError, WarmerError
from warmer.recipe import Recipe


class WarmupError(WarmerError):
    """The engine did not start or the workload failed; the message carries the log's tail."""


# vLLM 0.32.0's log format strings (vllm/compilation/decorators.py, backends.py, monitor.py,
# v1/engine/core.py), tolerant of older wordings.
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
JIT_EVENT = r"(?:Triton kernel|CuTeDSL|TileLang) JIT compilation during inference: [^\s(]+?(?=\.?(?:\s|$))"
EVENTS = {
    # evidence of compiling
    "aot_load_failure": r"Compiling model again due to a load failure",
    "graph_compiled": r"Compiling a graph for (?:compile range|dynamic shape)",
    "aot_saved": r"saved AOT compiled function to",
    "flashinfer_autotune": r"Running FlashInfer autotune with",
    # FlashInfer (flashinfer/jit/core.py build, jit/cubin_loader.py download)
    "flashinfer_jit_build": r"Building JIT module",
    "flashinfer_cubin_download": r"File downloaded successfully: |Fetching \S+ from http",
    # vLLM's JIT monitor (vllm/utils/jit_monitor.py), on in its GPU worker after warm-up: each Triton,
    # CuTe DSL or TileLang compile from then on (_handle_jit_event's "%s %s during inference"; warn
    # mode logs each message once), and Triton's own line for an autotune its cache lacked.
    "jit_monitor_activated": r"Kernel JIT monitor activated",
    "jit_compile_after_warmup": JIT_EVENT,
    "triton_autotune_after_warmup": r"Triton autotuning for function",
    # evidence of hits
    "aot_loaded": r"Directly load AOT compilation from path",
    "graph_loaded": r"Directly load the compiled graph",
}
# Where a start's time goes, from the arrival time of each line (run_engine prefixes "[+S.mmm] "):
# each marker begins the phase it names, which lasts until the next marker. Phases that recur
# (a Dynamo trace per compiled frame) add up. (phase, pattern), in no particular order.
PHASE_MARKERS = (
    ("engine start", r"Initializing a V1 LLM engine"),
    ("weights", r"Starting to load model"),
    ("model set-up", r"Loading weights took|Model loading took"),
    ("warm-up run", r"Warming up model for the compilation|Compiling a graph for|Directly load AOT compilation"),
    ("Dynamo trace", r"torchdynamo start tracing"),
    ("graph load or compile", r"torchdynamo done tracing|Dynamo bytecode transform time"),
    ("warm-up run", r"done compiler function|Directly load the compiled graph|torch\.compile took"),
    # With AOT off, vLLM times the compile and the profiling run as one (compilation/decorators.py).
    (
        "KV cache",
        r"Warming up done|Initial profiling/warmup run took|"
        r"torch\.compile and initial profiling/warmup run together took",
    ),
    ("CUDA graph capture", r"Capturing CUDA graphs"),
    ("KV cache", r"Graph capturing finished"),
    ("engine ready", r"init engine \(profile, create kv cache, warmup model\) took"),
)
PHASE_ORDER = (
    "import",
    "engine start",
    "weights",
    "model set-up",
    "Dynamo trace",
    "graph load or compile",
    "warm-up run",
    "CUDA graph capture",
    "KV cache",
    "engine ready",
    "workload",
    "exit",
)
# What a cache could still remove from each phase, as the report says it.
PHASE_NOTES = {
    "import": "no: Python and vLLM import (bytecode is cached already)",
    "engine start": "no: config, then EngineCore and worker processes spawned, each importing torch and vLLM",
    "weights": "no: reading the weights (storage and page cache)",
    "model set-up": "no: building the model's modules (and a hit's AOT load: vLLM logs it once done)",
    "Dynamo trace": "yes: torch's AOT compile (VLLM_USE_AOT_COMPILE=1) caches Dynamo's bytecode transform",
    "graph load or compile": "hit: compiled graphs loaded from the cache (compiles here on a miss)",
    "warm-up run": "no: running the model once (profiling) with the loaded kernels",
    "CUDA graph capture": "no: CUDA graphs are captured anew in each process",
    "KV cache": "no: allocating the KV cache",
    "engine ready": "no: tokenizer and front end after the engine is up",
    "workload": "no: the recipe's requests",
    "exit": "no: shutting the engine down",
}
_ARRIVAL = re.compile(r"^\[\+(\d+\.\d+)\] ", re.M)
RECOMPILE_EVENTS = (
    "aot_load_failure",
    "graph_compiled",
    "aot_saved",
    "flashinfer_jit_build",
    "flashinfer_cubin_download",
)
STAMP = r"(\d\d-\d\d \d\d:\d\d:\d\d)"
SANDBOX_VARS = ("HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME")


def phases(text: str, result: dict | None = None, wall_s: float | None = None) -> dict[str, float]:
    """Seconds per phase of a start (PHASE_MARKERS), from a log whose lines carry their arrival
    time; result (what the child measured: import_s, engine_init_s, workload_s) places the import,
    the end of LLM() and the workload. {} for a log without arrival times."""
    marks: list[tuple[float, str]] = []
    for m in _ARRIVAL.finditer(text):
        line = text[m.end() : text.find("\n", m.end())]
        for name, pattern in PHASE_MARKERS:
            if re.search(pattern, line):
                marks.append((float(m.group(1)), name))
                break
    if not marks:
        return {}
    result = result or {}
    marks.append((0.0, "import"))
    if result.get("import_s") is not None:
        imported = result["import_s"]
        marks.append((imported, "engine start"))
        if result.get("engine_init_s") is not None:
            ready = imported + result["engine_init_s"]
            marks.append((ready, "workload"))
            if result.get("workload_s") is not None:
                marks.append((ready + result["workload_s"], "exit"))
    marks.sort(key=lambda m: m[0])
    end = wall_s if wall_s is not None else marks[-1][0]
    out: dict[str, float] = {}
    # A phase ends where the next marker is, of any phase. Once the workload runs, engine lines
    # (a Dynamo trace for a new shape) are part of the workload, not of the start.
    workload_at = next((t for t, n in marks if n == "workload"), None)
    if workload_at is not None:
        marks = [(t, n) for t, n in marks if t < workload_at or n in ("workload", "exit")]
    for (t, name), (t_next, _) in zip(marks, marks[1:] + [(end, "")], strict=True):
        if t_next > t:
            out[name] = round(out.get(name, 0.0) + t_next - t, 3)
    return out


def parse_log(text: str, result: dict | None = None, wall_s: float | None = None) -> dict:
    """Phase timings (seconds, the last value of each), event counts, the start's phases
    (phases()) and what vLLM's JIT monitor said (jit_monitor()) from a vLLM log."""
    timings = {}
    for name, pattern in TIMINGS.items():
        found = re.findall(pattern, text)
        if found:
            timings[name] = float(found[-1])
    # The CPU runner logs its compile warm-up as two lines; their timestamps give its length.
    start = re.search(STAMP + r".*Warming up model for the compilation", text)
    done = re.search(STAMP + r".*Warming up done", text)
    if start and done:
        # vLLM's stamps have no year: read in a leap year (02-29 exists), and one that ends before it
        # began crossed New Year's Eve
        t0, t1 = (datetime.strptime(f"2000-{m.group(1)}", "%Y-%m-%d %H:%M:%S") for m in (start, done))
        t1 = t1 if t1 >= t0 else t1.replace(year=2001)
        timings["cpu_compile_warmup_s"] = (t1 - t0).total_seconds()
    events = {name: len(re.findall(pattern, text)) for name, pattern in EVENTS.items()}
    return {
        "timings": timings,
        "events": events,
        "phases": phases(text, result, wall_s),
        "jit_monitor": jit_monitor(text),
    }


def jit_monitor(text: str) -> dict:
    """What vLLM's JIT monitor said of a start: whether it was on, and each compile it saw after
    warm-up (the first few, named), Triton autotunes included."""
    events = re.findall(JIT_EVENT, text) + re.findall(r"Triton autotuning for function \S+?(?=,|$)", text, re.M)
    return {
        "active": bool(re.search(EVENTS["jit_monitor_activated"], text)),
        "events": len(events),
        "examples": [e.replace(" during inference", "") for e in events[:3]],
    }


def sandbox_env(sandbox: Path) -> dict[str, str]:
    """HOME and the XDG dirs in a fresh directory: where a library's default cache would land."""
    return {
        "HOME": str(sandbox),
        "XDG_CACHE_HOME": str(sandbox / ".cache"),
        "XDG_CONFIG_HOME": str(sandbox / ".config"),
        "XDG_DATA_HOME": str(sandbox / ".local" / "share"),
    }


def census(root: Path, files: list[tuple[str, int]], sandbox: Path | None) -> tuple[dict, ...]:
    """Every file no component packs: of root's files (_files(root)) those outside the components'
    rules, and any in the sandbox. Lock files and temporaries (components.base.ALWAYS_EXCLUDED)
    and files a component deliberately leaves out are not caches."""
    out = []
    for rel, size in files:
        if rel in (restore.MARKER, restore.PREPARED) or components.of_path(rel) or components.excluded(rel):
            continue
        out.append({"path": str(root / rel), "bytes": size, "where": "root"})
    if sandbox is not None:
        out += [
            {"path": str(sandbox / rel), "bytes": size, "where": "home"}
            for rel, size in _files(sandbox)
            if not components.junk(rel)
        ]
    return tuple(out)


def _files(base: Path) -> list[tuple[str, int]]:
    return sorted((rel, st.st_size) for rel, st in walk(base))


def walk(base: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(base-relative path, lstat) of every file under base. No link is followed but base's own
    flashinfer/ (the link to a shared FlashInfer workspace): one in that workspace, which every pod of
    the node can write, could be a loop, and FlashInfer's own links there lead to files listed already."""
    tops = [(base, "")]
    if (base / flashinfer.SUBDIR).is_symlink():
        tops.append((base / flashinfer.SUBDIR, flashinfer.SUBDIR + "/"))
    for top, prefix in tops:
        for dirpath, _, filenames in os.walk(top):
            for fn in filenames:
                full = os.path.join(dirpath, fn)
                try:
                    st = os.lstat(full)
                except FileNotFoundError:
                    continue
                yield prefix + os.path.relpath(full, top).replace(os.sep, "/"), st


@dataclass(frozen=True)
class EngineRun:
    result: dict = field(hash=False)  # what the child measured (import, engine init, workload, vLLM's key)
    log: dict = field(hash=False)  # parse_log of its output
    wall_s: float  # process start to exit
    log_path: Path
    sandbox: Path
    uncovered: tuple[dict, ...] = ()  # census after the run
    vllm: vllmkey.VllmKey | None = None  # what vLLM hashed, with the compile-cache folders its key named


def _vllm_key(result: dict, files: list[tuple[str, int]], recipe: Recipe) -> vllmkey.VllmKey | None:
    """What vLLM hashed in a run (result: the child's), with the compile-cache folders its key named
    among the root's files, and the digest of the model's config."""
    vk = result.get("vllm_key")
    if not vk:
        return None
    dirs = vllmkey.cache_dirs([rel for rel, _ in files])
    digest = vllmkey.model_config_digest(recipe.model, recipe.engine)
    return vllmkey.VllmKey(vk.get("version"), vk.get("env") or {}, vk.get("config_hash"), dirs, digest)


def engine_log(workdir: Path, label: str) -> Path:
    """Where run_engine(..., label) writes the engine's output."""
    return workdir / f"{label}.log"


def require_model(recipe: Recipe) -> None:
    """A served model path that is not on this machine, refused before an engine starts: vLLM would
    take it for a hub id and fail with a traceback after seconds of start-up."""
    if os.path.isabs(recipe.model) and not os.path.exists(recipe.model):
        fetch = (
            f" (e.g. `huggingface-cli download {recipe.model_id}"
            f"{' --revision ' + recipe.revision if recipe.revision else ''} --local-dir {recipe.model}`)"
            if recipe.model_id
            else ""
        )
        raise UsageError(
            f"the model path {recipe.model} (model.path in {recipe.source}) does not exist on this "
            f"machine: put the model's files there{fetch}, or fix model.path (the path nodes serve "
            "it from: vLLM keys its compile cache on it)"
        )


def engine_env(recipe: Recipe, root: Path, sandbox: Path, extra_env: dict | None = None) -> dict[str, str]:
    """The env of an engine run on root: this process's, less what would move a cache out of the
    root (components.MOVED_OUT), with every cache under root, HOME and XDG in sandbox, and the
    Hugging Face cache (the model's weights: input) where this process has it."""
    inherited = {k: v for k, v in os.environ.items() if k not in components.MOVED_OUT}
    env = {
        **serving.environ_for_vllm(recipe, root, inherited),
        **sandbox_env(sandbox),
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONUNBUFFERED": "1",
        **(extra_env or {}),
    }
    # torch's Dynamo says when it starts and ends tracing each frame (INFO lines, a few per graph):
    # the restored start's phases need them. Logging only: not in any compile key (vLLM hashes
    # VLLM_* factors, Inductor its configs).
    env.setdefault("TORCH_LOGS", os.environ.get("TORCH_LOGS") or "dynamo")
    # The model is input, not a cache: a hub id resolves through this machine's Hugging Face cache (its
    # downloads, its token for a gated model), not the sandbox's empty one, where vLLM would download
    # the weights again on every run and the census would call them uncovered caches. Its default, as
    # huggingface_hub/constants.py computes it, from this process's HOME and XDG_CACHE_HOME.
    env.setdefault(
        "HF_HOME",
        os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
        ),
    )
    return env


def run_engine(recipe: Recipe, root: Path, workdir: Path, label: str, *, extra_env: dict | None = None) -> EngineRun:
    """Start vLLM on root in a fresh process, run the workload, and return what was measured.

    The child gets its own process group, killed whole when the run ends or this process is
    stopped (SIGTERM arrives as errors.Terminated, which passes through the finally below)."""
    require_model(recipe)
    restore.prepare(root)
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = (workdir / f"{label}.{ext}" for ext in ("spec.json", "result.json"))
    log_path = engine_log(workdir, label)
    sandbox = workdir / f"{label}.home"
    shutil.rmtree(sandbox, ignore_errors=True)
    sandbox.mkdir()
    spec: dict[str, Any] = {"model": recipe.model, "engine": dict(recipe.engine), "workload": recipe.workload.spec()}
    if recipe.revision:
        spec["engine"].setdefault("revision", recipe.revision)
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path.unlink(missing_ok=True)
    env = engine_env(recipe, root, sandbox, extra_env)
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        proc: subprocess.Popen | None = None
        try:
            # Held until the finally below covers the child: a SIGTERM inside Popen (the child
            # already exec'd) or before the try left the engine running, its parent gone.
            with restore.signals_held():
                proc = subprocess.Popen(
                    [sys.executable, "-m", "warmer.workload", str(spec_path), str(result_path)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                stamper = threading.Thread(target=_stamp_lines, args=(proc.stdout, log, t0), daemon=True)
                stamper.start()
            rc = proc.wait(timeout=recipe.workload.timeout_s)
        except subprocess.TimeoutExpired:
            assert proc is not None  # it was waited on
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            stamper.join(timeout=30)
            raise WarmupError(
                f"{label}: the engine ran past workload.timeout_s={recipe.workload.timeout_s}; log: {log_path}\n"
                + _tail(log_path.read_text(errors="replace"))
            ) from None
        finally:
            if proc is not None:  # None: Popen itself failed, no child to stop
                # vLLM's spawned workers must not outlive the run, however it ends.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
                stamper.join(timeout=30)  # the group is gone: the pipe ends
                assert proc.stdout is not None  # stdout=PIPE
                proc.stdout.close()
    wall = time.perf_counter() - t0
    text = log_path.read_text(errors="replace")
    try:  # the child's file: empty or cut short when its own write failed (a full disk)
        result = json.loads(result_path.read_text())
    except (OSError, ValueError):
        result = None
    result = result if isinstance(result, dict) else {}
    if rc != 0 or not result or "error" in result:
        cause = f" ({result['error']})" if result.get("error") else ""
        raise WarmupError(f"{label}: the engine exited with code {rc}{cause}; log: {log_path}\n{_tail(text)}")
    files = _files(root)  # walked once after the run: the census and vLLM's key both read it
    return EngineRun(
        result,
        parse_log(text, result, wall),
        round(wall, 3),
        log_path,
        sandbox,
        census(root, files, sandbox),
        _vllm_key(result, files, recipe),
    )


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-25:])


def _stamp_lines(pipe, log, t0: float) -> None:
    """Copy the engine's output to its log, each line prefixed with when it began to arrive
    ("[+12.345] ", seconds since the process started): vLLM's own timestamps are whole seconds, and
    its processes (the front end, EngineCore, the workers) log on their own clocks. A progress
    bar's carriage return ends a line too (tqdm's "Capturing CUDA graphs" writes no newline until
    it closes), and what arrives goes to the log at once, for whoever follows a run that hangs."""
    at_start = True
    while chunk := pipe.read1(65536):
        now = b"[+%.3f] " % (time.perf_counter() - t0)
        out = bytearray()
        for piece in re.split(rb"(\r\n|\r|\n)", chunk):
            if piece in (b"\r\n", b"\r", b"\n"):
                out += b"" if at_start else b"\n"  # no empty lines (nor the gap of a split \r\n)
                at_start = True
            elif piece:
                out += now + piece if at_start else piece
                at_start = False
        log.write(out)
        log.flush()
    if not at_start:
        log.write(b"\n")
    log.flush()


def timings(run: EngineRun) -> dict:
    """One record of a run's timings, for artifact.json and reports: seconds by name, and the
    start's phases (phases()) when the log told them."""
    out = {
        "process_s": run.wall_s,
        **{k: v for k, v in run.result.items() if not isinstance(v, (dict, list))},
        **run.log["timings"],
    }
    if run.log.get("phases"):
        out["phases"] = run.log["phases"]
    return out
