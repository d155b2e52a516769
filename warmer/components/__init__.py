"""The kinds of cache warmer packs, and where each lives under a root.

Each module here describes one cache: the env var(s) that point it under the root, which of
its files belong in an artifact, and whether it survives a move to another root path.
"""

from __future__ import annotations

from pathlib import Path

from warmer.components.base import Component
from warmer.components import cuda, flashinfer, inductor, triton, vllm

ALL: tuple[Component, ...] = (vllm.COMPONENT, inductor.COMPONENT, inductor.HEADERS, triton.COMPONENT,
                              flashinfer.COMPONENT, flashinfer.B12X, cuda.COMPONENT)


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


__all__ = ["ALL", "Component", "cache_env", "collect", "of_path"]
