"""vLLM's own cache root: torch_compile_cache (AOT and piecewise artifacts), modelinfos, autotune.

VLLM_CACHE_ROOT is in none of vLLM's keys, so the cache moves between roots; the served
model path is in the key and is part of the recipe instead (vllm/envs.py compile_factors ignores
VLLM_CACHE_ROOT; vllm/config/model.py ModelConfig.compute_hash hashes `model`).
"""

from warmer.components.base import Component

COMPONENT = Component(
    name="vllm",
    subdir="vllm",
    env=(("VLLM_CACHE_ROOT", "vllm"),),
    about="torch_compile_cache, modelinfos, flashinfer_autotune_cache, deep_gemm",
    # The P2P access cache describes one machine's PCIe topology: never ship it.
    exclude=("gpu_p2p_access_cache_for_*", "dummy_cache/*"),
    defaults=(("VLLM_CACHE_ROOT", "{xdg}/vllm"),),
)

ORDER = 10  # where its caches come in warmer.components.ALL
COMPONENTS = (COMPONENT,)
