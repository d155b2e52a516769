"""TorchInductor's cache (FX graphs, AOTAutograd entries, C++ kernels) and its precompiled headers.

The cache dir's path is in no Inductor key, so it relocates. The precompiled header (~150 MB,
~8 s to rebuild on CPU) ignores TORCHINDUCTOR_CACHE_DIR and lands in
$TMPDIR/torchinductor_<user>/precompiled_headers: pointing TMPDIR under the root is the only
way to keep it (torch/_inductor/codecache.py: the header goes to default_cache_dir()/precompiled_headers).
"""

import re
from pathlib import Path

from warmer.components.base import Component, Held

# The user name is torch's (runtime/cache_dir_utils.py default_cache_dir: getpass.getuser()). Only a
# plain one becomes LOGNAME: it comes from the artifact's file list, and goes into the env file.
_HEADER = re.compile(r"tmp/torchinductor_([A-Za-z0-9_.@+-]{1,64})/precompiled_headers/.+")


class PrecompiledHeaders(Component):
    """torch looks for the header under the serving user's name: a pod serving as another name than
    the builder's (uid_1000 against CI's root or runner) rebuilds it on every start, ~8 s and 149 MB
    (measured on the tiny recipe: graph load 10.1 s against 1.7 s)."""

    def serve_env(self, held: Held, root: Path) -> dict[str, str]:
        """The builder's name as LOGNAME, which getpass.getuser() reads first: torch then finds the
        header the artifact holds. vLLM reads no cache path from it; torch's other getuser() paths
        (its vendored quack's cache) are under TMPDIR, and follow the build's the same way."""
        if not held.any_under(f"{self.subdir}/torchinductor_"):
            return {}
        names = {m.group(1) for path, _ in held.sizes() if (m := _HEADER.fullmatch(path))}
        return {"LOGNAME": names.pop()} if len(names) == 1 else {}


COMPONENT = Component(
    name="inductor",
    subdir="inductor",
    env=(("TORCHINDUCTOR_CACHE_DIR", "inductor"),),
    about="FX graph, AOTAutograd and C++/Triton kernel cache",
    defaults=(("TORCHINDUCTOR_CACHE_DIR", "{tmp}/torchinductor_{user}"),),
)

HEADERS = PrecompiledHeaders(
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
