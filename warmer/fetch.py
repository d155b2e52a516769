"""The node journey: fingerprint → key → one index lookup → download, check, restore → env.

A miss is a slow start, never a failed pod: fetch still prepares the root and the env so that
vLLM writes its caches there, and says why it missed. --require turns a miss into a failure.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from warmer import artifact, compat, explain, fingerprint, restore, signing, warmup
from warmer.components import flashinfer
from warmer.recipe import Recipe
from warmer.store import Store, StoreError, open_store


def contract_warnings(doc: dict, root: Path, recipe: Recipe) -> list[str]:
    """What will be rebuilt on this node because a path the caches depend on differs."""
    built = doc["path_contract"]
    out = []
    fi_built = built.get("flashinfer")
    if built["root"] != str(root):
        # FlashInfer's own check below says which modules and why.
        movable = [n for n, c in doc["components"].items() if not c["relocatable"] and not (n == "flashinfer" and fi_built)]
        if movable:
            out.append(f"root {root} differs from the build's {built['root']}: "
                       f"{', '.join(movable)} will rebuild; serve from {built['root']} to keep them")
    if built["model"] != recipe.model:
        out.append(f"model path {recipe.model} differs from the build's {built['model']}: "
                   "vLLM keys its compile cache on it and will recompile")
    if built["python_prefix"] != sys.prefix:
        out.append(f"python prefix {sys.prefix} differs from the build's {built['python_prefix']}: "
                   "Inductor's C++ kernels will recompile")
    if fi_built and fi_built.get("modules"):
        node = flashinfer.contract(root, warmup.serving_environ(recipe, root))
        reasons = flashinfer.compare(fi_built, node)
        if reasons:
            out.append(f"FlashInfer will rebuild {len(fi_built['modules'])} JIT module(s) "
                       f"({', '.join(fi_built['modules'][:5])}) because: " + "; ".join(reasons))
    return out


def fetch(recipe: Recipe, store_url: str | Store, root: Path, *, max_bytes: int = restore.DEFAULT_MAX_BYTES,
          trusted_keys=(), gpus: dict | None = None) -> dict:
    """gpus: the GPU section of a serving node's saved fingerprint, in place of this machine's GPUs
    (an image build on a machine without the target GPU)."""
    root = restore.check_root(root)
    store = open_store(store_url) if isinstance(store_url, str) else store_url
    node = fingerprint.probe(root=root, model=recipe.model)
    if gpus is not None:
        node = {**node, "gpu": gpus}
    key = compat.key(node, recipe.identity())
    report: dict = {"recipe": recipe.name, "key": key, "store": store.url, "root": str(root),
                    "env": warmup.serve_env(recipe, root), "warnings": []}
    if gpus is not None:
        report["for_gpus"] = (f"{gpus['count']} x {gpus['name']} (sm {gpus.get('compute_capability')}, "
                              f"driver {gpus.get('driver')}), from a saved fingerprint")
    problems = compat.problems(node)
    try:
        raw = None if problems else store.get_index(recipe.name, key)
    except StoreError as e:  # an unreachable store is a slow start too, not a failed pod
        problems = [f"{e}; vLLM will compile from cold"]
    if problems:  # no artifact fits this node: do not even look
        report["status"] = "miss"
        report["warnings"] += problems
    elif raw is None:
        report["status"] = "miss"
        try:
            report["nearest"] = explain.nearest(store, recipe, node)
        except StoreError as e:  # e.g. nodes allowed to read entries but not to list them
            report["warnings"].append(f"no nearest artifact to show: {e}")
        report["warnings"].append(f"no artifact for recipe {recipe.name} and this node (key {key[:16]}): "
                                  "vLLM will compile from cold")
    else:
        entry = json.loads(raw)
        doc = artifact.validate(entry["artifact"])
        decisions = compat.check(doc["fingerprint"], node, recipe.identity())
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
                result = restore.restore(doc, lambda: store.open_blob(blob, spool_dir=root.parent), root,
                                         archive_sha256=blob, max_bytes=max_bytes)
                report["status"] = "hit" if result["status"] == "restored" else result["status"]
                report["restore"] = result
                report["build_timings"] = doc["timings"]
                report["env"].update(flashinfer.artifact_env(doc, root))
                # ninja's dry run of every restored JIT module, in the env vLLM will start with
                report["flashinfer"] = flashinfer.dry_run(root, {**os.environ, **report["env"]})
                if report["flashinfer"]["clean"] is False:
                    dirty = [m for m, r in report["flashinfer"]["modules"].items() if not r["clean"]]
                    report["warnings"].append(f"ninja would rebuild FlashInfer module(s) {', '.join(dirty)}: "
                                              f"see `warmer flashinfer-check --root {root}`")
            except signing.SignatureError as e:
                report["status"] = "untrusted"
                report["warnings"].append(f"not activated: {e}")
            except restore.RestoreError as e:
                report["status"] = "error"
                report["warnings"].append(str(e))
            except StoreError as e:  # the download failed, or its bytes never matched their digest
                report["status"] = "error"
                report["warnings"].append(f"not activated, {root} is unchanged: {e}")
    warmup.prepare_root(root)
    return report
