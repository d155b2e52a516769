"""What every cache component is: a directory under the root, its env vars and its file rules."""

from __future__ import annotations

import os
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

# Lock files and half-written temporaries are never part of a cache.
ALWAYS_EXCLUDED = ("*.lock", "locks/*", "*/locks/*", "*.tmp", "*.tmp.*", "*.partial")


@dataclass(frozen=True)
class Component:
    name: str
    subdir: str                         # directory under the root
    env: tuple[tuple[str, str], ...]    # (VAR, path under the root) pairs
    about: str
    include: tuple[str, ...] = ("*",)   # patterns on the path relative to subdir
    exclude: tuple[str, ...] = ()
    relocatable: bool = True            # hits after a restore under another root path

    def env_under(self, root: Path) -> dict[str, str]:
        return {var: str(root / rel) for var, rel in self.env}

    def owns(self, rel: str) -> bool:
        head, _, inner = rel.partition("/")
        if head != self.subdir or not inner:
            return False
        return (any(fnmatch(inner, p) for p in self.include)
                and not any(fnmatch(inner, p) for p in self.exclude + ALWAYS_EXCLUDED))

    def files(self, root: Path) -> list[str]:
        base = root / self.subdir
        out = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for fn in sorted(filenames):
                full = os.path.join(dirpath, fn)
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                if os.path.isfile(full) and not os.path.islink(full) and self.owns(rel):
                    out.append(rel)
        return out
