"""warmer's Python API: what the CLI calls, for release pipelines and tools that bake images.

Every function takes plain arguments (paths, URLs, a recipe file or a Recipe) and returns a
frozen result type with `to_json()`; every error it raises on purpose is a
`warmer.errors.WarmerError` (UsageError, StoreError, UntrustedInput, ...) whose message says
what is wrong and what to do.

    from warmer import api
    got = api.fetch("manifests/models/llama-3.1-8b-h200.toml", store="s3://bucket/warmer",
                    root="/cache/llama-3.1-8b-h200", gpus_from="fingerprints/h200.json")
    if not got.hit:
        raise SystemExit(f"no warm cache: {got.warnings}")
    api.write_env(got.env, "/etc/warmer/vllm.env", "shell")
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

# What a node's fetch does not use (build, catalog, doctor, fleet, verify) is imported by the
# function that needs it: about 20 ms of every `warmer fetch` (BENCHMARKS.md, "Against the link").
from warmer import components as _components
from warmer import explain as _explain
from warmer import fetch as _fetch
from warmer import fingerprint as _fingerprint
from warmer import matrix as _matrix
from warmer import restore as _restore
from warmer import serving, signing
from warmer.artifact import Artifact
from warmer.atomic import write_bytes
from warmer.components import flashinfer
from warmer.deadline import DEFAULT_S as DEFAULT_DEADLINE_S
from warmer.deadline import ENV as DEADLINE_ENV
from warmer.deadline import Deadline
from warmer.entry import IndexEntry
from warmer.envfile import EnvFile
from warmer.errors import UsageError, WarmerError
from warmer.recipe import Recipe, load, read_doc
from warmer.store import NAME, Store, open_store

if TYPE_CHECKING:
    from warmer import build as _build
    from warmer import catalog, fleet
    from warmer import doctor as _doctor
    from warmer import verify as _verify

PathLike = str | os.PathLike
_log = logging.getLogger("warmer")

# -- Names callers need besides the functions: defaults, constants, result types. The CLI reaches no
# module past this one (warmer.errors aside), so whatever it shows or passes on is named here.
DEFAULT_MAX_BYTES = _restore.DEFAULT_MAX_BYTES
DEFAULT_LOCK_TIMEOUT = _restore.DEFAULT_LOCK_TIMEOUT
PUBLISH_DEADLINE_S = 3600.0  # `warmer publish`'s default: an upload of many GB over a CI runner's link
DEFAULT_ROOT_BASE = _matrix.DEFAULT_ROOT_BASE
github_matrix = _matrix.github  # matrix() entries as GitHub Actions' strategy.matrix
Explanation = _explain.Explanation
FetchResult = _fetch.FetchResult
Fingerprint = _fingerprint.Fingerprint
RestoreResult = _restore.RestoreResult
ServePlan = serving.ServePlan

# Those of modules a node's fetch does not import are imported when first named (PEP 562).
_LAZY = {
    "BuildResult": ("warmer.build", "BuildResult"),
    "PublishResult": ("warmer.build", "PublishResult"),
    "Collection": ("warmer.catalog", "Collection"),
    "Listing": ("warmer.catalog", "Listing"),
    "Removal": ("warmer.catalog", "Removal"),
    "ORPHAN_GRACE": ("warmer.catalog", "ORPHAN_GRACE"),
    "Diagnosis": ("warmer.doctor", "Diagnosis"),
    "DOCTOR_ERROR": ("warmer.doctor", "ERROR"),
    "DOCTOR_WARNING": ("warmer.doctor", "WARNING"),
    "DOCTOR_INFO": ("warmer.doctor", "INFO"),
    "LocalRoot": ("warmer.fleet", "LocalRoot"),
    "Outcome": ("warmer.fleet", "Outcome"),
    "VerifyResult": ("warmer.verify", "VerifyResult"),
    "PHASE_ORDER": ("warmer.warmup", "PHASE_ORDER"),
    "PHASE_NOTES": ("warmer.warmup", "PHASE_NOTES"),
}
if TYPE_CHECKING:  # the same names, for type checkers
    from warmer.build import BuildResult, PublishResult
    from warmer.catalog import ORPHAN_GRACE, Collection, Listing, Removal
    from warmer.doctor import ERROR as DOCTOR_ERROR
    from warmer.doctor import INFO as DOCTOR_INFO
    from warmer.doctor import WARNING as DOCTOR_WARNING
    from warmer.doctor import Diagnosis
    from warmer.fleet import LocalRoot, Outcome
    from warmer.verify import VerifyResult
    from warmer.warmup import PHASE_NOTES, PHASE_ORDER


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)


def recipe(source: PathLike | Recipe) -> Recipe:
    return source if isinstance(source, Recipe) else load(source)


def store(url: str | Store, **options) -> Store:
    """options: endpoint_url, path_style, progress (s3://), insecure_registry (oci://)."""
    return url if isinstance(url, Store) else open_store(url, **{k: v for k, v in options.items() if v is not None})


def fingerprint(*, root: PathLike | None = None, recipe_file: PathLike | None = None) -> _fingerprint.Fingerprint:
    return _fingerprint.probe(
        root=os.path.abspath(root) if root else None, model=load(recipe_file).model if recipe_file else None
    )


def explain(
    recipe_file: PathLike | Recipe, store_url: str | Store, *, gpus_from: PathLike | None = None, **store_options
) -> _explain.Explanation:
    """gpus_from: judge for the GPUs of a saved fingerprint (`warmer fingerprint --json` on a node),
    as fetch --gpus-from does, not this machine's."""
    r = recipe(recipe_file)
    node = _fingerprint.probe(model=r.model)
    if gpus_from:
        node = node.with_gpus(_fingerprint.saved_gpus(gpus_from))
    return _explain.explain(store(store_url, **store_options), r, node)


def build(
    recipe_file: PathLike | Recipe,
    store_url: str | Store,
    root: PathLike,
    *,
    workdir: PathLike | None = None,
    allow_partial: bool = False,
    sign_key: PathLike | None = None,
    layers: bool = False,
    **store_options,
) -> _build.BuildResult:
    from warmer import build as _build

    work = Path(workdir).absolute() if workdir else Path(tempfile.mkdtemp(prefix="warmer-"))
    return _build.build(
        recipe(recipe_file),
        store(store_url, **store_options),
        Path(root),
        work,
        allow_partial=allow_partial,
        sign_key=str(sign_key) if sign_key else None,
        layers=layers,
    )


@dataclass(frozen=True)
class Packed:
    artifact: str
    key: str
    files: int
    bytes: int
    archive_bytes: int

    def to_json(self) -> dict:
        return vars(self).copy()


def pack(root: PathLike, recipe_file: PathLike | Recipe, output: PathLike, *, level: int = 3) -> Packed:
    from warmer import build as _build

    art = _build.pack_root(Path(root), recipe(recipe_file), Path(output), level=level)
    return Packed(str(output), art.key, len(art.files), art.total_bytes, os.path.getsize(output))


def publish(
    artifact_file: PathLike,
    store_url: str | Store,
    *,
    sign_key: PathLike | None = None,
    deadline: float | None = None,
    layers: bool = False,
    **store_options,
) -> _build.PublishResult:
    """deadline: seconds the whole publish may take (None: only per-request timeouts and retries);
    layers: one blob per cache component, each uploaded only if the store lacks it (a layered
    entry, which nodes need this warmer version to read)."""
    from warmer import build as _build

    return _build.publish(
        store(store_url, **store_options),
        Path(artifact_file),
        str(sign_key) if sign_key else None,
        deadline=Deadline(deadline, "publish"),
        layers=layers,
    )


def fetch(
    recipe_file: PathLike | Recipe,
    store_url: str | Store,
    root: PathLike,
    *,
    gpus_from: PathLike | None = None,
    trusted_keys=(),
    max_bytes: int = _restore.DEFAULT_MAX_BYTES,
    offline: bool = False,
    lock_timeout: float = _restore.DEFAULT_LOCK_TIMEOUT,
    deadline: float | None = DEFAULT_DEADLINE_S,
    owner: tuple[int, int] | None = None,
    **store_options,
) -> _fetch.FetchResult:
    """A miss, an unreachable or slow store, or a bad artifact is a result (status), not an exception;
    the operator's own input (the recipe, the store URL, a key or fingerprint file) raises UsageError.
    deadline: seconds the whole fetch may take (index, download, restore), then a miss. owner:
    (uid, gid) to hand the restored root to (needs root), the user vLLM runs as."""
    gpus = _fingerprint.saved_gpus(gpus_from) if gpus_from else None
    # The recipe's schema check runs while the first bytes download (fetch calls checked()).
    r = recipe_file if isinstance(recipe_file, Recipe) else load(recipe_file, schema_later=True)
    return _fetch.fetch(
        r,
        store_url,
        Path(root),
        max_bytes=max_bytes,
        trusted_keys=tuple(trusted_keys),
        gpus=gpus,
        offline=offline,
        lock_timeout=lock_timeout,
        deadline=Deadline(deadline),
        owner=owner,
        store_options={k: v for k, v in store_options.items() if v is not None},
    )


def fetch_all(
    manifests: PathLike,
    store_url: str,
    root_base: PathLike,
    *,
    parallel: int = 2,
    skus: PathLike | None = None,
    trusted_keys=(),
    max_bytes: int = _restore.DEFAULT_MAX_BYTES,
    offline: bool = False,
    lock_timeout: float = _restore.DEFAULT_LOCK_TIMEOUT,
    deadline: float | None = DEFAULT_DEADLINE_S,
    owner: tuple[int, int] | None = None,
    **store_options,
) -> list[fleet.Outcome]:
    """Every recipe under manifests whose targets include this node's SKU, into root_base/RECIPE.
    deadline bounds the whole run: each recipe's fetch ends by it (a miss past it)."""
    from warmer import fleet

    return fleet.fetch_all(
        Path(manifests),
        store_url,
        Path(root_base),
        parallel=parallel,
        skus=Path(skus) if skus else None,
        store_options={k: v for k, v in store_options.items() if v is not None},
        trusted_keys=tuple(trusted_keys),
        max_bytes=max_bytes,
        offline=offline,
        lock_timeout=lock_timeout,
        deadline=Deadline(deadline, "fetch --all"),
        owner=owner,
    )


def write_fetch_metrics(path: PathLike, outcomes: list[fleet.Outcome], ran: bool = True) -> None:
    """node_exporter textfile-collector metrics of fetch outcomes, replaced whole; ran=False: the run
    failed as a whole, and no recipe's outcome is known."""
    from warmer import fleet

    fleet.write_metrics(Path(path), outcomes, ran)


def local_roots(root_base: PathLike, *, deadline: float | None = DEFAULT_DEADLINE_S) -> list[fleet.LocalRoot]:
    """The roots under root_base, each judged against this node, whose probe ends by the deadline
    (a wedged driver's NVML answers never)."""
    from warmer import fleet

    return fleet.local_roots(Path(root_base), Deadline(deadline, "ls --root-base"))


def restore(
    artifact_file: PathLike,
    root: PathLike,
    *,
    recipe_file: PathLike | Recipe | None = None,
    trusted_keys=(),
    signature_file: PathLike | None = None,
    max_bytes: int = _restore.DEFAULT_MAX_BYTES,
    force: bool = False,
    lock_timeout: float = _restore.DEFAULT_LOCK_TIMEOUT,
    owner: tuple[int, int] | None = None,
    progress: bool = False,
) -> _restore.RestoreResult:
    """recipe_file: the recipe the root will be served with (its env written from it): an artifact
    built for another recipe is refused before anything is written, unless force."""
    signature = signing.read_sidecar(Path(signature_file)) if signature_file else None
    if signature_file and signature is None:
        raise UsageError(f"signature file {signature_file} does not exist")
    if recipe_file is not None:
        _same_recipe(recipe(recipe_file), _restore.read_artifact_file(Path(artifact_file)), artifact_file, force)
    return _restore.restore_file(
        Path(artifact_file),
        Path(root),
        max_bytes=max_bytes,
        trusted_keys=tuple(trusted_keys),
        signature=signature,
        force=force,
        lock_timeout=lock_timeout,
        owner=owner,
        progress=progress,
    )


def artifact_recipe(artifact_file: PathLike) -> Recipe:
    """The recipe an artifact file was built for, from the identity its artifact.json records (what
    the env is written for when no recipe file is given)."""
    return Recipe.from_artifact(_restore.read_artifact_file(Path(artifact_file)))


def _same_recipe(given: Recipe, art: Artifact, artifact_file: PathLike, force: bool) -> None:
    """Refuse an artifact built for another recipe (another name, or the same name with another model,
    engine arg, env or workload): the env written from the given recipe would not be the one its caches
    were built in, and vLLM would compile from cold on top of them."""
    built = art.recipe
    if given.name == built.name and given.digest() == built.digest:
        return
    differ = _differences(built.identity if isinstance(built.identity, dict) else {}, given.identity())
    what = (
        f"{artifact_file} was built for recipe {built.name} (digest {built.digest[:16]}), not for recipe "
        f"{given.name} of {given.source} (digest {given.digest()[:16]})"
        + (f": {'; '.join(differ[:5])}" if differ else "")
    )
    if not force:
        raise UsageError(
            f"{what}. Its caches would be served with another recipe's env and args, and vLLM would "
            f"compile from cold: give --recipe the recipe it was built with (`warmer inspect "
            f"{artifact_file}` names it), leave --recipe out to write the env from the artifact "
            "itself, or pass --force to restore it anyway"
        )
    _log.warning("restore: %s; restoring it anyway (--force)", what)


def _differences(built: dict, given: dict) -> list[str]:
    """The recipe identity fields that differ, one level into tables (engine.max_model_len: 128 at
    build, 256 here)."""
    out = []
    for k in given:
        a, b = built.get(k), given.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [
                f"{k}.{sub}: {_shown(a.get(sub))} at build, {_shown(b.get(sub))} here"
                for sub in sorted(set(a) | set(b))
                if a.get(sub) != b.get(sub)
            ]
        elif k != "name" and a != b:
            out.append(f"{k}: {_shown(a)} at build, {_shown(b)} here")
    return out


def _shown(value) -> str:
    return "unset" if value is None else json.dumps(value) if not isinstance(value, str) else value


def serving_env(recipe_file: PathLike | Recipe | None, root: PathLike, *, offline: bool = False) -> EnvFile:
    """The env vLLM must start with to use root, for the artifact active there. recipe_file None:
    the active artifact's own recipe, from the identity its artifact.json records (no recipe file
    needed, e.g. in an image build that restores an artifact file)."""
    root = Path(os.path.abspath(root))
    marker = _restore.active(root)
    if marker is None:
        if recipe_file is None:
            raise UsageError(
                f"no artifact is active in {root}, so there is no recipe to write the env for: give --recipe RECIPE"
            )
        return serving.vllm_env(recipe(recipe_file), root, offline=offline)
    r = recipe(recipe_file) if recipe_file is not None else Recipe.from_artifact(marker.artifact)
    return serving.artifact_env(r, root, marker.artifact, offline=offline, components=marker.components)


PROBE_DEADLINE_S = 30.0


def serve_plan(
    recipe_file: PathLike | Recipe,
    root: PathLike,
    extra: Sequence[str] = (),
    *,
    env_file: PathLike | None = None,
    offline: bool = False,
    trusted_keys: Sequence[str] = (),
) -> serving.ServePlan:
    """What `warmer serve` would run: the recipe's `vllm serve` command, its env, and the check of
    vLLM's own key in that env (plan.predicted_miss). trusted_keys: as fetch's, for the root's artifact."""
    loaded = None
    if env_file:
        try:
            loaded = EnvFile.parse(Path(env_file).read_text(errors="replace"), str(env_file))
        except OSError as e:
            raise UsageError(f"cannot read the env file {env_file}: {e.strerror}") from None
    r = recipe(recipe_file)
    try:  # bounded as fetch's probe is (a wedged driver answers never); unknown, the fit is not judged
        node = Deadline(PROBE_DEADLINE_S, "serve").call(lambda: _fingerprint.probe(model=r.model), "probing the node")
    except Exception:
        node = None
    return serving.plan(
        r,
        Path(os.path.abspath(root)),
        list(extra),
        env_file=loaded,
        offline=offline,
        trusted_keys=trusted_keys,
        node=node,
    )


def serve(plan: serving.ServePlan) -> None:
    """Replace this process with vLLM, as the plan says (never returns)."""
    try:
        os.execvpe(plan.command[0], list(plan.command), plan.environ)
    except FileNotFoundError:  # execvpe names only the last PATH entry it tried
        raise UsageError(
            f"{plan.command[0]} is not on PATH ({plan.environ.get('PATH', os.defpath)}): run warmer serve "
            "where vLLM is installed (its image, or the venv that has it)"
        ) from None


def write_env(env: EnvFile, path: PathLike, fmt: str = "dotenv") -> None:
    try:
        write_bytes(path, env.render(fmt).encode())
    except OSError as e:  # the path the operator gave, never the temporary file beside it
        raise WarmerError(
            f"cannot write the env file {path}: {e.strerror or e}; its directory must exist and be "
            "writable by this user (or give --env-file another path)"
        ) from None


def verify(recipe_file: PathLike | Recipe, root: PathLike, *, workdir: PathLike | None = None) -> _verify.VerifyResult:
    from warmer import verify as _verify

    root = Path(os.path.abspath(root))
    marker = _restore.active(root)
    cold = marker.artifact.timings.get("build") if marker else None
    work = Path(workdir).absolute() if workdir else Path(tempfile.mkdtemp(prefix="warmer-"))
    return _verify.verify(recipe(recipe_file), root, work, cold=cold)


@dataclass(frozen=True)
class Inspection:
    artifact: Artifact
    entry: IndexEntry | None = None
    signature: signing.Signature | None = None  # of a file: its FILE.sig, when there is one

    @property
    def signed(self) -> bool:
        return (self.entry.signature if self.entry else self.signature) is not None

    def summary(self) -> dict:
        a = self.artifact
        out: dict[str, Any] = {
            "key": a.key,
            "recipe": a.recipe.to_json(),
            "path_contract": a.path_contract.to_json(),
            "components": {n: c.to_json() for n, c in a.components.items()},
            "timings": a.timings,
            "created_at": a.created_at,
        }
        if a.vllm:
            out["vllm"] = {
                "version": a.vllm.version,
                "config_hash": a.vllm.config_hash,
                "cache_dirs": list(a.vllm.cache_dirs),
            }
        if self.entry:
            blob = self.entry.blob  # None: a layered entry, whose blobs are its layers
            out.update(blob=vars(blob).copy() if blob else None, published_at=self.entry.published_at.isoformat())
            if blob is None:
                out["layers"] = [
                    {"component": x.component, "sha256": x.sha256, "size": x.size} for x in self.artifact.layers
                ]
        out["signed"] = self.signed
        return out


def inspect(file_or_url: str, **store_options) -> Inspection:
    """artifact.json of an artifact file, or of a published artifact (STORE/index/RECIPE/KEY)."""
    from warmer import catalog

    if "://" in file_or_url:
        entry = catalog.read_entry(file_or_url, **{k: v for k, v in store_options.items() if v is not None})
        return Inspection(entry.artifact, entry)
    path = Path(file_or_url)
    return Inspection(_restore.read_artifact_file(path), signature=signing.read_sidecar(signing.sidecar(path)))


def recipe_name_of(name_or_file: PathLike) -> str:
    """A recipe's name, from its file (as RECIPE is everywhere) or given as the name itself."""
    text = str(name_or_file)
    if NAME.match(text) and not text.endswith(".toml"):
        return text
    # Its name alone, as `warmer matrix` reads it: listing a store needs no model path or ${VAR} of this machine.
    return _matrix.name_and_targets(read_doc(text)[0], Path(text))[0]


def ls(
    store_url: str | Store,
    recipe_name: PathLike | None = None,
    *,
    deadline: float | None = DEFAULT_DEADLINE_S,
    **store_options,
) -> catalog.Listing:
    """recipe_name: only this recipe's artifacts (its file, or its name)."""
    from warmer import catalog

    name = recipe_name_of(recipe_name) if recipe_name else None
    bound = Deadline(deadline, "ls")
    # the store gets the deadline too: its requests and retries end by it
    opened = store(store_url, deadline=bound, **store_options)
    return bound.call(lambda: catalog.ls(opened, name), "listing the store")


def gc(
    store_url: str | Store, keep: int, *, older_than_days: float | None = None, dry_run: bool = False, **store_options
) -> catalog.Collection:
    from warmer import catalog

    return catalog.gc(store(store_url, **store_options), keep, older_than_days=older_than_days, dry_run=dry_run)


def rm(entry_url: str, *, yes: bool = False, **store_options) -> catalog.Removal:
    from warmer import catalog

    return catalog.rm(entry_url, yes=yes, **{k: v for k, v in store_options.items() if v is not None})


def matrix(
    paths: list[PathLike],
    *,
    skus: PathLike | None = None,
    only: list[str] | None = None,
    root_base: str = _matrix.DEFAULT_ROOT_BASE,
) -> tuple[list[dict], list[str]]:
    """The recipe x GPU SKU entries for CI (one build job each), and the recipes that target no SKU."""
    files = [Path(p) for p in paths]
    catalogue = Path(skus) if skus else _matrix.find_catalogue(files)
    return _matrix.entries(files, _matrix.load_skus(catalogue), catalogue, only=only, root_base=root_base)


def doctor(
    *,
    root: PathLike | None = None,
    recipe_file: PathLike | None = None,
    env_file: PathLike | None = None,
    pid: int | None = None,
    mountinfo: PathLike | None = None,
    trusted_keys: Sequence[str] = (),
) -> _doctor.Diagnosis:
    from warmer import doctor as _doctor

    signing.check_public_keys(trusted_keys)
    return _doctor.diagnose_here(
        root=str(root) if root else None,
        recipe=load(recipe_file) if recipe_file else None,
        env_file=str(env_file) if env_file else None,
        pid=pid,
        mountinfo_file=str(mountinfo) if mountinfo else None,
        trusted_keys=trusted_keys,
    )


def flashinfer_check(
    root: PathLike, *, recipe_file: PathLike | None = None, backdate: bool = False, include_site_packages: bool = False
) -> dict:
    root = Path(os.path.abspath(root))
    env = (
        serving.environ_for_vllm(load(recipe_file), root)
        if recipe_file
        else {**os.environ, **_components.cache_env(root)}
    )
    marker = _restore.active(root)
    built = marker.artifact.path_contract.flashinfer if marker else None
    return flashinfer.report(root, env, built, backdate_inputs=backdate, include_site_packages=include_site_packages)


__all__ = [
    "DEADLINE_ENV",
    "DEFAULT_DEADLINE_S",
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_ROOT_BASE",
    "DOCTOR_ERROR",
    "DOCTOR_INFO",
    "DOCTOR_WARNING",
    "ORPHAN_GRACE",
    "PHASE_NOTES",
    "PHASE_ORDER",
    "PUBLISH_DEADLINE_S",
    "BuildResult",
    "Collection",
    "Diagnosis",
    "Explanation",
    "FetchResult",
    "Fingerprint",
    "Inspection",
    "Listing",
    "LocalRoot",
    "Outcome",
    "Packed",
    "PublishResult",
    "Removal",
    "RestoreResult",
    "ServePlan",
    "VerifyResult",
    "github_matrix",
    "build",
    "doctor",
    "explain",
    "fetch",
    "fetch_all",
    "fingerprint",
    "local_roots",
    "flashinfer_check",
    "gc",
    "inspect",
    "ls",
    "matrix",
    "pack",
    "publish",
    "recipe",
    "recipe_name_of",
    "restore",
    "rm",
    "serve",
    "serve_plan",
    "serving_env",
    "store",
    "verify",
    "write_env",
]
