"""Command line: parses arguments, calls one warmer.api function per command, renders the result.

Errors are mapped to exit codes in one place (main) by their kind (warmer.errors); with --json
an error is also a JSON object on stdout, so a pipeline reads one stream.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import json
import logging
import os
import re
import select
import signal
import sys

from warmer import __version__, api, deadline, errors, matrix, report
from warmer.errors import EXIT_FINDINGS, EXIT_MISS, EXIT_NOT_HIT, EXIT_OK
from warmer.restore import DEFAULT_LOCK_TIMEOUT, DEFAULT_MAX_BYTES


def _emit(args, result, human: str) -> None:
    print(
        json.dumps(result.to_json() if hasattr(result, "to_json") else result, indent=1, default=str)
        if args.json
        else human
    )


QUIET = False  # --quiet: errors only on stderr


def _warn(lines) -> None:
    if QUIET:
        return
    for line in lines:
        print(f"warmer: warning: {line}", file=sys.stderr)


def _say(text: str) -> None:
    if not QUIET:
        print(text, file=sys.stderr)


def _store_options(args) -> dict:
    # Transfer bars only for a person at a terminal: never in pipelines or with --json.
    return {
        "endpoint_url": getattr(args, "endpoint_url", None),
        "path_style": getattr(args, "s3_path_style", None) or None,
        "insecure_registry": getattr(args, "insecure_registry", None) or None,
        "progress": sys.stderr.isatty() and not args.json and not QUIET,
    }


def cmd_fingerprint(args) -> int:
    fp = api.fingerprint(root=args.root, recipe_file=args.recipe)
    _emit(args, fp, report.fingerprint(fp))
    return EXIT_OK


def cmd_explain(args) -> int:
    result = api.explain(args.recipe, args.store, **_store_options(args))
    _emit(args, result, report.explain(result, verbose=args.verbose))
    return EXIT_OK


def cmd_build(args) -> int:
    recipe = api.recipe(args.recipe)
    try:
        result = api.build(
            recipe,
            args.store,
            args.root,
            workdir=args.workdir,
            allow_partial=args.allow_partial,
            sign_key=args.sign_key,
            **_store_options(args),
        )
    except errors.WarmerError as e:  # the CI summary says why, whatever stopped the build
        partial = getattr(e, "report", None)
        if partial is not None:
            _emit(args, partial, report.build(partial))
        _step_summary(args, partial, recipe.name, str(e))
        raise
    _step_summary(args, result, recipe.name)
    _warn(result.warnings)
    _warn(report.uncovered(result.uncovered))
    _emit(args, result, report.build(result))
    return EXIT_OK


def _step_summary(args, result, recipe: str, error: str | None = None) -> None:
    if args.step_summary:
        with open(args.step_summary, "a") as f:
            f.write(report.step_summary(result, recipe=recipe, error=error))


def cmd_pack(args) -> int:
    result = api.pack(args.dir, args.recipe, args.output, level=args.level)
    _emit(args, result, report.pairs(result.to_json()))
    return EXIT_OK


def cmd_publish(args) -> int:
    result = api.publish(args.file, args.store, sign_key=args.sign_key, deadline=args.deadline, **_store_options(args))
    _emit(args, result, report.pairs(result.to_json()))
    return EXIT_OK


def _write_env(args, env) -> None:
    if args.env_file:
        api.write_env(env, args.env_file, args.env_format)
    elif not args.json:
        sys.stdout.write(env.render("shell"))


def cmd_fetch(args) -> int:
    if args.all:
        return _fetch_all(args)
    if not args.recipe or not args.root:
        raise errors.UsageError("fetch needs RECIPE and --root (or WARMER_ROOT), or --all MANIFESTS --root-base DIR")
    result = api.fetch(
        args.recipe,
        args.store,
        args.root,
        gpus_from=args.gpus_from,
        trusted_keys=args.trusted_key or (),
        max_bytes=args.max_bytes,
        offline=args.offline,
        lock_timeout=args.lock_timeout,
        deadline=args.deadline,
        owner=args.owner,
        **_store_options(args),
    )
    _warn(result.warnings)
    _say(report.fetch(result))
    _write_env(args, result.env)
    if args.metrics_file:
        from warmer.fleet import Outcome

        api.write_fetch_metrics(
            args.metrics_file,
            [Outcome(result.recipe, result.root, result, result.restore.seconds if result.restore else 0.0)],
        )
    if args.json:
        print(json.dumps(result.to_json(), indent=1, default=str))
    return EXIT_OK if result.hit or not args.require else EXIT_MISS


def _fetch_all(args) -> int:
    if args.recipe or args.env_file or args.gpus_from:
        raise errors.UsageError(
            "fetch --all takes no RECIPE, --env-file or --gpus-from: each recipe goes into "
            "--root-base/RECIPE, and its pods' own fetch writes their env file"
        )
    outcomes = api.fetch_all(
        args.all,
        args.store,
        args.root_base,
        parallel=args.parallel,
        skus=args.skus,
        trusted_keys=args.trusted_key or (),
        max_bytes=args.max_bytes,
        offline=args.offline,
        lock_timeout=args.lock_timeout,
        deadline=args.deadline,
        owner=args.owner,
        **_store_options(args),
    )
    for o in outcomes:
        _say(f"warmer fetch --all: {o.line()}")
    if args.metrics_file:
        api.write_fetch_metrics(args.metrics_file, outcomes)
    if args.json:
        print(json.dumps([o.to_json() for o in outcomes], indent=1, default=str))
    fetched = [o for o in outcomes if o.result is not None]
    if any(o.bad_recipe for o in outcomes):  # the others were fetched; a bad file is the operator's to fix
        return errors.EXIT_USAGE
    return EXIT_MISS if args.require and not all(o.result.hit for o in fetched) else EXIT_OK


def cmd_restore(args) -> int:
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
        progress=_store_options(args)["progress"],
    )
    if args.recipe or args.env_file:
        # Without --recipe, the artifact's own (artifact.json records it): an image build needs no recipe file.
        _write_env(args, api.serving_env(args.recipe, args.root, offline=args.offline))
    _emit(args, result, report.pairs(result.to_json()))
    return EXIT_OK


def cmd_verify(args) -> int:
    result = api.verify(args.recipe, args.root, workdir=args.workdir)
    _emit(args, result, report.verify(result))
    return EXIT_OK if result.verdict == "hit" else EXIT_NOT_HIT


def cmd_flashinfer_check(args) -> int:
    result = api.flashinfer_check(
        args.root, recipe_file=args.recipe, backdate=args.backdate, include_site_packages=args.include_site_packages
    )
    _emit(args, result, report.flashinfer_check(result))
    final = result.get("dry_run_after", result["dry_run"])
    return EXIT_OK if final["clean"] is not False else EXIT_NOT_HIT


def cmd_inspect(args) -> int:
    result = api.inspect(args.file, **_store_options(args))
    _emit(args, result.artifact.to_json() if args.full else result.summary(), report.inspect(result))
    return EXIT_OK


def cmd_ls(args) -> int:
    if args.root_base:
        roots = api.local_roots(args.root_base)
        _emit(args, [r.to_json() for r in roots], report.local_roots(args.root_base, roots))
        return EXIT_OK
    if not args.store:
        raise errors.UsageError("ls needs --store URL (what a store holds) or --root-base DIR (the roots on this node)")
    result = api.ls(args.store, args.recipe, deadline=args.deadline, **_store_options(args))
    _emit(args, result, report.ls(result))
    return EXIT_OK


def cmd_gc(args) -> int:
    result = api.gc(
        args.store, args.keep, older_than_days=args.older_than, dry_run=args.dry_run, **_store_options(args)
    )
    _emit(args, result, report.gc(result))
    return EXIT_OK


def cmd_rm(args) -> int:
    result = api.rm(args.entry, yes=args.yes, **_store_options(args))
    _say(f"warmer: rm: {report.rm(result)}")
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    return EXIT_OK  # without --yes, a dry run: it did what was asked


def cmd_matrix(args) -> int:
    entries, skipped = api.matrix(args.paths, skus=args.skus, only=args.sku, root_base=args.root_base)
    for s in skipped:
        print(f"warmer: matrix: skipped {s}", file=sys.stderr)
    if args.format == "json" or args.json:
        print(json.dumps(entries, indent=1))
    else:
        print(json.dumps(matrix.github(entries), separators=(",", ":")))
    return EXIT_OK


def cmd_serve(args) -> int:
    plan = api.serve_plan(args.recipe, args.root, args.extra, env_file=args.env_file, offline=args.offline)
    _warn(plan.warnings)
    if args.dry_run:
        _emit(args, plan, plan.shell().rstrip())
        return EXIT_MISS if args.require_hit and plan.predicted_miss else EXIT_OK
    if args.require_hit and plan.predicted_miss:
        print(
            "warmer: serve: refusing to start: vLLM would compile from cold (above); without --require-hit it "
            "starts anyway",
            file=sys.stderr,
        )
        return EXIT_MISS
    sys.stdout.flush()
    api.serve(plan)  # does not return
    return EXIT_OK


def cmd_doctor(args) -> int:
    result = api.doctor(
        root=args.root, recipe_file=args.recipe, env_file=args.env_file, pid=args.pid, mountinfo=args.mountinfo
    )
    _emit(args, result, report.doctor(result))
    return EXIT_OK if result.ok else EXIT_FINDINGS


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


EPILOG = (
    "environment: WARMER_STORE, WARMER_ROOT, WARMER_TRUSTED_KEY and WARMER_REQUIRE are the defaults of\n"
    "--store, --root, --trusted-key and --require; a flag wins.\n\nexit codes:\n" + errors.exit_code_table()
)


JSON_ERRORS = False  # --json somewhere in argv: argparse's own usage errors are JSON on stdout too
_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<value>[^']*)' \(choose from (?P<choices>.*)\)$")


class Parser(argparse.ArgumentParser):
    """argparse, its usage errors as warmer's others: a "did you mean" for a mistyped command or
    choice, and with --json the JSON error object on stdout as well (exit 2 either way)."""

    def error(self, message: str):
        m = _INVALID_CHOICE.search(message)
        if m:
            close = difflib.get_close_matches(m["value"], re.findall(r"'([^']*)'", m["choices"]), n=1)
            if message.startswith("argument command:"):  # not argparse's list of all sixteen
                message = f"unknown command {m['value']!r}" + ("" if close else " (`warmer --help` lists them)")
            if close:
                message += f"; did you mean {close[0]}?"
        if JSON_ERRORS:
            print(json.dumps({"error": message, "kind": "usage", "exit_code": errors.EXIT_USAGE}), flush=True)
        super().error(message)


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="warmer",
        description="Warm vLLM's compile caches once per GPU type; start every later node warm.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"warmer {__version__}")
    quiet = "print errors only on stderr (no warnings, no progress)"
    p.add_argument("-q", "--quiet", action="store_true", help=quiet)
    sub = p.add_subparsers(dest="command", required=True)

    def cmd(name, fn, help_):
        c = sub.add_parser(
            name, help=help_, description=help_, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        c.set_defaults(fn=fn)
        c.add_argument("--json", action="store_true", help="print JSON for machines (errors too, on stdout)")
        # After the command too (warmer fetch ... -q); SUPPRESS: absent here, the top level's value stands.
        c.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=quiet)
        return c

    def env_out(c):
        c.add_argument("--env-file", help="write the env vLLM must start with to this file")
        c.add_argument(
            "--env-format",
            choices=("dotenv", "shell"),
            default="dotenv",
            help="format of --env-file (default dotenv: KEY=VALUE, quoted where needed)",
        )
        c.add_argument(
            "--offline",
            action="store_true",
            help="nodes without network: forbid FlashInfer downloads (FLASHINFER_NO_DOWNLOAD=1); a "
            "kernel the warm-up never fetched is then an error at serve time",
        )

    def sign_key(c):
        c.add_argument("--sign-key", help="Ed25519 private key (PEM) to sign the artifact with")

    def trust(c):
        default = [k for k in os.environ.get("WARMER_TRUSTED_KEY", "").split(os.pathsep) if k] or None
        c.add_argument(
            "--trusted-key",
            action="append",
            metavar="PUBKEY",
            default=default,
            help="Ed25519 public key (PEM); when given, only artifacts it signed are restored "
            "(repeat for several keys; env WARMER_TRUSTED_KEY, several separated by ':')",
        )

    # --store and --root are never required=True in argparse: the env can give them, and argparse's
    # usage line cannot say "this flag or that variable". main() refuses a command that has neither.
    def store(c, required=True):
        default = os.environ.get("WARMER_STORE")
        c.add_argument(
            "--store",
            default=default,
            metavar="URL",
            help="where artifacts live: file:///abs/dir, s3://bucket/prefix or oci://registry/repository "
            f"({'required: this or ' if required else ''}env WARMER_STORE"
            f"{', now ' + default if default else ''})",
        )
        c.set_defaults(needs_store=required)
        s3(c)

    def root(c, required=True, what="the directory vLLM's caches live under (the build's root path)"):
        default = os.environ.get("WARMER_ROOT")
        c.add_argument(
            "--root",
            default=default,
            help=f"{what} ({'required: this or ' if required else ''}env WARMER_ROOT"
            f"{', now ' + default if default else ''})",
        )
        c.set_defaults(needs_root=required)

    def s3(c):
        c.add_argument("--endpoint-url", help="S3-compatible endpoint (default: boto3's, e.g. AWS_ENDPOINT_URL)")
        c.add_argument(
            "--s3-path-style",
            action="store_true",
            help="path-style S3 addressing (endpoint/bucket/key), as many S3-compatible stores need",
        )
        c.add_argument(
            "--insecure-registry", action="store_true", help="plain HTTP to an oci:// registry that is not on loopback"
        )

    def recipe(c):
        c.add_argument("recipe", metavar="RECIPE", help="a recipe file, e.g. manifests/models/NAME.toml")

    def bounded(c, default: float | None, what: str):
        env = os.environ.get(deadline.ENV)
        # A string default goes through type= as a flag would: a bad value is a usage error, not a traceback.
        c.add_argument(
            "--deadline",
            type=_seconds,
            default=env or default,
            metavar="SECONDS",
            help=f"give up on the store after this long: {what} (env {deadline.ENV}; default "
            f"{'none' if default is None else f'{default:.0f}'}{', now ' + env if env else ''})",
        )

    def owner(c):
        c.add_argument(
            "--owner",
            type=_owner,
            default=os.environ.get("WARMER_OWNER") or None,
            metavar="UID:GID",
            help="hand the restored root to this user (run as root): vLLM, which writes lock and "
            "temporary files into it even on a full hit, runs as UID (env WARMER_OWNER)",
        )

    def limits(c):
        c.add_argument(
            "--max-bytes",
            type=size,
            default=DEFAULT_MAX_BYTES,
            metavar="SIZE",
            help="refuse artifacts that unpack to more than this: bytes, or with a unit, e.g. 256GiB, "
            f"512MiB, 10GB (default {DEFAULT_MAX_BYTES >> 30} GiB)",
        )
        c.add_argument(
            "--lock-timeout",
            type=float,
            default=DEFAULT_LOCK_TIMEOUT,
            metavar="SECONDS",
            help="wait at most this long for another restore of the same root (default 900)",
        )

    c = cmd("fingerprint", cmd_fingerprint, "describe this node")
    c.add_argument("--root", help="also record this cache root")
    c.add_argument("--recipe", help="also record this recipe's served model path")

    c = cmd("explain", cmd_explain, "every artifact of a recipe in a store: accepted or rejected here, and why")
    recipe(c)
    store(c)
    c.add_argument("-v", "--verbose", action="store_true", help="also show the rules that hold")

    c = cmd("build", cmd_build, "warm a recipe from cold, pack, verify and publish")
    recipe(c)
    store(c)
    root(c, what="an empty directory, the path nodes serve from: all caches live under it")
    c.add_argument("--workdir", help="logs and the artifact file (default: a new temporary directory)")
    c.add_argument("--allow-partial", action="store_true", help="publish even if verify sees recompiles")
    c.add_argument(
        "--step-summary",
        metavar="FILE",
        help="append a Markdown summary (cold and restored times, artifact size, verify result) "
        "to FILE, e.g. $GITHUB_STEP_SUMMARY",
    )
    sign_key(c)

    c = cmd("pack", cmd_pack, "pack a warmed root into an artifact file")
    c.add_argument("dir", metavar="ROOT", help="the root a warm-up filled")
    c.add_argument("--recipe", required=True, help="the recipe it was warmed with")
    c.add_argument("-o", "--output", required=True, help="the artifact file to write (.tar.zst)")
    c.add_argument("--level", type=int, default=3, help="zstd level (default 3)")

    c = cmd("publish", cmd_publish, "publish an artifact file to a store (after checking every member)")
    c.add_argument("file", metavar="ARTIFACT", help="an artifact file (warmer pack or build)")
    store(c)
    sign_key(c)
    bounded(c, PUBLISH_DEADLINE_S, "the upload fails")

    c = cmd("fetch", cmd_fetch, "node bootstrap: fetch this node's artifact, restore it, print the env")
    c.add_argument("recipe", metavar="RECIPE", nargs="?", help="a recipe file, e.g. manifests/models/NAME.toml")
    store(c)
    root(c, required=False)
    c.add_argument(
        "--require",
        action="store_true",
        default=_env_flag("WARMER_REQUIRE"),
        help=f"exit {EXIT_MISS} on a miss instead of 0 (env WARMER_REQUIRE=1)",
    )
    c.add_argument(
        "--all",
        metavar="MANIFESTS",
        help="every recipe in MANIFESTS (a directory with skus.toml and models/) that targets this node's "
        "SKU, each into --root-base/RECIPE: node bootstrap at the node (DaemonSet, systemd unit)",
    )
    c.add_argument(
        "--root-base",
        default=matrix.DEFAULT_ROOT_BASE,
        metavar="DIR",
        help="with --all: each recipe's root is DIR/RECIPE, the path CI built it at (default /cache)",
    )
    c.add_argument("--skus", help="with --all: the SKU catalogue (default: skus.toml in or above MANIFESTS)")
    c.add_argument("--parallel", type=int, default=2, metavar="N", help="with --all: recipes fetched at once")
    c.add_argument(
        "--metrics-file",
        metavar="PATH",
        help="write node_exporter textfile-collector metrics (warmer_fetch_seconds, warmer_artifact_bytes, "
        "warmer_fetch_status) to PATH, e.g. /var/lib/node_exporter/textfile/warmer.prom",
    )
    c.add_argument(
        "--gpus-from",
        metavar="FILE",
        help="fetch for the GPUs of this saved fingerprint (`warmer fingerprint --json` on a serving "
        "node), not this machine's: an image build on a machine without the target GPU",
    )
    env_out(c)
    limits(c)
    trust(c)
    bounded(
        c, deadline.DEFAULT_S, "the whole fetch (index, download, restore) is then a miss; with --all, the whole run"
    )
    owner(c)

    c = cmd("restore", cmd_restore, "restore a local artifact file into a root")
    c.add_argument("file", metavar="ARTIFACT", help="an artifact file")
    root(c)
    c.add_argument("--recipe", help="also print (or --env-file) the env for serving this recipe")
    c.add_argument("--force", action="store_true", help="replace a directory at --root that warmer did not create")
    env_out(c)
    limits(c)
    trust(c)
    owner(c)
    c.add_argument("--signature", help="signature file (default: ARTIFACT.sig when --trusted-key is given)")

    c = cmd("verify", cmd_verify, "start the engine on a root again and prove the cache is hit")
    recipe(c)
    root(c, what="a root holding a restored artifact")
    c.add_argument("--workdir", help="logs (default: a new temporary directory)")

    c = cmd(
        "flashinfer-check",
        cmd_flashinfer_check,
        "will FlashInfer rebuild the JIT modules under a root? contract, ninja dry run, newer inputs",
    )
    root(c, what="a root holding a restored artifact")
    c.add_argument("--recipe", help="check in the env this recipe serves with")
    c.add_argument(
        "--backdate",
        action="store_true",
        help="set inputs newer than the cache to just before it (files in the root only, unless "
        "--include-site-packages)",
    )
    c.add_argument(
        "--include-site-packages",
        action="store_true",
        help="with --backdate: also back-date installed headers (pip gives them the install time)",
    )

    c = cmd("inspect", cmd_inspect, "show the artifact.json of an artifact file or of a published artifact")
    c.add_argument(
        "file", metavar="FILE|URL", help="an artifact file, or STORE/index/RECIPE/KEY (a key prefix will do)"
    )
    c.add_argument("--full", action="store_true", help="with --json: the whole artifact.json, file list included")
    s3(c)

    c = cmd("ls", cmd_ls, "list the artifacts published in a store, or the roots on this node (--root-base)")
    store(c, required=False)
    c.add_argument("--recipe", metavar="RECIPE", help="only this recipe's artifacts: its file (or its name)")
    bounded(c, deadline.DEFAULT_S, "the listing fails")
    c.add_argument(
        "--root-base",
        metavar="DIR",
        help="list the roots under DIR on this node instead: recipe, key, size, restored when, and "
        "whether the artifact still fits this node",
    )

    c = cmd("gc", cmd_gc, "delete all but the newest artifacts of each recipe and machine kind, and unused blobs")
    store(c)
    c.add_argument(
        "--keep",
        type=int,
        required=True,
        metavar="N",
        help="keep the newest N artifacts of each recipe on each machine kind (CPU arch + GPU model)",
    )
    c.add_argument("--older-than", type=float, metavar="DAYS", help="delete only artifacts published over DAYS ago")
    c.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")

    c = cmd("rm", cmd_rm, "remove one published artifact (index entry, and its blob when no other entry uses it)")
    c.add_argument("entry", metavar="URL", help="STORE/index/RECIPE/KEY (a key prefix of 8+ hex digits will do)")
    c.add_argument("--yes", action="store_true", help="really remove it (without: say what would be removed)")
    s3(c)

    c = cmd("matrix", cmd_matrix, "the recipe x GPU SKU matrix for a CI job per SKU (GitHub Actions strategy.matrix)")
    c.add_argument("paths", nargs="+", metavar="MANIFESTS", help="the manifests directory, or recipe files")
    c.add_argument(
        "--format",
        choices=("github", "json"),
        default="github",
        help="github: one line of strategy.matrix JSON for $GITHUB_OUTPUT (default); json: the entries",
    )
    c.add_argument("--skus", help="the SKU catalogue (default: skus.toml in or above MANIFESTS)")
    c.add_argument("--sku", action="append", help="only this SKU (repeat for several)")
    c.add_argument(
        "--root-base",
        default=matrix.DEFAULT_ROOT_BASE,
        help="each entry's root is ROOT_BASE/RECIPE (default /cache): build and serve at the same path",
    )

    c = cmd(
        "serve",
        cmd_serve,
        "start vLLM exactly as warmed: the recipe's model and engine args as `vllm serve` "
        "flags, the env for the root's artifact, and a check that vLLM's own compile key will hold",
    )
    recipe(c)
    root(c, what="the root the artifact was fetched into")
    c.add_argument("--env-file", help="an env file (warmer fetch --env-file) applied on top")
    c.add_argument("--offline", action="store_true", help="forbid FlashInfer downloads (FLASHINFER_NO_DOWNLOAD=1)")
    c.add_argument("--dry-run", action="store_true", help="print the env and the command, start nothing")
    c.add_argument(
        "--require-hit",
        action="store_true",
        help=f"exit {EXIT_MISS} instead of starting when vLLM would compile from cold (no artifact, or "
        "an env var or flag it hashes differs from the build)",
    )
    c.epilog = (
        "more `vllm serve` flags go after --, e.g. `warmer serve R --root D -- --port 8000`; engine args "
        "there are not the warmed ones (a warning says so)\n\n" + EPILOG
    )

    c = cmd(
        "doctor",
        cmd_doctor,
        "check a serving environment: where the caches land, FlashInfer's writable "
        "directories, env vLLM hashes into its compile key, the active artifact",
    )
    c.add_argument(
        "--root", help="the warmer root to check the active artifact of (default: found from VLLM_CACHE_ROOT)"
    )
    c.add_argument("--recipe", help="the recipe being served: check the artifact's path contract against it")
    c.add_argument("--env-file", help="the env file vLLM starts with (warmer fetch --env-file), applied on top")
    c.add_argument("--pid", type=int, help="check the env of this process instead (e.g. 1: vLLM in its container)")
    c.add_argument("--mountinfo", help="a saved mountinfo file instead of /proc/self/mountinfo")
    return p


PUBLISH_DEADLINE_S = 3600.0  # an upload of many GB over a CI runner's link


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(B|[KMGT]i?B)?\s*", re.I)


def size(text: str) -> int:
    """Bytes, from a plain count or a number with a unit: 256GiB (2^30), 10GB (10^9), 512MiB, 64kB."""
    m = _SIZE.fullmatch(text)
    if m:
        number, unit = m[1], (m[2] or "B").upper()
        scale = 1 if unit == "B" else (1024 if "I" in unit else 1000) ** " KMGT".index(unit[0])
        if (unit != "B" or number.isdigit()) and float(number) * scale >= 1:  # no fractions of a byte
            return int(float(number) * scale)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a size: give bytes (e.g. 274877906944) or a number and a "
        "unit, e.g. 256GiB, 512MiB, 10GB (GB is 10^9 bytes, GiB 2^30)"
    )


def _owner(text: str) -> tuple[int, int]:
    uid, sep, gid = text.partition(":")
    if not uid.isdigit() or (sep and not gid.isdigit()):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not UID or UID:GID in numbers (e.g. 1000:1000, as the "
            "serving container's runAsUser and runAsGroup)"
        )
    return int(uid), int(gid) if sep else int(uid)


def _log_to_stderr(quiet: bool) -> None:
    """Progress and retry lines (the "warmer" logger) on stderr, unless quiet."""
    logger = logging.getLogger("warmer")
    if not any(getattr(h, "warmer_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("warmer: %(message)s"))
        handler.warmer_cli = True
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


def _terminated(signum, frame):
    raise errors.Terminated("terminated by SIGTERM")


def _stdout_gone() -> bool:
    """Whether stdout is a pipe its reader has closed (poll says POLLERR): a BrokenPipeError from a
    store's socket is an error like any other, one from stdout is not."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _needs(args) -> None:
    """--store and --root where a command needs them: the flag, or the env var (see store() in parser)."""
    for flag, env, what in (
        ("store", "WARMER_STORE", "URL: file:///abs/dir, s3://bucket/prefix or oci://registry/repository"),
        ("root", "WARMER_ROOT", "DIR"),
    ):
        if getattr(args, f"needs_{flag}", False) and not getattr(args, flag, None):
            raise errors.UsageError(f"--{flag} is required here: give --{flag} {what}, or set {env} in the environment")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after a lone -- goes to vLLM as it is (warmer serve R --root D -- --port 8000).
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    global JSON_ERRORS
    JSON_ERRORS = "--json" in ours
    args = parser().parse_args(ours)
    if extra and args.command != "serve":
        parser().error(f"`-- {' '.join(extra)}`: only `warmer serve` passes flags on (to vLLM)")
    args.extra = extra
    global QUIET
    QUIET = args.quiet
    _log_to_stderr(args.quiet or getattr(args, "json", False))
    # SIGTERM becomes an exception in the main thread, so that what a command started (the vLLM
    # engine's process group, a staging directory) is cleaned up on the way out.
    signal.signal(signal.SIGTERM, _terminated)
    try:
        _needs(args)
        return args.fn(args)
    except KeyboardInterrupt:
        return _fail(args, "interrupted", "interrupted", errors.EXIT_INTERRUPTED)
    except errors.WarmerError as e:
        return _fail(args, str(e), e.kind, e.exit_code)
    except OSError as e:  # a file the operator named, a disk: the message says which
        if isinstance(e, BrokenPipeError) and _stdout_gone():
            raise  # whoever read stdout went away (`warmer ls | head -1`): run() ends quietly
        return _fail(
            args, f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""), "os-error", errors.EXIT_ERROR
        )


