"""warmer rm: one published artifact removed (its index entry, and its blob when no other names it)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from warmer import api
from warmer.cli import Output, add_s3, store_options
from warmer.errors import EXIT_OK

if TYPE_CHECKING:
    from warmer.api import Removal

HELP = "remove one published artifact (index entry, and its blob when no other entry uses it)"
ORDER = 130


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("entry", metavar="URL", help="STORE/index/RECIPE/KEY (a key prefix of 8+ hex digits will do)")
    c.add_argument("--yes", action="store_true", help="really remove it (without: say what would be removed)")
    add_s3(c)


def run(args: argparse.Namespace, out: Output) -> int:
    result = api.rm(args.entry, yes=args.yes, **store_options(args, out))
    out.say(f"warmer: rm: {report(result)}")
    out.emit(result)
    return EXIT_OK  # without --yes, a dry run: it did what was asked


def report(r: Removal) -> str:
    kept = "kept (another entry names it, or an entry is unreadable)"
    if r.dry_run:  # nothing happened: say what --yes would do, in the conditional
        blob = (
            f"blob {r.blob[:16]} would be {'deleted too' if r.blob_deleted else kept}"
            if r.blob
            else "its blob is unknown (unreadable entry): it would be kept"
        )
        return f"would remove {r.store}/index/{r.recipe}/{r.key}; {blob}; nothing removed: pass --yes to remove it"
    blob = (
        f"blob {r.blob[:16]} {'deleted' if r.blob_deleted else kept}"
        if r.blob
        else "its blob is unknown (unreadable entry): kept"
    )
    return f"removed {r.store}/index/{r.recipe}/{r.key}; {blob}; an audit record is kept in the store"
