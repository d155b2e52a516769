"""vLLM's own compile key, as recorded at build, and what a serving env would change in it.

warmer's key says whether an artifact fits a node's hardware and libraries. Whether vLLM then
hits inside it is decided by what vLLM hashes:
- its env factors: vllm/envs.py compile_factors() hashes every env var vLLM knows (249 in
  0.32) except an ignore list; the raw CUDA_HOME is one of them;
- its config hash: VllmConfig.compute_hash() (model path and revision, scheduler sizes,
  compilation config, kv-cache dtype, parallel sizes);
- the folders those land in: vllm/torch_compile_cache/torch_aot_compile/<sha256> (the AOT key,
  vllm/compilation/decorators.py) and vllm/torch_compile_cache/<10 hex> (VllmBackend,
  vllm/compilation/backends.py, which writes cache_key_factors.json beside it).

The warm-up child records the factors' raw values as the process started (before vLLM's own
os.environ edits), so a node compares like with like: its env file plus its process env. When
the artifact holds none of those folders (vLLM's CPU backend with AOT compile off keeps only
Inductor's cache, which is keyed on the graph, not on vLLM's env), a factor that differs costs
nothing, and the comparison says so. Node path: never imports vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from warmer.untrusted import Fields

COMPILE_CACHE = "vllm/torch_compile_cache"


@dataclass(frozen=True)
class FactorDifference:
    name: str
    built: str | None
    here: str | None
    recompiles: bool  # vLLM's key is in use in the artifact, so this start compiles from cold

    def line(self) -> str:
        def show(v: str | None) -> str:
            return "unset" if v is None else repr(v)

        effect = (
            "this start recompiles"
            if self.recompiles
            else "but no cache in this artifact is keyed on vLLM's hash (AOT compile off): no recompile expected"
        )
        return f"{self.name}: build {show(self.built)}, here {show(self.here)}: vLLM hashes it, {effect}"

    def to_json(self) -> dict:
        return {"name": self.name, "built": self.built, "here": self.here, "recompiles": self.recompiles}


@dataclass(frozen=True)
class VllmKey:
    version: str | None
    env: dict[str, str | None] = field(hash=False)  # factor name -> raw value at start (None: unset)
    config_hash: str | None = None
    cache_dirs: tuple[str, ...] = ()  # root-relative compile-cache folders vLLM's key named
    model_config: str | None = None  # model_config_digest of the model warmed (a local one)

    @classmethod
    def from_json(cls, f: Fields) -> VllmKey:
        return cls(
            version=f.opt_text("version", max_len=64),
            env=f.str_map("env", values_may_be_null=True),
            config_hash=f.opt_text("config_hash", max_len=128),
            cache_dirs=f.str_list("cache_dirs"),
            model_config=f.opt_text("model_config", max_len=64),
        )

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "env": dict(self.env),
            "config_hash": self.config_hash,
            "cache_dirs": list(self.cache_dirs),
            "model_config": self.model_config,
        }

    @property
    def keyed(self) -> bool:
        """Whether any cache in the artifact sits under a folder named by vLLM's hash."""
        return bool(self.cache_dirs)

    def differences(self, env: Mapping[str, str]) -> list[FactorDifference]:
        """Every factor whose raw value in env (what vLLM will start with) differs from the build's."""
        return [
            FactorDifference(name, built, env.get(name), self.keyed)
            for name, built in sorted(self.env.items())
            if env.get(name) != built
        ]


MODEL_CONFIG_LIMIT = 4 << 20


def model_config_digest(model: str, engine: Mapping[str, object] | None = None) -> str | None:
    """sha256 of the model's config.json as JSON (key order and spacing aside, and without
    transformers_version, which vLLM's hash takes from the installed transformers), when model is
    a local folder holding one; None otherwise, and where the engine args read the config from
    elsewhere (hf_config_path, a config_format other than hf). vLLM hashes the model's config into
    its config hash: another model at the same path (a synced `main`, a moved link) keeps
    warmer's key and misses vLLM's. vLLM hashes the config as transformers loads it, defaults
    aside, so a config written out otherwise can differ here and not there: a warning, not more."""
    engine = engine or {}
    if engine.get("hf_config_path") or engine.get("config_format") not in (None, "auto", "hf"):
        return None
    try:
        with open(os.path.join(model, "config.json"), "rb") as f:
            doc = json.loads(f.read(MODEL_CONFIG_LIMIT + 1))
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(doc, dict):
        doc.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def cache_dirs(paths: list[str]) -> tuple[str, ...]:
    """The compile-cache folders named by vLLM's key among root-relative file paths."""
    found = set()
    prefix = COMPILE_CACHE + "/"
    for p in paths:
        if not p.startswith(prefix):
            continue
        parts = p[len(prefix) :].split("/")
        if parts[0] == "torch_aot_compile" and len(parts) > 2:
            found.add(f"{prefix}torch_aot_compile/{parts[1]}")
        elif len(parts) > 1 and parts[0] != "torch_aot_compile":
            found.add(prefix + parts[0])
    return tuple(sorted(found))
