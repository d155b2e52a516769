"""warmer fetch: node bootstrap. This node's artifact fetched and restored, and the env vLLM starts
with; with --all, every recipe that targets this node's SKU."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from warmer import api, components, errors
from warmer.cli import (
    Output,
    add_deadline,
    add_env_out,
    add_limits,
    add_owner,
    add_root,
    add_store,
    add_trust,
    check_out_file,
    env_flag,
    env_now,
    store_options,
    write_env,
)
from warmer.cli.render import megabytes, seconds
from warmer.envfile import EnvFile, EnvFileError
from warmer.errors import EXIT_MISS, EXIT_OK
from warmer.recipe import Recipe, load

if TYPE_CHECKING:
    from warmer.api import FetchResult

HELP = "node bootstrap: fetch this node's artifact, restore it, print the env"
ORDER = 60


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("recipe", metavar="RECIPE", nargs="?", help="a recipe file, e.g. manifests/models/NAME.toml")
    add_store(c)
    add_root(c, required=False)
    c.add_argument(
        "--require",
        nargs="?",
        const="all",
        default=_require_env(),
        metavar="COMPONENTS",
        help=f"exit {EXIT_MISS} unless it hits, instead of 0; with COMPONENTS (e.g. flashinfer,triton), unless "
        "at least those are restored: a partial hit that has them passes (env WARMER_REQUIRE=1 or =COMPONENTS"
        f"{env_now('WARMER_REQUIRE')})",
    )
    c.add_argument(
        "--all",
        metavar="MANIFESTS",
        help="every recipe in MANIFESTS (a directory with skus.toml and models/) that targets this node's "
        "SKU, each into --root-base/RECIPE: node bootstrap at the node (DaemonSet, systemd unit)",
    )
    c.add_argument(
        "--root-base",
        default=api.DEFAULT_ROOT_BASE,
        metavar="DIR",
        help="with --all: each recipe's root is DIR/RECIPE, the path CI built it at (default /cache)",
    )
    c.add_argument("--skus", help="with --all: the SKU catalogue (default: skus.toml in or above MANIFESTS)")
    c.add_argument("--parallel", type=int, default=2, metavar="N", help="with --all: recipes fetched at once")
    c.add_argument(
        "--metrics-file",
        metavar="PATH",
        help="write node_exporter textfile-collector metrics (warmer_fetch_seconds, warmer_artifact_bytes, "
        "warmer_fetch_status, warmer_fetch_run_success, warmer_fetch_last_run_timestamp_seconds) to PATH, "
        "e.g. /var/lib/node_exporter/textfile/warmer.prom",
    )
    c.add_argument(
        "--gpus-from",
        metavar="FILE",
        help="fetch for the GPUs of this saved fingerprint (`warmer fingerprint --json` on a serving "
        "node), not this machine's: an image build on a machine without the target GPU",
    )
    add_env_out(c)
    add_limits(c)
    add_trust(c)
    add_deadline(
        c,
        api.DEFAULT_DEADLINE_S,
        "the whole fetch (index, download, restore) is then a miss (a root already holding the key's whole "
        "artifact, intact and safe to load here, is kept); with --all, the whole run",
    )
    add_owner(c)


def run(args: argparse.Namespace, out: Output) -> int:
    if not args.metrics_file:
        return _run(args, out)
    check_out_file(
        "--metrics-file",
        args.metrics_file,
        "give a file in node_exporter's textfile-collector directory, mounted into the pod",
    )
    try:
        return _run(args, out)
    except Exception:  # a typo in WARMER_REQUIRE, a probe past the deadline: the last run's metrics must not stand
        _write_metrics(args.metrics_file, [], out, ran=False)
        raise


def _run(args: argparse.Namespace, out: Output) -> int:
    args.require = required_components(args.require)  # a typo is said before anything is fetched
    if args.all:
        return _fetch_all(args, out)
    if not args.recipe or not args.root:
        raise errors.UsageError("fetch needs RECIPE and --root (or WARMER_ROOT), or --all MANIFESTS --root-base DIR")
    # Its schema check still runs while the first bytes download (api.fetch).
    recipe = load(args.recipe, schema_later=True)
    if args.env_file:
        check_out_file("--env-file", args.env_file, "give a file in a directory the pod mounts (the shared emptyDir)")
    if args.env_file or not args.json:  # the env goes somewhere: what it cannot carry is said before the fetch
        check_env_format(recipe, args.root, args.env_format if args.env_file else "shell")
    t0 = time.perf_counter()  # the whole fetch, as fetch --all times each recipe: a miss waits too
    result = api.fetch(
        recipe,
        args.store,
        args.root,
        gpus_from=args.gpus_from,
        trusted_keys=args.trusted_key or (),
        max_bytes=args.max_bytes,
        offline=args.offline,
        lock_timeout=args.lock_timeout,
        deadline=args.deadline,
        owner=args.owner,
        **store_options(args, out),
    )
    took = time.perf_counter() - t0
    write_env(args, result.env)  # what the pod needs first; the words after it, at best
    if args.metrics_file:
        _write_metrics(args.metrics_file, [api.Outcome(result.recipe, result.root, result, took)], out)
    out.warn(result.warnings)
    out.say(report(result))
    out.emit(result)
    return EXIT_OK if args.require is None or result.holds(args.require) else EXIT_MISS


def _fetch_all(args: argparse.Namespace, out: Output) -> int:
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
        **store_options(args, out),
    )
    for o in outcomes:
        out.say(f"warmer fetch --all: {o.line()}")
    if args.metrics_file:
        _write_metrics(args.metrics_file, outcomes, out)
    out.emit([o.to_json() for o in outcomes])
    fetched = [o.result for o in outcomes if o.result is not None]
    if any(o.bad_recipe or o.bad_root for o in outcomes):  # the others were fetched; the operator's to fix
        return errors.EXIT_USAGE
    return EXIT_MISS if args.require is not None and not all(r.holds(args.require) for r in fetched) else EXIT_OK


def _require_env() -> str | None:
    value = os.environ.get("WARMER_REQUIRE", "").strip()
    if env_flag("WARMER_REQUIRE"):
        return "all"
    return value if value and value.lower() not in ("0", "false", "no", "off") else None


def required_components(value: str | None) -> tuple[str, ...] | None:
    """--require's value: None (not given), () (a hit: every component), or the components that must
    be restored. An unknown name is the operator's typo: UsageError, before anything is fetched."""
    if value is None:
        return None
    if value == "all":
        return ()
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in components.BY_NAME]
    if unknown or not names:
        raise errors.UsageError(
            f"--require {value!r}: {', '.join(unknown) or 'no component'} is not a cache component; "
            f"give a comma-separated list of {', '.join(components.BY_NAME)}, or --require alone for a full hit"
        )
    return names


