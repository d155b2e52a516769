"""What every cache component is: a directory under the root, its env vars and its file rules, and
the hooks a cache with behaviour of its own overrides (the env it needs for what an artifact holds,
the check that its restored files will be reused)."""

from __future__ import annotations

import fnmatch
import functools
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from warmer.finding import ERROR, Finding

if TYPE_CHECKING:
    from warmer.contract import PathContract


class Held(Protocol):
    """What an artifact holds, as a component's hooks ask it (warmer.archive.FileList)."""

    def any_under(self, prefix: str) -> bool: ...

    def sizes(self) -> Iterator[tuple[str, int]]: ...


@dataclass(frozen=True)
class Check:
    """A component's check of its restored cache: why it would not be reused (no findings: it will
    be), and what was measured (shown as is in fetch's JSON)."""

    findings: tuple[Finding, ...] = ()
    detail: dict[str, Any] | None = field(default=None, hash=False, compare=False)


# Lock files and half-written temporaries are never part of a cache.
ALWAYS_EXCLUDED = ("*.lock", "locks/*", "*/locks/*", "*.tmp", "*.tmp.*", "*.partial")


@dataclass(frozen=True)
class Component:
    name: str
    subdir: str  # directory under the root
    env: tuple[tuple[str, str], ...]  # (VAR, path under the root) pairs
    about: str
    include: tuple[str, ...] = ("*",)  # patterns on the path relative to subdir
    exclude: tuple[str, ...] = ()
    relocatable: bool = True  # hits after a restore under another root path
    # Where each env var's cache lands when the var is unset, as the library computes it: templates
    # over {home}, {xdg} (XDG_CACHE_HOME or ~/.cache), {tmp} (TMPDIR or /tmp), {user}, {triton_home},
    # {fi_base} (FLASHINFER_WORKSPACE_BASE or ~). doctor shows where a pod's caches really go.
    defaults: tuple[tuple[str, str], ...] = ()

    # Hooks: a component with behaviour of its own overrides these in its module.
    def serve_env(self, held: Held, root: Path) -> dict[str, str]:
        """Env vLLM needs for what an artifact restored in root holds of this cache."""
        return {}

    def check(self, root: Path, env: Mapping[str, str], built: PathContract) -> Check:
        """After a restore into root: will a start with env use this cache as it is? built: the
        paths the artifact's caches were built against. Here: every env var points into root."""
        return Check(
            tuple(
                Finding(
                    ERROR,
                    "artifact",
                    var,
                    f"{var} is {env.get(var)!r}, not {want}: vLLM will not use the restored cache",
                    "start vLLM with the env file `warmer fetch --env-file` wrote, or with `warmer serve`",
                )
                for var, want in self.env_under(root).items()
                if env.get(var) != want
            )
        )

    def env_under(self, root: Path) -> dict[str, str]:
        return {var: str(root / rel) for var, rel in self.env}

    def owns(self, rel: str) -> bool:
        head, _, inner = rel.partition("/")
        return head == self.subdir and bool(inner) and self._owns_inner(inner)

    def _owns_inner(self, inner: str) -> bool:
        included, excluded = _patterns(self.include, self.exclude + ALWAYS_EXCLUDED)
        return bool(included.match(inner)) and not excluded.match(inner)

    def leaves_out(self, rel: str) -> bool:
        """Whether rel is under this component and left out on purpose (a log, a lock, scratch)."""
        head, _, inner = rel.partition("/")
        return (
            head == self.subdir and bool(inner) and bool(_patterns((), self.exclude + ALWAYS_EXCLUDED)[1].match(inner))
        )

    def files(self, root: Path) -> list[str]:
        """Regular files under subdir that the rules take, in a stable order (a directory's files, then
        its subdirectories, each sorted by name). One scandir per directory: no stat per file."""
        out: list[str] = []

        def walk(path: str, inner: str) -> None:
            try:
                entries = sorted(os.scandir(path), key=lambda e: e.name)
            except (FileNotFoundError, NotADirectoryError):
                return
            dirs = []
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    dirs.append(e)
                elif e.is_file(follow_symlinks=False) and self._owns_inner(inner + e.name):
                    out.append(f"{self.subdir}/{inner}{e.name}")
            for e in dirs:
                walk(e.path, f"{inner}{e.name}/")

        walk(os.path.join(root, self.subdir), "")
        return out


def junk(rel: str) -> bool:
    """Lock files and half-written temporaries, wherever they are."""
    name = rel.rpartition("/")[2]
    return bool(_patterns((), ALWAYS_EXCLUDED)[1].match(rel) or _patterns((), ALWAYS_EXCLUDED)[1].match(name))


@functools.cache
def _patterns(include: tuple[str, ...], exclude: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    """fnmatch's rules as two compiled regexes: one match per path instead of one per pattern."""

    def union(patterns):
        return re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns) or "(?!)")

    return union(include), union(exclude)
