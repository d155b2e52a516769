"""The limits: how close warmer's fetch comes to the network, how it scales with the artifact and
with many nodes at once, and how close a restored vLLM start comes to the best any cache could do.

    floor       a mostly incompressible artifact (~515 MB) from s3:// through a link throttled to
                100 MB/s: warmer fetch and `aws s3 cp` + `tar` against the floor, bytes / rate
    scaling     trees of 256 MiB, 1 GiB and 4 GiB: pack, and fetch from file://, from s3:// and from
                s3:// through a link throttled to 100 MB/s (against its floor, bytes / rate); the
                time of each and the peak RSS of each (streaming: it must not grow with the bytes)
    concurrent  sixteen `warmer fetch` processes at once, one artifact from one S3 store (s3rver)
                into sixteen roots, against the same sixteen one after another: total time, and
                every one a hit
    vllm        the caching limit on the tiny CPU recipe (vLLM's CPU engine, a generated model):
                the first start on a new node root after `warmer fetch` (restored) against a second
                start on the build root itself (the warm restart no cache tool can beat), and
                their ratio; each start broken into its phases from vLLM's log

    python bench/limits.py [scaling|concurrent|vllm ...] [--trials 3] [--workdir .bench/limits]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import tree  # noqa: E402
from common import (BUCKET, RECIPE, BenchError, Ctx, aws_env, load, measure, mib, rmtree, s3rver,  # noqa: E402
                    summarize, throttled, warmer)

# The trees grow in files with their bytes (about 11,000 a GiB); 256MiBx16 is the 256 MiB tree's
# files made 16 times bigger (4 GiB in 2,904 files): memory against bytes alone.
SIZES = ("256MiB", "1GiB", "4GiB", "256MiBx16")
RATE = 100e6
NODES = 16


# -- scaling ------------------------------------------------------------------------------------

def _tree_size(label: str) -> tuple[int, int]:
    """256MiB -> (256 MiB, 1); 256MiBx16 -> (256 MiB, 16): the tree's size and its files' scale."""
    size_text, _, scale = label.partition("x")
    return tree.parse_size(size_text), int(scale or 1)


def scaling(args) -> dict:
    out = {}
    for label in args.sizes:
        size, scale = _tree_size(label)
        root = args.workdir / (f"tree-{size >> 20}MiB" + (f"-x{scale}" if scale > 1 else ""))
        t0 = time.perf_counter()
        info = tree.generate(root, size, args.seed, scale)
        print(f"scaling: tree {tree.human(info['bytes'])}, {info['files']} files ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
        ctx = Ctx(args, root, f"scale-{root.name}", baseline=False)
        ctx.trials = args.trials
        art = args.workdir / "scale.tar.zst"
        runs = {k: [] for k in ("pack", "fetch file://", "fetch s3://", "fetch s3:// at 100 MB/s")}
        store = args.workdir / "scale-store"
        try:
            for i in range(args.trials):
                rmtree(art)
                runs["pack"].append(measure(warmer("pack", str(root), "--recipe", str(RECIPE), "-o", str(art),
                                                   "--json")))
            packed = json.loads(runs["pack"][-1]["stdout"])
            rmtree(store)
            measure(warmer("publish", str(art), "--store", f"file://{store}", "--json"))
            with s3rver(args.workdir) as endpoint:
                env = aws_env(args.workdir, endpoint)
                measure(warmer("publish", str(art), "--store", f"s3://{BUCKET}/scale", "--json"), env=env)
                with throttled(endpoint, RATE, args.workdir) as proxy:
                    slow = aws_env(args.workdir, proxy)
                    for i in range(args.trials):
                        runs["fetch file://"].append(ctx.fetch(f"file://{store}", ctx.new_root(f"file-{i}")))
                        runs["fetch s3://"].append(ctx.fetch(f"s3://{BUCKET}/scale", ctx.new_root(f"s3-{i}"), env=env))
                        runs["fetch s3:// at 100 MB/s"].append(
                            ctx.fetch(f"s3://{BUCKET}/scale", ctx.new_root(f"s3slow-{i}"), env=slow))
                        print(f"  {label} trial {i}: " + ", ".join(f"{k} {v[-1]['seconds']:.2f} s"
                                                                    for k, v in runs.items() if v)
                              + f" (load {load()})", file=sys.stderr)
            archive_bytes = art.stat().st_size
        finally:
            rmtree(art)
            rmtree(store)
            rmtree(args.workdir / "roots")  # this size's roots: the next size starts on a clean disk
        out[label] = {"files": packed["files"], "bytes": packed["bytes"], "archive_bytes": archive_bytes,
                      "floor_s": archive_bytes / RATE, "steps": {k: summarize(v) for k, v in runs.items()}}
        if not args.keep_trees:
            rmtree(root)
    return out


def scaling_table(res: dict) -> str:
    first = next(iter(res.values()))
    head = " | ".join(f"{lbl}: {tree.human(r['bytes'])} in {r['files']} files, archive {mib(r['archive_bytes'])}"
                      for lbl, r in res.items())
    lines = [f"| step | {head} | s per GiB of cache |", "|---|" + "---:|" * (len(res) + 1)]
    for step in first["steps"]:
        cells, per_gib = [], []
        for r in res.values():
            s = r["steps"][step]
            extra = f", {s['seconds'] / r['floor_s']:.2f}× the floor" if "100 MB/s" in step else ""
            grew = (s["rss"] - first["steps"][step]["rss"]) / 2**20
            cells.append(f"{s['seconds']:.2f} s{extra}; {mib(s['rss'])}" + (f" ({grew:+.0f})" if r is not first else ""))
            per_gib.append(f"{s['seconds'] / (r['bytes'] / 2**30):.2f}")
        lines.append(f"| {step} | " + " | ".join(cells) + f" | {' / '.join(per_gib)} |")
    return "\n".join(lines)


# -- the floor: a mostly incompressible artifact through a 100 MB/s link ------------------------

def floor(args) -> dict:
    """What the issue measured by hand (a 515 MB, mostly incompressible artifact through a loopback
    proxy capped at 100 MB/s): warmer fetch and `aws s3 cp` + `tar` against bytes / rate, where the
    link and not the CPU is the limit (random bytes decompress as fast as they are copied)."""
    root = args.workdir / "tree-floor"
    tree.generate(root, 64 << 20, args.seed)
    big = root / "inductor" / "ab" / "big-kernel.so"
    if not big.exists() or big.stat().st_size != args.floor_mib << 20:
        big.parent.mkdir(parents=True, exist_ok=True)  # the seeded tree may have no inductor/ab
        with open(big, "wb") as f:
            for _ in range(args.floor_mib):
                f.write(os.urandom(1 << 20))
    art = args.workdir / "floor.tar.zst"
    rmtree(art)
    measure(warmer("pack", str(root), "--recipe", str(RECIPE), "-o", str(art), "--json"))
    size = art.stat().st_size
    aws = common.find_aws(None)
    if not aws:
        raise BenchError("the AWS CLI is not found: `make bench` installs it into .venv-aws")
    ctx = Ctx(args, root, "floor")
    local = args.workdir / "floor-download.tar.zst"
    with s3rver(args.workdir) as endpoint:
        env = aws_env(args.workdir, endpoint)
        measure(warmer("publish", str(art), "--store", f"s3://{BUCKET}/floor", "--json"), env=env)
        measure([aws, "s3", "cp", "--only-show-errors", str(art), f"s3://{BUCKET}/floor-b/a.tar.zst"], env=env)
        with throttled(endpoint, RATE, args.workdir) as proxy:
            slow = aws_env(args.workdir, proxy)
            got = common.pair(
                args.trials, lambda i, last: ctx.fetch(f"s3://{BUCKET}/floor", ctx.new_root(f"warmer-{i}"), env=slow),
                lambda i, last: ctx.untar(f"{aws} s3 cp --only-show-errors s3://{BUCKET}/floor-b/a.tar.zst {local} "
                                          f"&& tar --zstd -xf {local} -C {{root}} && rm {local}",
                                          ctx.new_root(f"baseline-{i}"), env=slow))
    rmtree(art)
    rmtree(args.workdir / "roots")
    print(f"  floor: warmer {got['warmer']['trials_s']}, baseline {got['baseline']['trials_s']} (load {load()})",
          file=sys.stderr)
    return {"archive_bytes": size, "rate": RATE, "floor_s": size / RATE, **got,
            "warmer_over_floor": got["warmer"]["seconds"] / (size / RATE),
            "baseline_over_floor": got["baseline"]["seconds"] / (size / RATE)}


# -- sixteen nodes at once ----------------------------------------------------------------------

FLEET = r"""
set -u
store="$1"; roots="$2"; mode="$3"; n="$4"; shift 4
for i in $(seq 1 "$n"); do
  if [ "$mode" = at-once ]; then
    "$@" fetch "$RECIPE" --store "$store" --root "$roots/node-$i" --json > "$roots/node-$i.json" 2> "$roots/node-$i.err" &
  else
    "$@" fetch "$RECIPE" --store "$store" --root "$roots/node-$i" --json > "$roots/node-$i.json" 2> "$roots/node-$i.err"
  fi
