"""The wheels the GPU machine lacks for scripts/gpu-check.sh, in .whl/ (carried there; it has no network).

    python scripts/gpu_wheels.py build [--python-version 3.12] [--flashinfer 0.7.0.post1] [--dest .whl] [--max-mib 60]
    python scripts/gpu_wheels.py unpack --target DIR WHEEL...   (gpu-check.sh, where Python has no pip)
    python scripts/gpu_wheels.py device-site DIR   (tests: the GPU machine's packages, linked from here)
    python scripts/gpu_wheels.py fresh DIR   (gpu-check.sh: is DIR's warmer wheel this checkout's?)

The GPU machine has Python 3.12 with torch 2.11 (+cu130), Triton 3.6, requests, tqdm, jinja2,
filelock, numpy, packaging, nvidia-ml-py and pyyaml; nvcc and ninja. What the check imports beyond
that: flashinfer-python (the JIT attention and autotuned GEMM ops), apache-tvm-ffi (FlashInfer
loads its modules through it), zstandard (warmer's archives), jsonschema and its four dependencies
(warmer validates every recipe it loads) and warmer itself (pack, restore).
Everything else FlashInfer declares is left out; LEFT_OUT says why for each. `import flashinfer`
and the ops the check runs need none of them (tests/unit/test_gpu_check.py installs this set into
an environment holding only the GPU machine's packages and imports it).

Two FlashInfer versions (--flashinfer, FLASHINFER_SETS): 0.7.0.post1 with apache-tvm-ffi 0.1.11,
what vLLM 0.32's CUDA wheel pins and so what a vLLM 0.32 user runs (the default); and 0.7.2.post1
with apache-tvm-ffi 0.1.15.post2, the version warmer's jit extra installs here and the one the
first H200 run measured. One set is carried per run: the two together exceed what the tool may carry
(64 MiB with the tree). The second goes in a directory git ignores, e.g.
`make gpu-wheels GPU_FLASHINFER=0.7.2.post1 GPU_WHEELS_DIR=build/gpu-wheels-0.7.2.post1`, and
gpu-check.sh takes it with WARMER_GPU_WHEELS=build/gpu-wheels-0.7.2.post1 (carry that directory).

flashinfer-python 0.7.2.post1's wheel is 59 MiB as PyPI deflates it (0.7.0.post1's 32 MiB): with
the rest, over the 60 MiB the tool may carry. Each wheel is therefore rewritten with LZMA members
(zipfile, which pip reads with, decompresses them): the same files, byte for byte, checked against
the wheel's own RECORD hashes. The set fails to build if it still exceeds --max-mib.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

class WheelError(Exception):
    pass


# FlashInfer and the TVM-FFI it loads its modules through, pinned per set. Both satisfy
# flashinfer-python's "apache-tvm-ffi<0.2,>=0.1.11".
FLASHINFER_SETS = {
    # vLLM 0.32's CUDA wheel pins flashinfer-python==0.7.0.post1 and apache-tvm-ffi==0.1.11.
    "0.7.0.post1": ("flashinfer-python==0.7.0.post1", "apache-tvm-ffi==0.1.11"),
    # warmer's jit extra (pyproject) and the research notes; no vLLM 0.32 user runs it.
    "0.7.2.post1": ("flashinfer-python==0.7.2.post1", "apache-tvm-ffi==0.1.15.post2"),
}
DEFAULT_FLASHINFER = "0.7.0.post1"
COMMON = ("zstandard==0.25.0",
          # warmer validates every recipe it loads against its JSON Schema (warmer/recipe.py)
          "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
          "attrs==26.1.0")


def wanted(flashinfer: str = DEFAULT_FLASHINFER) -> tuple[str, ...]:
    if flashinfer not in FLASHINFER_SETS:
        raise WheelError(f"no wheel set for flashinfer {flashinfer!r}; choose from {', '.join(FLASHINFER_SETS)}")
    return FLASHINFER_SETS[flashinfer] + COMMON


WANTED = wanted()

# flashinfer-python 0.7.0.post1 and 0.7.2.post1 declare these; the check's imports and ops need none.
LEFT_OUT = {
    "ninja": "the GPU machine has ninja on PATH; the pip ninja would put another ninja first, and "
             "ninja's version is part of what a JIT cache depends on",
    "nvidia-cutlass-dsl": "CuTe-DSL kernels (Blackwell and newer paths), imported lazily; hundreds of MiB",
    "nvidia-cudnn-frontend": "cuDNN backends, imported in try/except (CUDNN_AVAILABLE); the check uses fa2 "
                             "attention and the cuBLASLt GEMM",
    "cuda-python": "cuda.bindings, used by CuTe-DSL and communication kernels, imported lazily",
    "cuda-tile": "cuTile backends, imported lazily",
    "nccl-extensions": "multi-GPU communication, imported lazily",
    "nccl4py": "multi-GPU communication, imported lazily",
    "einops": "used by kernels the check does not run, imported lazily",
    "click": "the `flashinfer` command line only",
    "tabulate": "the `flashinfer` command line only",
    "boto3": "warmer imports it only for s3:// stores; the check packs and restores files",
    "cryptography": "warmer imports it only to sign or verify artifacts; the check does neither",
}

# What the GPU machine has installed (the task's description of it); torch's requirements come along.
DEVICE_PACKAGES = ("torch", "triton", "requests", "tqdm", "jinja2", "filelock", "numpy", "packaging",
                   "nvidia-ml-py", "pyyaml")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
MIB = 1024 * 1024


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise WheelError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _record(z: zipfile.ZipFile) -> dict[str, str]:
    """path -> urlsafe-b64 sha256 from the wheel's RECORD (entries without a hash are skipped)."""
    name = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    out = {}
    for row in csv.reader(io.StringIO(z.read(name).decode())):
        if len(row) >= 2 and row[1].startswith("sha256="):
            out[row[0]] = row[1][len("sha256="):]
    return out


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def relzma(src: Path, dst: Path) -> dict:
    """Rewrite a wheel with LZMA members; every file must match the original RECORD's sha256."""
    with zipfile.ZipFile(src) as z:
        record = _record(z)
        tmp = dst.with_name(dst.name + ".partial")
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_LZMA) as out:
            for info in z.infolist():
                data = z.read(info.filename)
                want = record.get(info.filename)
                if want is not None and _digest(data) != want:
                    raise WheelError(f"{src.name}: {info.filename} does not match the wheel's RECORD")
                member = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                member.external_attr = info.external_attr
                out.writestr(member, data, compress_type=zipfile.ZIP_LZMA)
    with zipfile.ZipFile(tmp) as z:   # read back what was written, as pip will
        for name, want in record.items():
            if _digest(z.read(name)) != want:
                raise WheelError(f"{dst.name}: {name} changed in the rewrite")
    tmp.replace(dst)
    return {"files_checked": len(record)}


