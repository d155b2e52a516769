"""The CuTe DSL's other file cache: kernels compiled through its experimental DSL (cute.experimental).

Each CuTe DSL singleton keeps its own file cache, under ${prefix}_CACHE_DIR, else
$TMPDIR/<user name>/cutlass_python_cache (nvidia_cutlass_dsl .../base_dsl/cache_helpers.py
get_default_generated_ir_path, called by base_dsl/compile_backend.py with the DSL's name). The
experimental one, CUTE_EXPERIMENTAL_DSL (cutlass_dsl/cutlass.py CuteExperimentalDSL), compiles
FlashInfer's @cute.experimental.jit kernels: the warp-split-K runner behind mm_bf16(backend="cute-dsl")
and the TGV GEMM (flashinfer/gemm/kernels/dense_bf16_gemm_warp_splitk.py, tgv_gemm_cute_ext.py;
flashinfer/gemm/gemm_base.py). vLLM calls that backend with --linear-backend=flashinfer_cutedsl
(vllm/model_executor/layers/utils.py) and for Kimi K3's QKVG projection on SM100/SM103
(vllm/models/kimi_k3/nvidia/low_latency_gemm.py), so CUTE_DSL_CACHE_DIR alone leaves those kernels in
TMPDIR, where nothing packs them.
"""

from warmer.components.base import Component

COMPONENT = Component(
    name="cute-experimental-dsl",
    subdir="cute_experimental_dsl",
    env=(("CUTE_EXPERIMENTAL_DSL_CACHE_DIR", "cute_experimental_dsl"),),
    about="CUTLASS CuTe DSL kernels of its experimental DSL (FlashInfer's cute-dsl and TGV BF16 GEMMs)",
    # Like CUTE_DSL_CACHE_DIR's entries: keyed by module hashes over sources; moving them is untested.
    relocatable=False,
    defaults=(("CUTE_EXPERIMENTAL_DSL_CACHE_DIR", "{tmp}/{user}/cutlass_python_cache"),),
)

ORDER = 60  # where its caches come in warmer.components.ALL
COMPONENTS = (COMPONENT,)
