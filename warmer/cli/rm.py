"""warmer rm: one published artifact removed (its index entry, and each blob of it that no other entry names)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from warmer import api
from warmer.cli import Output, add_s3, store_options
from warmer.cli.render import damaged
from warmer.errors import EXIT_ERROR, EXIT_OK

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
    out.warn(damaged(result.raced, "rm"))  # with --json too: exit 1 must not come without a word
    return EXIT_ERROR if result.raced else EXIT_OK  # without --yes, a dry run: it did what was asked


def _layers(r: Removal) -> str:
    """A layered entry's blobs: each deleted, or kept where another entry shares it."""
    gone, kept = ("would be deleted", "would be kept") if r.dry_run else ("deleted", "kept")
    shown = [f"{c} {sha[:12]} {gone if sha in r.deleted_blobs else kept}" for c, sha in r.layers]
    return (
        f"its {len(r.layers)} layer(s): {', '.join(shown)} (a layer is kept while another entry names it, "
        "or while an entry is unreadable)"
    )


def report(r: Removal) -> str:
    kept = "kept (another entry names it, or an entry is unreadable)"
    if r.layers:
        if r.dry_run:
            return (
                f"would remove {r.store}/index/{r.recipe}/{r.key}; {_layers(r)}; nothing removed: "
                "pass --yes to remove it"
            )
        return f"removed {r.store}/index/{r.recipe}/{r.key}; {_layers(r)}; an audit record is kept in the store"
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
