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

import argparse
import hashlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

TRITON_COMPILES = {"compiled": 0, "cache_hit": 0}


def _listen_to_triton() -> bool:
    """Count Triton compiles in this process (Inductor compiles in-process: TORCHINDUCTOR_COMPILE_THREADS=1)."""
    try:
        from triton import knobs
    except Exception:  # no Triton (a CPU torch), or a Triton without knobs
        return False
    if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
        return False

    def listener(*, cache_hit: bool, **_):
        TRITON_COMPILES["cache_hit" if cache_hit else "compiled"] += 1

    knobs.compilation.listener = listener
    return True


def _torch_counters() -> dict:
    from torch._dynamo.utils import counters
    keep = ("inductor", "aot_autograd", "stats")
    return {group: {k: v for k, v in counters[group].items()} for group in keep if counters.get(group)}


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
        fn = compiled.aot_compile(((x,), {}))
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
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(lens, pages)], dtype=torch.int32, device=device)
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


def flashinfer_autotune(device: str, quick: bool, r: dict) -> None:
    """(d) FlashInfer's autotuner choosing a cuBLASLt algorithm for mm_bf16, persisted as vLLM 0.32 does
    (vllm/model_executor/warmup/kernel_warmup.py): load_configs(file) if it exists, run under
    autotune(tune_mode=True), save_configs(file) only when the tuner is dirty. The file lives where
    vLLM puts it: VLLM_CACHE_ROOT/flashinfer_autotune_cache/<fi version>/<arch>/<hash>/."""
    if device != "cuda":
        r["skipped"] = "the autotuner profiles kernels on a GPU"
        return
    import torch
    import flashinfer
    from flashinfer.autotuner import AutoTuner, autotune
    from flashinfer.jit import env as jit_env

    ws_dir = Path(jit_env.FLASHINFER_WORKSPACE_DIR)
    path = (Path(os.environ["VLLM_CACHE_ROOT"]) / "flashinfer_autotune_cache" / ws_dir.parent.name / ws_dir.name
            / hashlib.sha256(b"warmer-gpu-check mm_bf16 cublaslt").hexdigest() / "autotune_configs_dp0_rank0.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    r["autotune_file"] = str(path)
    tuner = AutoTuner.get()
    r["autotune_loaded"] = bool(tuner.load_configs(str(path))) if path.exists() else False
    tuned_before = sum(tuner.stats.tuned_op_successful_configs.values())
    torch.manual_seed(0)
    m, k, n = 128, 1024, 1024
    a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, k, dtype=torch.bfloat16, device=device).t()   # (k, n), column-major
    with torch.inference_mode(), autotune(tune_mode=True):
        flashinfer.mm_bf16(a, b, backend="cublaslt")
    r["autotune_profiles_tuned"] = sum(tuner.stats.tuned_op_successful_configs.values()) - tuned_before
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


WORKS = {
    "torch-compile": torch_compile,
    "aot-compile": aot_compile,
    "flashinfer-jit": flashinfer_jit,
    "flashinfer-autotune": flashinfer_autotune,
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=sorted(WORKS))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    t0 = time.monotonic()
    r: dict = {"check": args.check, "device": args.device, "pid": os.getpid()}
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
        t1 = time.monotonic()
        r["import_s"] = round(t1 - t0, 2)
        WORKS[args.check](args.device, args.quick, r)
        r["work_s"] = round(time.monotonic() - t1, 2)
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"
        r["traceback"] = traceback.format_exc()[-4000:]
    finally:
        try:
            r["counters"] = _torch_counters()
        except Exception:
            r["counters"] = {}
        r["triton"] = dict(TRITON_COMPILES)
        Path(args.out).write_text(json.dumps(r, indent=1, default=str))
    return 1 if "error" in r else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
