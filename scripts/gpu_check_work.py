"""The work of one check in one process: what scripts/gpu_check.py runs, cold and then restored.

    python scripts/gpu_check_work.py CHECK --device cuda|cpu [--quick] --out RESULT.json

The same work runs in both phases; whether it compiled is read afterwards from what it counted:
Inductor's and AOTAutograd's counters, Triton's compilation listener (each kernel it compiled
rather than found in its cache), FlashInfer's autotuner statistics, torch's AOT loads. Compiler
calls (nvcc, gcc, g++ ...) are logged by the wrappers gpu_check.py puts on PATH and in CUDA_HOME,
so they are counted outside this process. Every cache location comes from the environment
(warmer's cache_env); nothing here names a path of its own except where vLLM names one under
VLLM_CACHE_ROOT, and there the layout is vLLM 0.32's.
"""

from __future__ import annotations

import time

T_FIRST_LINE = time.time()   # the phase table's end of interpreter start (gpu_check.py passes the spawn time)

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

TRITON_COMPILES = {"compiled": 0, "cache_hit": 0, "compile_s": 0.0}
SPAWN_ENV = "WARMER_GPU_CHECK_SPAWN_TS"   # time.time() in the parent just before it started this process


def _listen_to_triton() -> bool:
    """Count Triton compiles in this process (Inductor compiles in-process: TORCHINDUCTOR_COMPILE_THREADS=1)."""
    try:
        from triton import knobs
    except Exception:  # no Triton (a CPU torch), or a Triton without knobs
        return False
    if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
        return False

    def listener(*, cache_hit: bool, times=None, **_):
        TRITON_COMPILES["cache_hit" if cache_hit else "compiled"] += 1
        if not cache_hit:   # CompileTimes.total is in microseconds
            TRITON_COMPILES["compile_s"] += getattr(times, "total", 0) / 1e6

    knobs.compilation.listener = listener
    return True


REPLAYED: dict[str, int] = {}


def _keep_replays_apart() -> bool:
    """On an FX-graph-cache hit Inductor adds back the counters it recorded when the graph was
    compiled (torch/_inductor/codecache.py, FxGraphCache.cache_hit_post_compile: `counters["inductor"]
    += graph.counter_deltas`, torch 2.11 and 2.13; the AOTAutograd cache's hit calls it too), so a hit
    shows select_algorithm_autotune, benchmarking.* and precompiles that nothing ran. What a hit adds
    is kept here, and gpu_check.py's compiles() takes it off."""
    try:
        from torch._dynamo.utils import counters
        from torch._inductor.codecache import FxGraphCache
    except Exception:
        return False
    hit = FxGraphCache.__dict__.get("cache_hit_post_compile")
    if not isinstance(hit, staticmethod):
        return False
    post_compile = hit.__func__

    def keep_apart(*args, **kwargs):
        before = counters["inductor"].copy()
        try:
            return post_compile(*args, **kwargs)
        finally:
            for k, v in (counters["inductor"] - before).items():
                REPLAYED[k] = REPLAYED.get(k, 0) + v

    FxGraphCache.cache_hit_post_compile = staticmethod(keep_apart)
    return True


def _torch_counters() -> dict:
    from torch._dynamo.utils import counters
    keep = ("inductor", "aot_autograd", "stats")
    return {group: {k: v for k, v in counters[group].items()} for group in keep if counters.get(group)}


def _timed_sections() -> dict:
    """Seconds torch spent in each dynamo_timed section (Inductor's autotuning and precompiling,
    compile_fx_inner ...): what the re-work list prices a counter with."""
    from torch._dynamo.utils import compilation_time_metrics
    return {k: round(sum(v), 3) for k, v in compilation_time_metrics.items() if v}


def _sync(device: str) -> None:
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