def run() -> None:
    """The `warmer` command (and `python -m warmer`): main, then exit without the garbage
    collector's last pass over every object the imports made (0.08 s of a node's fetch)."""
    try:
        try:
            code = main()
        except SystemExit as e:  # argparse's --help, --version and usage errors
            code = e.code
        sys.stdout.flush()  # here, not at exit: a reader gone is then seen below, not as a traceback
    except BrokenPipeError:  # only stdout's gets here (main)
        _exit_on_sigpipe()
    gc.freeze()
    sys.exit(code)


def _exit_on_sigpipe() -> None:
    """End as coreutils do when their reader goes (`warmer ls | head -1`): killed by SIGPIPE, no
    message, no traceback; the shell says 141 (128 + 13), which pipefail scripts and the
    `|| [ $? -eq 141 ]` idiom already know from `ls | head`. Not exit 1: that is "an error, the
    message says what", and nothing went wrong here. Python ignores SIGPIPE so that a broken
    socket (a store's) is an exception; the default comes back only now, to end this process."""
    try:  # nothing more may reach the pipe, not even the interpreter's flush at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):
        pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(errors.EXIT_PIPE)  # not reached: the signal ends the process


def _fail(args, message: str, kind: str, code: int) -> int:
    print(f"warmer: {args.command}: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"error": message, "kind": kind, "exit_code": code}))
    return code