def warmer_source(repo: Path = REPO) -> str:
    """sha256 of what warmer's wheel is built from (the package's files and pyproject.toml): a set
    built from other sources carries another warmer than the checkout it travels with."""
    h = hashlib.sha256()
    files = [p for p in sorted((repo / "warmer").rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    for path in [*files, repo / "pyproject.toml"]:
        h.update(f"{path.relative_to(repo)}\0{path.stat().st_size}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def stale(dest: Path, repo: Path = REPO) -> str | None:
    """Why the set in dest carries another warmer than repo's (None: the same sources)."""
    try:
        built = json.loads((dest / "SET.json").read_text()).get("warmer_source")
    except (OSError, ValueError):
        built = None
    if built is None:
        return f"{dest}/SET.json does not say which sources its warmer wheel was built from"
    if built != warmer_source(repo):
        return f"the warmer wheel in {dest} was built from other sources than {repo}'s (make gpu-wheels again)"
    return None


def build(dest: Path, python_version: str, max_mib: float, cache: Path | None,
          flashinfer: str = DEFAULT_FLASHINFER) -> dict:
    """Download (and build warmer), rewrite, check the size; returns the manifest (also dest/SET.json)."""
    want = wanted(flashinfer)
    if not re.fullmatch(r"3\.\d+", python_version):
        raise WheelError(f"--python-version wants MAJOR.MINOR, e.g. 3.12, not {python_version!r}")
    dest.mkdir(parents=True, exist_ok=True)
    for old in list(dest.glob("*.whl")) + list(dest.glob("SET.json")):
        old.unlink()
    abi = "cp" + python_version.replace(".", "")
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-") as tmp:
        raw = Path(tmp, "raw")
        plat = [a for p in PLATFORMS for a in ("--platform", p)]
        _pip("download", "--quiet", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:",
             "--python-version", python_version, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
             "--abi", "none", *plat, "-d", str(raw), *want)
        # warmer itself, as a wheel (pure Python), built from a copy of this checkout's package so
        # that no build/ or egg-info is left in the tree.
        tree = Path(tmp, "src")
        shutil.copytree(REPO / "warmer", tree / "warmer", ignore=shutil.ignore_patterns("__pycache__"))
        for f in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / f, tree / f)
        build_args = ["wheel", "--quiet", "--disable-pip-version-check", "--no-deps", "-w", str(raw), str(tree)]
        if importlib.util.find_spec("setuptools") is not None:   # build here, fetching no build backend
            build_args.insert(1, "--no-build-isolation")
        _pip(*build_args)
        wheels = []
        for src in sorted(raw.glob("*.whl")):
            digest = _sha256(src)
            cached = cache / digest / src.name if cache else None
            if cached is not None and cached.exists():
                shutil.copy2(cached, dest / src.name)
                info = {"files_checked": "cached"}
            else:
                info = relzma(src, dest / src.name)
                if cached is not None:
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(dest / src.name, cached)
            wheels.append({"file": src.name, "bytes": (dest / src.name).stat().st_size,
                           "fetched_bytes": src.stat().st_size, "fetched_sha256": digest, **info})
    total = sum(w["bytes"] for w in wheels)
    doc = {"python_version": python_version, "flashinfer": flashinfer, "warmer_source": warmer_source(),
           "wanted": list(want),
           "platforms": list(PLATFORMS), "wheels": wheels,
           "total_bytes": total, "total_mib": round(total / MIB, 2), "max_mib": max_mib, "left_out": LEFT_OUT}
    (dest / "SET.json").write_text(json.dumps(doc, indent=1) + "\n")
    if total > max_mib * MIB:
        raise WheelError(f"the wheel set is {total / MIB:.1f} MiB, over {max_mib} MiB: "
                         + ", ".join(f"{w['file']} {w['bytes'] / MIB:.1f} MiB" for w in wheels))
    return doc


def unpack(wheels: list[Path], target: Path) -> list[str]:
    """What `pip install --no-index --no-deps --target` does with these wheels, for a Python without
    pip: refuse a wheel whose tags this interpreter does not accept, then unzip it (a .data/purelib
    or platlib directory goes to the top; scripts and headers are not needed)."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
    accepted = set(sys_tags())
    done = []
    for wheel in wheels:
        _, _, _, tags = parse_wheel_filename(wheel.name)
        if not tags & accepted:
            raise WheelError(f"{wheel.name} is not a supported wheel on this platform")
    target.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                dest = target.joinpath(*parts)
                if not dest.resolve().is_relative_to(target.resolve()):
                    raise WheelError(f"{wheel.name}: {info.filename} points outside the target")
                if info.is_dir():
                    dest.mkdir(parents=True, exist_ok=True)
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(z.read(info))
                if info.external_attr >> 16 & 0o111:
                    dest.chmod(0o755)
        done.append(wheel.name)
    return done


# ------------------------------------------------------------------ the GPU machine's packages

def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names) -> dict:
    """The installed distributions names need, with their requirements (extras not taken)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    seen, todo, missing = {}, list(names), []
    while todo:
        name = todo.pop()
        if _norm(name) in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        seen[_norm(name)] = dist
        for req in dist.requires or []:
            r = Requirement(req)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return {"dists": seen, "missing": sorted(set(missing))}


def device_site(dest: Path, names=DEVICE_PACKAGES) -> dict:
    """Link the installed files of names (and what they require) into dest: with dest as its only
    site-packages, a Python sees what the GPU machine has and nothing else."""
    found = closure(names)
    dest.mkdir(parents=True, exist_ok=True)
    linked = set()
    for dist in found["dists"].values():
        for f in dist.files or []:
            top = f.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or top in linked or os.path.lexists(dest / top):
                continue
            src = Path(dist.locate_file(top))
            if src.exists():
                (dest / top).symlink_to(src)
                linked.add(top)
    return {"distributions": sorted(found["dists"]), "missing": found["missing"]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download and check the wheel set")
    b.add_argument("--python-version", default="3.12")
    b.add_argument("--flashinfer", default=DEFAULT_FLASHINFER, choices=sorted(FLASHINFER_SETS),
                   help=f"which FlashInfer set (default {DEFAULT_FLASHINFER}, what vLLM 0.32 pins)")
    b.add_argument("--dest", type=Path, default=REPO / ".whl")
    b.add_argument("--max-mib", type=float, default=60.0)
    b.add_argument("--cache", type=Path, default=Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                   / "warmer" / "gpu-wheels", help="rewritten wheels, by the PyPI wheel's sha256")
    u = sub.add_parser("unpack", help="install wheels into a target dir without pip (pip's --target layout)")
    u.add_argument("--target", type=Path, required=True)
    u.add_argument("wheels", type=Path, nargs="+")
    d = sub.add_parser("device-site", help="link the GPU machine's packages from this Python into DIR")
    d.add_argument("dir", type=Path)
    f = sub.add_parser("fresh", help="exit 0 when DIR's warmer wheel is built from this checkout; else 1, saying why")
    f.add_argument("dir", type=Path)
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            doc = build(args.dest, args.python_version, args.max_mib, args.cache, args.flashinfer)
            for w in doc["wheels"]:
                print(f"{w['bytes'] / MIB:7.2f} MiB  {w['file']}  (as fetched or built: {w['fetched_bytes'] / MIB:.2f} MiB)")
            print(f"{doc['total_mib']:7.2f} MiB  in {args.dest}: flashinfer {args.flashinfer} for Python "
                  f"{args.python_version} "
                  f"(limit {args.max_mib:g} MiB); left out: {', '.join(LEFT_OUT)} (see {args.dest / 'SET.json'})")
        elif args.cmd == "fresh":
            why = stale(args.dir)
            if why:
                print(why)
                return 1
        elif args.cmd == "unpack":
            print(f"unpacked {', '.join(unpack(args.wheels, args.target))} into {args.target}")
        else:
            print(json.dumps(device_site(args.dir), indent=1))
    except WheelError as e:
        print(f"gpu-wheels: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
