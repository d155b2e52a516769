"""The path contract: the absolute paths an artifact's caches were built at, and what rebuilds
on a node where one differs.

Path-fragile caches record the paths they depend on: vLLM keys its compile
cache on the served model path string, Inductor's C++ kernels hold -I paths into the Python
install, FlashInfer's build.ninja holds absolute paths (warmer.flashinfer_jit). build writes the
contract into artifact.json; fetch and doctor compare it with the node's and say what rebuilds.
"""

from __future__ import annotations

import getpass
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from warmer import flashinfer_jit
from warmer.untrusted import Fields


@dataclass(frozen=True)
class PathContract:
    root: str
    model: str
    python_prefix: str
    user: str | None = None
    flashinfer: flashinfer_jit.FlashInferContract | None = None

    @classmethod
    def here(cls, root: Path, model: str, env: Mapping[str, str]) -> PathContract:
        """The contract of caches warmed under root, for this Python and this env."""
        return cls(
            root=str(root),
            model=model,
            python_prefix=sys.prefix,
            user=getpass.getuser(),
            flashinfer=flashinfer_jit.contract(root, dict(env)),
        )

    @classmethod
    def from_json(cls, f: Fields) -> PathContract:
        fi = f.opt_obj("flashinfer")
        return cls(
            root=f.str("root"),
            model=f.str("model"),
            python_prefix=f.str("python_prefix"),
            user=f.opt_str("user", max_len=256),
            flashinfer=flashinfer_jit.FlashInferContract.from_json(fi) if fi else None,
        )

    def to_json(self) -> dict:
        doc = {"root": self.root, "model": self.model, "python_prefix": self.python_prefix, "user": self.user}
        if self.flashinfer is not None:
            doc["flashinfer"] = self.flashinfer.to_json()
        return doc

    def warnings(self, root: Path, model: str, fixed_components: list[str], env: Mapping[str, str]) -> list[str]:
        """What will be rebuilt on this node because a path the caches depend on differs.

        fixed_components: the artifact's components that do not survive a move to another root;
        env: the environment vLLM will start with (FlashInfer's rebuild triggers are read in it)."""
        out = []
        fi = self.flashinfer
        if self.root != str(root):
            # FlashInfer's own comparison below says which modules and why.
            moved = [n for n in fixed_components if not (n == "flashinfer" and fi)]
            if moved:
                out.append(
                    f"root {root} differs from the build's {self.root}: {', '.join(moved)} will rebuild; "
                    f"serve from {self.root} to keep them"
                )
        if self.model != model:
            out.append(
                f"model path {model} differs from the build's {self.model}: vLLM keys its compile cache "
                "on it and will recompile"
            )
        if self.python_prefix != sys.prefix:
            out.append(
                f"python prefix {sys.prefix} differs from the build's {self.python_prefix}: Inductor's C++ "
                "kernels will recompile"
            )
        if fi and fi.modules:
            reasons = flashinfer_jit.compare(fi, flashinfer_jit.contract(root, dict(env)))
            if reasons:
                out.append(
                    f"FlashInfer will rebuild {len(fi.modules)} JIT module(s) ({', '.join(fi.modules[:5])}) "
                    "because: " + "; ".join(reasons)
                )
        return out
