"""FlashInfer's workspace: JIT modules built by ninja, generated sources, cubins, autotune results.

FLASHINFER_WORKSPACE_BASE is the only knob for the workspace (FLASHINFER_CACHE_DIR is not an
env var). A JIT module is reused only when `ninja` finds nothing to do, and ninja rebuilds when
the workspace's real path, the install paths in the command line, CUDA_HOME, the ninja version,
the compile-affecting env or file times differ (research/flashinfer-caches.md §2). So the
artifact records those (the path contract), fetch compares them with the node's, and a dry run
of ninja in every module proves "no work to do" after a restore.

Nothing here imports flashinfer or torch: install dirs are found with importlib's finders.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sysconfig
from importlib import metadata
from pathlib import Path

from warmer.components.base import Component

CACHE = ".cache/flashinfer"  # under FLASHINFER_WORKSPACE_BASE

COMPONENT = Component(
    name="flashinfer",
    subdir="flashinfer",
    env=(("FLASHINFER_WORKSPACE_BASE", "flashinfer"),
         ("FLASHINFER_AUTOTUNE_CACHE_DIR", f"flashinfer/{CACHE}/autotune")),
    about="JIT modules (cached_ops, generated), cubins, autotune",
    # The log is reopened by every import; cached_ops/tmp holds the per-module locks.
    exclude=("*/flashinfer_jit.log", "*/cached_ops/tmp/*"),
    relocatable=False,
)

B12X = Component(
    name="b12x",
    subdir="b12x",
    env=(("B12X_COMPILE_CACHE_DIR", "b12x"),),
    about="compile and tuning caches of FlashInfer's b12x (CuTe DSL) kernels",
    # Its key hashes relative package paths, CUDA_HOME and versions; moving it is untested.
    relocatable=False,
)

# Variables that change a JIT module's compile command, so a change makes ninja rebuild.
COMPILE_ENV = ("CUDA_HOME", "CUDA_PATH", "CC", "CXX", "FLASHINFER_NVCC", "FLASHINFER_NVCC_LAUNCHER",
               "FLASHINFER_CXX_LAUNCHER", "FLASHINFER_EXTRA_CFLAGS", "FLASHINFER_EXTRA_CUDAFLAGS",
               "FLASHINFER_EXTRA_LDFLAGS", "FLASHINFER_NVCC_THREADS", "FLASHINFER_JIT_DEBUG",
               "FLASHINFER_JIT_VERBOSE", "FLASHINFER_JIT_LINEINFO", "FLASHINFER_CUDA_ARCH_LIST")


def modules(root: Path) -> list[Path]:
    """Every JIT module directory (one build.ninja each) in root's FlashInfer workspace."""
    return sorted(p.parent for p in (root / COMPONENT.subdir / CACHE).glob("*/*/cached_ops/*/build.ninja"))


def cuda_home(env: dict) -> str | None:
    """The CUDA_HOME FlashInfer will use: its own rule (jit/cpp_ext.py get_cuda_path)."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc))
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda") else None


def _ninja(env: dict) -> tuple[str | None, str | None]:
    """(path, version) of the ninja FlashInfer runs: the first on PATH."""
    path = shutil.which("ninja", path=env.get("PATH"))
    if not path:
        return None, None
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        version = None
    return path, version


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    return os.path.dirname(spec.origin) if spec and spec.origin else None


def contract(root: Path, env: dict) -> dict | None:
    """The paths and settings FlashInfer's JIT cache under root depends on; None without FlashInfer."""
    install = _package_dir("flashinfer")
    if install is None and not modules(root):
        return None
    commit = None
    if install:
        meta = Path(install, "_build_meta.py")
        m = re.search(r"__git_commit__\s*=\s*['\"]([0-9a-f]+)['\"]", meta.read_text()) if meta.exists() else None
        commit = m.group(1) if m else None
    try:
        version = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        version = None
    _, ninja_version = _ninja(env)
    return {
        "workspace_base": os.path.realpath(root / COMPONENT.subdir),
        "version": version,
        "install_dir": install,
        "git_commit": commit,
        "tvm_ffi_dir": _package_dir("tvm_ffi"),
        "python_include": sysconfig.get_paths()["include"],
        "cuda_home": cuda_home(env),
        "ninja": ninja_version,
        "env": {k: env[k] for k in COMPILE_ENV if k in env},
        "modules": [m.name for m in modules(root)],
    }


def compare(built: dict, node: dict | None) -> list[str]:
    """Why FlashInfer on this node will rebuild the artifact's JIT modules; empty if it will not."""
    if not built or not built.get("modules"):
        return []
    if node is None:
        return ["FlashInfer is not installed here, so the cache cannot be checked (fetch outside the serving "
                "image?): run `warmer verify` in the serving container"]
    labels = {"workspace_base": "workspace real path (ninja keys on absolute paths; a symlink does not help)",
              "version": "flashinfer-python version", "install_dir": "flashinfer install dir",
              "git_commit": "flashinfer git commit", "tvm_ffi_dir": "tvm-ffi install dir",
              "python_include": "Python include dir", "cuda_home": "CUDA_HOME",
              "ninja": "ninja version (its log format differs)"}
    out = [f"{label}: built with {built.get(k)!r}, here {node.get(k)!r}"
           for k, label in labels.items() if built.get(k) != node.get(k)]
    for var in sorted(set(built.get("env", {})) | set(node.get("env", {}))):
        b, n = built["env"].get(var), node["env"].get(var)
        if b != n:
            out.append(f"{var}: built with {b!r}, here {n!r} (it is in the compile command)")
    return out


