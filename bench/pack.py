"""pack: `warmer pack` against `tar -cf - | zstd -T0 -LEVEL` on the same tree, at the same level.

Both sides on every CPU the machine gives, and again pinned with taskset to one CPU and to two:
with CPU seconds beside the wall time, the rows show which resource bounds pack (both sides are
CPU-bound here: warmer hashes every byte, which tar does not, and compresses as much).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from common import RECIPE, SUBDIRS, measure, pair, rmtree, warmer

# (step, taskset CPU list or None): the CPU counts pack is measured at
PINNED = (("pack-1cpu", "0"), ("pack-2cpu", "0,1"))


def run(ctx, steps: dict, res: dict) -> Path:
    """The pack rows; returns warmer's archive of the tree (kept for the fetch rows)."""
    root, wd, level, n = ctx.root, ctx.workdir, str(ctx.args.level), ctx.trials
    w_art, b_art = wd / "warmer.tar.zst", wd / "baseline.tar.zst"

    def w_pack(cpus):
        def go(i, last):
            rmtree(w_art)
            r = measure(warmer("pack", str(root), "--recipe", str(RECIPE), "-o", str(w_art), "--level", level,
                               "--json"), cpus=cpus)
            packed = json.loads(r["stdout"])
            res.update(files=packed["files"], bytes=packed["bytes"], warmer_archive_bytes=w_art.stat().st_size)
            return r
        return go

    def b_pack(cpus):
        def go(i, last):
            r = measure(f"tar -C {root} -cf - {' '.join(SUBDIRS)} | zstd -q -T0 {'--ultra ' if level > 19 else ''}-{level} -o {b_art}", cpus=cpus)
            res["baseline_archive_bytes"] = b_art.stat().st_size
            rmtree(b_art)
            return r
        return go

    steps["pack"] = pair(n, w_pack(None), ctx.base(b_pack(None)))
    ctx.say("pack")
    if ctx.baseline and not ctx.args.no_pinned:
        for name, cpus in PINNED:
            if max(int(c) for c in cpus.split(",")) < (os.cpu_count() or 1):
                steps[name] = pair(n, w_pack(cpus), b_pack(cpus))
                ctx.say(name)
    return w_art