def check_env_format(recipe: Recipe, root: str, fmt: str) -> None:
    """A value the env file's format cannot carry (a dotenv file: a newline, say) is the
    operator's to fix, a usage error before anything is fetched: found when the file is written,
    after the fetch, it would fail the pod that a miss must never fail. The file holds the
    recipe's env and paths under root; a restore adds only more paths and fixed values."""
    env = {**components.cache_env(Path(os.path.abspath(root))), **recipe.env}
    try:  # values of the wrong type are the schema check's to name
        EnvFile({k: v for k, v in env.items() if isinstance(v, str)}).render(fmt)
    except EnvFileError as e:
        raise errors.UsageError(f"{recipe.source}: {e}") from None


def _write_metrics(path: str, outcomes: list[api.Outcome], out: Output, ran: bool = True) -> None:
    """Metrics are the fetch's record, not its result: a write that fails now (a full disk) is a warning."""
    try:
        api.write_fetch_metrics(path, outcomes, ran)
    except OSError as e:
        out.warn([f"could not write --metrics-file {path}: {e.strerror or e}"])


def report(r: FetchResult) -> str:
    lines = [f"warmer fetch: {r.status} - recipe {r.recipe}, key {r.key[:16]}, root {r.root}"]
    if r.for_gpus:
        lines.append(f"  for GPUs: {r.for_gpus}")
    if r.status == "partial":
        lines.append(f"  restored: {', '.join(r.components)}")
        lines += [f"    {layer.line()}" for layer in r.layers]
    if r.restore:
        rs = r.restore
        extra = f", {rs.files} files, {megabytes(rs.bytes)}" if rs.files is not None else ""
        lines.append(f"  restore: {rs.status} in {seconds(rs.seconds)}{extra}")
    if r.nearest:
        n = r.nearest
        if n.differences:
            lines.append(f"  nearest artifact {n.key[:16]} differs in: " + "; ".join(n.differences))
        else:  # fits, but was published under another key: an older warmer's rules
            lines.append(
                f"  artifact {n.key[:16]} fits this node but was published under another key; "
                "rebuild it with this warmer version (`warmer explain` shows every rule)"
            )
    if any(d.recompiles for d in r.vllm_differences):
        lines.append(
            f"  predicted: vLLM recompiles ({', '.join(d.name for d in r.vllm_differences if d.recompiles)}"
            " differ from the build)"
        )
    return "\n".join(lines)