class _Small:
    """A block shaped like a transformer MLP: LayerNorm, two GEMMs, GELU, a residual."""

    @staticmethod
    def make(device: str, dim: int, hidden: int):
        import torch
        from torch import nn

        class Small(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = nn.LayerNorm(dim)
                self.up = nn.Linear(dim, hidden)
                self.down = nn.Linear(hidden, dim)

            def forward(self, x):
                return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

        torch.manual_seed(0)
        dtype = torch.float16 if device == "cuda" else torch.float32
        return Small().to(device=device, dtype=dtype).eval(), dtype


def torch_compile(device: str, quick: bool, r: dict) -> None:
    """(a) torch.compile with Inductor; on CUDA, Triton kernels and max-autotune's GEMM choice."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU()).to(device=device, dtype=dtype).eval()
    x = torch.randn(64, 256, device=device, dtype=dtype)
    # On CUDA, max-autotune benchmarks Triton GEMM templates against cuBLAS for the Linear and
    # bakes the winner into the generated code. GEMMs only, and a few Triton configs (Inductor's
    # own test knob, itself in the cache key): every config is a kernel compile, and
    # coordinate-descent or pointwise tuning would add minutes of them without adding a kind of
    # cache. On CPU max-autotune would build C++ GEMM templates for minutes: the CPU run compiles
    # in the default mode.
    options = {}
    if device == "cuda":
        options = {"max_autotune_gemm": True, "max_autotune_pointwise": False, "coordinate_descent_tuning": False}
        if "test_configs.max_mm_configs" in torch._inductor.config.get_config_copy():
            options["test_configs.max_mm_configs"] = 2 if quick else 4
    compiled = torch.compile(model, options=options)
    with torch.no_grad():
        y = compiled(x).float()
        ref = model(x).float()
    _sync(device)
    r["options"] = options
    r["max_err"] = float(((y - ref).abs() / (ref.abs() + 1)).max())
    r["tolerance"] = 2e-2 if dtype == torch.float16 else 1e-4


def aot_compile(device: str, quick: bool, r: dict) -> None:
    """(b) torch's AOT compile path as vLLM 0.32 drives it (vllm/compilation/decorators.py, wrapper.py).

    vLLM compiles with torch._dynamo.config.enable_aot_compile, calls .aot_compile((args, kwargs)) on
    the torch.compile'd forward, saves with save_compiled_function (to model.<pid>.tmp, then
    os.replace), and on the next start loads with torch.compiler.load_compiled_function(f,
    f_globals=forward.__globals__) and disables the guard check. The files live where vLLM puts them:
    VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/<hash>/{inductor_cache, rank_0_0/model},
    with TORCHINDUCTOR_CACHE_DIR pointed at that inductor_cache. The backend is Inductor itself:
    vLLM's VllmBackend is vLLM's, and vLLM is not on the GPU machine."""
    import torch

    missing = [name for name, ok in (
        ("torch._dynamo.config.enable_aot_compile", hasattr(torch._dynamo.config, "enable_aot_compile")),
        ("torch.compiler.load_compiled_function", hasattr(torch.compiler, "load_compiled_function")),
    ) if not ok]
    if missing:
        r["skipped"] = f"torch {torch.__version__} lacks {', '.join(missing)}: vLLM 0.32 uses no AOT path here either"
        return

    model, dtype = _Small.make(device, 128, 512)
    x = torch.randn(32, 128, device=device, dtype=dtype)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    factors = [torch.__version__, torch.version.cuda, name, sys.version_info[:2], "warmer-gpu-check aot v1",
               type(model).forward.__qualname__]
    cache_dir = Path(os.environ["VLLM_CACHE_ROOT"], "torch_compile_cache", "torch_aot_compile",
                     hashlib.sha256(str(factors).encode()).hexdigest())
    inductor_cache = cache_dir / "inductor_cache"
    inductor_cache.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)   # as vLLM: process-wide, unconditional
    path = cache_dir / "rank_0_0" / "model"
    r["aot_path"] = str(path)
    r["aot_loaded"] = 0
    r["aot_compiled"] = 0
    fn = None
    if path.exists():
        try:
            with open(path, "rb") as f:
                fn = torch.compiler.load_compiled_function(f, f_globals=model.forward.__globals__)
            fn.disable_guard_check()
            r["aot_loaded"] = 1
        except Exception as e:  # vLLM: "Compiling model again due to a load failure"
            r["aot_load_failure"] = f"{type(e).__name__}: {e}"[:500]
            fn = None
    if fn is None:
        options = {}
        if hasattr(torch.compiler, "skip_all_guards_unsafe"):
            options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
        with torch._dynamo.config.patch(enable_aot_compile=True):
            compiled = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="inductor",
                                     options=options)
        t = time.monotonic()
        fn = compiled.aot_compile(((x,), {}))
        r["aot_compile_s"] = round(time.monotonic() - t, 3)
        r["aot_compiled"] = 1
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fn.save_compiled_function(str(tmp))
        os.replace(tmp, path)
    with torch.no_grad():
        y = fn(model, x)
        ref = model(x)
    _sync(device)
    r["max_err"] = float((y.float() - ref.float()).abs().max())
    r["tolerance"] = 5e-2 if dtype == torch.float16 else 1e-4


# The decode (and, in a full run, prefill) shapes: GQA with 4 query heads per KV head, fp16, 4
# requests of different lengths over 16-token pages.
HEADS_QO, HEADS_KV, HEAD_DIM, PAGE = 16, 4, 128, 16
KV_LENS = (33, 17, 64, 5)


def _paged_kv(torch, lens, device):
    pages = [math.ceil(n / PAGE) for n in lens]
    indptr = torch.tensor([0] + [sum(pages[:i + 1]) for i in range(len(pages))], dtype=torch.int32, device=device)
    indices = torch.arange(sum(pages), dtype=torch.int32, device=device)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(lens, pages, strict=True)], dtype=torch.int32, device=device)
    cache = torch.randn(sum(pages), 2, PAGE, HEADS_KV, HEAD_DIM, dtype=torch.float16, device=device)
    return indptr, indices, last, cache


def _kv_of(cache, indptr, i, n):
    pages = cache[int(indptr[i]):int(indptr[i + 1])]              # [p, 2, PAGE, H, D]
    k = pages[:, 0].reshape(-1, HEADS_KV, HEAD_DIM)[:n]
    v = pages[:, 1].reshape(-1, HEADS_KV, HEAD_DIM)[:n]
    return k, v


def _attention(torch, q, k, v, causal: bool):
    """Reference attention in fp32: q [t, Hq, D], k/v [n, Hkv, D]; causal aligns q to k's end."""
    group = HEADS_QO // HEADS_KV
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,nhd->htn", q.float(), k) / math.sqrt(HEAD_DIM)
    if causal:
        t, n = q.shape[0], k.shape[0]
        mask = torch.arange(n, device=q.device)[None, :] > (torch.arange(t, device=q.device)[:, None] + n - t)
        s = s.masked_fill(mask[None], float("-inf"))
    return torch.einsum("htn,nhd->thd", s.softmax(-1), v)


