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
from warmer import catalog, explain
from warmer import doctor, matrix
from warmer import components
from warmer.components import flashinfer
from warmer.recipe import RecipeError, load
from warmer.store import StoreError, open_store

# Errors whose message is written for the user: print it, no traceback.
USER_ERRORS = (RecipeError, StoreError, archive.ArchiveError, artifact.ArtifactError, restore.RestoreError,
               warmup.WarmupError, build.BuildError, signing.SignatureError, matrix.MatrixError,
               fingerprint.FingerprintError, OSError)

EXIT_ERROR, EXIT_MISS, EXIT_NOT_HIT, EXIT_FINDINGS = 1, 3, 4, 5


def _emit(args, doc: dict, human: str) -> None:
    print(json.dumps(doc, indent=1, default=str) if args.json else human)


def _workdir(args) -> Path:
    return Path(args.workdir).absolute() if args.workdir else Path(tempfile.mkdtemp(prefix="warmer-"))


def _store_options(args) -> dict:
    # Transfer bars only for a person at a terminal: never in pipelines or with --json.
    return {"endpoint_url": args.endpoint_url, "path_style": args.s3_path_style or None,
            "progress": sys.stderr.isatty() and not args.json}


def _store(args):
    return open_store(args.store, **_store_options(args))


def cmd_fingerprint(args) -> int:
    fp = fingerprint.probe(root=os.path.abspath(args.root) if args.root else None,
                           model=load(args.recipe).model if args.recipe else None)
    _emit(args, fp, report.fingerprint(fp))
    return 0


def cmd_explain(args) -> int:
    recipe = load(args.recipe)
    node = fingerprint.probe(model=recipe.model)
    result = explain.explain(_store(args), recipe, node)
    _emit(args, result, report.explain(result, verbose=args.verbose))
    return 0


def _step_summary(args, result: dict | None, recipe: str, error: str | None = None) -> None:
    if args.step_summary:
        with open(args.step_summary, "a") as f:
            f.write(matrix.step_summary(result, recipe=recipe, error=error))


def cmd_build(args) -> int:
    recipe = load(args.recipe)
    try:
        result = build.build(recipe, _store(args), Path(args.root), _workdir(args), allow_partial=args.allow_partial,
                             sign_key=args.sign_key)
    except Exception as e:  # the CI summary says why, whatever stopped the build
        if isinstance(e, build.BuildError) and e.report:
            _emit(args, e.report, report.build(e.report))
        _step_summary(args, getattr(e, "report", None), recipe.name, str(e))
        raise
    _step_summary(args, result, recipe.name)
    for w in result.get("warnings", []):
        print(f"warmer: warning: {w}", file=sys.stderr)
    _emit(args, result, report.build(result))
    return 0


def cmd_pack(args) -> int:
    doc = build.pack_root(Path(args.dir), load(args.recipe), Path(args.output), level=args.level)
    out = {"artifact": args.output, "key": doc["key"], "files": len(doc["files"]),
           "bytes": artifact.total_bytes(doc), "archive_bytes": os.path.getsize(args.output)}
    _emit(args, out, report.pairs(out))
    return 0


def cmd_publish(args) -> int:
    result = build.publish(_store(args), Path(args.file), args.sign_key)
    _emit(args, result, report.pairs(result))
    return 0


def _write_env(env: dict, env_file: str | None, fmt: str, args) -> None:
    if env_file:
        Path(env_file).write_text(restore.render_env(env, fmt))
    elif not args.json:
        sys.stdout.write(restore.render_env(env, "shell"))


def cmd_fetch(args) -> int:
    recipe = load(args.recipe)
    gpus = fingerprint.saved_gpus(args.gpus_from) if args.gpus_from else None
    result = fetch.fetch(recipe, _store(args), Path(args.root), max_bytes=args.max_bytes,
                         trusted_keys=args.trusted_key or (), gpus=gpus)
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


