"""The path contract: the absolute paths an artifact's caches were built at, and what rebuilds
on a node where one differs.

Path-fragile caches record the paths they depend on: vLLM keys its compile
cache on the served model path string, Inductor's C++ kernels hold -I paths into the Python
install, FlashInfer's build.ninja holds absolute paths (warmer.components.flashinfer). build writes the
contract into artifact.json; fetch and doctor compare it with the node's and say what rebuilds.
"""

from __future__ import annotations

import os
import pwd
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmer.components import flashinfer as fi_jit  # its module's name is this class's field
from warmer.untrusted import Fields


def user_name(env: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """The name torch gives the user in its cache paths (torchinductor_NAME): getpass.getuser()'s
    env vars, then uid's passwd entry (this process's uid by default). A uid without one
    (Kubernetes' runAsUser, OpenShift's arbitrary uids: no USER either) makes getpass.getuser()
    raise KeyError; it is then torch's own fallback, uid_N."""
    env = os.environ if env is None else env
    for var in ("LOGNAME", "USER", "LNAME", "USERNAME"):  # getpass.getuser()'s order
        if env.get(var):
            return env[var]
    uid = os.getuid() if uid is None else uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid_{uid}"


@dataclass(frozen=True)
class PathContract:
    root: str
    model: str
    python_prefix: str
    user: str | None = None
    flashinfer: fi_jit.FlashInferContract | None = None

    @classmethod
    def here(cls, root: Path, model: str, env: Mapping[str, str]) -> PathContract:
        """The contract of caches warmed under root, for this Python and this env."""
        return cls(
            root=str(root),
            model=model,
            python_prefix=sys.prefix,
            user=user_name(),
            flashinfer=fi_jit.contract(root, dict(env)),
        )

    @classmethod
    def from_json(cls, f: Fields) -> PathContract:
        fi = f.opt_obj("flashinfer")
        return cls(
            root=f.text("root"),
            model=f.text("model"),
            python_prefix=f.text("python_prefix"),
            user=f.opt_text("user", max_len=256),
            flashinfer=fi_jit.FlashInferContract.from_json(fi) if fi else None,
        )

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "root": self.root,
            "model": self.model,
            "python_prefix": self.python_prefix,
            "user": self.user,
        }
        if self.flashinfer is not None:
            doc["flashinfer"] = self.flashinfer.to_json()
        return doc

    def warnings(self, root: Path, model: str, fixed_components: list[str]) -> list[str]:
        """What will be rebuilt on this node because a path the caches depend on differs.

        fixed_components: the artifact's components that do not survive a move to another root.
        FlashInfer's own comparison (which modules, and why) is its component's check."""
        out = []
        fi = self.flashinfer
        if self.root != str(root):
            # FlashInfer's component check says which of its modules rebuild, and why.
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
        return out
