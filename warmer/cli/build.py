"""warmer build: a recipe warmed from cold, packed, verified and published; its report and CI summary."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from warmer import api, errors
from warmer.cli import Output, add_layers, add_recipe, add_root, add_sign_key, add_store, store_options
from warmer.cli import verify as verify_cmd
from warmer.cli.render import megabytes, seconds
from warmer.errors import EXIT_OK

if TYPE_CHECKING:
    from warmer.api import BuildResult, PublishResult

HELP = "warm a recipe from cold, pack, verify and publish"
ORDER = 30


def add_arguments(c: argparse.ArgumentParser) -> None:
    add_recipe(c)
    add_store(c)
    add_root(c, what="an empty directory, the path nodes serve from: all caches live under it")
    c.add_argument("--workdir", help="logs and the artifact file (default: a new temporary directory)")
    c.add_argument("--allow-partial", action="store_true", help="publish even if verify sees recompiles")
    c.add_argument(
        "--step-summary",
        metavar="FILE",
        help="append a Markdown summary (cold and restored times, artifact size, verify result) "
        "to FILE, e.g. $GITHUB_STEP_SUMMARY",
    )
    add_sign_key(c)
    add_layers(c)


def run(args: argparse.Namespace, out: Output) -> int:
    recipe = api.recipe(args.recipe)
    try:
        result = api.build(
            recipe,
            args.store,
            args.root,
            workdir=args.workdir,
            allow_partial=args.allow_partial,
            sign_key=args.sign_key,
            layers=args.layers,
            **store_options(args, out),
        )
    except errors.WarmerError as e:  # the CI summary says why, whatever stopped the build
        partial = getattr(e, "report", None)
        if partial is not None and not out.json:  # with --json, main puts it in the error object
            out.emit(partial, report(partial))
        _step_summary(args, partial, recipe.name, str(e))
        raise
    _step_summary(args, result, recipe.name)
    out.warn(result.warnings)
    out.warn(uncovered(result.uncovered))
    out.emit(result, report(result))
    return EXIT_OK


def _step_summary(args: argparse.Namespace, result: BuildResult | None, recipe: str, error: str | None = None) -> None:
    if args.step_summary:
        with open(args.step_summary, "a") as f:
            f.write(step_summary(result, recipe=recipe, error=error))


def uncovered(files: tuple[dict, ...]) -> list[str]:
    return [
        f"uncovered cache: {u['path']} ({u['bytes']} bytes) was written outside every component: it is not "
        "packed; a node will write it again"
        for u in files
    ]


def publish_line(p: PublishResult) -> str:
    if p.layers is not None:  # a layered entry names its layers, not the whole file's blob
        sent = sum(p.layers.values())
        return (
            f"publish: {p.status} to {p.store} ({sent} of {len(p.layers)} layer(s) uploaded, "
            f"{megabytes(p.bytes_uploaded or 0)}; the others already there)"
        )
    return (
        f"publish: {p.status} to {p.store} (blob {p.blob[:16]}, {'uploaded' if p.blob_uploaded else 'already there'})"
    )


def report(r: BuildResult) -> str:
    if r.status == "already-published" and r.verify is None:
        return f"already published: recipe {r.recipe}, key {r.key[:16]} in {r.store} (nothing to build)"
    lines = [
        f"recipe {r.recipe}  key {r.key[:16]}",
        f"artifact: {r.artifact} ({r.files} files, {megabytes(r.bytes)} -> {megabytes(r.archive_bytes)})",
    ]
    lines += [f"  {name:<18}{c.files:>6} files {megabytes(c.bytes):>12}" for name, c in (r.components or {}).items()]
    if r.env_added:
        lines.append("env added at build: " + ", ".join(f"{k}={v}" for k, v in r.env_added.items()))
    if r.restore:
        lines.append(f"restore for verify: {seconds(r.restore.seconds)}")
    if r.verify:
        lines.append(verify_cmd.report(r.verify))
    if r.publish:
        lines.append(publish_line(r.publish))
    return "\n".join(lines)


# (label, key in the timings) rows of the CI summary: the phases a cold start pays for.
SUMMARY_ROWS = (
    ("engine start (LLM() to ready)", "engine_init_s"),
    ("vLLM init engine", "init_engine_s"),
    ("torch.compile", "torch_compile_s"),
    ("process, start to exit", "process_s"),
)


def step_summary(r: BuildResult | None, *, recipe: str, error: str | None = None) -> str:
    """Markdown for $GITHUB_STEP_SUMMARY: cold and restored times, artifact size, verify result."""
    status = "failed" if error else (r.status if r else "-")
    lines = [f"### warmer build: `{recipe}` — {status}", ""]
    if error:
        lines += [f"> {error}", ""]
    if r is None:
        return "\n".join(lines) + "\n"
    if r.status == "already-published" and r.verify is None:
        lines.append(f"Already published in `{r.store}` (key `{r.key[:16]}`): nothing built.")
        return "\n".join(lines) + "\n"
    v = r.verify
    lines += [
        "| | |",
        "|---|---|",
        f"| key | `{r.key[:16]}` |",
        f"| artifact | {r.files if r.files is not None else '-'} files, {megabytes(r.bytes)} packed to "
        f"{megabytes(r.archive_bytes)} |",
        f"| verify | **{v.verdict if v else '-'}**, {v.files.recompiled if v else '-'} recompiled file(s) |",
    ]
    if r.uncovered:
        lines.append(f"| uncovered caches | {len(r.uncovered)} file(s) outside every component |")
    if r.restore:
        lines.append(f"| restore | {seconds(r.restore.seconds)} |")
    if r.publish:
        lines.append(f"| publish | {r.publish.status} to `{r.publish.store}` |")
    cold, restored = r.cold or {}, (v.restored if v else {})
    rows = [
        (label, cold.get(k), restored.get(k))
        for label, k in SUMMARY_ROWS
        if cold.get(k) is not None or restored.get(k) is not None
    ]
    if rows:
        lines += ["", "| phase | cold | restored |", "|---|---:|---:|"]
        lines += [f"| {label} | {seconds(c)} | {seconds(w)} |" for label, c, w in rows]
    return "\n".join(lines) + "\n"
