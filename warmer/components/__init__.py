"""The kinds of cache warmer packs, and where each lives under a root.

Each module here describes one cache: the env var(s) that point it under the root, which of
its files belong in an artifact, and whether it survives a move to another root path.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from warmer.components.base import Check, Component, Held, junk
from warmer.finding import WARNING, Finding

if TYPE_CHECKING:
    from warmer.contract import PathContract


def _discovered() -> tuple[Component, ...]:
    """Every module of this package that defines COMPONENTS, in its ORDER: a new cache is one new
    module here (its env, rules and hooks), nothing else."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "COMPONENTS"):
            found.append((getattr(module, "ORDER", 100), info.name, module.COMPONENTS))
    return tuple(c for _, _, cs in sorted(found) for c in cs)


ALL: tuple[Component, ...] = _discovered()
BY_NAME: dict[str, Component] = {c.name: c for c in ALL}

# What the cache census (tests/unit/test_cache_census.py) finds in the installed libraries' sources that no
# component points under the root, each with why it needs none, checked in the source it cites. Keys are
# env vars ({prefix} where a library builds the name), or the file that builds a default cache path
# without one. A new key needs the same: what the library writes there, and why a start is warm without it.
NOT_PACKED: dict[str, str] = {
    # Defaults that land inside a component's directory; set, each moves its cache out of the root (MOVED_OUT).
    "DG_JIT_CACHE_DIR": "DeepGEMM's JIT cache: vLLM sets it to $VLLM_CACHE_ROOT/deep_gemm when unset (vllm/utils/deep_gemm.py "
    "_lazy_init), inside the vllm component",
    "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR": "an override, unset by default: vLLM's FlashInfer autotune results then go to "
    "$VLLM_CACHE_ROOT/flashinfer_autotune_cache (vllm/model_executor/warmup/flashinfer_autotune_cache.py "
    "resolve_flashinfer_autotune_file), in the vllm component",
    "FLASHINFER_CUBIN_DIR": "unset, cubins go to $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/cubins (flashinfer/jit/env.py "
    "_get_cubin_dir), in the flashinfer component; warmer points it at the packed copy when an artifact holds "
    "cubins (components/flashinfer.py JitWorkspace.serve_env)",
    "FLASHINFER_AUTOTUNE_DIR": "unset, PCIe-IPC and SM120 sparse-MLA tuning JSONs go to <FlashInfer workspace>/autotune "
    "(flashinfer/comm/pcie_ipc_tuning.py default_cache_path, mla/_sparse_mla_sm120/_calibration.py "
    "default_cache_path), in the flashinfer component",
    "FLASHINFER_KDA_PTX_CACHE_DIR": "unset, KDA cubins go to <FlashInfer workspace>/cached_ops/kda_ptx "
    "(flashinfer/kda_kernels/ptx/static_runtime.py _cubin), in the flashinfer component",
    # Bases other caches' defaults start from; each cache under them has its own variable, censused here.
    "HOME": "read in C++ only as the base of ~/.tensorrt_llm "
    "(flashinfer/data/csrc/nv_internal/tensorrt_llm/deep_gemm/compiler.cuh getDefaultUserDir), which "
    "TRTLLM_DG_CACHE_DIR replaces (trtllm-deep-gemm component)",
    "XDG_CACHE_HOME": "base of defaults only (vllm/envs.py get_default_cache_root, torch/_appdirs.py user_cache_dir, b12x); "
    "every cache under it is censused by its own variable or file",
    "XDG_CONFIG_HOME": "base of VLLM_CONFIG_ROOT's default (vllm/envs.py get_default_config_root): config, not caches",
    "XDG_DATA_HOME": "torch/_appdirs.py user_data_dir, which nothing in torch, vLLM or FlashInfer calls",
    "XDG_STATE_HOME": "torch/_appdirs.py user_state_dir, which nothing in torch, vLLM or FlashInfer calls",
    "TRITON_HOME": "base of ~/.triton: cache/ is TRITON_CACHE_DIR (triton component), dump/ and override/ are "
    "TRITON_DUMP_DIR and TRITON_OVERRIDE_DIR, debug only (triton/knobs.py cache_knobs)",
    "TORCH_HOME": "torch.hub's model and checkpoint downloads (torch/hub.py _get_torch_home); nothing in vLLM or FlashInfer "
    "uses torch.hub",
    # Switches, not locations (a name ending in CACHE).
    "TORCHINDUCTOR_FX_GRAPH_CACHE": "a switch for Inductor's FX graph cache, on by default (torch/_inductor/config.py fx_graph_cache); the "
    "cache is in TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_AUTOGRAD_CACHE": "a switch for the AOTAutograd cache, on by default (torch/_functorch/config.py enable_autograd_cache); "
    "the cache is in TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE": "a switch (torch/_inductor/config.py bundle_triton_into_fx_graph_cache_default)",
    "TORCH_FAKE_TENSOR_DISPATCH_CACHE": "a switch for an in-memory cache (torch/_dynamo/config.py fake_tensor_cache_enabled)",
    "B12X_COMPILE_DISK_CACHE": "a switch for b12x's disk cache, on by default (flashinfer/experimental/b12x/_lib/compiler.py "
    "_cute_compile_disk_cache_enabled); the cache is B12X_COMPILE_CACHE_DIR (b12x component)",
    "UCX_MEMTYPE_CACHE": "a UCX switch vLLM sets to n on Intel XPU (vllm/platforms/xpu.py)",
    "VLLM_DEBUG_WORKSPACE": "a switch that logs the GPU scratch workspace's resizes (vllm/v1/worker/workspace.py); no files",
    "MEGA_PEEK_WORKSPACE": "a debug switch that prints the MoE-EP kernel's workspace (flashinfer/moe_ep/.../mega_runner.py); no "
    "files",
    # Where libraries and toolkits are read from, not written.
    "CUDA_HOME": "where nvcc and the CUDA headers are read from (flashinfer/jit/cpp_ext.py get_cuda_path, "
    "torch/utils/cpp_extension.py); a path-contract input (warmer.components.flashinfer), not a cache",
    "WINDOWS_CUDA_HOME": "Windows CUDA toolkit for AOTInductor cross-compilation (torch/utils/cpp_extension.py)",
    "CUDNN_HOME": "where cuDNN is read from when building torch extensions (torch/utils/cpp_extension.py)",
    "NCCL_HOME": "where NCCL headers and libraries are read from for FlashInfer's comm JIT modules (flashinfer/jit/comm.py "
    "gen_dcp_lse_reduce_module)",
    "ROCM_HOME": "the ROCm toolkit (torch/cuda/__init__.py, torch/utils/cpp_extension.py, tvm_ffi/cpp/extension.py "
    "_find_rocm_home)",
    "ONEAPI_ROOT": "Intel's oneAPI toolkit for Inductor's XPU backend (torch/_inductor/codegen/xpu/compile_utils.py "
    "_sycl_compiler)",
    "NVSHMEM_LIB_DIR": "where libnvshmem_device.bc is read from (torch/distributed/_symmetric_memory/_nvshmem_triton.py)",
    "ROCSHMEM_LIB_DIR": "where the rocSHMEM library is read from (torch/distributed/_symmetric_memory/_rocshmem_triton.py)",
    "TORCHINDUCTOR_CUTLASS_DIR": "CUTLASS sources Inductor's CUTLASS backend reads (torch/_inductor/config.py cuda.cutlass_dir)",
    "TORCHINDUCTOR_CK_DIR": "Composable Kernel sources for Inductor's ROCm backend (torch/_inductor/config.py rocm.ck_dir)",
    "FLASHINFER_DSL_FMHA_LOCAL_DIR": "development mode: load CuTe-DSL FMHA kernels from a local directory instead of the cubin download "
    "(flashinfer/attention/cute_dsl/fmha.py get_cute_dsl_fmha_kernel)",
    "VLLM_TUNED_CONFIG_FOLDER": "tuned kernel configs vLLM reads (vllm/model_executor/layers/fused_moe/fused_moe.py); input shipped with "
    "the image",
    "VLLM_LORA_RESOLVER_CACHE_DIR": "LoRA adapters the filesystem resolver reads (vllm/plugins/lora_resolvers/filesystem_resolver.py "
    "register_filesystem_resolver); model data, not compile output",
    "CRIU_CUDA_PLUGIN_DIR": "CRIU's CUDA plugin for vLLM's process snapshots (vllm/snapshot/runtime.py)",
    "VLLM_PRECOMPILED_WHEEL_LOCATION": "building vLLM from source (vllm/envs.py VLLM_USE_PRECOMPILED); not read when serving",
    "TRTLLM_GEN_ROOT": "a FlashInfer benchmark tool's input (flashinfer/prims_ts/batched_gemm/tools/bench.py)",
    "TRTLLM_GEN_BUILD_DIR": "a FlashInfer benchmark tool's build directory (flashinfer/prims_ts/batched_gemm/tools/bench.py)",
    # Downloads, models, config and run-time state: not compile output.
    "VLLM_ASSETS_CACHE": "downloads of example media and S3/GCS model streams (vllm/assets/base.py get_cache_dir, "
    "vllm/transformers_utils/runai_utils.py), not compile output",
    "VLLM_MEDIA_CACHE": "opt-in cache of media fetched for requests (vllm/multimodal/media/connector.py), empty by default",
    "VLLM_CONFIG_ROOT": "usage-stats config and Ray's env-var list, no compiled code (vllm/usage/usage_lib.py, "
    "vllm/ray/ray_env.py)",
    "OUTLINES_CACHE_DIR": "outlines' grammar index cache, on disk only with VLLM_V1_USE_OUTLINES_CACHE=1 and filled by requests "
    "(vllm/v1/structured_output/utils.py get_outlines_cache)",
    "PROMETHEUS_MULTIPROC_DIR": "per-process metrics files in a TemporaryDirectory vLLM creates and deletes "
    "(vllm/v1/metrics/prometheus.py setup_multiprocess_prometheus)",
    "FLASHINFER_MOE_EP_KNOB_CACHE": "MoE-EP kernel knobs: written only by the offline tuner or a knobs='auto' run "
    "(flashinfer/moe_ep/.../shim/knob_cache.py record_knobs, shim/autotune.py), which vLLM never asks for; "
    "read by lookup_knobs. Ship a tuned file in the image",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "a disk cache that is off unless FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 "
    "(flashinfer/cute_dsl/sparse/bsa_utils/cache_utils.py)",
    "QUACK_CACHE_DIR": "torch's vendored quack CuTe-DSL kernels (torch/_vendor/quack/cache/jit.py get_cache_path, default "
    "$TMPDIR/<user>/torch_vendor_quack_cache) back torch's aten overrides on CUDA SM90+ with "
    "nvidia_cutlass_dsl installed (torch/_native/ops): fp32 topk with k in 16..1024, fp16/bf16/fp32 "
    "scatter_add, _fused_rms_norm. vLLM's own code calls none of them in those forms (rms_norm is written out "
    "in vllm/ir/ops/layernorm.py, its scatter_add_ is int64, the dummy sampler's top_k is vocab-1); model "
    "code that does compiles them under $TMPDIR, outside every component",
    "TORCH_VENDOR_QUACK_HOME": "base of TORCH_VENDOR_QUACK_CACHE_DIR's default, ~/.torch_vendor_quack/cache "
    "(torch/_vendor/quack/autotuner.py get_home_dir, default_cache_dir)",
    "TORCH_VENDOR_QUACK_CACHE_DIR": "results of torch's vendored quack @autotune (torch/_vendor/quack/autotuner.py FileCacheManager), used by "
    "its autotuned rmsnorm entry points only; torch's _fused_rms_norm override compiles the un-tuned kernel "
    "(torch/_native/ops/norm/norms.py)",
    "TVM_FFI_CACHE_DIR": "tvm-ffi's build cache (tvm_ffi/cpp/extension.py build_inline, default ~/.cache/tvm-ffi), which no vLLM "
    "start writes with torch 2.13: torch has Tensor.__dlpack_c_exchange_api__, so tvm_ffi skips building its "
    "DLPack addon (tvm_ffi/_optional_torch_c_dlpack.py load_torch_c_dlpack_extension), and FlashInfer calls "
    "load_inline without a build_directory only on backends vLLM never passes (flashinfer/gdn_prefill.py "
    "backend='cake_gdn', flashinfer/kda.py backend='ptx', Trace Apply); its other load_inline modules build "
    "in FLASHINFER_JIT_DIR (flashinfer/jit/cake_fmha_request_ordered.py, mamba/cake_ssd_combined.py)",
    "VLLM_XLA_CACHE_PATH": "TPU only, and nothing in this vLLM reads it (vllm/envs.py)",
    "FLYDSL_RUNTIME_CACHE_DIR": "ROCm only: AMD's FlyDSL kernels for DeepSeek-V4.1 (vllm/models/deepseek_v41/amd/mono/runner.py)",
    "B12X_ROCE_CACHE_DIR": "b12x's RDMA proxy library for multi-node comm (flashinfer/experimental/b12x/comm/roce/_proxy.py "
    "_cache_dir); vLLM imports only b12x.attention, .gemm, .moe and ._lib modules (vllm/utils/b12x.py "
    "_B12X_SUBMODULES), none of which loads comm.roce",
    # Debug output, written only when asked for.
    "TRITON_DUMP_DIR": "IR dumps, only with TRITON_KERNEL_DUMP=1 (triton/compiler/compiler.py compile)",
    "TRITON_OVERRIDE_DIR": "kernels read instead of compiled, only with TRITON_KERNEL_OVERRIDE=1 (triton/compiler/compiler.py "
    "compile)",
    "TORCH_COMPILE_DEBUG_DIR": "torch.compile debug traces (torch/_dynamo/config.py default_debug_dir_root), only with "
    "TORCH_COMPILE_DEBUG",
    "TORCHINDUCTOR_TRITON_PROTON_OUTPUT_DIR": "Proton profiles, only with TORCHINDUCTOR_TRITON_PROTON_PROFILING=1 (torch/_inductor/config.py)",
    "PARTITIONER_MEMORY_BUDGET_PARETO_DIR": "an SVG plot of the activation-checkpointing trade-off (torch/_functorch/config.py)",
    "CUTE_DSL_DUMP_DIR": "dumps: IR/PTX/cubin only with CUTE_DSL_KEEP (nvidia_cutlass_dsl .../base_dsl/env_manager.py dump_dir), "
    "IKET DAGs only when saved (.../cute/experimental/iket/dag.py save)",
    "CUTE_EXPERIMENTAL_DSL_DUMP_DIR": "the experimental DSL's dumps, only with CUTE_EXPERIMENTAL_DSL_KEEP (same dump_dir)",
    "FLASHINFER_DUMP_DIR": "tensor dumps at FLASHINFER_LOGLEVEL=10 (flashinfer/api_logging.py)",
    "FLASHINFER_TRACE_DUMP_DIR": "trace JSONs, only with FLASHINFER_TRACE_DUMP=1 (flashinfer/trace/template.py, fi_trace.py)",
    "B12X_PREPARATION_TRACE_DIR": "timing traces of b12x's preparation (flashinfer/experimental/b12x/preparation/_timing.py)",
    "TRITON_TEST_JUNIT_DIR": "Triton's own test runner (triton/_test_runner.py)",
    "TRITON_CI_COMPILE_TRACE_DIR": "Triton's own test runner (triton/_test_runner.py)",
    # Default paths built without a variable of their own, by the file that builds them.
    "vllm/envs.py": "get_default_cache_root: $XDG_CACHE_HOME or ~/.cache, the base of VLLM_CACHE_ROOT's default",
    "vllm/v1/structured_output/utils.py": "get_outlines_cache_path: OUTLINES_CACHE_DIR's defaults (see OUTLINES_CACHE_DIR)",
    "vllm/compilation/compiler_interface.py": "an error message that names ~/.cache/vllm/torch_compile_cache",
    "torch/_appdirs.py": "user_cache_dir: $XDG_CACHE_HOME or ~/.cache, the base of TORCH_EXTENSIONS_DIR's default "
    "(torch-extensions component)",
    "torch/_inductor/cache.py": "OnDiskCache.base_dir's $TMPDIR/cache/<name>: nothing in torch or vLLM builds an OnDiskCache, and its "
    "subclass InductorOnDiskCache moves base_dir into TORCHINDUCTOR_CACHE_DIR",
    "torch/_vendor/quack/cache/jit.py": "get_cache_path: QUACK_CACHE_DIR's default (see QUACK_CACHE_DIR)",
    "torch/cuda/_memory_viz.py": "format_flamegraph downloads flamegraph.pl to ~/.cache, a memory-profiling tool",
    "flashinfer/trace_apply/loaders/python.py": "_cache_base: solution sources of Trace Apply, which is off unless FLASHINFER_TRACE_APPLY=1 "
    "(flashinfer/__init__.py)",
    "flashinfer/experimental/b12x/loader/_native.py": "_build: b12x's io_uring weight loader under $XDG_CACHE_HOME/b12x/loader, which vLLM's b12x imports "
    "(vllm/utils/b12x.py) never load",
    "flashinfer/experimental/b12x/loader/_gds_native.py": "b12x's GPUDirect-Storage reader and cuFile config under $XDG_CACHE_HOME/b12x/gds, which vLLM's b12x "
    "imports never load",
}


