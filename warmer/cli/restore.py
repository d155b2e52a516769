"""warmer restore: a local artifact file restored into a root (an image build, an air-gapped node)."""

from __future__ import annotations

import argparse

from warmer import api
from warmer.cli import Output, add_env_out, add_limits, add_owner, add_root, add_trust, check_out_file, write_env
from warmer.cli.fetch import check_env_format
from warmer.cli.render import pairs
from warmer.errors import EXIT_OK
from warmer.recipe import load

HELP = "restore a local artifact file into a root"
ORDER = 70


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("file", metavar="ARTIFACT", help="an artifact file")
    add_root(c)
    c.add_argument(
        "--recipe",
        help="refuse an artifact built for another recipe (or another version of it), and print (or "
        "--env-file) the env for serving this recipe",
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="restore an artifact built for another --recipe, or replace a directory at --root that warmer "
        "did not create",
    )
    add_env_out(c)
    add_limits(c)
    add_trust(c)
    add_owner(c)
    c.add_argument("--signature", help="signature file (default: ARTIFACT.sig when --trusted-key is given)")


def run(args: argparse.Namespace, out: Output) -> int:
    if args.env_file:
        check_out_file("--env-file", args.env_file, "give a file in a directory this user can write")
    if args.env_file or (args.recipe and not args.json):  # as fetch: said before the root is touched
        served = load(args.recipe) if args.recipe else api.artifact_recipe(args.file)
        check_env_format(served, args.root, args.env_format if args.env_file else "shell")
    result = api.restore(
        args.file,
        args.root,
        recipe_file=args.recipe,
        trusted_keys=args.trusted_key or (),
        signature_file=args.signature,
        max_bytes=args.max_bytes,
        force=args.force,
        lock_timeout=args.lock_timeout,
        owner=args.owner,
        progress=out.progress,
    )
    out.warn(result.warnings or ())
    if args.recipe or args.env_file:
        # Without --recipe, the artifact's own (artifact.json records it): an image build needs no recipe file.
        write_env(args, api.serving_env(args.recipe, args.root, offline=args.offline))
    if args.recipe and not args.env_file and not out.json:
        # stdout holds the env's export lines, to eval or source: the report goes beside it, as fetch's does
        out.say(pairs(result.to_json()))
    else:
        out.emit(result, pairs(result.to_json()))
    return EXIT_OK
