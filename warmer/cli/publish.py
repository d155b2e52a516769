"""warmer publish: an artifact file checked member by member, then published to a store."""

from __future__ import annotations

import argparse

from warmer import api
from warmer.cli import Output, add_deadline, add_layers, add_sign_key, add_store, store_options
from warmer.cli.render import pairs
from warmer.errors import EXIT_OK

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
    out.emit(result, pairs({k: v for k, v in result.to_json().items() if k != "warnings"}))
    return EXIT_OK
