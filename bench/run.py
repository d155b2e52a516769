"""warmer against tar + zstd and the AWS CLI, side by side, on a synthetic cache tree: `make bench`.

For each tree size (default 1 GiB and a quarter of it) and each step, the median of --trials runs
of each side, interleaved (warmer, baseline, warmer, ...) so that a busy neighbour slows both.
The steps live by what they measure:

    bench/pack.py        pack              warmer pack                  tar -cf - | zstd -T0 -LEVEL
                                           (and pinned to 1 and 2 CPUs with taskset)
    bench/fetch_file.py  publish-file      warmer publish file://       cp && sync FILE
                         restore-file      warmer fetch (file store)    zstd -d | tar -x
                         no-op fetch       warmer fetch, already active -
    bench/fetch_s3.py    publish-s3        warmer publish s3://         aws s3 cp FILE s3://
                         restore-s3        warmer fetch (s3 store)      aws s3 cp s3:// FILE && tar --zstd -xf FILE
                         restore-s3-100MBps, -1000MBps: the same through a link throttled to that rate
    bench/oci_fetch.py   the oci:// rows (a registry on loopback), run by `make bench` after this
    bench/limits.py      scaling to 4 GiB, sixteen concurrent fetches, vLLM's caching limit

Then warmer alone, once, on the small tree's files made 4x bigger: peak memory against bytes.

Every command runs as its own process (bench/common.py): wall time from start to exit, peak RSS
from wait4 (the largest process of a pipeline), CPU seconds. S3 is s3rver on loopback. Each
restore goes into a new root, kept until the end of the run and dropped from the page cache once
measured; `sync` runs (untimed) before every timed command. Inputs stay in the page cache
(--drop-caches: not).

    python bench/run.py [--size 1GiB] [--trials 3] [--workdir .bench] [--json FILE] [--no-s3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import fetch_file  # noqa: E402
import fetch_s3  # noqa: E402
import pack  # noqa: E402
import tree  # noqa: E402
from common import BenchError, Ctx, first_line, machine, rmtree  # noqa: E402

# Goals: warmer's time over the baseline's, and the no-op fetch in seconds.
GOALS = {"pack": 1.0, "restore-file": 1.1, "restore-s3": 1.1, "restore-s3-100MBps": 1.0, "restore-s3-1000MBps": 1.0}
FLOOR_GOAL = 1.1  # the throttled S3 fetch against the link's floor (bytes / rate)
NOOP_GOAL_S = 0.5
# "Does not grow": the same files with ~4x the bytes may add buffers, not data: at most this much.
RSS_GROWTH_GOAL = 16 << 20


def bench_size(size: int, args, aws: str | None, scale: int = 1, baseline: bool = True) -> dict:
    """Every step on a tree of this size; scale > 1: the same files with bigger binaries, and
    warmer alone, once (for peak memory)."""
    wd: Path = args.workdir
    tree_label = f"{size >> 20}MiB" + (f"-x{scale}" if scale > 1 else "")
    root = wd / f"tree-{tree_label}"
    t0 = time.perf_counter()
    info = tree.generate(root, size, args.seed, scale)
    print(f"tree {root}: {info['files']} files, {tree.human(info['bytes'])} "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    ctx = Ctx(args, root, tree_label, baseline)
    res: dict = {"size": size, "scale": scale, "tree_files": info["files"], "tree_bytes": info["bytes"],
                 "steps": ctx.steps}
    w_art = pack.run(ctx, ctx.steps, res)
    fetch_file.run(ctx, ctx.steps, w_art)
    if aws:
        fetch_s3.run(ctx, ctx.steps, w_art, aws, rates=fetch_s3.RATES if baseline else ())
    rmtree(w_art)
    for s in ctx.steps.values():
        for side in ("warmer", "baseline"):
            if side in s:
                s[side]["mb_s"] = res["bytes"] / s[side]["seconds"] / 1e6
        if "floor_s" in s:
            s["warmer_over_floor"] = s["warmer"]["seconds"] / s["floor_s"]
            if "baseline" in s:
                s["baseline_over_floor"] = s["baseline"]["seconds"] / s["floor_s"]
    return res


# -- the table ------------------------------------------------------------------------------------

ROWS = [("pack", "pack", "tar -cf - | zstd -T0"), ("pack-1cpu", "pack, 1 CPU (taskset)", "the same, 1 CPU"),
        ("pack-2cpu", "pack, 2 CPUs (taskset)", "the same, 2 CPUs"),
        ("publish-file", "publish file://", "cp + fsync"),
        ("restore-file", "fetch file://", "zstd -d | tar -x"), ("noop-fetch", "fetch, already active", "-"),
        ("publish-s3", "publish s3://", "aws s3 cp (up)"), ("restore-s3", "fetch s3://", "aws s3 cp + tar --zstd -x"),
        ("restore-s3-100MBps", "fetch s3:// at 100 MB/s", "aws s3 cp + tar --zstd -x"),
        ("restore-s3-1000MBps", "fetch s3:// at 1 GB/s", "aws s3 cp + tar --zstd -x")]
_mib = common.mib


def table(results: dict) -> str:
    out = []
    for r in results["sizes"]:
        steps = r["steps"]
        w_arc, b_arc = r["warmer_archive_bytes"], r["baseline_archive_bytes"]
        out.append(f"\n{tree.human(r['bytes'])} of cache in {r['files']} files; archive {_mib(w_arc)} "
                   f"(ratio {r['bytes'] / w_arc:.2f}x) vs tar+zstd {_mib(b_arc)} "
                   f"({r['bytes'] / r['baseline_archive_bytes']:.2f}x); median of {results['trials']}")
        out.append("| step | warmer s | MB/s | peak RSS | CPU s | baseline | baseline s | MB/s | peak RSS | CPU s "
                   "| warmer/baseline | goal |")
        out.append("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|")
        for name, label, base in ROWS:
            s = steps.get(name)
            if s is None:
                continue
            w, b = s["warmer"], s.get("baseline")
            goal = []
            if name in GOALS and "ratio" in s:
                goal.append(f"≤ {GOALS[name]:.1f}× {'met' if s['ratio'] <= GOALS[name] else 'MISSED'}")
            if "floor_s" in s:
                over = s["warmer_over_floor"]
                goal.append(f"floor {s['floor_s']:.2f} s: warmer {over:.2f}×"
                            + (f" (≤ {FLOOR_GOAL}× {'met' if over <= FLOOR_GOAL else 'MISSED'})"
                               if s["rate"] <= 100e6 else "")
                            + (f", baseline {s['baseline_over_floor']:.2f}×" if "baseline_over_floor" in s else ""))
            if name == "noop-fetch":
                goal.append(f"< {NOOP_GOAL_S} s {'met' if w['seconds'] < NOOP_GOAL_S else 'MISSED'}")
            rate = "" if name == "noop-fetch" else f"{w['mb_s']:.0f}"
            row = [label, f"{w['seconds']:.2f}", rate, _mib(w["rss"]), f"{w.get('cpu_s', 0):.2f}",
                   base.replace("|", "\\|")]
            row += ([f"{b['seconds']:.2f}", f"{b['mb_s']:.0f}", _mib(b["rss"]), f"{b.get('cpu_s', 0):.2f}",
                     f"{s['ratio']:.2f}"] if b else ["", "", "", "", ""])
            out.append("| " + " | ".join(row + ["; ".join(goal)]) + " |")
    mem = results.get("memory")
    if mem:
        t = results["memory_trees"]
        cols = [f"{tree.human(t[k]['bytes'])} in {t[k]['files']} files" for k in ("small", "probe", "large")]
        out.append(f"\npeak RSS of each warmer step (goal: the same files with more bytes add at most "
                   f"{_mib(RSS_GROWTH_GOAL)})")
        out.append(f"| step | {cols[0]} | {cols[1]} | added by the bytes | {cols[2]} | per added file |")
        out.append("|---|---:|---:|---:|---:|---:|")
        for name, m in mem.items():
            r = m["rss"]
            added = round((r["probe"] - r["small"]) / 2**20)
            out.append(f"| {name} | {_mib(r['small'])} | {_mib(r['probe'])} | {added:+d} MiB "
                       f"{'met' if m['met'] else 'MISSED'} | {_mib(r['large'])} | {m['kib_per_file']:.1f} KiB |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=tree.parse_size, default=tree.parse_size("1GiB"),
                   help="the tree's size (default 1GiB); also run at a quarter of it for peak memory")
    p.add_argument("--sizes", help="comma-separated sizes instead (e.g. 64MiB,16MiB)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--level", type=int, default=3, help="zstd level on both sides (warmer's default: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=Path(".bench"))
    p.add_argument("--json", type=Path, help="write the results here (default WORKDIR/results.json)")
    p.add_argument("--aws", default=None, help="the AWS CLI (default: .venv-aws/bin/aws, else aws on PATH)")
    p.add_argument("--no-s3", action="store_true", help="skip the S3 rows")
    p.add_argument("--no-pinned", action="store_true", help="skip the pack rows pinned to 1 and 2 CPUs")
    p.add_argument("--warmer-src", type=Path, help="run the warmer package of this source tree instead (e.g. a "
                                                   "worktree of an older commit, to measure a change)")
    p.add_argument("--discard-roots", action="store_true",
                   help="remove each restored root once measured (tmpfs, or filesystems with a journal); "
                        "by default they are kept until the end: see bench_size")
    p.add_argument("--drop-caches", action="store_true",
                   help="drop the page cache before every timed command (root only; slows the whole machine)")
    a = p.parse_args(argv)
    if a.trials < 1:
        p.error("--trials must be at least 1")
    common.DROP_CACHES = a.drop_caches
    if a.warmer_src:
        if not (a.warmer_src / "warmer" / "__init__.py").is_file():
            p.error(f"--warmer-src {a.warmer_src}: no warmer package there")
        common.WARMER_SRC = str(a.warmer_src.absolute())
    if common.DROP_CACHES and os.geteuid() != 0:
        p.error("--drop-caches needs root (it writes /proc/sys/vm/drop_caches)")
    sizes = [tree.parse_size(s) for s in a.sizes.split(",")] if a.sizes else [a.size, a.size // 4]

    missing = [t for t in ("zstd", "tar", "sync") if not shutil.which(t)]
    if missing:
        print(f"bench: {', '.join(missing)} not found: install them (Debian/Ubuntu: apt-get install zstd tar)",
              file=sys.stderr)
        return 2
    if "GNU tar" not in (first_line(["tar", "--version"]) or ""):
        print("bench: tar is not GNU tar (needed for --zstd): apt-get install tar", file=sys.stderr)
        return 2
    aws = None
    if not a.no_s3:
        aws = common.find_aws(a.aws)
        if not aws:
            print("bench: the AWS CLI is not found: `make bench` installs it into .venv-aws, or pass --aws, "
                  "or --no-s3", file=sys.stderr)
            return 2
        if not common.S3RVER.exists():
            print("bench: s3rver is not installed: `make bench` installs it into .s3rver (npm), or --no-s3",
                  file=sys.stderr)
            return 2
    a.workdir = a.workdir.absolute()
    a.workdir.mkdir(parents=True, exist_ok=True)
    # Every restored root stays until the end (see bench_size), trees and archives besides.
    restores = 2 * (1 if a.no_s3 else 2 + len(fetch_s3.RATES)) * a.trials
    need = (sum(s * (restores + 2) for s in sizes) + 4 * max(sizes)) * 11 // 10
    free = shutil.disk_usage(a.workdir).free
    if free < need:
        print(f"bench: {tree.human(need)} of free space needed under {a.workdir}, {tree.human(free)} free: "
              "pass a smaller --size, fewer --trials or another --workdir", file=sys.stderr)
        return 2
    roots = a.workdir / "roots"
    if roots.exists():  # an interrupted run's: deleted at the end, not right before creating files
        roots.rename(a.workdir / f"trash-{time.time_ns()}")
    results = {"machine": machine(a.workdir, aws), "trials": a.trials, "level": a.level,
               "warmer_src": common.WARMER_SRC,
               "page_cache": "dropped before each command" if common.DROP_CACHES else "warm (same for both sides)",
               "load_before": os.getloadavg(), "sizes": []}
    print(f"bench: sizes {[tree.human(s) for s in sizes]}, {a.trials} trials, load {os.getloadavg()[0]:.2f}",
          file=sys.stderr)
    try:
        for size in sizes:
            results["sizes"].append(bench_size(size, a, aws))
        if len(sizes) > 1:  # the smallest tree's files with bigger binaries: memory against bytes alone
            small, large = min(sizes), max(sizes)
            results["memory_probe"] = bench_size(small, a, aws, scale=large // small, baseline=False)
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    finally:
        for p in [roots, *a.workdir.glob("trash-*")]:
            rmtree(p)
    results["load_after"] = os.getloadavg()
    if "memory_probe" in results:
        # Peak RSS against bytes at a constant file count (streaming: flat), and against the file
        # count (artifact.json's entries are held in memory: a few KiB each).
        small = min(results["sizes"], key=lambda r: r["size"])
        large = max(results["sizes"], key=lambda r: r["size"])
        probe = results["memory_probe"]
        results["memory"] = {}
        for name, s in probe["steps"].items():
            if name not in small["steps"] or name not in large["steps"]:
                continue
            rss = {k: r["steps"][name]["warmer"]["rss"] for k, r in (("small", small), ("probe", probe),
                                                                       ("large", large))}
            growth = rss["probe"] / rss["small"]
            results["memory"][name] = {
                "rss": rss, "growth_with_bytes": growth, "met": rss["probe"] - rss["small"] <= RSS_GROWTH_GOAL,
                "kib_per_file": (rss["large"] - rss["small"]) / 1024 / max(large["files"] - small["files"], 1)}
        results["memory_trees"] = {k: {"files": r["files"], "bytes": r["bytes"]}
                                   for k, r in (("small", small), ("probe", probe), ("large", large))}
    main_size = results["sizes"][0]
    results["ratios"] = {k: s["ratio"] for k, s in main_size["steps"].items() if "ratio" in s}
    results["over_floor"] = {k: s["warmer_over_floor"] for k, s in main_size["steps"].items() if "floor_s" in s}
    results["goals"] = {
        **{k: {"goal": f"<= {g}", "value": results["ratios"].get(k),
               "met": results["ratios"][k] <= g if k in results["ratios"] else None} for k, g in GOALS.items()},
        "noop-fetch": {"goal": f"< {NOOP_GOAL_S} s", "value": main_size["steps"]["noop-fetch"]["warmer"]["seconds"],
                       "met": main_size["steps"]["noop-fetch"]["warmer"]["seconds"] < NOOP_GOAL_S},
        "s3-floor-100MBps": {"goal": f"<= {FLOOR_GOAL}x the floor", "value": results["over_floor"].get("restore-s3-100MBps"),
                             "met": (results["over_floor"]["restore-s3-100MBps"] <= FLOOR_GOAL
                                     if "restore-s3-100MBps" in results["over_floor"] else None)},
        "memory": {"goal": f"same files, ~4x the bytes: peak RSS grows by <= {RSS_GROWTH_GOAL >> 20} MiB",
                   "met": all(m["met"] for m in results.get("memory", {}).values()) if results.get("memory") else None}}
    text = table(results)
    load = results["load_before"], results["load_after"]
    print(f"\nwarmer bench on {results['machine']['cpu']}, {results['machine']['cores']} cores; "
          f"load {load[0][0]:.2f} before, {load[1][0]:.2f} after; page cache {results['page_cache']}{text}")
    out = a.json or a.workdir / "results.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nresults: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