def flashinfer_jit(device: str, quick: bool, r: dict) -> None:
    """(c) FlashInfer attention over a paged KV cache, JIT-built by ninja and nvcc on a miss."""
    import torch
    from flashinfer.jit import env as jit_env

    r["workspace"] = str(jit_env.FLASHINFER_WORKSPACE_DIR)
    if device != "cuda":
        # No GPU to run on: build exactly the module the decode wrapper below asks for (fp16 q/kv/out,
        # int32 indices, head_dim 128, no RoPE, no window, no soft cap), for FLASHINFER_CUDA_ARCH_LIST.
        from flashinfer.jit.attention.modules import gen_batch_decode_module
        spec = gen_batch_decode_module(torch.float16, torch.float16, torch.float16, torch.int32,
                                       HEAD_DIM, HEAD_DIM, 0, False, False)
        spec.build(verbose=False)
        r["modules"] = [spec.name]
        r["ops"] = ["batch decode module built (no GPU to load it on)"]
        return
    import flashinfer

    torch.manual_seed(0)
    ws = torch.zeros(64 * 1024 * 1024, dtype=torch.uint8, device=device)
    indptr, indices, last, cache = _paged_kv(torch, KV_LENS, device)
    errs = {}

    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    decode.plan(indptr, indices, last, HEADS_QO, HEADS_KV, HEAD_DIM, PAGE, pos_encoding_mode="NONE",
                q_data_type=torch.float16)
    q = torch.randn(len(KV_LENS), HEADS_QO, HEAD_DIM, dtype=torch.float16, device=device)
    out = decode.run(q, cache)
    ref = torch.cat([_attention(torch, q[i:i + 1], *_kv_of(cache, indptr, i, n), causal=False)
                     for i, n in enumerate(KV_LENS)])
    errs["decode"] = float((out.float() - ref).abs().max())

    if not quick:
        q_lens = (7, 17, 1, 5)
        qo_indptr = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))], dtype=torch.int32,
                                 device=device)
        prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        prefill.plan(qo_indptr, indptr, indices, last, HEADS_QO, HEADS_KV, HEAD_DIM, PAGE, causal=True,
                     q_data_type=torch.float16)
        qp = torch.randn(sum(q_lens), HEADS_QO, HEAD_DIM, dtype=torch.float16, device=device)
        out = prefill.run(qp, cache)
        ref = torch.cat([_attention(torch, qp[int(qo_indptr[i]):int(qo_indptr[i + 1])],
                                    *_kv_of(cache, indptr, i, n), causal=True) for i, n in enumerate(KV_LENS)])
        errs["prefill"] = float((out.float() - ref).abs().max())
    torch.cuda.synchronize()
    r["ops"] = sorted(errs)
    r["max_err"] = max(errs.values())
    r["errors_by_op"] = errs
    r["tolerance"] = 1e-2


