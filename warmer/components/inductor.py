"""TorchInductor's cache (FX graphs, AOTAutograd entries, C++ kernels) and its precompiled headers.

The cache dir's path is in no Inductor key, so it relocates. The precompiled header (~150 MB,
~8 s to rebuild on CPU) ignores TORCHINDUCTOR_CACHE_DIR and lands in
$TMPDIR/torchinductor_<user>/precompiled_headers: pointing TMPDIR under the root is the only
way to keep it (torch/_inductor/codecache.py: the header goes to default_cache_dir()/precompiled_headers).
"""

from warmer.components.base import Component

COMPONENT = Component(
    name="inductor",
    subdir="inductor",
    env=(("TORCHINDUCTOR_CACHE_DIR", "inductor"),),
    about="FX graph, AOTAutograd and C++/Triton kernel cache",
    defaults=(("TORCHINDUCTOR_CACHE_DIR", "{tmp}/torchinductor_{user}"),),
)

HEADERS = Component(
    name="inductor-headers",
    subdir="tmp",
    env=(("TMPDIR", "tmp"),),
    about="precompiled headers for Inductor's C++ kernels",
    include=("torchinductor_*/precompiled_headers/*",),
    # torch.distributed's file rendezvous, one per engine start (torch/distributed/rendezvous.py):
    # scratch in TMPDIR, never a cache.
    exclude=("vllm_dist_*",),
    defaults=(("TMPDIR", "/tmp"),),
)

ORDER = 20  # where its caches come in warmer.components.ALL
COMPONENTS = (
    COMPONENT,
    HEADERS,
)