def dry_run(root: Path, env: dict) -> dict:
    """`ninja -n -d explain` in every module: {"modules": {name: {"clean", "reasons"}}, "clean": bool}."""
    mods = modules(root)
    path, version = _ninja(env)
    if not mods:
        return {"clean": True, "modules": {}}
    if path is None:
        return {"clean": None, "skipped": "ninja is not on PATH: the dry run was skipped", "modules": {}}
    result = {}
    for m in mods:
        if str(Path(os.path.realpath(m))) not in (m / "build.ninja").read_text():
            # Written for another path: FlashInfer regenerates it here, and everything rebuilds.
            result[m.name] = {"clean": False, "reasons": [f"build.ninja names other paths than {m}: the cache "
                                                          "was built under another workspace"]}
            continue
        out = subprocess.run([path, "-n", "-d", "explain", "-C", str(m), "-f", "build.ninja"],
                             capture_output=True, text=True, env=env, timeout=120)
        text = out.stdout + out.stderr
        clean = out.returncode == 0 and "no work to do" in text
        reasons = [line.split("ninja explain: ", 1)[1] for line in text.splitlines() if "ninja explain: " in line]
        result[m.name] = {"clean": clean, "reasons": reasons[:5]}
    return {"clean": all(r["clean"] for r in result.values()), "ninja": version, "modules": result}


def _oldest_output_ns(module: Path) -> int | None:
    """The earliest time ninja holds for the module's outputs: their mtimes, and the mtimes
    .ninja_log recorded (ninja >= 1.12 compares inputs with those, taken when a command starts)."""
    times = [p.stat().st_mtime_ns for p in module.iterdir() if p.suffix in (".o", ".so")]
    try:
        for line in (module / ".ninja_log").read_text().splitlines():
            fields = line.split("\t")
            if len(fields) >= 4 and fields[2].isdigit() and int(fields[2]) > 0:
                times.append(int(fields[2]))
    except FileNotFoundError:
        pass
    return min(times) if times else None


def newer_inputs(root: Path, env: dict) -> list[tuple[str, str]]:
    """(input, module) for every recorded input newer than its module's oldest output: the
    inputs that make ninja rebuild after a `pip install` gave installed headers new mtimes."""
    path, _ = _ninja(env)
    if path is None:
        return []
    found = []
    for m in modules(root):
        out = subprocess.run([path, "-C", str(m), "-f", "build.ninja", "-t", "deps"], capture_output=True,
                             text=True, env=env, timeout=120).stdout
        oldest = _oldest_output_ns(m)
        if oldest is None:
            continue
        deps = {line.strip() for line in out.splitlines() if line.startswith("    ")}
        for dep in sorted(deps):
            try:
                if os.stat(dep).st_mtime_ns > oldest:
                    found.append((dep, m.name))
            except FileNotFoundError:
                continue
    return found


def backdate(root: Path, env: dict, *, apply: bool, include_site_packages: bool) -> dict:
    """Set the mtime of inputs newer than the cache to just before its oldest output.

    Files under site-packages (pip gives installed headers the install time) are changed only
    with include_site_packages: they belong to the Python environment, not to the cache."""
    site = sysconfig.get_paths()["purelib"]
    changed, held_back = [], []
    for dep, module in newer_inputs(root, env):
        if dep.startswith(site) and not include_site_packages:
            held_back.append(dep)
            continue
        changed.append(dep)
        if apply:
            when = _oldest_output_ns(modules_by_name(root)[module]) - 1_000_000_000
            os.utime(dep, ns=(when, when))
    return {"applied": apply, "files": changed, "held_back_site_packages": held_back}


def modules_by_name(root: Path) -> dict[str, Path]:
    return {m.name: m for m in modules(root)}


def artifact_env(doc: dict, root: Path) -> dict[str, str]:
    """Serve env that depends on what the artifact holds: when its warm-up downloaded cubins, point
    FlashInfer at them and forbid downloads, so a node without network starts without waiting."""
    cubins = f"{COMPONENT.subdir}/{CACHE}/cubins/"
    if any(f["path"].startswith(cubins) for f in doc["files"]):
        return {"FLASHINFER_CUBIN_DIR": str(root / cubins.rstrip("/")), "FLASHINFER_NO_DOWNLOAD": "1"}
    return {}


def check(root: Path, env: dict, built: dict | None, *, backdate_inputs: bool = False,
          include_site_packages: bool = False) -> dict:
    """Everything `warmer flashinfer-check` reports: the contract against the build's, ninja's
    dry run, inputs newer than the cache, and (when asked) the back-dating fix."""
    report = {"contract": compare(built, contract(root, env)) if built else [],
              "dry_run": dry_run(root, env),
              "newer_inputs": [{"file": f, "module": m} for f, m in newer_inputs(root, env)]}
    if backdate_inputs:
        report["backdate"] = backdate(root, env, apply=True, include_site_packages=include_site_packages)
        report["dry_run_after"] = dry_run(root, env)
    return report
