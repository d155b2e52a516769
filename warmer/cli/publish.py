"""warmer publish: an artifact file checked member by member, then published to a store."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from warmer import api
from warmer.cli import Output, add_deadline, add_layers, add_sign_key, add_store, store_options
from warmer.cli.render import pairs
from warmer.errors import EXIT_ERROR, EXIT_OK

if TYPE_CHECKING:
    from warmer.api import PublishResult

HELP = "publish an artifact file to a store (after checking every member)"
ORDER = 50


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("file", metavar="ARTIFACT", help="an artifact file (warmer pack or build)")
    add_store(c)
    add_sign_key(c)
    add_layers(c)
    add_deadline(c, api.PUBLISH_DEADLINE_S, "the upload fails")


def run(args: argparse.Namespace, out: Output) -> int:
    result = api.publish(
        args.file,
        args.store,
        sign_key=args.sign_key,
        deadline=args.deadline,
        layers=args.layers,
        **store_options(args, out),
    )
    out.warn(result.warnings or ())
    out.emit(result, report(result))
    if result.missing_blobs:  # published, and every node on it misses: not a green publish
        out.warn(
            [
                f"the published entry of {result.recipe} {result.key[:16]} names {len(result.missing_blobs)} "
                f"blob(s) the store lacks and this file does not hold ({', '.join(b[:12] for b in result.missing_blobs)}): "
                "every node on that key misses; publish the artifact file it was built as, or `warmer rm "
                f"{result.store}/index/{result.recipe}/{result.key} --yes` and publish this one"
            ]
        )
        return EXIT_ERROR
    return EXIT_OK


def report(r: PublishResult) -> str:
    lines = [pairs({k: v for k, v in r.to_json().items() if k != "warnings"})]
    if r.layers:  # what went up: the whole-file blob is no layered entry's
        lines.append(
            "layers: " + ", ".join(f"{c} {'uploaded' if up else 'already there'}" for c, up in r.layers.items())
        )
    if r.mended:
        lines.append("mended: " + ", ".join(sha[:12] for sha in r.mended))
    if r.missing_blobs:
        lines.append("missing: " + ", ".join(sha[:12] for sha in r.missing_blobs))
    return "\n".join(lines)
