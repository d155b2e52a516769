"""A synthetic cache root shaped like a real one, for the benchmark: deterministic for a seed.

    inductor/                       Inductor: kernel .py/.cpp/.json by the thousand, .so kernels,
                                    FX-graph entries
    vllm/torch_compile_cache/...    vLLM: computation_graph.py, transformed_code.py, inductor artifacts
    triton/<hash>/                  Triton: .json/.ptx/.ttir/.llir/.source and .cubin
    flashinfer/.cache/flashinfer/<ver>/<arch>/cached_ops/<m>/   FlashInfer JIT: build.ninja, .o, .so

About an eighth of the bytes are small text files, compressible like source code (zstd -3: ~4x);
the rest are binaries made of 4 KiB blocks, partly random (code and data that do not compress),
partly near-copies of a few templates (repeated instruction sequences, symbol tables) and
partly zero runs (alignment padding), so that the whole tree compresses 2-4x like real caches.
Lock files, FlashInfer's JIT log and its cached_ops/tmp are written too: warmer's components
must leave them out.

    python bench/tree.py DIR [--size 1GiB] [--seed 0]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
from pathlib import Path

TEXT_SHARE = 0.125          # of the bytes
TEXT_MEDIAN = 6 << 10       # lognormal file sizes, clipped below
TEXT_RANGE = (200, 512 << 10)
BIN_MEDIAN = 512 << 10
BIN_RANGE = (16 << 10, 64 << 20)
BLOCK = 4096
# Shares of a binary's 4 KiB blocks: random / template copy with a few changed bytes / zeros.
BIN_MIX = (0.28, 0.55, 0.17)
FI_VERSION, FI_ARCH = "0.7.2", "90a"
STAMP = ".bench-tree.json"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: use e.g. 1GiB, 256MiB, 64M")
    return int(float(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper()))


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _hash(rng: random.Random, n: int = 32) -> str:
    return "%0*x" % (n, rng.getrandbits(4 * n))


def _sizes(rng: random.Random, budget: int, median: int, lo_hi: tuple[int, int], sigma: float) -> list[int]:
    out, left = [], budget
    while left > lo_hi[0]:
        n = int(min(max(rng.lognormvariate(math.log(median), sigma), lo_hi[0]), lo_hi[1], left))
        out.append(n)
        left -= n
    return out


# -- text: lines like the code the compilers write, with identifiers and numbers that vary ---------

_PY = ["    tmp{a} = tl.load(in_ptr{b} + (x{c} + {d}*x{e}), xmask, eviction_policy='evict_last')",
       "    tmp{a} = tmp{b} * tmp{c}", "    tmp{a} = tl.where(tmp{b}, tmp{c}, {f})",
       "    xoffset = tl.program_id(0) * XBLOCK", "    x{a} = xindex % {d}",
       "    tl.store(out_ptr{b} + (x{c}), tmp{a}, xmask)",
       "@triton_heuristics.pointwise(size_hints=[{d}], filename=__file__, triton_meta={{'signature': {{{a}: '*fp32'}}}})",
       "def triton_poi_fused_add_mul_{a}(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK : tl.constexpr):",
       "buf{a} = empty_strided_cuda(({d}, {e}), ({e}, 1), torch.bfloat16)",
       "extern_kernels.mm(reinterpret_tensor(buf{b}, ({d}, {e}), ({e}, 1), 0), arg{c}_1, out=buf{a})",
       "# kernel path: /root/.cache/inductor/{h2}/c{h}.py", "del buf{a}"]
_CPP = ["    for(int64_t x{a}=static_cast<int64_t>(0L); x{a}<static_cast<int64_t>({d}L); x{a}+=static_cast<int64_t>(16L))",
        "        auto tmp{a} = at::vec::Vectorized<float>::loadu(in_ptr{b} + static_cast<int64_t>(x{c} + {d}L*x{e}), 16);",
        "        auto tmp{a} = tmp{b} * tmp{c};", "        tmp{a}.store(out_ptr{b} + static_cast<int64_t>(x{c}));",
        "#include \"/tmp/torchinductor_root/precompiled_headers/{h}.h\"",
        "extern \"C\"  void kernel_{a}(const float* in_ptr{b}, float* out_ptr{c})", "    }}", "{{"]
_JSON = ['  "hash": "{h}",', '  "num_warps": {b},', '  "shared": {d},', '  "name": "triton_poi_fused_{a}",',
         '  "target": {{"backend": "cuda", "arch": {e}, "warp_size": 32}},', '  "constants": {{"XBLOCK": {d}}},',
         '  "{h2}": [{a}, {b}, {c}],']
_PTX = ["\tld.global.v4.b32 {{%r{a}, %r{b}, %r{c}, %r{e}}}, [ %rd{d} + 0 ];", "\tmul.f32 \t%f{a}, %f{b}, %f{c};",
        "\tadd.s64 \t%rd{a}, %rd{b}, %rd{c};", "\tst.global.b32 \t[ %rd{a} + 0 ], {{ %r{b} }};",
        "\tsetp.lt.s32 \t%p{a}, %r{b}, {d};", "$L__BB0_{a}:", "\t.loc\t1 {b} {c}"]
_NINJA = ["build {h}.cuda.o: cuda_compile /opt/flashinfer/csrc/{h2}.cu",
          "cuda_cflags = -gencode=arch=compute_{e},code=sm_{e} -O3 -std=c++17 -DFLASHINFER_{a}",
          "  command = $nvcc --generate-dependencies-with-compile $cuda_cflags -c $in -o $out", "rule cuda_compile"]
KINDS = {"py": _PY, "cpp": _CPP, "json": _JSON, "ptx": _PTX, "ninja": _NINJA}


def _pool(rng: random.Random, templates: list[str], n: int = 6000) -> list[str]:
    def num(hi: int) -> int:  # small numbers are common, like real generated code
        return int(hi ** rng.random())
    return [rng.choice(templates).format(a=num(400), b=num(40), c=num(400), d=num(65536), e=num(128),
                                         f=rng.choice(["0.0", "-inf", "1.0"]), h=_hash(rng, 52), h2=_hash(rng, 2))
            for _ in range(n)]


def _text(rng: random.Random, pool: list[str], size: int) -> bytes:
    out, n = [], 0
    while n < size:
        lines = rng.choices(pool, k=64)
        out.extend(lines)
        n += sum(map(len, lines)) + 64
    return "\n".join(out).encode()[:size]


# -- binaries: random blocks, near-copies of templates, zero runs ---------------------------------

def _binary(rng: random.Random, templates: list[bytes], size: int) -> bytes:
    blocks = []
    rand, tmpl, _ = BIN_MIX
    zero = bytes(BLOCK)
    for _ in range(-(-size // BLOCK)):
        r = rng.random()
        if r < rand:
            blocks.append(rng.randbytes(BLOCK))
        elif r < rand + tmpl:
            t = rng.choice(templates)
            at = rng.randrange(0, BLOCK - 64)
            blocks.append(t[:at] + rng.randbytes(16) + t[at + 16:])
        else:
            blocks.append(zero)
    return b"".join(blocks)[:size]


def _dir_hash(kind: str, k: int, n: int) -> str:
    """A stable hash-like name for the k-th directory of a kind (e.g. one Triton kernel)."""
    return hashlib.sha256(f"{kind}-{k}".encode()).hexdigest()[:n]


def _text_path(rng: random.Random, i: int) -> tuple[str, str]:
    """(path under the root, kind of text) for the i-th small file."""
    r = rng.random()
    h = _hash(rng)
    if r < 0.45:  # Inductor: 256 two-letter directories of generated kernels
        ext = rng.choice(["py", "py", "py", "cpp", "json"])
        return f"inductor/{h[:2]}/c{h[:50]}.{ext}", ext
    if r < 0.55:  # vLLM: a few compiled graphs, each a directory of many files
        name = rng.choice(["computation_graph.py", "transformed_code.py", f"cache_key_factors_{i}.json",
                           f"submod_{i}.py"])
        return (f"vllm/torch_compile_cache/{_dir_hash('vllm', i % 4, 10)}/rank_0_0/backbone/{name}",
                name.rsplit(".", 1)[1])
    if r < 0.90:  # Triton: a directory per kernel holding its stages (and its cubin, below)
        ext = rng.choice(["json", "ptx", "ttir", "ttgir", "llir", "source"])
        kind = {"ttir": "py", "ttgir": "py", "llir": "ptx", "source": "py"}.get(ext, ext)
        return f"triton/{_dir_hash('triton', i // 5, 52)}/triton_poi_fused_{i // 5}.{ext}", kind
    m = f"batch_prefill_with_kv_cache_dtype_q_bf16_{i % 12}"
    base = f"flashinfer/.cache/flashinfer/{FI_VERSION}/{FI_ARCH}"
    if rng.random() < 0.5:
        return f"{base}/generated/{m}/kernel_{i}.cu", "cpp"
    return f"{base}/cached_ops/{m}/build.ninja" if i % 7 == 0 else f"{base}/cached_ops/{m}/{h[:8]}.d", "ninja"


def _binary_path(rng: random.Random, i: int, kernels: int) -> str:
    r = rng.random()
    h = _hash(rng)
    if r < 0.25:
        return (f"inductor/{h[:2]}/c{h[:50]}.so" if rng.random() < 0.6
                else f"inductor/fxgraph/{h[:2]}/f{h[:50]}/{_hash(rng, 40)}")
    if r < 0.50:
        return (f"vllm/torch_compile_cache/{_dir_hash('vllm', i % 4, 10)}/rank_0_0/backbone/"
                f"artifact_shape_None_subgraph_{i}")
    if r < 0.65:
        k = rng.randrange(max(kernels, 1))
        return f"triton/{_dir_hash('triton', k, 52)}/triton_poi_fused_{k}_{i}.cubin"
    m = f"batch_prefill_with_kv_cache_dtype_q_bf16_{i % 12}"
    ext = rng.choice([".cuda.o", ".cuda.o", ".so"])
    return f"flashinfer/.cache/flashinfer/{FI_VERSION}/{FI_ARCH}/cached_ops/{m}/{h[:12]}{ext}"


# What warmer must leave out: lock files, FlashInfer's per-module locks and its JIT log.
EXCLUDED = ["inductor/locks/c1.lock", "triton/abc.lock", "vllm/torch_compile_cache/x/rank_0_0/backbone/x.lock",
            f"flashinfer/.cache/flashinfer/{FI_VERSION}/{FI_ARCH}/cached_ops/tmp/m.lock",
            f"flashinfer/.cache/flashinfer/{FI_VERSION}/{FI_ARCH}/flashinfer_jit.log"]


def generate(root: Path, size: int, seed: int = 0, scale: int = 1) -> dict:
    """Write the tree (replacing one with other parameters); return its summary.

    scale multiplies every binary's size and keeps the files: the same tree, more bytes."""
    params = {"size": size, "seed": seed, "scale": scale, "version": 2}
    stamp = root / STAMP
    if stamp.exists():
        done = json.loads(stamp.read_text())
        if done.get("params") == params:
            return done
    if root.exists():
        shutil.rmtree(root)
    rng = random.Random(seed)
    pools = {k: _pool(rng, t) for k, t in KINDS.items()}
    templates = [rng.randbytes(BLOCK) for _ in range(64)]
    files, text_bytes, bin_bytes = 0, 0, 0
    written: set[str] = set()

    def write(rel: str, data: bytes) -> None:
        nonlocal files
        if rel in written:  # a repeated name (fixed names like build.ninja): keep the first
            return
        written.add(rel)
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        files += 1

    texts = _sizes(rng, int(size * TEXT_SHARE), TEXT_MEDIAN, TEXT_RANGE, 1.1)
    for i, n in enumerate(texts):
        rel, kind = _text_path(rng, i)
        write(rel, _text(rng, pools[kind], n))
        text_bytes += n
    for i, n in enumerate(_sizes(rng, size - text_bytes, BIN_MEDIAN, BIN_RANGE, 1.4)):
        write(_binary_path(rng, i, len(texts) // 5), _binary(rng, templates, n * scale))
        bin_bytes += n * scale
    for rel in EXCLUDED:
        write(rel, b"")
    summary = {"params": params, "files": files, "bytes": sum((root / r).stat().st_size for r in written),
               "excluded_files": len(EXCLUDED)}
    stamp.write_text(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=int, default=1, help="multiply the binaries' sizes, keep the files")
    a = p.parse_args(argv)
    s = generate(Path(a.dir), a.size, a.seed, a.scale)
    print(f"{a.dir}: {s['files']} files, {human(s['bytes'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