# vLLM 0.32 tunes at max_num_batched_tokens with FlashInfer's hybrid buckets; 128 tokens give the
# eight power-of-two buckets 1 ... 128 (get_hybrid_num_tokens_buckets(128)).
AUTOTUNE_TOKENS = 128


def _autotune_cache_fingerprint(path: Path):
    """vLLM 0.32's kernel_warmup._autotune_cache_fingerprint: the file's FlashInfer metadata and size."""
    try:
        configs = json.loads(path.read_text())
        metadata = configs.pop("_metadata", None)
    except (OSError, ValueError, AttributeError):
        return None
    return json.dumps(metadata, sort_keys=True), len(configs)


def flashinfer_autotune(device: str, quick: bool, r: dict) -> None:
    """(d) FlashInfer's autotuner choosing a cuBLASLt algorithm for mm_bf16, driven as vLLM 0.32 drives
    it (vllm/model_executor/warmup/kernel_warmup.py, flashinfer_autotune, one rank):

    - the file: resolve_flashinfer_autotune_file's VLLM_CACHE_ROOT/flashinfer_autotune_cache/<fi
      version>/<arch>/<hash>/autotune_configs.json (or VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR/<hash>/),
      renamed autotune_configs_dp{dp_rank}_rank{rank}.json;
    - _all_ranks_have_matching_cache (world size 1: the file parses and has metadata), then
      AutoTuner.load_configs(file), clear_cache() when it did not load;
    - set_autotune_process_group(None); under torch.inference_mode() and
      fi_utils.autotune(tune_mode=True), _run_flashinfer_autotune_dummy_runs: for each token count,
      fi_utils.autotune(tuning_buckets=get_hybrid_num_tokens_buckets(n), round_up=True) around the
      dummy run (here one mm_bf16 of n tokens);
    - save_configs(file) only when the tuner is dirty.
    fi_utils.autotune is FlashInfer's autotune (a lazy import); vLLM is not on the GPU machine."""
    if device != "cuda":
        r["skipped"] = "the autotuner profiles kernels on a GPU"
        return
    import flashinfer
    import torch
    from flashinfer.autotuner import AutoTuner, autotune, set_autotune_process_group
    from flashinfer.fused_moe.utils import get_hybrid_num_tokens_buckets
    from flashinfer.jit import env as jit_env

    r["flashinfer"] = flashinfer.__version__
    override = os.environ.get("VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR")
    if override:
        root = Path(override).expanduser()
    else:
        ws_dir = Path(jit_env.FLASHINFER_WORKSPACE_DIR)
        root = Path(os.environ["VLLM_CACHE_ROOT"]) / "flashinfer_autotune_cache" / ws_dir.parent.name / ws_dir.name
    # vLLM hashes its config (flashinfer_autotune_cache_hash); the check's "config" is its op and shape.
    out_dir = root / hashlib.sha256(f"warmer-gpu-check mm_bf16 cublaslt {AUTOTUNE_TOKENS}".encode()).hexdigest()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "autotune_configs.json"
    dp_rank, rank = 0, 0
    path = path.with_name(f"{path.stem}_dp{dp_rank}_rank{rank}{path.suffix}")
    r["autotune_file"] = str(path)

    tuner = AutoTuner.get()
    fingerprint = _autotune_cache_fingerprint(path)
    r["autotune_file_matching"] = fingerprint is not None
    r["autotune_file_entries"] = fingerprint[1] if fingerprint else 0
    r["autotune_loaded"] = False
    if fingerprint is not None:     # _all_ranks_have_matching_cache, world size 1
        loaded = tuner.load_configs(str(path))
        r["autotune_loaded"] = bool(loaded)
        if not loaded:
            tuner.clear_cache()
    stats = tuner.stats
    tuned_before = sum(stats.tuned_op_successful_configs.values())
    torch.manual_seed(0)
    k, n = 1024, 1024
    a = torch.randn(AUTOTUNE_TOKENS, k, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, k, dtype=torch.bfloat16, device=device).t()   # (k, n), column-major
    buckets = tuple(get_hybrid_num_tokens_buckets(AUTOTUNE_TOKENS))
    r["autotune_buckets"] = list(buckets)
    set_autotune_process_group(None)
    t = time.monotonic()
    try:
        with torch.inference_mode(), autotune(tune_mode=True):
            for num_tokens in (AUTOTUNE_TOKENS,):          # _flashinfer_autotune_token_counts
                with autotune(tuning_buckets=buckets, round_up=True):
                    flashinfer.mm_bf16(a[:num_tokens], b, backend="cublaslt")   # the dummy run
        torch.cuda.synchronize()
    finally:
        set_autotune_process_group(None)
    r["autotune_s"] = round(time.monotonic() - t, 3)
    r["autotune_profiles_total"] = sum(stats.tuned_op_total_configs.values())
    r["autotune_profiles_tuned"] = sum(stats.tuned_op_successful_configs.values()) - tuned_before
    r["autotune_dirty"] = bool(tuner._dirty)
    r["autotune_saved"] = False
    if tuner._dirty:
        tuner.save_configs(str(path))
        r["autotune_saved"] = True
    with torch.inference_mode():
        out = flashinfer.mm_bf16(a, b, backend="cublaslt")   # outside tune mode: the cached choice
    torch.cuda.synchronize()
    ref = a.float() @ b.float()
    r["max_err"] = float(((out.float() - ref).abs() / (ref.abs() + 1)).max())
    r["tolerance"] = 5e-2


