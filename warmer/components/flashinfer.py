"""FlashInfer's caches as warmer packs them, and what decides whether they are reused.

Packed: the JIT workspace (modules built by ninja, generated sources, cubins, autotune results)
and the b12x (CuTe DSL) kernels' own cache. FLASHINFER_WORKSPACE_BASE is the only knob for the
workspace (FLASHINFER_CACHE_DIR is not an env var: flashinfer/jit/env.py).

Reused: a JIT module is reused only when `ninja` finds nothing to do (flashinfer/jit/core.py
build_and_load), and ninja rebuilds when the workspace's real path, the install paths in the
command line, CUDA_HOME, the ninja version, the compile-affecting env or file times differ
(flashinfer/jit/cpp_ext.py writes absolute paths into build.ninja; jit/core.py runs ninja on every
load). So the artifact records those (FlashInferContract, part of the path contract), fetch
compares them with the node's, and a dry run of ninja in every module (this component's check)
proves "no work to do" after a restore. `warmer flashinfer-check` shows the same and can back-date
newer inputs.

Nothing here imports flashinfer or torch: install dirs are found with importlib's finders.
"""

from __future__ import annotations

import os
import re
import subprocess
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from warmer.components.base import Check, Component, Held
from warmer.finding import WARNING, Finding
from warmer.fingerprint import cuda_home, installed_version, ninja_path_and_version, nvcc_version, package_dir
from warmer.untrusted import Fields, InvalidDocument

if TYPE_CHECKING:
    from warmer.contract import PathContract

CACHE = ".cache/flashinfer"  # under FLASHINFER_WORKSPACE_BASE
SUBDIR = "flashinfer"
CUBINS = f"{SUBDIR}/{CACHE}/cubins/"  # what FlashInfer downloaded, root-relative


class JitWorkspace(Component):
    """The JIT workspace: its cubins need FLASHINFER_CUBIN_DIR, its modules a clean ninja dry run."""

    def serve_env(self, held: Held, root: Path) -> dict[str, str]:
        """When the warm-up downloaded cubins, point FlashInfer at them (flashinfer/jit/env.py:
        FLASHINFER_CUBIN_DIR wins over the default)."""
        if held.any_under(CUBINS):
            return {"FLASHINFER_CUBIN_DIR": str(root / CUBINS.rstrip("/"))}
        return {}

    def env_under(self, root: Path) -> dict[str, str]:
        """Through the link to a shared workspace (warmer/workspace.py), its real path: FlashInfer
        writes the base as given into build.ninja, and ninja rebuilds for any other spelling."""
        here = root / self.subdir
        if not os.path.islink(here):  # os.path's: False in a root this user cannot enter (its checks say so)
            return super().env_under(root)
        real = Path(os.path.realpath(here))
        return {var: str(real / Path(rel).relative_to(self.subdir)) for var, rel in self.env}

    def check(self, root: Path, env: Mapping[str, str], built: PathContract) -> Check:
        """The env, the paths FlashInfer's JIT modules were built against (their contract) against
        this node's, and ninja's dry run of every restored module, in the env vLLM starts with."""
        found = list(super().check(root, env, built).findings)
        fi = built.flashinfer
        if fi and fi.modules:
            reasons = compare(fi, contract(root, dict(env)))
            if reasons:
                found.append(
                    Finding(
                        WARNING,
                        "path-contract",
                        str(root),
                        f"FlashInfer will rebuild {len(fi.modules)} JIT module(s) ({', '.join(fi.modules[:5])}) "
                        "because: " + "; ".join(reasons),
                        f"serve from the build's paths ({built.root}), or build an artifact at these paths",
                    )
                )
        result = dry_run(root, dict(env), fi)
        dirty = [m for m, r in result["modules"].items() if not r["clean"]]
        if dirty:
            found.append(
                Finding(
                    WARNING,
                    self.name,
                    str(root),
                    f"ninja would rebuild FlashInfer module(s) {', '.join(dirty)}: "
                    f"see `warmer flashinfer-check --root {root}`",
                    f"`warmer flashinfer-check --root {root}`",
                )
            )
        return Check(tuple(found), result)


