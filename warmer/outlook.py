"""Will the artifact active in a root hit when vLLM starts with this env, and why not?

One answer, as a list of typed findings, for the three places that ask: fetch (right after it
activates), `warmer serve` (before it starts vLLM) and `warmer doctor` (inside a pod). Each finding
names the check, what it found and the fix. The checks, in order:
- recipe: the artifact is another recipe's, or another version of this one (edited since);
- artifact: the env does not point every cache into the root, or lacks what the build served with
  (the recipe's env, the env the build added);
- vllm-key: what vLLM hashed at build, against this env (vllm/envs.py compile factors);
- path-contract: the paths the artifact's caches depend on (the root, the model, FlashInfer's ...);
- fit: the artifact against this node's fingerprint, when the caller has one;
- a component's name: that component's own check of its restored files (FlashInfer: ninja's dry run).
Node path: imports neither torch nor vllm.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmer import compat
from warmer import components as _components  # outlook's parameter is named components
from warmer.artifact import Artifact
from warmer.finding import ERROR, INFO, WARNING, Finding
from warmer.fingerprint import Fingerprint
from warmer.recipe import UNHASHED_ENGINE_ARGS, Recipe
from warmer.vllmkey import FactorDifference, model_config_digest

__all__ = ["ERROR", "INFO", "WARNING", "Finding", "Outlook", "outlook"]


@dataclass(frozen=True)
class Outlook:
    findings: tuple[Finding, ...] = ()
    differences: tuple[FactorDifference, ...] = ()  # vLLM's compile factors that differ from the build's
    details: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)  # what component checks measured

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(f.what for f in self.findings)

    @property
    def recompiles(self) -> bool:
        """Whether vLLM's own key predicts a cold compile here."""
        return any(d.recompiles for d in self.differences)


def outlook(
    recipe: Recipe | None,
    root: Path,
    art: Artifact,
    env: Mapping[str, str],
    *,
    node: Fingerprint | None = None,
    exists: Callable[[str], bool] | None = None,
    components: tuple[str, ...] | None = None,
) -> Outlook:
    """art is active in root and vLLM starts with env (the whole process env). recipe: the one
    being served (None: the artifact's own, as doctor sees a pod); node: check the fit too;
    exists: whether a path exists where vLLM runs (doctor's, for the model path); components: a
    partial hit's (only they are judged: the rest compiles from cold, as said when it was fetched)."""
    held = tuple(art.components) if components is None else components
    checked = {  # each cache's env, paths and files
        name: check
        for name, check in _components.checks(root, env, art.path_contract).items()
        if name in held or name not in art.components
    }
    out = [f for check in checked.values() for f in check.findings]
    if recipe is not None:
        out += _recipe(recipe, root, art, held if components is not None else None)
    vllm_held = "vllm" in held or "vllm" not in art.components
    if vllm_held:  # what vLLM hashes matters only where its own cache was restored
        out += _served_as_built(art, env)
    if vllm_held or "inductor" in held:  # AOT on moves Inductor's cache out of root/inductor
        out += _serve_env_kept(art, env)
    said = set(art.recipe.identity.get("env") or {}) | set(art.serve_env)
    differences = tuple(art.vllm.differences(env)) if art.vllm and vllm_held else ()
    out += [_difference(d) for d in differences if d.name not in said]
    served = recipe or Recipe.from_artifact(art)
    if vllm_held:
        out += _model_as_built(art, served)
    fixed = [n for n, c in art.components.items() if not c.relocatable and n in held]
    for w in art.path_contract.warnings(root, served.model, fixed):
        out.append(
            Finding(
                WARNING,
                "path-contract",
                str(root),
                w,
                f"serve from the build's paths ({art.path_contract.root}, model "
                f"{art.path_contract.model}), or build an artifact at these paths",
            )
        )
    model = art.path_contract.model
    if recipe is None and exists and model.startswith("/") and not exists(model):
        out.append(
            Finding(
                WARNING,
                "path-contract",
                model,
                f"the artifact was built for the model at {model}, "
                "which does not exist here: vLLM keys its compile cache on that path",
                f"serve the model from {model}",
            )
        )
    if node is not None:
        bad = compat.held_misfits(art.fingerprint, node, art.recipe.identity, components)
        if bad:
            out.append(
                Finding(
                    ERROR,
                    "fit",
                    str(root),
                    "the active artifact does not fit this node: " + "; ".join(d.line() for d in bad),
                    "`warmer fetch` replaces it with what fits, when the store has it, or build one on this node's type",
                )
            )
    details = {name: check.detail for name, check in checked.items() if check.detail is not None}
    return Outlook(tuple(out), differences, details)


