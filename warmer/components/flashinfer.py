"""FlashInfer's workspace: JIT modules built by ninja, generated sources, cubins, autotune results.

FLASHINFER_WORKSPACE_BASE is the only knob (FLASHINFER_CACHE_DIR is not an env var). ninja
rebuilds when paths, CUDA_HOME or file times differ, so it is not relocatable
(research/flashinfer-caches.md).
"""

from warmer.components.base import Component

COMPONENT = Component(
    name="flashinfer",
    subdir="flashinfer",
    env=(("FLASHINFER_WORKSPACE_BASE", "flashinfer"),),
    about="JIT modules (cached_ops, generated), cubins, autotune",
    relocatable=False,
)
