"""warmer ls: the artifacts a store holds, or the roots on this node (--root-base)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from warmer import api, errors
from warmer.cli import Output, add_deadline, add_store, store_options
from warmer.cli.render import grace_hours
from warmer.errors import EXIT_OK

if TYPE_CHECKING:
    from warmer.api import Listing, LocalRoot
    from warmer.catalog import Row

HELP = "list the artifacts published in a store, or the roots on this node (--root-base)"
ORDER = 110


def add_arguments(c: argparse.ArgumentParser) -> None:
    add_store(c, required=False)
    c.add_argument("--recipe", metavar="RECIPE", help="only this recipe's artifacts: its file (or its name)")
    add_deadline(c, api.DEFAULT_DEADLINE_S, "the listing fails")
    c.add_argument(
        "--root-base",
        metavar="DIR",
        help="list the roots under DIR on this node instead: recipe, key, size, restored when, and "
        "whether the artifact still fits this node",
    )


def run(args: argparse.Namespace, out: Output) -> int:
    if args.root_base:
        roots = api.local_roots(args.root_base, deadline=args.deadline)
        out.emit([r.to_json() for r in roots], local_roots(args.root_base, roots))
        return EXIT_OK
    if not args.store:
        raise errors.UsageError("ls needs --store URL (what a store holds) or --root-base DIR (the roots on this node)")
    result = api.ls(args.store, args.recipe, deadline=args.deadline, **store_options(args, out))
    out.emit(result, report(result))
    return EXIT_OK


def _orphans(blobs: Sequence) -> str:
    return f"{len(blobs)} orphan blob(s), {sum(b.size for b in blobs) / 1e6:.1f} MB"


def _stored_as(row: Row) -> str:
    """How an entry's bytes are stored: one blob, or layers (and how many of them other entries share)."""
    if not row.layers:
        return "1 blob" + (" (shared)" if row.shared_bytes else "")
    shared = sum(x.shared for x in row.layers)
    return f"{len(row.layers)} layers" + (f", {shared} shared ({row.shared_bytes / 1e6:.1f} MB)" if shared else "")


def report(r: Listing) -> str:
    # No entry names an orphan blob: an upload in flight or a lost publish race, gc's to delete.
    orphans = (
        f"{_orphans(r.orphans)} that no index entry names (an upload in flight, or left by an "
        f"interrupted publish): `warmer gc --store {r.store} --keep N --dry-run` lists them, gc deletes them once "
        f"{grace_hours():.0f} h old"
        if r.orphans
        else None
    )
    if not r.rows and not r.unreadable:
        return "\n".join([f"{r.store}: no artifacts"] + ([orphans] if orphans else []))
    lines = [f"{'RECIPE':<28} {'KEY':<16} {'MACHINE':<28} {'PUBLISHED':<25} {'SIZE':>10} {'VERIFY':<8} STORED AS"]
    for row in r.rows:
        lines.append(
            f"{row.recipe:<28} {row.key[:16]:<16} {row.machine:<28} "
            f"{row.published_at.isoformat():<25} {row.archive_bytes / 1e6:>7.1f} MB {row.verify or '-':<8} "
            f"{_stored_as(row)}"
        )
    for u in r.unreadable:
        lines.append(f"{u.recipe:<28} {u.key[:16]:<16} UNREADABLE: {u.why}")
    lines.append(f"{len(r.rows)} artifact(s) in {r.store}; details: warmer inspect {r.store}/index/RECIPE/KEY")
    if r.rows:
        lines.append(
            f"{r.stored_bytes / 1e6:.1f} MB stored in {r.blob_count} blob(s), {r.unshared_bytes / 1e6:.1f} MB "
            f"unshared; {r.shared_blobs} blob(s) shared by more than one entry"
        )
    if r.unreadable:
        lines.append(
            f"{len(r.unreadable)} unreadable entr{'y' if len(r.unreadable) == 1 else 'ies'}: remove with "
            f"`warmer rm {r.store}/index/RECIPE/KEY --yes`"
        )
    if orphans:
        lines.append(orphans)
    return "\n".join(lines)


def local_roots(base: str, roots: Sequence[LocalRoot]) -> str:
    """The roots on this node (warmer ls --root-base)."""
    if not roots:
        return f"{base}: no roots"
    width = max(len("ROOT"), *(len(r.root) for r in roots))
    lines = [f"{'RECIPE':<28} {'ROOT':<{width}} {'KEY':<16} {'SIZE':>10} {'RESTORED':<25} FITS"]
    for r in roots:
        fits = "-" if r.fits is None else "yes" if r.fits else "NO: " + "; ".join(r.why_not)
        lines.append(
            f"{r.recipe:<28} {r.root:<{width}} {(r.key or 'none active')[:16]:<16} {r.bytes / 1e6:>7.1f} MB "
            f"{r.restored_at or '-':<25} {fits}"
        )
    return "\n".join(lines)
