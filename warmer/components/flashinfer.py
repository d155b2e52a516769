"""FlashInfer's caches as warmer packs them: the JIT workspace (modules built by ninja, generated
sources, cubins, autotune results) and the b12x (CuTe DSL) kernels' own cache.

FLASHINFER_WORKSPACE_BASE is the only knob for the workspace (FLASHINFER_CACHE_DIR is not an env
var: flashinfer/jit/env.py). Whether a restored JIT module will be reused is warmer.flashinfer_jit's
business: the contract of paths it depends on, ninja's dry run, and back-dating.
"""

from __future__ import annotations

from pathlib import Path

from warmer.components.base import Component

CACHE = ".cache/flashinfer"  # under FLASHINFER_WORKSPACE_BASE

COMPONENT = Component(
    name="flashinfer",
    subdir="flashinfer",
    env=(
        ("FLASHINFER_WORKSPACE_BASE", "flashinfer"),
        ("FLASHINFER_AUTOTUNE_CACHE_DIR", f"flashinfer/{CACHE}/autotune"),
    ),
    about="JIT modules (cached_ops, generated), cubins, autotune",
    # The log is reopened by every import; cached_ops/tmp holds the per-module locks.
    exclude=("*/flashinfer_jit.log", "*/cached_ops/tmp/*"),
    relocatable=False,
    defaults=(
        ("FLASHINFER_WORKSPACE_BASE", "{home}"),
        ("FLASHINFER_AUTOTUNE_CACHE_DIR", "{fi_base}/.cache/flashinfer/autotune"),
    ),
)

CUBINS = f"{COMPONENT.subdir}/{CACHE}/cubins/"  # what FlashInfer downloaded, root-relative

B12X = Component(
    name="b12x",
    subdir="b12x",
    env=(("B12X_COMPILE_CACHE_DIR", "b12x"),),
    about="compile and tuning caches of FlashInfer's b12x (CuTe DSL) kernels",
    # Its key hashes relative package paths, CUDA_HOME and versions; moving it is untested.
    relocatable=False,
    defaults=(("B12X_COMPILE_CACHE_DIR", "{xdg}/b12x/compile"),),
)

# Variables that change a JIT module's compile command, so a change makes ninja rebuild.
COMPILE_ENV = (
    "CUDA_HOME",
    "CUDA_PATH",
    "CC",
    "CXX",
    "FLASHINFER_NVCC",
    "FLASHINFER_NVCC_LAUNCHER",
    "FLASHINFER_CXX_LAUNCHER",
    "FLASHINFER_EXTRA_CFLAGS",
    "FLASHINFER_EXTRA_CUDAFLAGS",
    "FLASHINFER_EXTRA_LDFLAGS",
    "FLASHINFER_NVCC_THREADS",
    "FLASHINFER_JIT_DEBUG",
    "FLASHINFER_JIT_VERBOSE",
    "FLASHINFER_JIT_LINEINFO",
    "FLASHINFER_CUDA_ARCH_LIST",
)


def modules(root: Path) -> list[Path]:
    """Every JIT module directory (one build.ninja each) in root's FlashInfer workspace."""
    return sorted(p.parent for p in (root / COMPONENT.subdir / CACHE).glob("*/*/cached_ops/*/build.ninja"))


def artifact_env(files, root: Path) -> dict[str, str]:
    """Serve env that depends on what an artifact holds (files: its warmer.archive.FileList):
    when its warm-up downloaded cubins, point FlashInfer at them (flashinfer/jit/env.py:
    FLASHINFER_CUBIN_DIR wins over the default)."""
    if files.any_under(CUBINS):
        return {"FLASHINFER_CUBIN_DIR": str(root / CUBINS.rstrip("/"))}
    return {}
