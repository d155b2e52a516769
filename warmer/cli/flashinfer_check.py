"""warmer flashinfer-check: will FlashInfer rebuild the JIT modules under a root, and why."""

from __future__ import annotations

import argparse

from warmer import api
from warmer.cli import Output, add_root
from warmer.errors import EXIT_NOT_HIT, EXIT_OK

HELP = "will FlashInfer rebuild the JIT modules under a root? contract, ninja dry run, newer inputs"
ORDER = 90


def add_arguments(c: argparse.ArgumentParser) -> None:
    add_root(c, what="a root holding a restored artifact")
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


def run(args: argparse.Namespace, out: Output) -> int:
    result = api.flashinfer_check(
        args.root, recipe_file=args.recipe, backdate=args.backdate, include_site_packages=args.include_site_packages
    )
    out.emit(result, report(result))
    final = result.get("dry_run_after", result["dry_run"])
    return EXIT_OK if final["clean"] is not False else EXIT_NOT_HIT


def report(r: dict) -> str:
    lines = []
    if r["contract"]:
        lines.append("path contract broken (FlashInfer will rebuild):")
        lines += [f"  - {c}" for c in r["contract"]]
    for title, key in (("ninja dry run", "dry_run"), ("ninja dry run after back-dating", "dry_run_after")):
        d = r.get(key)
        if d is None:
            continue
        if d.get("skipped"):
            lines.append(f"{title}: {d['skipped']}")
            continue
        lines.append(
            f"{title}: {len(d['modules'])} module(s), " + ("no work to do" if d["clean"] else "rebuilds needed")
        )
        for name, m in d["modules"].items():
            lines.append(f"  {name}: {'no work to do' if m['clean'] else 'REBUILD: ' + '; '.join(m['reasons'][:2])}")
    if r["newer_inputs"]:
        lines.append(
            f"{len(r['newer_inputs'])} input(s) newer than the cache, e.g. {r['newer_inputs'][0]['file']}: "
            "rerun with --backdate (add --include-site-packages for installed headers)"
        )
    if "backdate" in r:
        b = r["backdate"]
        lines.append(
            f"back-dated {len(b['files'])} file(s) in the root; left {len(b['held_back_site_packages'])} in "
            f"site-packages and {len(b['held_back_outside_root'])} elsewhere outside the root"
        )
    return "\n".join(lines) or "no FlashInfer JIT modules under this root"
