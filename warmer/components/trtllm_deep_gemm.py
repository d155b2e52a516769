"""FlashInfer's TensorRT-LLM DeepGEMM JIT: FP8 block-scale GEMM kernels nvcc builds on Hopper.

FlashInfer's SM90 FP8 block-scale GEMM and its CUTLASS fused MoE turn this JIT on when they load
(flashinfer/gemm/gemm_base.py get_fp8_blockscale_gemm_runner_sm90, flashinfer/fused_moe/core.py:
set_deepgemm_jit_include_dirs). vLLM picks that GEMM first for FP8 block-scale linear layers on SM90
when FlashInfer and DeepGEMM are installed, for batches under 32 tokens
(vllm/model_executor/kernels/linear/__init__.py _POSSIBLE_FP8_BLOCK_KERNELS:
FlashInferFp8DeepGEMMDynamicBlockScaledKernel; VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER defaults to 1).
Each kernel shape is compiled with nvcc (flashinfer/data/csrc/nv_internal/tensorrt_llm/deep_gemm/
compiler.cuh Compiler::build; runtime.cuh kJitUseNvcc is always true) into
$TRTLLM_DG_CACHE_DIR/cache/<shape>/nvcc_kernel.cubin, else ~/.tensorrt_llm/cache (getDefaultUserDir),
which RuntimeCache loads on the next start. The variable is read in C++, not Python.
"""

from warmer.components.base import Component

COMPONENT = Component(
    name="trtllm-deep-gemm",
    subdir="trtllm_deep_gemm",
    env=(("TRTLLM_DG_CACHE_DIR", "trtllm_deep_gemm"),),
    about="FP8 block-scale GEMM kernels FlashInfer's TRT-LLM DeepGEMM JIT builds with nvcc (Hopper)",
    # cache/ holds the finished kernels; tmp/ the ones nvcc is compiling (removed once renamed into cache/).
    exclude=("tmp/*",),
    # An entry's directory name is the kernel's shape signature and nothing in it holds a path.
    relocatable=True,
    defaults=(("TRTLLM_DG_CACHE_DIR", "{home}/.tensorrt_llm"),),
)

ORDER = 80  # where its caches come in warmer.components.ALL
COMPONENTS = (COMPONENT,)
