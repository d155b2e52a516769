"""warmer serve: vLLM started exactly as warmed, after a check that its own compile key will hold."""

from __future__ import annotations

import argparse
import sys

from warmer import api
from warmer.cli import Output, add_recipe, add_root, add_trust
from warmer.errors import EXIT_MISS, EXIT_OK, WarmerError

HELP = (
    "start vLLM exactly as warmed: the recipe's model and engine args as `vllm serve` "
    "flags, the env for the root's artifact, and a check that vLLM's own compile key will hold"
)
ORDER = 150


class WouldCompile(WarmerError):
    """--require-hit, and vLLM would compile from cold: an error like any other (a JSON object with --json)."""

    kind = "miss"
    exit_code = EXIT_MISS


def add_arguments(c: argparse.ArgumentParser) -> None:
    add_recipe(c)
    add_root(c, what="the root the artifact was fetched into")
    c.add_argument("--env-file", help="an env file (warmer fetch --env-file) applied on top")
    c.add_argument("--offline", action="store_true", help="forbid FlashInfer downloads (FLASHINFER_NO_DOWNLOAD=1)")
    add_trust(c, "the root's artifact is served only if one of them signed it, else vLLM starts cold")
    c.add_argument("--dry-run", action="store_true", help="print the env and the command, start nothing")
    c.add_argument(
        "--require-hit",
        action="store_true",
        help=f"exit {EXIT_MISS} instead of starting when vLLM would compile from cold (no artifact, a "
        "partial hit, or an env var or flag it hashes differs from the build)",
    )
    c.epilog = (
        "more `vllm serve` flags go after --, e.g. `warmer serve R --root D -- --port 8000`; engine args "
        f"there are not the warmed ones (a warning says so)\n\n{c.epilog}"
    )


def run(args: argparse.Namespace, out: Output) -> int:
    plan = api.serve_plan(
        args.recipe,
        args.root,
        args.extra,
        env_file=args.env_file,
        offline=args.offline,
        trusted_keys=args.trusted_key or (),
    )
    out.warn(plan.warnings)
    if args.dry_run:
        out.emit(plan, plan.shell().rstrip())
        return EXIT_MISS if args.require_hit and plan.predicted_miss else EXIT_OK
    if args.require_hit and plan.predicted_miss:
        raise WouldCompile(
            "refusing to start: vLLM would compile from cold (above); without --require-hit it starts anyway"
        )
    sys.stdout.flush()
    api.serve(plan)  # does not return
    return EXIT_OK
