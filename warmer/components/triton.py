"""Triton's kernel cache. Its __grp__ files hold absolute paths, so it is not relocatable; Inductor
re-emits the kernels it bundles into FX entries anyway (torch/_inductor/triton_bundler.py)."""

from warmer.components.base import Component

COMPONENT = Component(
    name="triton",
    subdir="triton",
    env=(("TRITON_CACHE_DIR", "triton"),),
    about="compiled Triton kernels (cubin, ptx, metadata) and autotune results",
    relocatable=False,
    defaults=(("TRITON_CACHE_DIR", "{triton_home}/.triton/cache"),),
)

ORDER = 30  # where its caches come in warmer.components.ALL
COMPONENTS = (COMPONENT,)
