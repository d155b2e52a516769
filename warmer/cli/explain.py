"""warmer explain: every artifact of a recipe in a store, accepted or rejected on this node, and why."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from warmer import api
from warmer.cli import Output, add_recipe, add_store, store_options
from warmer.errors import EXIT_OK

if TYPE_CHECKING:
    from warmer.api import Explanation

HELP = "every artifact of a recipe in a store: accepted or rejected here, and why"
ORDER = 20


def add_arguments(c: argparse.ArgumentParser) -> None:
    add_recipe(c)
    add_store(c)
    c.add_argument("-v", "--verbose", action="store_true", help="also show the rules that hold")
    c.add_argument(
        "--gpus-from",
        metavar="FILE",
        help="judge for the GPUs of this saved fingerprint (`warmer fingerprint --json` on a serving node), "
        "not this machine's",
    )


def run(args: argparse.Namespace, out: Output) -> int:
    result = api.explain(args.recipe, args.store, gpus_from=args.gpus_from, **store_options(args, out))
    out.emit(result, report(result, verbose=args.verbose))
    return EXIT_OK


def report(r: Explanation, verbose: bool = False) -> str:
    """Accepted artifacts, then rejected ones nearest first, each failed rule with its reason."""
    lines = [
        f"recipe {r.recipe} in {r.store}: {r.accepted} accepted, {r.rejected} rejected "
        f"for this node (key {r.node_key[:16]})",
        f"this node: {r.node}",
    ]
    lines += [f"  warning: {p}" for p in r.unfit + r.volatile_env]
    if not r.candidates:
        lines.append("no artifact of this recipe is published in this store")
    for c in r.candidates:
        verdict = "ACCEPTED" if c.accepted else "rejected"
        failed = ", ".join(f"{len(v)} {k}" for k, v in (("hard", c.failed_hard), ("ranged", c.failed_ranged)) if v)
        lines.append(
            f"{verdict:<9}{c.key[:16]}{'  (this node key)' if c.exact else ''}"
            f"{'  fails ' + failed if failed else ''}  published {c.published_at.isoformat()}"
        )
        lines.append(f"           built on {c.built_on}")
        lines += [f"    layer {layer.line()}" for layer in c.layers]
        for d in c.decisions:
            if not d.ok or (verbose and d.kind != "advisory"):
                lines.append(f"    {'ok ' if d.ok else 'NO '} {d.field} [{d.kind}]: {d.reason}")
                if not d.ok and d.why:
                    lines.append(f"         why: {d.why}")
        if c.advisory_differences:
            lines.append(f"    advisory differences (not decisive): {', '.join(c.advisory_differences)}")
    lines += [f"unreadable {key[:16]}: {why}" for key, why in r.unreadable]
    return "\n".join(lines)
