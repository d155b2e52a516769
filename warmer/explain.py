"""Why each published artifact of a recipe fits this node or not, field by field, ranked.

Like HF kernels' variant decision trace and NIM's compatible / incompatible profile lists:
every artifact of the recipe in the store is listed, accepted ones first, then the rejected
ones nearest first (fewest failed hard fields, then fewest failed ranged fields, then fewest
advisory differences, then the newest), each with the rules it fails and why.
"""

from __future__ import annotations

import json
from datetime import datetime

from warmer import compat
from warmer.recipe import Recipe
from warmer.store import Store


def candidate(key: str, entry: dict, recipe: Recipe, node: dict, node_key: str) -> dict:
    """One artifact judged against this node and this recipe."""
    doc = entry["artifact"]
    decisions = compat.recipe_check(doc["recipe"]["identity"], recipe.identity())
    decisions += compat.check(doc["fingerprint"], node, recipe.identity())
    failed = [d for d in decisions if not d.ok]
    return {
        "key": key,
        "exact": key == node_key,
        "accepted": not failed and not compat.problems(node),
        "failed": {kind: [d.field for d in failed if d.rule == kind] for kind in (compat.HARD, compat.RANGED)},
        "advisory_differences": [d.field for d in decisions if d.rule == compat.ADVISORY and d.built != d.node],
        "published_at": entry.get("published_at"),
        "blob": entry.get("blob", {}),
        "built_on": _summary(doc["fingerprint"]),
        "decisions": compat.as_dicts(decisions),
    }


def _summary(fp: dict) -> str:
    gpu = fp["gpu"]
    gpus = f"{gpu['count']}x {gpu['name']} (sm {gpu['compute_capability']}, {gpu['arch']})" if gpu.get("name") \
        else "no GPU" if not gpu["count"] else "mixed GPUs"
    return f"{fp['machine']}, {gpus}, cpu {fp['cpu']['model'] or '?'} ({fp['cpu']['threads']} threads)"


def _rank(c: dict) -> tuple:
    newest = -_epoch(c["published_at"])
    return (not c["accepted"], not c["exact"], len(c["failed"][compat.HARD]), len(c["failed"][compat.RANGED]),
            len(c["advisory_differences"]), newest, c["key"])


def _epoch(stamp: str | None) -> float:
    try:
        return datetime.fromisoformat(stamp).timestamp() if stamp else 0.0
    except ValueError:
        return 0.0


def explain(store: Store, recipe: Recipe, node: dict, *, limit: int | None = None) -> dict:
    """Every artifact of recipe in store (the first `limit` index entries when given), ranked."""
    node_key = compat.key(node, recipe.identity())
    candidates, unreadable = [], []
    for name, key in store.list_index(recipe.name)[:limit]:
        raw = store.get_index(name, key)
        if raw is None:
            continue  # removed since the listing (gc)
        try:
            candidates.append(candidate(key, json.loads(raw), recipe, node, node_key))
        except (ValueError, KeyError, TypeError) as e:
            unreadable.append({"key": key, "error": f"index entry unreadable: {e!r}"})
    candidates.sort(key=_rank)
    return {"recipe": recipe.name, "store": store.url, "node_key": node_key, "node": _summary(node),
            "problems": compat.problems(node), "volatile_env": compat.volatile_warnings(recipe.env),
            "accepted": sum(c["accepted"] for c in candidates), "rejected": sum(not c["accepted"] for c in candidates),
            "candidates": candidates, "unreadable": unreadable}


def differences(c: dict) -> list[str]:
    """The failed rules of a candidate, one line each: 'field: reason'."""
    return [f"{d['field']}: {d['reason']}" for d in c["decisions"] if not d["ok"]]


def nearest(store: Store, recipe: Recipe, node: dict, *, limit: int = 50) -> dict | None:
    """On a miss: the published artifact of this recipe that fails the fewest rules on this node."""
    found = explain(store, recipe, node, limit=limit)["candidates"]
    if not found:
        return None
    best = found[0]
    return {"key": best["key"], "accepted": best["accepted"], "differences": differences(best)}
