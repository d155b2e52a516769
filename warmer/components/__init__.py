"""The kinds of cache warmer packs, and where each lives under a root.

Each module here describes one cache: the env var(s) that point it under the root, which of
its files belong in an artifact, and whether it survives a move to another root path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from warmer.components.base import Component, junk
from warmer.components import cuda, cute_dsl, flashinfer, inductor, triton, vllm

ALL: tuple[Component, ...] = (vllm.COMPONENT, inductor.COMPONENT, inductor.HEADERS, triton.COMPONENT,
                              flashinfer.COMPONENT, flashinfer.B12X, cute_dsl.COMPONENT, cuda.COMPONENT)


def cache_env(root: Path) -> dict[str, str]:
    """Every cache env var, pointed under root (an absolute path)."""
    env: dict[str, str] = {}
    for c in ALL:
        env.update(c.env_under(root))
    return env


def collect(root: Path) -> list[tuple[Component, str]]:
    """(component, path relative to root) for every file an artifact should hold."""
    return [(c, rel) for c in ALL for rel in c.files(root)]


def of_path(rel: str) -> Component | None:
    """The component a root-relative path belongs to."""
    return next((c for c in ALL if c.owns(rel)), None)


def excluded(rel: str) -> bool:
    """Whether a root-relative path is left out on purpose by the component it is under, or is junk."""
    return junk(rel) or any(c.leaves_out(rel) for c in ALL)


def default_paths(env: Mapping[str, str], user: str) -> dict[str, str]:
    """Where each cache env var's cache lands in env when the var is unset (as each library computes it)."""
    home = env.get("HOME") or os.path.expanduser("~")
    values = {"home": home, "xdg": env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache"),
              "tmp": env.get("TMPDIR") or "/tmp", "user": user, "triton_home": env.get("TRITON_HOME") or home,
              "fi_base": env.get("FLASHINFER_WORKSPACE_BASE") or home}
    return {var: template.format(**values) for c in ALL for var, template in c.defaults}


__all__ = ["ALL", "Component", "cache_env", "collect", "default_paths", "excluded", "junk", "of_path"]