COMPONENT = JitWorkspace(
    name="flashinfer",
    subdir=SUBDIR,
    env=(
        ("FLASHINFER_WORKSPACE_BASE", SUBDIR),
        ("FLASHINFER_AUTOTUNE_CACHE_DIR", f"{SUBDIR}/{CACHE}/autotune"),
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


ORDER = 40  # where its caches come in warmer.components.ALL
COMPONENTS = (COMPONENT, B12X)


@dataclass(frozen=True)
class FlashInferContract:
    """The paths and settings FlashInfer's JIT cache under a root depends on."""

    workspace_base: str
    version: str | None
    install_dir: str | None
    git_commit: str | None
    tvm_ffi_dir: str | None
    python_include: str | None
    cuda_home: str | None
    ninja: str | None
    env: dict[str, str] = field(hash=False)
    modules: tuple[str, ...] = ()
    # FlashInfer's links into its cubin dir (link under CACHE: target under its cubins/), re-made at restore
    links: dict[str, str] = field(default_factory=dict, hash=False)
    # The nvcc that compiled the modules: FlashInfer picks flags by its version (cpp_ext.py
    # get_cuda_version), and its .so files link its CUDA runtime. In the workspace's key, so that two
    # images' toolkits at one CUDA_HOME path never share modules; not compared here (a node without
    # nvcc loads restored modules; the flashinfer layer's fit rule compares it where both have one).
    nvcc: str | None = None

    LABELS = {
        "workspace_base": "workspace real path (ninja keys on absolute paths; a symlink does not help)",
        "version": "flashinfer-python version",
        "install_dir": "flashinfer install dir",
        "git_commit": "flashinfer git commit",
        "tvm_ffi_dir": "tvm-ffi install dir",
        "python_include": "Python include dir",
        "cuda_home": "CUDA_HOME",
        "ninja": "ninja version (its log format differs)",
    }

    @classmethod
    def from_json(cls, f: Fields) -> FlashInferContract:
        return cls(
            workspace_base=f.text("workspace_base"),
            version=f.opt_text("version"),
            install_dir=f.opt_text("install_dir"),
            git_commit=f.opt_text("git_commit"),
            tvm_ffi_dir=f.opt_text("tvm_ffi_dir"),
            python_include=f.opt_text("python_include"),
            cuda_home=f.opt_text("cuda_home"),
            ninja=f.opt_text("ninja"),
            env=f.str_map("env"),
            modules=f.str_list("modules"),
            links=_checked_links(f.str_map("links")) if f.doc.get("links") is not None else {},
            nvcc=f.opt_text("nvcc", max_len=64),
        )

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}


def contract(root: Path, env: dict) -> FlashInferContract | None:
    """What FlashInfer's JIT cache under root depends on, in env; None without FlashInfer."""
    install = package_dir("flashinfer")
    if install is None and not modules(root):
        return None
    commit = None
    if install:
        meta = Path(install, "_build_meta.py")
        m = re.search(r"__git_commit__\s*=\s*['\"]([0-9a-f]+)['\"]", meta.read_text()) if meta.exists() else None
        commit = m.group(1) if m else None
    # as the fingerprint reads it: two dist-infos of one name give every node the same version
    version = installed_version("flashinfer-python")
    return FlashInferContract(
        workspace_base=os.path.realpath(root / COMPONENT.subdir),
        version=version,
        install_dir=install,
        git_commit=commit,
        tvm_ffi_dir=package_dir("tvm_ffi"),
        python_include=sysconfig.get_paths()["include"],
        cuda_home=cuda_home(env),
        ninja=ninja_path_and_version(env)[1],
        env={k: env[k] for k in COMPILE_ENV if k in env},
        modules=tuple(m.name for m in modules(root)),
        links=links(root),
        nvcc=nvcc_version(cuda_home(env)),
    )


def links(root: Path) -> dict[str, str]:
    """The links FlashInfer made in root's workspace into its cubin dir, {link under CACHE: target under
    its cubins/}. Its trtllm-gen modules include their export headers through them (jit/fused_moe.py,
    moe_utils.py, gemm/core.py: ensure_symlink(generated/.../trtllmGen_*_export -> FLASHINFER_CUBIN_DIR/...))
    and ninja's deps name the headers by the linked path; an artifact holds no links, so a restore makes
    these again (warmer.workspace.make_links). A link to anywhere else is not recorded."""
    cache = root / SUBDIR / CACHE
    cubins = os.path.realpath(cache / "cubins")
    out = {}
    for dirpath, dirnames, filenames in os.walk(cache):  # links are not followed
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            if os.path.islink(full) and (real := os.path.realpath(full)).startswith(cubins + "/"):
                out[os.path.relpath(full, cache)] = os.path.relpath(real, cubins)
    return dict(sorted(out.items()))


def _checked_links(links: dict[str, str]) -> dict[str, str]:
    """An artifact's links, refused unless each is a plain relative path (no '..', not absolute) and none
    lies under another or under a link's target: a restore makes them inside the workspace, to targets
    inside its cubin dir, and none leads back to a link (a loop: verify's snapshot follows links)."""
    targets = {f"cubins/{target}" for target in links.values()}
    for link, target in links.items():
        for path in (link, target):
            if any(part in ("", ".", "..") for part in path.split("/")) or "\0" in path:
                raise InvalidDocument(f"flashinfer.links: {path!r} is not a plain relative path: refused")
        above = [str(parent) for parent in Path(link).parents if str(parent) != "."]
        if any(parent in links for parent in above):
            raise InvalidDocument(f"flashinfer.links: {link!r} lies under another link: refused")
        if any(path in targets for path in (link, *above)):
            raise InvalidDocument(f"flashinfer.links: {link!r} lies under a link's target (a loop): refused")
    return links


def compare(built: FlashInferContract | None, node: FlashInferContract | None) -> list[str]:
    """Why FlashInfer on this node will rebuild the artifact's JIT modules; empty if it will not."""
    if built is None or not built.modules:
        return []
    if node is None:
        return [
            "FlashInfer is not installed here, so the cache cannot be checked (fetch outside the serving "
            "image?): run `warmer verify` in the serving container"
        ]
    out = [
        f"{label}: built with {getattr(built, k)!r}, here {getattr(node, k)!r}"
        for k, label in FlashInferContract.LABELS.items()
        if getattr(built, k) != getattr(node, k)
    ]
    for var in sorted(set(built.env) | set(node.env)):
        b, n = built.env.get(var), node.env.get(var)
        if b != n:
            out.append(f"{var}: built with {b!r}, here {n!r} (it is in the compile command)")
    return out


def dry_run(root: Path, env: dict, built: FlashInferContract | None = None) -> dict:
    """`ninja -n -d explain` in every module: {"modules": {name: {"clean", "reasons"}}, "clean": bool}.
    built: the contract of the artifact restored there; only its modules are judged (a shared
    workspace holds other recipes' too, not this artifact's to judge), and one of them absent is
    not clean. Without one (or from an artifact that lists none), every module."""
    only = built.modules if built and built.modules else None
    mods = [m for m in modules(root) if only is None or m.name in only]
    absent = sorted(set(only or ()) - {m.name for m in mods})
    path, version = ninja_path_and_version(env)
    if not mods and not absent:
        return {"clean": True, "modules": {}}
    if path is None:
        return {"clean": None, "skipped": "ninja is not on PATH: the dry run was skipped", "modules": {}}
    result: dict[str, dict] = {
        name: {"clean": False, "reasons": [f"{name} is not in the workspace: FlashInfer builds it at first use"]}
        for name in absent
    }
    for m in mods:
        try:  # bytes: the file is the store's or the pods' (the shared workspace), not always text
            written_here = os.fsencode(os.path.realpath(m)) in (m / "build.ninja").read_bytes()
        except OSError as e:
            written_here, unread = False, f"build.ninja cannot be read ({e.strerror})"
        else:
            unread = f"build.ninja names other paths than {m}: the cache was built under another workspace"
        if not written_here:
            # Written for another path: FlashInfer regenerates it here, and everything rebuilds.
            result[m.name] = {"clean": False, "reasons": [unread]}
            continue
        try:
            out = subprocess.run(
                [path, "-n", "-d", "explain", "-C", str(m), "-f", "build.ninja"],
                capture_output=True,
                text=True,
                errors="replace",
                env=env,
                timeout=120,
            )
        except subprocess.TimeoutExpired:
            result[m.name] = {"clean": False, "reasons": ["ninja's dry run did not end within 120 s"]}
            continue
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
    path, _ = ninja_path_and_version(env)
    if path is None:
        return []
    found = []
    for m in modules(root):
        out = subprocess.run(
            [path, "-C", str(m), "-f", "build.ninja", "-t", "deps"],
            capture_output=True,
            text=True,
            errors="replace",
            env=env,
            timeout=120,
        ).stdout
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


def _under(path: str, base: str) -> bool:
    return path == base or path.startswith(base.rstrip("/") + "/")


def backdate(root: Path, env: dict, *, apply: bool, include_site_packages: bool) -> dict:
    """Set the mtime of inputs newer than the cache to just before its oldest output.

    Only files inside the root are changed: a restored .ninja_deps names files anywhere (system
    and CUDA headers), and an artifact is untrusted input. Installed headers under site-packages
    (pip gives them the install time) are changed only with include_site_packages: they belong to
    the Python environment, not to the cache. Everything else is held back and listed."""
    sites = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    real_root = os.path.realpath(root)
    changed, held_back, outside = [], [], []
    for dep, module in newer_inputs(root, env):
        real = os.path.realpath(dep)
        if any(_under(real, s) for s in sites):
            if not include_site_packages:
                held_back.append(dep)
                continue
        elif not _under(real, real_root):
            outside.append(dep)
            continue
        changed.append(dep)
        oldest = _oldest_output_ns(modules_by_name(root)[module])
        if apply and oldest is not None:  # newer_inputs lists only modules with outputs
            when = oldest - 1_000_000_000
            os.utime(real, ns=(when, when), follow_symlinks=False)
    return {"applied": apply, "files": changed, "held_back_site_packages": held_back, "held_back_outside_root": outside}


def modules_by_name(root: Path) -> dict[str, Path]:
    return {m.name: m for m in modules(root)}


def report(
    root: Path,
    env: dict,
    built: FlashInferContract | None,
    *,
    backdate_inputs: bool = False,
    include_site_packages: bool = False,
) -> dict:
    """Everything `warmer flashinfer-check` reports: the contract against the build's, ninja's
    dry run, inputs newer than the cache, and (when asked) the back-dating fix."""
    # the artifact's modules, as fetch judges them: a shared workspace holds other recipes' too
    mine = set(built.modules) if built and built.modules else None
    report = {
        "contract": compare(built, contract(root, env)) if built else [],
        "dry_run": dry_run(root, env, built),
        "newer_inputs": [{"file": f, "module": m} for f, m in newer_inputs(root, env) if mine is None or m in mine],
    }
    if backdate_inputs:
        report["backdate"] = backdate(root, env, apply=True, include_site_packages=include_site_packages)
        report["dry_run_after"] = dry_run(root, env, built)
    return report
