"""PyTorch C++/CUDA extensions JIT-built at start-up with torch.utils.cpp_extension.load/load_inline.

FlashInfer's autotuner builds its %globaltimer kernel this way (flashinfer/utils.py
get_globaltimer_kernel) whenever it times with the GPU global timer: under Confidential Computing, or
with FLASHINFER_AUTOTUNE_TIMER=globaltimer (flashinfer/autotuner/autotuner.py AutoTuner.__init__),
and vLLM autotunes FlashInfer at start-up on SM >= 9.0. vLLM's hf3fs KV connector builds its client
the same way when the module is imported (vllm/distributed/kv_transfer/kv_connector/v1/hf3fs/
hf3fs_client.py). Unset, they land in $XDG_CACHE_HOME/torch_extensions/py<ver>_<accel>/<name>;
set, in $TORCH_EXTENSIONS_DIR/<name> (torch/utils/cpp_extension.py _get_build_directory).
"""

from warmer.components.base import Component

COMPONENT = Component(
    name="torch-extensions",
    subdir="torch_extensions",
    env=(("TORCH_EXTENSIONS_DIR", "torch_extensions"),),
    about="PyTorch extensions built at start-up (FlashInfer's autotune timer kernel)",
    # Each extension directory holds a FileBaton named "lock" (torch/utils/cpp_extension.py _jit_compile).
    exclude=("*/lock",),
    # ninja rebuilds from a build.ninja of absolute paths; moving it is untested.
    relocatable=False,
    defaults=(("TORCH_EXTENSIONS_DIR", "{xdg}/torch_extensions"),),
)

ORDER = 70  # where its caches come in warmer.components.ALL
COMPONENTS = (COMPONENT,)
