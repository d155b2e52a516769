"""warmer pack: a warmed root packed into an artifact file."""

from __future__ import annotations

import argparse

from warmer import api
from warmer.cli import Output
from warmer.cli.render import pairs
from warmer.errors import EXIT_OK

HELP = "pack a warmed root into an artifact file"
ORDER = 40


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("dir", metavar="ROOT", help="the root a warm-up filled")
    c.add_argument("--recipe", required=True, help="the recipe it was warmed with")
    c.add_argument("-o", "--output", required=True, help="the artifact file to write (.tar.zst)")
    c.add_argument("--level", type=_level, default=3, help="zstd level, 1 to 22 (default 3)")


def _level(text: str) -> int:
    """zstd's levels: a level outside them was a traceback from the compressor, not a usage error."""
    if not text.lstrip("-").isdigit() or not 1 <= int(text) <= 22:
        raise argparse.ArgumentTypeError(f"{text!r} is not a zstd level: give 1 to 22")
    return int(text)


def run(args: argparse.Namespace, out: Output) -> int:
    result = api.pack(args.dir, args.recipe, args.output, level=args.level)
    out.emit(result, pairs(result.to_json()))
    return EXIT_OK
