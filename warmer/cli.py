"""Command line: parses arguments, calls the journeys, prints. No logic of its own."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from warmer import (__version__, archive, artifact, build, fetch, fingerprint, report, restore, signing, verify,
                    warmup)
from warmer.recipe import RecipeError, load
from warmer.store import StoreError, open_store

# Errors whose message is written for the user: print it, no traceback.
USER_ERRORS = (RecipeError, StoreError, archive.ArchiveError, artifact.ArtifactError, restore.RestoreError,
               warmup.WarmupError, build.BuildError, signing.SignatureError, OSError)

EXIT_ERROR, EXIT_MISS, EXIT_NOT_HIT = 1, 3, 4


def _emit(args, doc: dict, human: str) -> None:
    print(json.dumps(doc, indent=1, default=str) if args.json else human)


def _workdir(args) -> Path:
    return Path(args.workdir).absolute() if args.workdir else Path(tempfile.mkdtemp(prefix="warmer-"))


def cmd_fingerprint(args) -> int:
    fp = fingerprint.probe()
    _emit(args, fp, report.fingerprint(fp))
    return 0


def cmd_build(args) -> int:
    recipe = load(args.recipe)
    try:
        result = build.build(recipe, args.store, Path(args.root), _workdir(args), allow_partial=args.allow_partial,
                             sign_key=args.sign_key)
    except build.BuildError as e:
        if e.report:
            _emit(args, e.report, report.build(e.report))
        raise
    _emit(args, result, report.build(result))
    return 0


def cmd_pack(args) -> int:
    doc = build.pack_root(Path(args.dir), load(args.recipe), Path(args.output), level=args.level)
    out = {"artifact": args.output, "key": doc["key"], "files": len(doc["files"]),
           "bytes": artifact.total_bytes(doc), "archive_bytes": os.path.getsize(args.output)}
    _emit(args, out, report.pairs(out))
    return 0


def cmd_publish(args) -> int:
    result = build.publish(open_store(args.store), Path(args.file), args.sign_key)
    _emit(args, result, report.pairs(result))
    return 0


def _write_env(env: dict, env_file: str | None, fmt: str, args) -> None:
    if env_file:
        Path(env_file).write_text(restore.render_env(env, fmt))
    elif not args.json:
        sys.stdout.write(restore.render_env(env, "shell"))


def cmd_fetch(args) -> int:
    recipe = load(args.recipe)
    result = fetch.fetch(recipe, args.store, Path(args.root), max_bytes=args.max_bytes,
                         trusted_keys=args.trusted_key or ())
    for w in result["warnings"]:
        print(f"warmer: warning: {w}", file=sys.stderr)
    print(report.fetch(result), file=sys.stderr)
    _write_env(result["env"], args.env_file, args.env_format, args)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    if result["status"] in ("hit", "already-active"):
        return 0
    return EXIT_MISS if args.require else 0


def cmd_restore(args) -> int:
    signature = json.loads(Path(args.signature).read_text()) if args.signature else None
    result = restore.restore_file(Path(args.file), Path(args.root), max_bytes=args.max_bytes,
                                  trusted_keys=args.trusted_key or (), signature=signature)
    if args.recipe:
        result["env"] = warmup.serve_env(load(args.recipe), Path(os.path.abspath(args.root)))
        _write_env(result["env"], args.env_file, args.env_format, args)
    _emit(args, result, report.pairs(result))
    return 0


def cmd_verify(args) -> int:
    root = Path(os.path.abspath(args.root))
    marker = restore.active(root)
    cold = marker["artifact"]["timings"].get("build") if marker else None
    result = verify.verify(load(args.recipe), root, _workdir(args), cold=cold)
    _emit(args, result, report.verify(result))
    return 0 if result["verdict"] == "hit" else EXIT_NOT_HIT


def cmd_inspect(args) -> int:
    with open(args.file, "rb") as f:
        doc = artifact.loads(archive.read_manifest(f))
    summary = {k: doc[k] for k in ("key", "recipe", "path_contract", "components", "timings", "created_at")}
    _emit(args, doc if args.full else summary, json.dumps(summary, indent=1))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="warmer", description="Warm vLLM's compile caches once per GPU type; "
                                "start every later node warm.")
    p.add_argument("--version", action="version", version=f"warmer {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def cmd(name, fn, help_):
        c = sub.add_parser(name, help=help_, description=help_)
        c.set_defaults(fn=fn)
        c.add_argument("--json", action="store_true", help="print JSON for machines")
        return c

    def env_out(c):
        c.add_argument("--env-file", help="write the env vLLM must start with to this file")
        c.add_argument("--env-format", choices=("dotenv", "shell"), default="dotenv",
                       help="format of --env-file (default dotenv: KEY=VALUE)")

    def sign_key(c):
        c.add_argument("--sign-key", help="Ed25519 private key (PEM) to sign the artifact with")

    def trust(c):
        c.add_argument("--trusted-key", action="append", metavar="PUBKEY",
                       help="Ed25519 public key (PEM); when given, only artifacts it signed are restored "
                            "(repeat for several keys)")

    def limit(c):
        c.add_argument("--max-bytes", type=int, default=restore.DEFAULT_MAX_BYTES,
                       help="refuse artifacts that unpack to more than this (default 256 GiB)")

    cmd("fingerprint", cmd_fingerprint, "describe this node")

    c = cmd("build", cmd_build, "warm a recipe from cold, pack, verify and publish")
    c.add_argument("recipe")
    c.add_argument("--store", required=True, help="file:///dir")
    c.add_argument("--root", required=True, help="empty directory: all caches live under it")
    c.add_argument("--workdir", help="logs and the artifact file (default: a new temporary directory)")
    c.add_argument("--allow-partial", action="store_true", help="publish even if verify sees recompiles")
    sign_key(c)

    c = cmd("pack", cmd_pack, "pack a warmed root into an artifact file")
    c.add_argument("dir")
    c.add_argument("--recipe", required=True)
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--level", type=int, default=3, help="zstd level (default 3)")

    c = cmd("publish", cmd_publish, "publish an artifact file to a store")
    c.add_argument("file")
    c.add_argument("--store", required=True)
    sign_key(c)

    c = cmd("fetch", cmd_fetch, "node bootstrap: fetch this node's artifact, restore it, print the env")
    c.add_argument("recipe")
    c.add_argument("--store", required=True)
    c.add_argument("--root", required=True)
    c.add_argument("--require", action="store_true", help=f"exit {EXIT_MISS} on a miss instead of 0")
    env_out(c)
    limit(c)
    trust(c)

    c = cmd("restore", cmd_restore, "restore a local artifact file into a root")
    c.add_argument("file")
    c.add_argument("--root", required=True)
    c.add_argument("--recipe", help="also print (or --env-file) the env for serving this recipe")
    env_out(c)
    limit(c)
    trust(c)
    c.add_argument("--signature", help="signature file (default: FILE.sig when --trusted-key is given)")

    c = cmd("verify", cmd_verify, "start the engine on a root again and prove the cache is hit")
    c.add_argument("recipe")
    c.add_argument("--root", required=True)
    c.add_argument("--workdir", help="logs (default: a new temporary directory)")

    c = cmd("inspect", cmd_inspect, "show an artifact file's artifact.json")
    c.add_argument("file")
    c.add_argument("--full", action="store_true", help="with --json: the whole artifact.json, file list included")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        print(f"warmer: {args.command}: {e}", file=sys.stderr)
        return EXIT_ERROR