done
wait
"""


def concurrent(args) -> dict:
    size = tree.parse_size(args.fleet_size)
    root = args.workdir / f"tree-{size >> 20}MiB"
    info = tree.generate(root, size, args.seed)
    art = args.workdir / "fleet.tar.zst"
    rmtree(art)
    measure(warmer("pack", str(root), "--recipe", str(RECIPE), "-o", str(art), "--json"))
    out = {"tree_bytes": info["bytes"], "files": info["files"], "archive_bytes": art.stat().st_size, "nodes": NODES,
           "trials": []}
    with s3rver(args.workdir) as endpoint:
        env = {**aws_env(args.workdir, endpoint), "RECIPE": str(RECIPE)}
        measure(warmer("publish", str(art), "--store", f"s3://{BUCKET}/fleet", "--json"), env=env)
        for i in range(args.trials):
            trial = {}
            for mode in ("at-once", "one-by-one"):
                roots = args.workdir / "roots" / f"fleet-{mode}-{i}"
                rmtree(roots)
                roots.mkdir(parents=True)
                r = measure(["bash", "-c", FLEET, "fleet", f"s3://{BUCKET}/fleet", str(roots), mode, str(NODES),
                             *warmer()], env=env)
                statuses = []
                for n in range(1, NODES + 1):
                    try:
                        statuses.append(json.loads((roots / f"node-{n}.json").read_text())["status"])
                    except (OSError, ValueError, KeyError):
                        statuses.append("no answer: " + (roots / f"node-{n}.err").read_text()[-300:])
                errors = [s for s in statuses if s != "hit"]
                trial[mode] = {"seconds": r["seconds"], "rss": r["rss"], "cpu_s": r["cpu_s"], "hits": statuses.count("hit"),
                               "errors": errors}
                common.evict(roots)
                print(f"  fleet {mode} trial {i}: {r['seconds']:.2f} s, {statuses.count('hit')} hits, "
                      f"{len(errors)} errors (load {load()})", file=sys.stderr)
            out["trials"].append(trial)
    rmtree(art)
    rmtree(args.workdir / "roots")
    for mode in ("at-once", "one-by-one"):
        out[mode] = {"seconds": statistics.median(t[mode]["seconds"] for t in out["trials"]),
                     "errors": sum(len(t[mode]["errors"]) for t in out["trials"]),
                     "hits": sum(t[mode]["hits"] for t in out["trials"])}
    out["ratio"] = out["at-once"]["seconds"] / out["one-by-one"]["seconds"]
    return out


# -- the caching limit for vLLM -----------------------------------------------------------------

def vllm_limit(args) -> dict:
    """Build the tiny recipe (cold warm-up, pack, verify, publish to a file store), then, trial by
    trial, interleaved: fetch into a new node root and start vLLM there (restored); start vLLM on
    the build root again (warm restart). Each start is warmer's own engine run (warmer.warmup), as
    verify runs it, with its phases from vLLM's log."""
    sys.path.insert(0, str(common.REPO))
    from warmer import build, fetch, tinymodel, warmup
    from warmer.recipe import load as load_recipe

    work = args.workdir / "vllm"
    rmtree(work)
    work.mkdir(parents=True)
    model = work / "model"
    tinymodel.generate(model)
    os.environ["WARMER_TINY_MODEL"] = str(model)
    recipe = load_recipe(common.REPO / "manifests/models/tiny-llama-cpu.toml")
    store, build_root, logs = f"file://{work / 'store'}", work / "build-root", work / "logs"
    t0 = time.perf_counter()
    built = build.build(recipe, store, build_root, logs)
    print(f"vllm: built in {time.perf_counter() - t0:.0f} s, verdict {built.verify.verdict if built.verify else '-'}",
          file=sys.stderr)
    runs = {"restored": [], "warm restart": []}
    for i in range(args.trials):
        node = work / f"node-{i}"
        got = fetch.fetch(recipe, store, node)
        if got.status != "hit":
            raise BenchError(f"vllm: fetch into {node}: {got.status}: {got.warnings}")
        for label, root in (("restored", node), ("warm restart", build_root)):
            run = warmup.run_engine(recipe, root, logs, f"{label.replace(' ', '-')}-{i}")
            runs[label].append({**warmup.timings(run), "phases": run.log.get("phases", {}),
                                "recompiles": {e: run.log["events"][e] for e in warmup.RECOMPILE_EVENTS
                                               if run.log["events"].get(e)}})
            print(f"  vllm {label} {i}: process {run.wall_s:.1f} s, LLM() {run.result.get('engine_init_s')} s, "
                  f"init engine {run.log['timings'].get('init_engine_s')} s (load {load()})", file=sys.stderr)
        rmtree(node)
    out = {"cold": built.cold, "trials": runs}
    for key in ("process_s", "engine_init_s", "init_engine_s"):
        med = {label: statistics.median(r[key] for r in rs if r.get(key) is not None) for label, rs in runs.items()}
        out[key] = {**med, "ratio": med["restored"] / med["warm restart"]}
    phases = {}
    for label, rs in runs.items():
        names = {n for r in rs for n in r["phases"]}
        phases[label] = {n: statistics.median(r["phases"].get(n, 0.0) for r in rs) for n in names}
    out["phases"] = phases
    if not args.keep_trees:
        rmtree(work / "build-root")
    return out