def triton_autotune(device: str, quick: bool, r: dict) -> None:
    """(e) A Triton kernel under @triton.autotune, persisted as vLLM 0.32 persists it: vLLM sets
    TRITON_CACHE_AUTOTUNING=1 at import (vllm/env_override.py), so the autotuner keeps each key's
    timings as <kernel>.autotune.json in Triton's cache (triton/runtime/autotuner.py,
    Autotuner.check_disk_cache), beside the kernels of every config it benchmarked. A restored start
    reads the choice and loads its kernel: no benchmark, no compile."""
    if device != "cuda":
        r["skipped"] = "Triton's autotuner benchmarks kernels on a GPU"
        return
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")   # read when the decorator builds the Autotuner
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import autotuner

    benchmarks = [0]
    bench = autotuner.Autotuner._bench

    def counted(self, *args, **kwargs):
        benchmarks[0] += 1
        return bench(self, *args, **kwargs)

    autotuner.Autotuner._bench = counted
    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((128, 4), (256, 4), (1024, 8))]

    @triton.autotune(configs=configs, key=["n"])
    @triton.jit
    def scaled_add(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        y = tl.load(y_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, x * alpha + y, mask=mask)

    torch.manual_seed(0)
    n = 1 << 20
    x = torch.randn(n, device=device)
    y = torch.randn(n, device=device)
    out = torch.empty_like(x)
    t0 = time.time()
    scaled_add[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, out, n, 0.5)
    torch.cuda.synchronize()
    r["triton_autotune_s"] = round(time.time() - t0, 3)
    r["triton_autotune_cache"] = bool(scaled_add.cache_results)
    r["triton_autotune_benchmarks"] = benchmarks[0]
    r["triton_autotune_choice"] = str(scaled_add.best_config)
    r["max_err"] = float((out - (x * 0.5 + y)).abs().max())
    r["tolerance"] = 1e-5


WORKS = {
    "torch-compile": torch_compile,
    "aot-compile": aot_compile,
    "flashinfer-jit": flashinfer_jit,
    "flashinfer-autotune": flashinfer_autotune,
    "triton-autotune": triton_autotune,
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=sorted(WORKS))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    r: dict = {"check": args.check, "device": args.device, "pid": os.getpid()}
    # The phase table (gpu_check.py prints it): interpreter start (the parent's spawn to this
    # script's first line), import torch, CUDA context, work; the parent adds the exit from end_ts.
    phases: dict = {"interpreter_s": None, "import_s": None, "cuda_s": None, "work_s": None}
    r["phases"] = phases
    spawn = os.environ.get(SPAWN_ENV)
    if spawn:
        try:
            phases["interpreter_s"] = round(T_FIRST_LINE - float(spawn), 3)
        except ValueError:
            pass
    try:
        import tempfile
        if os.environ.get("TMPDIR") and tempfile.gettempdir() != os.path.abspath(os.environ["TMPDIR"]):
            # Python falls back to /tmp when TMPDIR does not exist: files would escape the census.
            raise RuntimeError(f"TMPDIR {os.environ['TMPDIR']} is not usable: temporary files go to "
                               f"{tempfile.gettempdir()}")
        import torch
        r["torch"] = torch.__version__
        if args.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available to torch: run with --cpu on a machine without a GPU")
        r["triton_listener"] = _listen_to_triton() if args.device == "cuda" else False
        r["replays_kept_apart"] = _keep_replays_apart()
        t1 = time.time()
        phases["import_s"] = round(t1 - T_FIRST_LINE, 3)
        if args.device == "cuda":   # the context, timed on its own: a first tiny op, synchronized
            torch.cuda.init()
            torch.zeros(1, device="cuda").add_(1)
            torch.cuda.synchronize()
            t2 = time.time()
            phases["cuda_s"] = round(t2 - t1, 3)
            t1 = t2
        WORKS[args.check](args.device, args.quick, r)
        phases["work_s"] = round(time.time() - t1, 3)
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"
        r["traceback"] = traceback.format_exc()[-4000:]
    finally:
        try:
            r["counters"] = _torch_counters()
        except Exception:
            r["counters"] = {}
        try:
            r["timings"] = _timed_sections()
        except Exception:
            r["timings"] = {}
        r["replayed"] = {"inductor": dict(REPLAYED)}
        r["triton"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in TRITON_COMPILES.items()}
        r["end_ts"] = time.time()   # the parent's exit phase: its wall clock at exit minus this
        Path(args.out).write_text(json.dumps(r, indent=1, default=str))
    return 1 if "error" in r else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