def cmd_flashinfer_check(args) -> int:
    root = Path(os.path.abspath(args.root))
    extra = warmup.serve_env(load(args.recipe), root) if args.recipe else components.cache_env(root)
    marker = restore.active(root)
    built = marker["artifact"]["path_contract"].get("flashinfer") if marker else None
    result = flashinfer.check(root, {**os.environ, **extra}, built, backdate_inputs=args.backdate,
                              include_site_packages=args.include_site_packages)
    _emit(args, result, report.flashinfer_check(result))
    final = result.get("dry_run_after", result["dry_run"])
    return 0 if final["clean"] is not False else EXIT_NOT_HIT


def cmd_inspect(args) -> int:
    entry = None
    if "://" in args.file:  # a published artifact: STORE/index/RECIPE/KEY
        entry = catalog.read_entry(args.file, **_store_options(args))
        doc = artifact.loads(artifact.dumps(entry["artifact"]))
    else:
        with open(args.file, "rb") as f:
            doc = artifact.loads(archive.read_manifest(f))
    summary = {k: doc[k] for k in ("key", "recipe", "path_contract", "components", "timings", "created_at")}
    if entry:
        summary.update(blob=entry["blob"], published_at=entry["published_at"], signed=bool(entry.get("signature")))
    _emit(args, doc if args.full else summary, json.dumps(summary, indent=1))
    return 0


def cmd_ls(args) -> int:
    store = _store(args)
    rows = catalog.ls(store, args.recipe)
    _emit(args, rows, catalog.render_ls(store, rows))
    return 0


def cmd_gc(args) -> int:
    result = catalog.gc(_store(args), args.keep, older_than_days=args.older_than, dry_run=args.dry_run)
    _emit(args, result, catalog.render_gc(result))
    return 0


def cmd_matrix(args) -> int:
    paths = [Path(p) for p in args.paths]
    catalogue = Path(args.skus) if args.skus else matrix.find_catalogue(paths)
    entries, skipped = matrix.entries(paths, matrix.load_skus(catalogue), catalogue, only=args.sku,
                                      root_base=args.root_base)
    for s in skipped:
        print(f"warmer: matrix: skipped {s}", file=sys.stderr)
    if args.format == "json" or args.json:
        print(json.dumps(entries, indent=1))
    else:
        print(json.dumps(matrix.github(entries), separators=(",", ":")))
    return 0


