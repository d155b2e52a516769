"""The CUTLASS CuTe DSL's file cache: kernels FlashInfer's b12x and CuTe-DSL paths compile (sm_120 NVFP4).

Unset, it lands in $TMPDIR/<user name>/cutlass_python_cache (nvidia_cutlass_dsl
.../base_dsl/cache_helpers.py get_default_generated_ir_path), which the tmp/ component does not
pack, and whose user name makes root and non-root pods miss each other's; CUTE_DSL_CACHE_DIR
moves it under the root.
"""

from warmer.components.base import Component

COMPONENT = Component(
    name="cute-dsl",
    subdir="cute_dsl",
    env=(("CUTE_DSL_CACHE_DIR", "cute_dsl"),),
    about="CUTLASS CuTe DSL kernels (FlashInfer b12x)",
    # Its entries hash source paths; moving them is untested.
    relocatable=False,
    defaults=(("CUTE_DSL_CACHE_DIR", "{tmp}/{user}/cutlass_python_cache"),),
)

ORDER = 50  # where its caches come in warmer.components.ALL
COMPONENTS = (COMPONENT,)
