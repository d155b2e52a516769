"""`make demo`: the whole loop on this machine, from nothing to a report.

generate a tiny model → build its recipe (cold warm-up, pack, verify, publish to a file store)
→ fetch it into a different, empty node root → verify the restored start → report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from warmer import api, build, fetch, tinymodel, verify, warmup
from warmer.cli import build as build_cli
from warmer.cli import fetch as fetch_cli
from warmer.cli import verify as verify_cli
from warmer.recipe import load


def _step(text: str) -> None:
    print(f"\n== {text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m warmer.demo", description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default=".demo", help="everything the demo writes (default .demo)")
    p.add_argument("--recipe", default="manifests/models/tiny-llama-cpu.toml")
    args = p.parse_args(argv)

    work = Path(args.workdir).absolute()
    model = work / "model"
    store_dir, build_root, node_root, logs = (work / n for n in ("store", "build-root", "node-root", "logs"))
    for d in (store_dir, build_root, node_root, logs):
        shutil.rmtree(d, ignore_errors=True)
    store = f"file://{store_dir}"

    _step(f"generate the tiny model: python -m warmer.tinymodel {model}")
    tinymodel.generate(model)
    os.environ["WARMER_TINY_MODEL"] = str(model)
    recipe = load(args.recipe)

    _step(f"build: warmer build {args.recipe} --store {store} --root {build_root}")
    built = build.build(recipe, store, build_root, logs)
    print(build_cli.report(built))
    for line in build_cli.uncovered(built.uncovered):
        print(f"  warning: {line}")

    _step(f"fetch into an empty node root: warmer fetch {args.recipe} --store {store} --root {node_root}")
    got = fetch.fetch(recipe, store, node_root)
    print(fetch_cli.report(got))
    for w in got.warnings:
        print(f"  warning: {w}")
    env_file = work / "node.env"
    api.write_env(got.env, env_file, "dotenv")
    print(f"  env for vLLM written to {env_file}:")
    print("    " + got.env.render("shell").rstrip().replace("\n", "\n    "))

    _step(f"verify the node: warmer verify {args.recipe} --root {node_root}")
    checked = verify.verify(recipe, node_root, logs, cold=built.cold, label="node-verify")
    print(verify_cli.report(checked))

    cold, warm = built.cold, checked.restored
    assert cold is not None  # the store was emptied above: the build warmed from cold
    summary: dict[str, Any] = {
        "artifact_bytes": built.archive_bytes,
        "cache_bytes": built.bytes,
        "files": built.files,
        "restore_s": got.restore.seconds if got.restore else None,
        "cold_init_engine_s": cold.get("init_engine_s"),
        "restored_init_engine_s": warm.get("init_engine_s"),
        "cold_engine_init_s": cold.get("engine_init_s"),
        "restored_engine_init_s": warm.get("engine_init_s"),
        "recompiled_files": checked.files.recompiled,
        "verdict": checked.verdict,
        "uncovered_files": len(built.uncovered),
        "restored_phases": warm.get("phases") or {},
    }
    (work / "report.json").write_text(
        json.dumps(
            {"build": built.to_json(), "fetch": got.to_json(), "verify": checked.to_json(), "summary": summary},
            indent=1,
            default=str,
        )
    )
    _step("report")
    print(
        f"  artifact:              {summary['files']} files, {summary['cache_bytes'] / 1e6:.1f} MB "
        f"packed to {summary['artifact_bytes'] / 1e6:.1f} MB"
    )
    print(f"  fetch + restore:       {summary['restore_s']} s")
    print(
        f"  vLLM init engine:      cold {summary['cold_init_engine_s']} s -> restored "
        f"{summary['restored_init_engine_s']} s"
    )
    print(
        f"  LLM() start to ready:  cold {summary['cold_engine_init_s']} s -> restored "
        f"{summary['restored_engine_init_s']} s"
    )
    print(f"  recompiled files:      {summary['recompiled_files']}   verdict: {summary['verdict']}")
    phases = summary["restored_phases"]
    if phases:
        top = sorted(((s, n) for n, s in phases.items() if n not in ("workload", "exit")), reverse=True)[:4]
        print("  restored start:        " + ", ".join(f"{n} {s:.1f} s" for s, n in top))
        removable = {n: s for n, s in phases.items() if warmup.PHASE_NOTES.get(n, "").startswith("yes")}
        print(
            "  a cache could remove:  "
            + (
                ", ".join(f"{n} {s:.1f} s ({warmup.PHASE_NOTES[n][5:]})" for n, s in removable.items())
                or "nothing more"
            )
        )
    print(f"  full report:           {work / 'report.json'}")
    return 0 if checked.verdict == "hit" and got.status == "hit" else 1


if __name__ == "__main__":
    sys.exit(main())
