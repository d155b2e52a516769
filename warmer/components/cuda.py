"""The CUDA driver's compute cache: PTX JIT-compiled to the node's GPU."""

from warmer.components.base import Component

COMPONENT = Component(
    name="cuda",
    subdir="cuda",
    env=(("CUDA_CACHE_PATH", "cuda"),),
    about="CUDA driver JIT cache (PTX to SASS)",
    defaults=(("CUDA_CACHE_PATH", "{home}/.nv/ComputeCache"),),
)

ORDER = 90  # where its caches come in warmer.components.ALL
COMPONENTS = (COMPONENT,)