def _recipe(recipe: Recipe, root: Path, art: Artifact, held: tuple[str, ...] | None) -> list[Finding]:
    """The recipe served against the one the artifact was warmed with. Another version of it (an
    edited engine arg, model, env or workload) has another key: fetch misses and leaves this artifact
    active, and vLLM, started with the new args, compiles from cold. held: a partial hit's layers;
    only those keyed on the recipe can be stale (fetch restored the others for this recipe)."""
    out = []
    if art.recipe.name != recipe.name:
        out.append(
            Finding(
                WARNING,
                "recipe",
                str(root),
                f"the artifact active in {root} is recipe {art.recipe.name}'s, not {recipe.name}'s",
                f"fetch {recipe.name}'s artifact into a root of its own",
            )
        )
    if held is not None and not any(compat.layer_rule(c).recipe for c in held):
        return out
    # The name alone is none of what vLLM hashes: said above, as a warning.
    differ = [d for d in compat.recipe_decisions(art.recipe.identity, recipe.identity()) if d.field != "recipe.name"]
    fields = "; ".join(
        f"{d.field.removeprefix('recipe.')} {_shown(d.built)} at build, {_shown(d.node)} here" for d in differ
    )
    if differ and all(_unhashed(d.field, art) for d in differ):
        out.append(
            Finding(
                INFO,
                "recipe",
                str(root),
                f"the artifact active in {root} was warmed with another version of recipe {art.recipe.name} "
                f"({fields}): vLLM leaves these out of its compile key, so its caches serve this one",
                "none",
            )
        )
    elif differ:
        out.append(
            Finding(
                ERROR,
                "recipe",
                str(root),
                f"the artifact active in {root} was warmed with another version of recipe {art.recipe.name} "
                f"({fields}): its caches are not this recipe's (vLLM hashes the model and engine args into "
                "its compile key), so vLLM compiles from cold",
                "build and fetch an artifact of this recipe (`warmer fetch` says why it missed), or serve the "
                "recipe the artifact was warmed with (`warmer inspect` shows it)",
            )
        )
    return out


def _unhashed(field: str, art: Artifact) -> bool:
    """Whether vLLM leaves a recipe field out of its compile key: an engine arg its configs' hashes
    ignore, or a VLLM_ variable its env hash ignores (not among the factors the build recorded)."""
    section, _, name = field.removeprefix("recipe.").partition(".")
    if section == "engine":
        return name in UNHASHED_ENGINE_ARGS
    factors = art.vllm.env if art.vllm else {}
    return section == "env" and bool(factors) and name.startswith("VLLM_") and name not in factors


def _shown(value: object) -> str:
    return "unset" if value is None else repr(value)


def _served_as_built(art: Artifact, env: Mapping[str, str]) -> list[Finding]:
    """The env must hold what the build served with: the recipe's env."""
    out = []
    built_env = art.recipe.identity.get("env") or {}
    for var, want in sorted(built_env.items()):
        if env.get(var) != want and var not in compat.volatile_env(built_env):
            out.append(
                Finding(
                    ERROR,
                    "artifact",
                    var,
                    f"{var} is {env.get(var)!r} here and was {want!r} at "
                    "build time: vLLM hashes its env, so the cache will miss",
                    f"start vLLM with the env file warmer wrote (it sets {var})",
                )
            )
    return out


def _model_as_built(art: Artifact, served: Recipe) -> list[Finding]:
    """The model at the served path should be the one warmed: vLLM hashes its config. Said where
    the model can be read (the vLLM container; an init container may not mount it); a warning, as
    vLLM hashes the config as transformers loads it, which a digest of the file only approaches."""
    built = art.vllm.model_config if art.vllm else None
    here = model_config_digest(served.model, served.engine) if built is not None else None
    if built is None or here is None or here == built:
        return []
    model = served.model
    return [
        Finding(
            WARNING,
            "model",
            model,
            f"the model at {model} may not be the one this artifact was warmed with: its config.json differs "
            f"(sha256 {here[:12]} here, {built[:12]} at build); vLLM hashes the model's config into its "
            "compile key, so if the model changed, it compiles from cold",
            "build an artifact of this model (a new model at the same path keeps warmer's key: `warmer rm` "
            "the old entry first), or serve the model that was warmed",
        )
    ]


def _serve_env_kept(art: Artifact, env: Mapping[str, str]) -> list[Finding]:
    """The env must hold what the build added (VLLM_USE_AOT_COMPILE=0)."""
    out = []
    for var, want in sorted(art.serve_env.items()):
        if env.get(var) != want:
            out.append(
                Finding(
                    ERROR,
                    "artifact",
                    var,
                    f"{var} is {env.get(var)!r} here; the build served with "
                    f"{var}={want} (it added it: see `warmer inspect`), so vLLM will compile from cold",
                    "start vLLM with the env file warmer wrote, or with `warmer serve`",
                )
            )
    return out


def _difference(d: FactorDifference) -> Finding:
    fix = (
        f"start vLLM with {d.name} as at build ({'unset' if d.built is None else repr(d.built)}),"
        " or add it to the recipe's [env] and rebuild"
    )
    return Finding(ERROR if d.recompiles else INFO, "vllm-key", d.name, d.line(), fix if d.recompiles else "none")
