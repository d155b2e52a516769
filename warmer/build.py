"""The build journey: warm → pack → verify → publish, and pack and publish on their own.

    warm     vLLM in a child process, every cache under an empty root (a true cold start)
    pack     the root's cache files into a tar.zst with artifact.json
    verify   restore that artifact over the root (exactly what a node does), start again,
             prove the hit; its timings go into artifact.json
    publish  blob first, then the index entry; the first publisher of a key wins
"""

from __future__ import annotations

import getpass
import json
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from warmer import archive, artifact, compat, components, fingerprint, restore, signing, verify, warmup
from warmer.components import flashinfer
from warmer.recipe import Recipe
from warmer.store import Store, open_store


class BuildError(Exception):
    """The build stopped; nothing was published. report: what was measured up to then."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


def path_contract(recipe: Recipe, root: Path) -> dict:
    """The absolute paths the caches were built at: fetch compares them with the node's."""
    contract = {"root": str(root), "model": recipe.model, "python_prefix": sys.prefix, "user": getpass.getuser()}
    fi = flashinfer.contract(root, warmup.serving_environ(recipe, root))
    if fi:
        contract["flashinfer"] = fi
    return contract


def pack_root(root: Path, recipe: Recipe, out: Path, *, fp: dict | None = None, timings: dict | None = None,
              level: int = 3) -> dict:
    """Pack root's caches into out (tar.zst); return the artifact.json written into it."""
    root = Path(root).absolute()
    fp = fp or fingerprint.probe(root=root, model=recipe.model)
    if compat.problems(fp):
        raise BuildError(f"this node cannot build an artifact: {'; '.join(compat.problems(fp))}")
    found = components.collect(root)
    if not found:
        raise BuildError(f"{root} holds no cache files: was it the --root of a warm-up?")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out.parent) as body:
        files = archive.pack_body(root, [rel for _, rel in found], body, level=level)
        sizes = {f.path: f.size for f in files}
        summary: dict[str, dict] = {}
        for c, rel in found:
            s = summary.setdefault(c.name, {"subdir": c.subdir, "env": [v for v, _ in c.env],
                                            "relocatable": c.relocatable, "files": 0, "bytes": 0})
            s["files"] += 1
            s["bytes"] += sizes[rel]
        doc = artifact.new(key=compat.key(fp, recipe.identity()), recipe=recipe.summary(), fingerprint=fp,
                           path_contract=path_contract(recipe, root), components=summary, files=files,
                           timings=timings or {})
        body.seek(0)
        tmp = out.with_name(out.name + ".tmp")
        with open(tmp, "wb") as f:
            archive.assemble(artifact.dumps(doc), body, f)
        tmp.replace(out)
    return doc


def publish(store: Store, path: Path, sign_key: str | None = None) -> dict:
    """Upload the blob (unless the store has it), then create the index entry if it is absent.

    With sign_key, artifact.json is signed; the signature goes into the index entry and beside
    the file as FILE.sig."""
    with open(path, "rb") as f:
        manifest = archive.read_manifest(f)
    doc = artifact.loads(manifest)
    signature = signing.sign(manifest, sign_key) if sign_key else None
    if signature:
        signing.write_sidecar(path, signature)
    digest = archive.sha256_file(path)
    size = path.stat().st_size
    uploaded = store.put_blob(str(path), digest)
    entry = {"schema": artifact.SCHEMA_VERSION, "recipe": doc["recipe"]["name"], "key": doc["key"],
             "blob": {"sha256": digest, "size": size}, "artifact": doc, "signature": signature,
             "published_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    won = store.put_index(doc["recipe"]["name"], doc["key"], json.dumps(entry, separators=(",", ":")).encode())
    result = {"status": "published" if won else "already-published", "store": store.url,
              "recipe": doc["recipe"]["name"], "key": doc["key"], "blob": digest, "bytes": size,
              "blob_uploaded": uploaded}
    if not won:
        existing = json.loads(store.get_index(doc["recipe"]["name"], doc["key"]))
        result["published_blob"] = existing["blob"]["sha256"]
    return result


def build(recipe: Recipe, store_url: str | Store, root: Path, workdir: Path, *, allow_partial: bool = False,
          sign_key: str | None = None) -> dict:
    root = restore.check_root(root)
    store = open_store(store_url) if isinstance(store_url, str) else store_url
    if root.exists() and any(root.iterdir()):
        raise BuildError(f"root {root} is not empty: a build warms from cold, so give it an empty or "
                         "new directory (the same path the nodes will serve from)")
    fp = fingerprint.probe(root=root, model=recipe.model)
    if compat.problems(fp):
        raise BuildError(f"this node cannot build an artifact: {'; '.join(compat.problems(fp))}")
    key = compat.key(fp, recipe.identity())
    warnings = compat.volatile_warnings(recipe.env) + recipe.warnings()
    if store.get_index(recipe.name, key) is not None:
        return {"status": "already-published", "recipe": recipe.name, "key": key, "store": store.url,
                "warnings": warnings}

    cold = warmup.run_engine(recipe, root, workdir, "cold")
    build_timings = warmup.timings(cold)
    out = workdir / f"{recipe.name}-{key[:16]}.tar.zst"
    doc = pack_root(root, recipe, out, fp=fp, timings={"build": build_timings})

    # Verify exactly as a node would: restore the packed artifact over the warm root, start again.
    restored = restore.restore_file(out, root)
    report = verify.verify(recipe, root, workdir, cold=build_timings)
    doc["timings"]["verify"] = {**report["restored"], "verdict": report["verdict"],
                                "recompiled_files": report["files"]["recompiled_files"],
                                "restore_s": restored["seconds"]}
    archive.replace_manifest(out, artifact.dumps(doc))
    result = {"recipe": recipe.name, "key": key, "artifact": str(out), "cold": build_timings,
              "verify": report, "restore": restored,
              "components": doc["components"], "files": len(doc["files"]),
              "bytes": artifact.total_bytes(doc), "archive_bytes": out.stat().st_size, "warnings": warnings}
    if report["verdict"] != "hit" and not allow_partial:
        raise BuildError(f"verify found {report['files']['recompiled_files']} recompiled file(s) and log "
                         f"events {report['log_recompiles']}: not publishing an artifact that does not "
                         f"hit (see {report['log']}); --allow-partial publishes it anyway", result)
    result["publish"] = publish(store, out, sign_key)
    result["status"] = result["publish"]["status"]
    return result
