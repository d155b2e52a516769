"""warmer verify: the engine started again on a restored root, and proof that its cache is hit."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from warmer import api
from warmer.cli import Output, add_recipe, add_root
from warmer.cli.render import seconds
from warmer.errors import EXIT_NOT_HIT, EXIT_OK

if TYPE_CHECKING:
    from warmer.api import VerifyResult

HELP = "start the engine on a root again and prove the cache is hit"
ORDER = 80


def add_arguments(c: argparse.ArgumentParser) -> None:
    add_recipe(c)
    add_root(c, what="a root holding a restored artifact")
    c.add_argument("--workdir", help="logs (default: a new temporary directory)")


def run(args: argparse.Namespace, out: Output) -> int:
    result = api.verify(args.recipe, args.root, workdir=args.workdir)
    out.emit(result, report(result))
    return EXIT_OK if result.verdict == "hit" else EXIT_NOT_HIT


TIMING_ROWS = (
    ("process (start to exit)", "process_s"),
    ("engine init (LLM())", "engine_init_s"),
    ("vLLM init engine", "init_engine_s"),
    ("compile warm-up (CPU)", "cpu_compile_warmup_s"),
    ("torch.compile", "torch_compile_s"),
    ("load weights", "load_weights_s"),
    ("workload", "workload_s"),
)


def timings_table(cold: dict, restored: dict) -> str:
    lines = [f"  {'phase':<26}{'cold':>10}{'restored':>10}{'ratio':>8}"]
    for label, key in TIMING_ROWS:
        c, r = cold.get(key), restored.get(key)
        if c is None and r is None:
            continue
        # Ratios of sub-0.1 s phases are noise.
        ratio = f"{c / r:.1f}x" if c and r and min(c, r) >= 0.1 else "-"
        lines.append(f"  {label:<26}{seconds(c):>10}{seconds(r):>10}{ratio:>8}")
    return "\n".join(lines)


def phases_table(cold: dict, restored: dict) -> str:
    """Where a start's time goes (warmup.phases), cold against restored, and what a cache could
    still take away from each phase of the restored start."""
    c, r = cold.get("phases") or {}, restored.get("phases") or {}
    if not r:
        return ""
    order, notes = api.PHASE_ORDER, api.PHASE_NOTES
    lines = [f"  {'phase of the start':<24}{'cold':>9}{'restored':>10}  a cache could still remove it?"]
    for name in [n for n in order if n in c or n in r] + sorted((set(c) | set(r)) - set(order)):
        lines.append(f"  {name:<24}{seconds(c.get(name)):>9}{seconds(r.get(name)):>10}  {notes.get(name, '')}")
    return "\n".join(lines)


def report(v: VerifyResult) -> str:
    f = v.files
    lines = [f"verdict: {v.verdict} - {f.recompiled} recompiled file(s) ({f.new} new, {f.rewritten} rewritten)"]
    if v.components is not None:
        rest = sum(n for c, n in f.by_component.items() if c not in v.components)
        lines.append(
            f"  a partial root: judged on what was restored ({', '.join(v.components)}); the other "
            f"components compiled {rest} file(s), as the fetch said"
        )
    if f.by_component:
        lines.append("  by component: " + ", ".join(f"{k} {n}" for k, n in f.by_component.items()))
    if v.outside_root:
        lines.append(f"  {len(v.outside_root)} file(s) written outside the root, e.g. {v.outside_root[0]['path']}")
    if v.log_recompiles:
        lines.append("  vLLM log: " + ", ".join(f"{k} x{n}" for k, n in v.log_recompiles.items()))
    if v.stale_modules:
        lines.append(
            f"  FlashInfer's ninja would rebuild {len(v.stale_modules)} module(s): {'; '.join(v.stale_modules[:3])}"
        )
    lines.append(f"  {v.certificate}")
    lines.append(timings_table(v.cold, v.restored))
    table = phases_table(v.cold, v.restored)
    if table:
        lines.append(table)
    lines.append(f"  log: {v.log}")
    return "\n".join(lines)
