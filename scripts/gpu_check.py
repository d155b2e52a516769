"""The work scripts/gpu-check.sh runs on a GPU machine, one phase per process.

    python scripts/gpu_check.py run ROOT OUT.json [--device cuda|cpu]

runs a FlashInfer op (JIT-built by ninja/nvcc on a miss) and a torch.compile'd function (Triton
kernels on CUDA, C++ on CPU) with every cache under ROOT, and writes what it measured: Inductor's
FX-graph cache hits and misses, the FlashInfer dry run before the op, files under ROOT.
`--device cpu` exercises the same flow without a GPU (FlashInfer then only builds its module).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run(root: Path, out: Path, device: str) -> None:
    from warmer.components import flashinfer as fi_component

    result = {"device": device, "flashinfer_dry_run": fi_component.dry_run(root, dict(os.environ))}
    import torch
    from torch._dynamo.utils import counters

    from flashinfer.jit.activation import gen_act_and_mul_module

    if device == "cuda":
        import flashinfer

        x = torch.randn(64, 2 * 1024, device="cuda", dtype=torch.float16)
        y = flashinfer.activation.silu_and_mul(x)
        ref = torch.nn.functional.silu(x[:, :1024]) * x[:, 1024:]
        result["flashinfer_op_max_err"] = float((y - ref).abs().max())
    else:
        gen_act_and_mul_module("silu").build(verbose=False)  # no GPU to load it on

    @torch.compile
    def f(a, b):
        return torch.sin(a) * b + torch.cos(b).sum(dim=-1, keepdim=True)

    a = torch.randn(256, 512, device=device)
    b = torch.randn(256, 512, device=device)
    got = f(a, b)
    result["compile_max_err"] = float((got - (torch.sin(a) * b + torch.cos(b).sum(-1, keepdim=True))).abs().max())
    result["inductor"] = {k: v for k, v in counters["inductor"].items() if "cache" in k}
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    args = sys.argv[1:]
    device = args[args.index("--device") + 1] if "--device" in args else "cuda"
    run(Path(args[1]), Path(args[2]), device)