def cmd_doctor(args) -> int:
    result = doctor.check(root=args.root, recipe=load(args.recipe) if args.recipe else None,
                          env_file=args.env_file, pid=args.pid, mountinfo_file=args.mountinfo)
    _emit(args, result, doctor.render(result))
    return 0 if result["ok"] else EXIT_FINDINGS


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

    def s3(c):
        c.add_argument("--endpoint-url", help="S3-compatible endpoint (default: boto3's, e.g. AWS_ENDPOINT_URL)")
        c.add_argument("--s3-path-style", action="store_true",
                       help="path-style S3 addressing (endpoint/bucket/key), as many S3-compatible stores need")

    def limit(c):
        c.add_argument("--max-bytes", type=int, default=restore.DEFAULT_MAX_BYTES,
                       help="refuse artifacts that unpack to more than this (default 256 GiB)")

    c = cmd("fingerprint", cmd_fingerprint, "describe this node")
    c.add_argument("--root", help="also record this cache root")
    c.add_argument("--recipe", help="also record this recipe's served model path")

    c = cmd("explain", cmd_explain, "every artifact of a recipe in a store: accepted or rejected here, and why")
    c.add_argument("recipe")
    c.add_argument("--store", required=True)
    s3(c)
    c.add_argument("-v", "--verbose", action="store_true", help="also show the rules that hold")

    c = cmd("build", cmd_build, "warm a recipe from cold, pack, verify and publish")
    c.add_argument("recipe")
    c.add_argument("--store", required=True, help="file:///dir or s3://bucket/prefix")
    s3(c)
    c.add_argument("--root", required=True, help="empty directory: all caches live under it")
    c.add_argument("--workdir", help="logs and the artifact file (default: a new temporary directory)")
    c.add_argument("--allow-partial", action="store_true", help="publish even if verify sees recompiles")
    c.add_argument("--step-summary", metavar="FILE",
                   help="append a Markdown summary (cold and restored times, artifact size, verify result) "
                        "to FILE, e.g. $GITHUB_STEP_SUMMARY")
    sign_key(c)

    c = cmd("pack", cmd_pack, "pack a warmed root into an artifact file")
    c.add_argument("dir")
    c.add_argument("--recipe", required=True)
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--level", type=int, default=3, help="zstd level (default 3)")

    c = cmd("publish", cmd_publish, "publish an artifact file to a store")
    c.add_argument("file")
    c.add_argument("--store", required=True)
    s3(c)
    sign_key(c)

    c = cmd("fetch", cmd_fetch, "node bootstrap: fetch this node's artifact, restore it, print the env")
    c.add_argument("recipe")
    c.add_argument("--store", required=True)
    s3(c)
    c.add_argument("--root", required=True)
    c.add_argument("--require", action="store_true", help=f"exit {EXIT_MISS} on a miss instead of 0")
    c.add_argument("--gpus-from", metavar="FILE",
                   help="fetch for the GPUs of this saved fingerprint (`warmer fingerprint --json` on a serving "
                        "node), not this machine's: an image build on a machine without the target GPU")
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

    c = cmd("flashinfer-check", cmd_flashinfer_check,
            "will FlashInfer rebuild the JIT modules under a root? contract, ninja dry run, newer inputs")
    c.add_argument("--root", required=True)
    c.add_argument("--recipe", help="check in the env this recipe serves with")
    c.add_argument("--backdate", action="store_true",
                   help="set inputs newer than the cache to just before it (files in the root only, unless "
                        "--include-site-packages)")
    c.add_argument("--include-site-packages", action="store_true",
                   help="with --backdate: also back-date installed headers (pip gives them the install time)")

    c = cmd("inspect", cmd_inspect, "show the artifact.json of an artifact file or of a published artifact")
    c.add_argument("file", metavar="FILE|URL", help="an artifact file, or STORE/index/RECIPE/KEY (a key prefix will do)")
    c.add_argument("--full", action="store_true", help="with --json: the whole artifact.json, file list included")
    s3(c)

    c = cmd("ls", cmd_ls, "list the artifacts published in a store")
    c.add_argument("--store", required=True)
    c.add_argument("--recipe", help="only this recipe's artifacts")
    s3(c)

    c = cmd("gc", cmd_gc, "delete all but the newest artifacts of each recipe and machine kind, and unused blobs")
    c.add_argument("--store", required=True)
    c.add_argument("--keep", type=int, required=True, metavar="N",
                   help="keep the newest N artifacts of each recipe on each machine kind (CPU arch + GPU model)")
    c.add_argument("--older-than", type=float, metavar="DAYS", help="delete only artifacts published over DAYS ago")
    c.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    s3(c)

    c = cmd("matrix", cmd_matrix, "the recipe x GPU SKU matrix for a CI job per SKU (GitHub Actions strategy.matrix)")
    c.add_argument("paths", nargs="+", metavar="MANIFESTS", help="the manifests directory, or recipe files")
    c.add_argument("--format", choices=("github", "json"), default="github",
                   help="github: one line of strategy.matrix JSON for $GITHUB_OUTPUT (default); json: the entries")
    c.add_argument("--skus", help="the SKU catalogue (default: skus.toml in or above MANIFESTS)")
    c.add_argument("--sku", action="append", help="only this SKU (repeat for several)")
    c.add_argument("--root-base", default=matrix.DEFAULT_ROOT_BASE,
                   help="each entry's root is ROOT_BASE/RECIPE (default /cache): build and serve at the same path")

    c = cmd("doctor", cmd_doctor, "check a serving environment: where the caches land, FlashInfer's writable "
            "directories, per-pod env in vLLM's compile key, the active artifact")
    c.add_argument("--root", help="the warmer root to check the active artifact of (default: found from "
                                  "VLLM_CACHE_ROOT)")
    c.add_argument("--recipe", help="the recipe being served: check the artifact's path contract against it")
    c.add_argument("--env-file", help="the env file vLLM starts with (warmer fetch --env-file), applied on top")
    c.add_argument("--pid", type=int, help="check the env of this process instead (e.g. 1: vLLM in its container)")
    c.add_argument("--mountinfo", help="a saved mountinfo file instead of /proc/self/mountinfo")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except USER_ERRORS as e:
        print(f"warmer: {args.command}: {e}", file=sys.stderr)
        return EXIT_ERROR
