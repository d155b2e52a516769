"""tvm-ffi's build cache: host modules FlashInfer JIT-builds with tvm_ffi.cpp.load_inline.

FlashInfer's GDN kernels (flashinfer/jit/cake_gdn.py load_cake_gdn_kernel: the prefill vLLM picks by
default on Hopper for Qwen3-Next-style models, vllm/model_executor/layers/mamba/gdn/
qwen_gdn_linear_attn.py _resolve_gdn_prefill_backend) and its KDA PTX runtime
(flashinfer/kda_kernels/ptx/static_runtime.py) call load_inline without a build_directory. The module
then lands in $TVM_FFI_CACHE_DIR/<name>_<hash>, else ~/.cache/tvm-ffi (tvm_ffi/cpp/extension.py
build_inline): outside FLASHINFER_WORKSPACE_BASE, so the flashinfer component never saw it.
"""

from warmer.components.base import Component

COMPONENT = Component(
    name="tvm-ffi",
    subdir="tvm_ffi",
    env=(("TVM_FFI_CACHE_DIR", "tvm_ffi"),),
    about="host modules FlashInfer builds through tvm-ffi (GDN, KDA)",
    # Each module directory holds a FileLock named "lock" (tvm_ffi/cpp/extension.py _build_impl).
    exclude=("*/lock",),
    # Built by ninja on every load from a build.ninja of absolute paths, like FlashInfer's own modules.
    relocatable=False,
    defaults=(("TVM_FFI_CACHE_DIR", "{home}/.cache/tvm-ffi"),),
)
