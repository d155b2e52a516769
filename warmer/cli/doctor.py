"""warmer doctor: a serving environment checked: where the caches land, what vLLM hashes, the artifact."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from warmer import api
from warmer.cli import Output, add_trust
from warmer.cli.render import shown
from warmer.errors import EXIT_FINDINGS, EXIT_OK

if TYPE_CHECKING:
    from warmer.api import Diagnosis

HELP = (
    "check a serving environment: where the caches land, FlashInfer's writable "
    "directories, env vLLM hashes into its compile key, the active artifact"
)
ORDER = 160


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--root", help="the warmer root to check the active artifact of (default: found from VLLM_CACHE_ROOT)"
    )
    c.add_argument("--recipe", help="the recipe being served: check the artifact's path contract against it")
    c.add_argument("--env-file", help="the env file vLLM starts with (warmer fetch --env-file), applied on top")
    c.add_argument("--pid", type=int, help="check the env of this process instead (e.g. 1: vLLM in its container)")
    c.add_argument("--mountinfo", help="a saved mountinfo file instead of /proc/self/mountinfo")
    add_trust(c, "an active artifact none of them signed is an error (serve starts vLLM cold)")


def run(args: argparse.Namespace, out: Output) -> int:
    result = api.doctor(
        root=args.root,
        recipe_file=args.recipe,
        env_file=args.env_file,
        pid=args.pid,
        mountinfo=args.mountinfo,
        trusted_keys=args.trusted_key or (),
    )
    out.emit(result, report(result))
    return EXIT_OK if result.ok else EXIT_FINDINGS


# doctor's messages quote values with repr(): an unset variable reads "VAR is None" there.
_IS_NONE = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*) is None\b")


def _unset(text: str) -> str:
    return _IS_NONE.sub(r"\1 is unset", text)


def report(r: Diagnosis) -> str:
    rows = [
        (
            row["var"],
            shown(row["path"]) + (" (default)" if row["default"] else ""),
            f"{shown(row['kind'])}: "
            + (f"{shown(row['fstype'])} on {row['mount_point']}" if row["mount_point"] else "?")
            + (", read-only" if row["read_only"] else ""),
        )
        for row in r.locations
    ]
    # Columns as wide as their longest cell, two spaces apart: a long name never runs into its value.
    var_w = max([len("VARIABLE")] + [len(v) for v, _, _ in rows])
    path_w = max([len("PATH")] + [len(p) for _, p, _ in rows])
    lines = ["cache locations:", f"  {'VARIABLE':<{var_w}}  {'PATH':<{path_w}}  FILESYSTEM"]
    lines += [f"  {var:<{var_w}}  {path:<{path_w}}  {where}" for var, path, where in rows]
    if r.root:
        lines.append(f"root: {r.root}")
    for f in r.findings:
        lines.append(f"{f.severity.upper():<8}{f.check}: {_unset(shown(f.what))}")
        if f.fix != "none":
            lines.append(f"{'':<8}fix: {_unset(shown(f.fix))}")
    c = r.counts
    lines.append(f"{c[api.DOCTOR_ERROR]} error(s), {c[api.DOCTOR_WARNING]} warning(s), {c[api.DOCTOR_INFO]} note(s)")
    return "\n".join(lines)
