"""The evidence that a restored cache was hit: start the engine again, see what it had to write.

A full hit means: no cache file appeared or changed under the root (file delta), and vLLM's
log shows no recompile. Timings against the cold build are reported beside it.
"""

from __future__ import annotations

import os
from pathlib import Path

from warmer import components, warmup
from warmer.components import flashinfer
from warmer.recipe import Recipe


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under root, by root-relative path."""
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for fn in filenames:
            full = os.path.join(dirpath, fn)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                continue
            out[os.path.relpath(full, root).replace(os.sep, "/")] = (st.st_size, st.st_mtime_ns)
    return out


def delta(before: dict, after: dict) -> dict:
    """Cache files the run created or rewrote, by component; lock files and scratch are ignored."""
    new = sorted(p for p in after if p not in before)
    rewritten = sorted(p for p in after if p in before and after[p] != before[p])
    by_component: dict[str, int] = {}
    changed = []
    for path in new + rewritten:
        c = components.of_path(path)
        if c is not None:
            by_component[c.name] = by_component.get(c.name, 0) + 1
            changed.append(path)
    return {"new_files": sum(1 for p in new if components.of_path(p)),
            "rewritten_files": sum(1 for p in rewritten if components.of_path(p)),
            "recompiled_files": len(changed), "by_component": by_component, "examples": changed[:10]}


def _ratio(cold: dict, warm: dict, name: str) -> float | None:
    if cold.get(name) and warm.get(name):
        return round(cold[name] / warm[name], 2)
    return None


def verify(recipe: Recipe, root: Path, workdir: Path, cold: dict | None = None, label: str = "verify") -> dict:
    """Run the engine on root once more and judge the hit; cold: the build's timings, if known."""
    # Before the engine starts: afterwards ninja would have rebuilt what it found dirty.
    ninja = flashinfer.dry_run(root, warmup.serving_environ(recipe, root))
    before = snapshot(root)
    run = warmup.run_engine(recipe, root, workdir, label)
    files = delta(before, snapshot(root))
    events = run.log["events"]
    recompiles = {e: events[e] for e in warmup.RECOMPILE_EVENTS if events.get(e)}
    hit = files["recompiled_files"] == 0 and not recompiles and ninja["clean"] is not False
    restored = warmup.timings(run)
    cold = cold or {}
    return {
        "verdict": "hit" if hit else "partial",
        "files": files,
        "log_recompiles": recompiles,
        "flashinfer_dry_run": ninja,
        "log_events": events,
        "restored": restored,
        "cold": cold,
        "speedup": {name: _ratio(cold, restored, name) for name in ("init_engine_s", "engine_init_s", "process_s")},
        "log": str(run.log_path),
    }