def vllm_table(res: dict) -> str:
    lines = ["| measure | cold build | restored (new node root) | warm restart (build root) | restored / warm |",
             "|---|---:|---:|---:|---:|"]
    for key, label in (("process_s", "process, start to exit"), ("engine_init_s", "LLM() start to ready"),
                       ("init_engine_s", "vLLM init engine")):
        m = res[key]
        lines.append(f"| {label} | {res['cold'].get(key, 0):.2f} s | {m['restored']:.2f} s | {m['warm restart']:.2f} s "
                     f"| {m['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="*", help="which limits: floor, scaling, concurrent, vllm (default: all four)")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"the scaling row's trees (default {','.join(SIZES)})")
    p.add_argument("--fleet-size", default="256MiB", help="the tree of the sixteen-node row (default 256MiB)")
    p.add_argument("--floor-mib", type=int, default=470,
                   help="the random file of the floor row, in MiB (default 470: a ~515 MB artifact, the size the issue measured by hand)")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=Path(".bench/limits"))
    p.add_argument("--json", type=Path, help="default WORKDIR/limits.json")
    p.add_argument("--keep-trees", action="store_true", help="keep the generated trees and the build root")
    a = p.parse_args(argv)
    kinds = ["floor", "scaling", "concurrent", "vllm"]
    a.what = a.what or kinds
    if set(a.what) - set(kinds):
        p.error(f"unknown limit(s) {sorted(set(a.what) - set(kinds))}: {', '.join(kinds)}")
    a.sizes = a.sizes.split(",")
    a.discard_roots = False
    a.workdir = a.workdir.absolute()
    a.workdir.mkdir(parents=True, exist_ok=True)
    if {"floor", "scaling", "concurrent"} & set(a.what) and not common.S3RVER.exists():
        print("limits: s3rver is not installed: `make bench` installs it into .s3rver (npm)", file=sys.stderr)
        return 2
    biggest = max(size * scale for size, scale in map(_tree_size, a.sizes)) if "scaling" in a.what else 0
    need = biggest * (3 * a.trials + 3) * 11 // 10
    if shutil.disk_usage(a.workdir).free < need:
        print(f"limits: {tree.human(need)} of free space needed under {a.workdir}", file=sys.stderr)
        return 2
    results = {"machine": common.machine(a.workdir), "trials": a.trials, "load_before": os.getloadavg()}
    try:
        if "floor" in a.what:
            results["floor"] = f = floor(a)
            print(f"\nS3 fetch of a mostly incompressible artifact ({f['archive_bytes'] / 1e6:.0f} MB) through a "
                  f"{RATE / 1e6:.0f} MB/s link, median of {a.trials}: floor {f['floor_s']:.2f} s; warmer "
                  f"{f['warmer']['seconds']:.2f} s ({f['warmer_over_floor']:.2f}× the floor, peak RSS "
                  f"{mib(f['warmer']['rss'])}); aws s3 cp + tar {f['baseline']['seconds']:.2f} s "
                  f"({f['baseline_over_floor']:.2f}×); warmer/baseline {f['ratio']:.2f}")
        if "scaling" in a.what:
            results["scaling"] = scaling(a)
            print("\nscaling (median of %d; peak RSS of each step's process)\n" % a.trials + scaling_table(results["scaling"]))
        if "concurrent" in a.what:
            results["concurrent"] = c = concurrent(a)
            print(f"\n{NODES} fetches of one artifact ({mib(c['archive_bytes'])}, {tree.human(c['tree_bytes'])} of "
                  f"cache) from one S3 store: at once {c['at-once']['seconds']:.2f} s, one by one "
                  f"{c['one-by-one']['seconds']:.2f} s, ratio {c['ratio']:.2f}; hits {c['at-once']['hits']} and "
                  f"{c['one-by-one']['hits']}, errors {c['at-once']['errors']} and {c['one-by-one']['errors']}")
        if "vllm" in a.what:
            results["vllm"] = v = vllm_limit(a)
            print("\nthe caching limit (tiny CPU recipe, median of %d)\n" % a.trials + vllm_table(v))
    except BenchError as e:
        print(f"limits: {e}", file=sys.stderr)
        return 1
    results["load_after"] = os.getloadavg()
    out = a.json or a.workdir / "limits.json"
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nload {results['load_before'][0]:.2f} before, {results['load_after'][0]:.2f} after; results: {out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
