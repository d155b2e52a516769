"""warmer fingerprint: what this node is, as warmer keys artifacts by it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from warmer import api
from warmer.cli import Output
from warmer.errors import EXIT_OK

if TYPE_CHECKING:
    from warmer.api import Fingerprint

HELP = "describe this node"
ORDER = 10


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--root", help="also record this cache root")
    c.add_argument("--recipe", help="also record this recipe's served model path")


def run(args: argparse.Namespace, out: Output) -> int:
    fp = api.fingerprint(root=args.root, recipe_file=args.recipe)
    out.emit(fp, report(fp))
    return EXIT_OK


def report(fp: Fingerprint) -> str:
    gpu, cpu, paths = fp.gpu, fp.cpu, fp.paths
    if gpu.mixed:
        gpus = "MIXED: " + ", ".join(f"{d.index}: {d.name} (sm {d.compute_capability})" for d in gpu.devices)
    elif gpu.count:
        gpus = f"{gpu.count} x {gpu.name} (sm {gpu.compute_capability}, FlashInfer arch {gpu.arch})"
    else:
        gpus = "none" + (f" ({'; '.join(gpu.notes)})" if gpu.notes else "")
    pkgs = ", ".join(f"{k} {v}" for k, v in sorted(fp.packages.items())) or "none"
    lines = [
        f"machine:   {fp.machine} {fp.os}, glibc {fp.glibc}, python {fp.python}",
        f"cpu:       {cpu.model} ({cpu.vendor}), {cpu.threads} threads ({cpu.logical} logical), isa {' '.join(cpu.isa)}",
        f"gpus:      {gpus}",
    ]
    if gpu.count:
        lines.append(f"driver:    {gpu.driver}, cuda driver {gpu.cuda_driver} (from {gpu.source})")
    lines += [
        f"packages:  {pkgs}",
        f"toolchain: torch cuda {fp.torch_cuda}, nvcc {fp.nvcc}, ninja {fp.ninja}",
        "paths:     " + ", ".join(f"{k} {v}" for k, v in vars(paths).items() if v is not None),
    ]
    return "\n".join(lines)
