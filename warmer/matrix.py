"""What CI needs: the recipe × SKU matrix (one build job per recipe and GPU SKU).

The SKU catalogue (manifests/skus.toml) says where each SKU named in a recipe's `targets` runs:
the GitHub runner labels, the Kubernetes node labels and the image. Recipes are read as TOML
only (name, targets, engine): planning must not need the model, its env or a GPU.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmer import compat
from warmer.errors import UsageError
from warmer.recipe import NAME_RE, read_doc

CATALOGUE = "skus.toml"
# Kubernetes' names of CPU architectures (kubernetes.io/arch) as platform.machine() spells them.
KUBE_ARCH = {"amd64": "x86_64", "arm64": "aarch64"}
DEFAULT_ROOT_BASE = "/cache"


class MatrixError(UsageError):
    """The recipes or the SKU catalogue cannot make a matrix; the message says what to fix."""


@dataclass(frozen=True)
class Sku:
    name: str
    runs_on: list[str]
    node_selector: dict[str, str]
    image: str
    gpu_name: str | None = None
    compute_capability: str | None = None
    uncertain: bool = False

    def matches(self, fp) -> bool:
        """Whether a node (warmer.fingerprint.Fingerprint) is of this SKU: its GPU's name, or for a
        CPU SKU no GPU and the CPU architecture its node selector names."""
        if self.gpu_name:
            return fp.gpu.count > 0 and fp.gpu.name == self.gpu_name
        arch = self.node_selector.get("kubernetes.io/arch")
        return fp.gpu.count == 0 and (arch is None or KUBE_ARCH.get(arch, arch) == fp.machine)


def _strings(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value)


def load_skus(path: str | Path) -> dict[str, Sku]:
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_bytes().decode())
    except FileNotFoundError:
        raise MatrixError(
            f"no SKU catalogue at {path}: copy manifests/skus.toml from warmer "
            "next to your recipes, or pass --skus FILE"
        ) from None
    except OSError as e:
        raise MatrixError(f"cannot read the SKU catalogue {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise MatrixError(f"{path}: not UTF-8 (byte {e.start}): TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise MatrixError(f"{path}: not valid TOML: {e}") from e
    defaults, tables = doc.get("defaults", {}), doc.get("sku", {})
    if not isinstance(defaults, dict) or not isinstance(tables, dict):
        raise MatrixError(f"{path}: [defaults] and [sku.NAME] must be tables (see manifests/skus.toml)")
    skus = {}
    for name, t in tables.items():
        where = f"{path}: [sku.{name}]"
        if not NAME_RE.match(name):
            raise MatrixError(f"{where}: a SKU name is lower-case letters, digits, '.', '_' or '-'")
        if not isinstance(t, dict):
            raise MatrixError(f"{where} must be a table")
        if not _strings(t.get("runs_on")):
            raise MatrixError(
                f'{where}: runs_on must be a non-empty list of runner labels, e.g. ["self-hosted", "gpu-h200"]'
            )
        selector = t.get("node_selector")
        if (
            not isinstance(selector, dict)
            or not selector
            or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in selector.items())
        ):
            raise MatrixError(
                f"{where}: node_selector must be a table of node labels, "
                'e.g. { "nvidia.com/gpu.product" = "NVIDIA-H200" }'
            )
        image = t.get("image", defaults.get("image"))
        if not isinstance(image, str) or not image:
            raise MatrixError(f"{where}: no image: set image there or in [defaults]")
        gpu_name = t.get("gpu_name")
        if gpu_name is not None and (not isinstance(gpu_name, str) or not gpu_name):  # "" would be a CPU SKU
            raise MatrixError(f'{where}: gpu_name must be the name nvidia-smi reports, e.g. "NVIDIA H200"')
        skus[name] = Sku(
            name=name,
            runs_on=list(t["runs_on"]),
            node_selector=dict(selector),
            image=image,
            gpu_name=gpu_name,
            compute_capability=t.get("compute_capability"),
            uncertain=bool(t.get("uncertain", False)),
        )
    if not skus:
        raise MatrixError(f"{path} lists no SKUs: add [sku.NAME] tables")
    return skus


def find_catalogue(paths: list[Path]) -> Path:
    """skus.toml in the first directory given, or beside the directory a recipe file lives in."""
    for p in paths:
        base = p if p.is_dir() else p.parent
        for d in (base, base.parent):
            if (d / CATALOGUE).is_file():
                return d / CATALOGUE
    raise MatrixError(
        f"no {CATALOGUE} found in or above {', '.join(map(str, paths))}: copy "
        "manifests/skus.toml from warmer beside your recipes, or pass --skus FILE"
    )


def recipe_files(paths: list[Path]) -> list[Path]:
    """Recipe files: those given, and in a directory its models/*.toml (or its own *.toml)."""
    out = []
    for p in paths:
        if p.is_dir():
            found = (
                sorted((p / "models").glob("*.toml"))
                if (p / "models").is_dir()
                else sorted(f for f in p.glob("*.toml") if f.name != CATALOGUE)
            )
            if not found:
                raise MatrixError(f"{p} holds no recipes (models/*.toml or *.toml)")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise MatrixError(f"{p} does not exist: pass the manifests directory or recipe files")
    return out


def name_and_targets(doc: dict[str, Any], source: Path) -> tuple[str, list[str]]:
    """A recipe document's name and target SKUs (recipe.read_doc: nothing expanded), checked as far
    as planning needs. The CI matrix and a node's `fetch --all` decide which recipes are theirs by
    these alone: a recipe for another SKU must not need the model, its env or a GPU here."""
    name, targets = doc.get("name"), doc.get("targets", [])
    # fullmatch: the pattern's `$` would also let a trailing newline through
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise MatrixError(f"{source}: name must be lower-case letters, digits, '.', '_' or '-', got {name!r}")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise MatrixError(f'{source}: targets must be a list of SKU names, e.g. ["h200"]')
    return name, targets


def entries(
    paths: list[Path],
    skus: dict[str, Sku],
    catalogue: Path,
    *,
    only: list[str] | None = None,
    root_base: str = DEFAULT_ROOT_BASE,
) -> tuple[list[dict], list[str]]:
    """One entry per recipe and target SKU; and the recipes skipped because they target none."""
    if only:
        unknown = sorted(set(only) - set(skus))
        if unknown:
            raise MatrixError(f"--sku {', '.join(unknown)}: not in {catalogue} (known: {', '.join(sorted(skus))})")
    out: list[dict] = []
    skipped: list[str] = []
    seen: dict[str, Path] = {}
    for f in recipe_files(paths):
        doc, _ = read_doc(f)
        name, targets = name_and_targets(doc, f)
        if name in seen:
            raise MatrixError(f"{f} and {seen[name]} are both named {name!r}: recipe names must be unique")
        seen[name] = f
        if not targets:
            skipped.append(f"{f}: no targets")
            continue
        engine = doc.get("engine", {})
        if not isinstance(engine, dict):
            raise MatrixError(f"{f}: [engine] must be a table of vLLM engine args")
        for arg in ("tensor_parallel_size", "pipeline_parallel_size"):  # they give the GPUs a build needs
            value = engine.get(arg, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MatrixError(f"{f}: engine.{arg} = {value!r}: give a whole number, at least 1")
        # The build must see as many GPUs as a serving pod: the fingerprint counts them.
        gpus = compat.gpus_needed({"engine": engine})
        for t in dict.fromkeys(targets):
            sku = skus.get(t)
            if sku is None:
                raise MatrixError(
                    f"{f} targets SKU {t!r}, which {catalogue} does not list: add a [sku.{t}] "
                    f"table there (gpu_name, runs_on, node_selector) or fix the name "
                    f"(known: {', '.join(sorted(skus))})"
                )
            if only and t not in only:
                continue
            out.append(
                {
                    "name": name,
                    "sku": t,
                    "recipe": f.as_posix(),
                    "root": f"{root_base.rstrip('/')}/{name}",
                    "runs_on": sku.runs_on,
                    "node_selector": sku.node_selector,
                    "image": sku.image,
                    "gpu_name": sku.gpu_name,
                    "gpus": gpus if sku.gpu_name else 0,
                }
            )
    return out, skipped


def github(matrix: list[dict]) -> dict:
    """GitHub Actions' strategy.matrix: {"include": [...]}. An empty include fails the workflow
    with an unclear message, so say it here."""
    if not matrix:
        raise MatrixError(
            'no recipe targets a SKU (after filtering): nothing to build; add targets = ["h200", ...] to a recipe'
        )
    return {"include": matrix}