# The first group of NOT_PACKED: unset, each cache lands inside a component; set in the env warmer
# runs in (an image's ENV, a shell that eval'ed an earlier `warmer fetch`), it lands where the value
# says, outside the root: packed by nothing, seen by no census, and hit again by verify in the same
# env, while every node misses it. A warm-up or verify run drops them (a recipe's [env] still wins).
MOVED_OUT: tuple[str, ...] = (
    "DG_JIT_CACHE_DIR",
    "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR",
    "FLASHINFER_CUBIN_DIR",
    "FLASHINFER_AUTOTUNE_DIR",
    "FLASHINFER_KDA_PTX_CACHE_DIR",
)


def serve_env(held: Held, root: Path, names: Iterable[str] | None = None) -> dict[str, str]:
    """What vLLM needs set for what an artifact restored in root holds (held: its file list), from
    each component's hook; names: the components the artifact carries (default: all)."""
    env: dict[str, str] = {}
    for c in ALL if names is None else [BY_NAME[n] for n in names if n in BY_NAME]:
        env.update(c.serve_env(held, root))
    return env


def checks(root: Path, env: Mapping[str, str], built: PathContract) -> dict[str, Check]:
    """Every component's check that a start with env uses its cache restored in root as it is. A
    check that fails (a file in the root it cannot read, a tool that hangs) is said as a warning:
    it judges a cache already activated, and fetch, serve and doctor run it on every start."""
    out = {}
    for c in ALL:
        try:
            out[c.name] = c.check(root, env, built)
        except Exception as e:  # the root's files are the pods' and the store's, not ours
            out[c.name] = Check(
                (
                    Finding(
                        WARNING,
                        c.name,
                        str(root),
                        f"could not check the restored {c.name} cache ({type(e).__name__}: {e}): whether "
                        "vLLM reuses it is not known",
                        f"`warmer doctor --root {root}` once it is readable; if it persists, report it as a bug",
                    ),
                )
            )
    return out


