"""Recipes (manifests/models/*.toml): what to warm, with which engine args, env and workload.

A recipe's identity (everything but its description, targets and timeouts) goes into the
artifact key: change the model, its served path, an engine arg, the env or the workload, and
nodes look for a new artifact.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")
VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# In vLLM's compile key (SchedulerConfig.compute_hash), with defaults that depend on the entry point.
SCHEDULER_ARGS = ("max_num_batched_tokens", "max_num_seqs")
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"}


class RecipeError(Exception):
    """A recipe that cannot be used; the message names the field and the fix."""


@dataclass(frozen=True)
class Workload:
    prompt_lengths: list[int]
    batch_sizes: list[int]
    max_tokens: int
    sampling: list[dict]
    timeout_s: int = 1800

    def spec(self) -> dict:
        return {"prompt_lengths": self.prompt_lengths, "batch_sizes": self.batch_sizes,
                "max_tokens": self.max_tokens, "sampling": self.sampling}


@dataclass(frozen=True)
class Recipe:
    name: str
    source: Path
    model: str                      # what vLLM is given: the served path, or the hub id
    model_id: str | None
    revision: str | None
    engine: dict
    env: dict[str, str]
    workload: Workload
    targets: list[str] = field(default_factory=list)
    description: str = ""

    def identity(self) -> dict:
        return {"name": self.name, "model": self.model, "model_id": self.model_id,
                "revision": self.revision, "engine": self.engine, "env": self.env,
                "workload": self.workload.spec()}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode()).hexdigest()

    def summary(self) -> dict:
        return {"name": self.name, "digest": self.digest(), "identity": self.identity()}

    def warnings(self) -> list[str]:
        """Engine args left to defaults that differ between the warm-up and `vllm serve`."""
        return [f"{self.source}: engine.{arg} is not set: vLLM's LLM() (the warm-up) and `vllm serve` "
                f"default it differently (max_num_batched_tokens 16384 vs 8192 on H100/H200, 8192 vs 2048 on "
                f"smaller GPUs) and vLLM hashes it into its compile key: pin it, and serve with the same value"
                for arg in SCHEDULER_ARGS if arg not in self.engine]


def _expand(value: str, where: str) -> str:
    def sub(m: re.Match) -> str:
        var = m.group(1)
        if var not in os.environ:
            raise RecipeError(f"{where} uses ${{{var}}}, which is not set: export {var} before running warmer")
        return os.environ[var]
    return VAR_RE.sub(sub, value)


def _positive_ints(value, where: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and v > 0 for v in value):
        raise RecipeError(f"{where} must be a non-empty list of positive integers, got {value!r}")
    return value


def parse(doc: dict, source: Path) -> Recipe:
    where = str(source)
    name = doc.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise RecipeError(f"{where}: name must be lower-case letters, digits, '.', '_' or '-', got {name!r}")

    model = doc.get("model")
    if not isinstance(model, dict):
        raise RecipeError(f"{where}: a [model] table with `path` (served path) or `id` is required")
    model_id, revision, path = model.get("id"), model.get("revision"), model.get("path")
    if path is not None:
        path = _expand(str(path), f"{where}: model.path")
        if not os.path.isabs(path):
            raise RecipeError(f"{where}: model.path must be absolute (vLLM keys its compile cache on "
                              f"this exact string), got {path!r}")
    elif model_id and not revision:
        raise RecipeError(f"{where}: model.id {model_id!r} needs model.revision (a commit) so that "
                          "every node serves the same weights")
    elif not model_id:
        raise RecipeError(f"{where}: [model] needs `path` (the directory it is served from) or `id`")

    engine = doc.get("engine", {})
    if not isinstance(engine, dict):
        raise RecipeError(f"{where}: [engine] must be a table of vLLM engine args")
    if "model" in engine:
        raise RecipeError(f"{where}: set the model in [model], not engine.model")

    env = doc.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise RecipeError(f"{where}: [env] values must be strings, e.g. VLLM_USE_AOT_COMPILE = \"0\"")

    w = doc.get("workload")
    if not isinstance(w, dict):
        raise RecipeError(f"{where}: a [workload] table is required (prompt_lengths, batch_sizes, max_tokens)")
    sampling = w.get("sampling", [{"temperature": 0.0}])
    if not isinstance(sampling, list) or not all(isinstance(s, dict) for s in sampling):
        raise RecipeError(f"{where}: workload.sampling must be an array of tables ([[workload.sampling]])")
    for s in sampling:
        unknown = set(s) - SAMPLING_KEYS
        if unknown:
            raise RecipeError(f"{where}: workload.sampling has unknown key(s) {sorted(unknown)}; "
                              f"known: {sorted(SAMPLING_KEYS)}")
    max_tokens = w.get("max_tokens", 16)
    timeout = w.get("timeout_s", 1800)
    if not isinstance(max_tokens, int) or max_tokens < 1 or not isinstance(timeout, int) or timeout < 1:
        raise RecipeError(f"{where}: workload.max_tokens and workload.timeout_s must be positive integers")
    workload = Workload(_positive_ints(w.get("prompt_lengths"), f"{where}: workload.prompt_lengths"),
                        _positive_ints(w.get("batch_sizes", [1]), f"{where}: workload.batch_sizes"),
                        max_tokens, sampling, timeout)

    targets = doc.get("targets", [])
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise RecipeError(f"{where}: targets must be a list of GPU SKU names")
    return Recipe(name=name, source=source, model=path or model_id, model_id=model_id, revision=revision,
                  engine=engine, env=dict(env), workload=workload, targets=targets,
                  description=str(doc.get("description", "")))


def load(path: str | os.PathLike) -> Recipe:
    source = Path(path)
    try:
        doc = tomllib.loads(source.read_text())
    except FileNotFoundError:
        raise RecipeError(f"recipe {source} does not exist; recipes live in manifests/models/*.toml") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{source}: not valid TOML: {e}") from e
    return parse(doc, source)
