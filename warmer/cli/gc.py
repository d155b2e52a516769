"""warmer gc: all but the newest artifacts of each recipe and machine kind deleted, and unused blobs."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from warmer import api
from warmer.cli import Output, add_store, store_options
from warmer.cli.render import damaged, grace_hours, megabytes
from warmer.errors import EXIT_ERROR, EXIT_OK

if TYPE_CHECKING:
    from warmer.api import Collection

HELP = "delete all but the newest artifacts of each recipe and machine kind, and unused blobs"
ORDER = 120


def add_arguments(c: argparse.ArgumentParser) -> None:
    add_store(c)
    c.add_argument(
        "--keep",
        type=int,
        required=True,
        metavar="N",
        help="keep the newest N artifacts of each recipe on each machine kind (CPU arch + GPU model)",
    )
    c.add_argument("--older-than", type=float, metavar="DAYS", help="delete only artifacts published over DAYS ago")
    c.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")


def run(args: argparse.Namespace, out: Output) -> int:
    result = api.gc(
        args.store, args.keep, older_than_days=args.older_than, dry_run=args.dry_run, **store_options(args, out)
    )
    out.emit(result, report(result))
    if out.json:  # the report says it; with --json alone, exit 1 would come without a word
        out.warn(damaged(result.raced, "gc"))
    return EXIT_ERROR if result.raced else EXIT_OK


def _orphan(b: Any) -> str:
    return f"orphan blob {b.sha256[:16]} ({megabytes(b.size)}, uploaded {b.modified.isoformat(timespec='seconds')})"


def report(r: Collection) -> str:
    verb = "would delete" if r.dry_run else "deleted"
    lines = [
        f"{verb}: {e.recipe} {e.key[:16]} ({e.machine}, published {e.published_at.isoformat()})"
        for e in r.deleted_entries
    ]
    lines += [f"{verb}: {_orphan(b)}: no index entry names it" for b in r.orphans_deleted]
    lines += [
        f"kept: {_orphan(b)}: no index entry names it, but it is younger than {grace_hours():.0f} h "
        "(maybe a publish in flight)"
        for b in r.orphans_kept
    ]
    lines += [
        f"{verb}: {x.path} ({megabytes(x.size)}, last written {x.modified.isoformat(timespec='seconds')}): "
        "left by a publisher that died mid-copy"
        for x in r.scraps_deleted
    ]
    lines += [
        f"kept: {e.recipe} {e.key[:16]} ({e.machine}): also named {by} in the store, which deleting it "
        "would delete too; remove that name to let gc drop it"
        for e, by in r.pinned
    ]
    if r.shared_kept:
        lines.append(
            f"kept: {len(r.shared_kept)} blob(s) of the {'doomed' if r.dry_run else 'deleted'} entries that "
            "entries left still name (shared layers)"
        )
    lines += damaged(r.raced, "gc")
    lines.append(
        f"{r.store}: {verb} {len(r.deleted_entries)} of {r.entries} index entries and "
        f"{len(r.deleted_blobs)} blob(s), {r.freed_bytes / 1e6:.1f} MB; kept {r.kept_entries} "
        f"(newest {r.keep} per recipe and machine kind)"
    )
    return "\n".join(lines)
