"""warmer matrix: the recipe x GPU SKU matrix, one CI build job per entry."""

from __future__ import annotations

import argparse
import json

from warmer import api
from warmer.cli import Output
from warmer.errors import EXIT_OK

HELP = "the recipe x GPU SKU matrix for a CI job per SKU (GitHub Actions strategy.matrix)"
ORDER = 140


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("paths", nargs="+", metavar="MANIFESTS", help="the manifests directory, or recipe files")
    c.add_argument(
        "--format",
        choices=("github", "json"),
        default="github",
        help="github: one line of strategy.matrix JSON for $GITHUB_OUTPUT (default); json: the entries",
    )
    c.add_argument("--skus", help="the SKU catalogue (default: skus.toml in or above MANIFESTS)")
    c.add_argument("--sku", action="append", help="only this SKU (repeat for several)")
    c.add_argument(
        "--root-base",
        default=api.DEFAULT_ROOT_BASE,
        help="each entry's root is ROOT_BASE/RECIPE (default /cache): build and serve at the same path",
    )


def run(args: argparse.Namespace, out: Output) -> int:
    entries, skipped = api.matrix(args.paths, skus=args.skus, only=args.sku, root_base=args.root_base)
    for s in skipped:
        out.say(f"warmer: matrix: skipped {s}")
    if args.format == "json" or out.json:
        print(json.dumps(entries, indent=1))
    else:
        print(json.dumps(api.github_matrix(entries), separators=(",", ":")))
    return EXIT_OK