def cache_env(root: Path) -> dict[str, str]:
    """Every cache env var, pointed under root (an absolute path)."""
    env: dict[str, str] = {}
    for c in ALL:
        env.update(c.env_under(root))
    return env


def collect(root: Path) -> list[tuple[Component, str]]:
    """(component, path relative to root) for every file an artifact should hold."""
    return [(c, rel) for c in ALL for rel in c.files(root)]


def of_path(rel: str) -> Component | None:
    """The component a root-relative path belongs to."""
    return next((c for c in ALL if c.owns(rel)), None)


def excluded(rel: str) -> bool:
    """Whether a root-relative path is left out on purpose by the component it is under, or is junk."""
    return junk(rel) or any(c.leaves_out(rel) for c in ALL)


def default_paths(env: Mapping[str, str], user: str) -> dict[str, str]:
    """Where each cache env var's cache lands in env when the var is unset (as each library computes it)."""
    home = env.get("HOME") or os.path.expanduser("~")
    values = {
        "home": home,
        "xdg": env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"),
        "tmp": env.get("TMPDIR") or "/tmp",
        "user": user,
        "triton_home": env.get("TRITON_HOME") or home,
        "fi_base": env.get("FLASHINFER_WORKSPACE_BASE") or home,
    }
    return {var: template.format(**values) for c in ALL for var, template in c.defaults}


__all__ = [
    "ALL",
    "BY_NAME",
    "MOVED_OUT",
    "NOT_PACKED",
    "Check",
    "Component",
    "Held",
    "cache_env",
    "checks",
    "collect",
    "default_paths",
    "excluded",
    "junk",
    "of_path",
    "serve_env",
]
