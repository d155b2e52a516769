"""The node journey: fingerprint → key → one index lookup → download, check, restore → env.

A miss is a slow start, never a failed pod: fetch still prepares the root and the env so that
vLLM writes its caches there, and says why it missed. --require turns a miss into a failure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from warmer import artifact, compat, fingerprint, restore, signing, warmup
from warmer.recipe import Recipe
from warmer.store import Store, open_store


def contract_warnings(doc: dict, root: Path, recipe: Recipe) -> list[str]:
    """What will be rebuilt on this node because a path the caches depend on differs."""
    built = doc["path_contract"]
    out = []
    if built["root"] != str(root):
        movable = [n for n, c in doc["components"].items() if not c["relocatable"]]
        if movable:
            out.append(f"root {root} differs from the build's {built['root']}: "
                       f"{', '.join(movable)} will rebuild; serve from {built['root']} to keep them")
    if built["model"] != recipe.model:
        out.append(f"model path {recipe.model} differs from the build's {built['model']}: "
                   "vLLM keys its compile cache on it and will recompile")
    if built["python_prefix"] != sys.prefix:
        out.append(f"python prefix {sys.prefix} differs from the build's {built['python_prefix']}: "
                   "Inductor's C++ kernels will recompile")
    return out


def nearest(store: Store, recipe: Recipe, node: dict) -> dict | None:
    """The published artifact of this recipe that fails the fewest rules on this node."""
    best = None
    for name, key in store.list_index(recipe.name)[:50]:
        doc = json.loads(store.get_index(name, key))["artifact"]
        differences = [f"{d.field}: {d.reason}" for d in compat.check(doc["fingerprint"], node) if not d.ok]
        if doc["recipe"]["digest"] != recipe.digest():
            differences.append(f"recipe: built from another version of {recipe.name} "
                               f"(digest {doc['recipe']['digest'][:12]}, this one {recipe.digest()[:12]})")
        if best is None or len(differences) < len(best["differences"]):
            best = {"key": key, "differences": differences}
    return best


def fetch(recipe: Recipe, store_url: str, root: Path, *, max_bytes: int = restore.DEFAULT_MAX_BYTES,
          trusted_keys=()) -> dict:
    root = restore.check_root(root)
    store = open_store(store_url)
    node = fingerprint.probe()
    key = compat.key(node, recipe.identity())
    report: dict = {"recipe": recipe.name, "key": key, "store": store.url, "root": str(root),
                    "env": warmup.serve_env(recipe, root), "warnings": []}
    raw = store.get_index(recipe.name, key)
    if raw is None:
        report["status"] = "miss"
        report["nearest"] = nearest(store, recipe, node)
        report["warnings"].append(f"no artifact for recipe {recipe.name} and this node (key {key[:16]}): "
                                  "vLLM will compile from cold")
    else:
        entry = json.loads(raw)
        doc = artifact.loads(artifact.dumps(entry["artifact"]))
        decisions = compat.check(doc["fingerprint"], node)
        report["decisions"] = compat.as_dicts(decisions)
        if not compat.fits(decisions):
            report["status"] = "misfit"
            report["warnings"] += [f"{d.field}: {d.reason}" for d in decisions if not d.ok]
        else:
            report["warnings"] += contract_warnings(doc, root, recipe)
            blob = entry["blob"]["sha256"]
            try:
                if trusted_keys:  # checked before a byte of the blob is downloaded
                    report["signed_by"] = signing.check(artifact.dumps(doc), entry.get("signature"),
                                                        list(trusted_keys))
                result = restore.restore(doc, lambda: store.open_blob(blob), root,
                                         archive_sha256=blob, max_bytes=max_bytes)
                report["status"] = "hit" if result["status"] == "restored" else result["status"]
                report["restore"] = result
                report["build_timings"] = doc["timings"]
            except signing.SignatureError as e:
                report["status"] = "untrusted"
                report["warnings"].append(f"not activated: {e}")
            except restore.RestoreError as e:
                report["status"] = "error"
                report["warnings"].append(str(e))
    warmup.prepare_root(root)
    return report
