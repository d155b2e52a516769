"""The node journey: fingerprint → key → one index lookup → download, check, restore → env.

A miss is a slow start, never a failed pod: fetch still prepares the root and the env so that
vLLM writes its caches there, and says why it missed. That holds for anything that goes wrong
past the operator's own input (an unreachable, slow or silent store, a hostile or newer entry, a
corrupt blob, a full disk, a bug): the result is a miss with the reason, within the deadline, and
--require turns it into a failure. The operator's own input (the store URL, a key file, the
recipe) is a UsageError, raised before anything is read: a typo must not be a cold start forever.

The env describes what is active and usable: after a refused or failed restore it names no
artifact (no cubin directory, no download ban), and a root the serving user cannot write is
never handed to vLLM (it writes lock files there even on a full hit).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from warmer import compat, explain, fingerprint, flashinfer_jit, restore, serving, signing
from warmer.compat import Decision
from warmer.deadline import Deadline, DeadlineExceeded
from warmer.entry import EntrySchemaError, IndexEntry
from warmer.envfile import EnvFile
from warmer.errors import StoreError, Terminated, UntrustedInput, UsageError, WarmerError
from warmer.fingerprint import Gpus
from warmer.recipe import Recipe
from warmer.store import Store, open_store
from warmer.vllmkey import FactorDifference

HIT_STATUSES = ("hit", "already-active")
# Every status a fetch ends with (metrics name each one): the hits, then why not.
STATUSES = (*HIT_STATUSES, "miss", "misfit", "untrusted", "rollback", "unwritable", "error")


@dataclass(frozen=True)
class FetchResult:
    recipe: str
    key: str
    store: str
    root: str
    status: str  # one of STATUSES
    env: EnvFile
    warnings: tuple[str, ...] = ()
    decisions: tuple[Decision, ...] = ()
    nearest: explain.Nearest | None = None
    restore: restore.RestoreResult | None = None
    build_timings: dict | None = field(default=None, hash=False)
    flashinfer: dict | None = field(default=None, hash=False)
    signed_by: str | None = None
    for_gpus: str | None = None
    vllm_differences: tuple[FactorDifference, ...] = ()

    @property
    def hit(self) -> bool:
        return self.status in HIT_STATUSES

    def to_json(self) -> dict:
        doc = {
            "recipe": self.recipe,
            "key": self.key,
            "store": self.store,
            "root": self.root,
            "status": self.status,
            "env": dict(self.env.vars),
            "warnings": list(self.warnings),
        }
        if self.decisions:
            doc["decisions"] = [d.to_json() for d in self.decisions]
        if self.nearest:
            doc["nearest"] = self.nearest.to_json()
        if self.restore:
            doc["restore"] = self.restore.to_json()
        for name in ("build_timings", "flashinfer", "signed_by", "for_gpus"):
            if getattr(self, name) is not None:
                doc[name] = getattr(self, name)
        doc["vllm_key"] = {
            "differences": [d.to_json() for d in self.vllm_differences],
            "predicted_recompile": any(d.recompiles for d in self.vllm_differences),
        }
        return doc


def fetch(
    recipe: Recipe,
    store_url: str | Store,
    root: Path,
    *,
    max_bytes: int = restore.DEFAULT_MAX_BYTES,
    trusted_keys=(),
    gpus: Gpus | None = None,
    offline: bool = False,
    serving_env: Mapping[str, str] | None = None,
    lock_timeout: float = restore.DEFAULT_LOCK_TIMEOUT,
    store_options: dict | None = None,
    deadline: Deadline | None = None,
    owner: tuple[int, int] | None = None,
) -> FetchResult:
    """gpus: the GPUs of a serving node's saved fingerprint, in place of this machine's (an image
    build on a machine without the target GPU). serving_env: the environment vLLM will start
    with besides the env file (default: this process's), for the prediction of vLLM's own key.
    deadline: the whole fetch ends by it (default 120 s), a miss past it; a Store passed in
    gets it as its own. owner: (uid, gid) vLLM runs as: the root is handed to it (needs root),
    and the env points vLLM at the root only if that user can write it.
    The operator's own input (the store URL, a key file, the owner, the recipe) raises
    UsageError before anything is read; everything past it is a result. A recipe loaded with
    schema_later is checked while the first bytes download; if it fails, RecipeError, and
    nothing is activated or written."""
    deadline = deadline or Deadline()
    root = restore.check_root(root)
    restore.check_owner(owner)
    signing.check_public_keys(trusted_keys)
    store = _open(store_url, deadline, store_options or {})
    try:
        node = fingerprint.probe(root=root, model=recipe.model)
        if gpus is not None:
            node = node.with_gpus(gpus)
        key = compat.key(node, recipe.identity())
    except Exception:
        recipe.checked()  # unchecked (load's schema_later), the recipe may be what failed: name it
        raise
    out = {
        "recipe": recipe.name,
        "key": key,
        "root": str(root),
        "store": store.url,
        "warnings": [],
        "for_gpus": f"{gpus.describe()}, driver {gpus.driver}, from a saved fingerprint" if gpus else None,
    }
    checked = False

    def check_recipe() -> None:
        """recipe.checked(), once; a RecipeError is the caller's usage error, whatever the store said."""
        nonlocal checked
        if not checked:
            out["warnings"][:0] = recipe.checked().notes
            checked = True

    art = None
    try:
        art = _fetch(
            recipe,
            store,
            root,
            node,
            key,
            out,
            max_bytes=max_bytes,
            trusted_keys=tuple(trusted_keys),
            offline=offline,
            serving_env=os.environ if serving_env is None else serving_env,
            lock_timeout=lock_timeout,
            progress=bool((store_options or {}).get("progress")),
            check_recipe=check_recipe,
            deadline=deadline,
            owner=owner,
        )
    except (KeyboardInterrupt, SystemExit, Terminated, UsageError):
        raise
    except DeadlineExceeded as e:  # a slow or silent store: a slow start, said in one line
        out["status"] = "miss"
        out["warnings"].append(f"{e}: not activated, {root} is unchanged; vLLM will compile from cold")
    except Exception as e:  # the README's promise: whatever went wrong, the pod starts (slowly)
        out["status"] = "error"
        detail = str(e) if isinstance(e, WarmerError) else f"unexpected {type(e).__name__}: {e}"
        if not detail.startswith("not activated"):
            detail = f"not activated, {root} is unchanged: {detail}"
        out["warnings"].append(f"{detail}; vLLM will compile from cold")
    check_recipe()  # before anything is written: a miss or an error may not have needed it
    hit = out["status"] in HIT_STATUSES
    if not hit:
        art = None  # the env describes no artifact: nothing of a refused one (its cubins, no downloads)
        if offline or recipe.offline:
            out["warnings"].append(
                "FLASHINFER_NO_DOWNLOAD (--offline, or the recipe's offline) is not set: no "
                "artifact is active, so FlashInfer must be free to fetch what vLLM needs"
            )
    out["env"], why = _serving_env(recipe, root, art, offline=offline, owner=owner)
    if why:
        out["warnings"].append(why)
        if hit:
            out["status"] = "unwritable"
    out["warnings"] = tuple(out["warnings"])
    return FetchResult(**out)


def _open(store_url: str | Store, deadline: Deadline, options: dict) -> Store:
    if isinstance(store_url, Store):
        store_url.deadline = deadline
        return store_url
    return open_store(store_url, deadline=deadline, **options)


def _serving_env(
    recipe: Recipe, root: Path, art, *, offline: bool, owner: tuple[int, int] | None
) -> tuple[EnvFile, str | None]:
    """The env vLLM starts with, and why it does not point at root (None when it does): a root the
    serving user cannot write would crash vLLM (torch and vLLM write locks and temporary files
    into it even on a full hit), so vLLM is sent to a directory of its own instead, cold."""
    try:
        problem = restore.prepare(root, owner)
    except OSError as e:
        problem = f"cannot prepare it ({e.strerror}: {e.filename or root})"
    if problem is None:
        env = (
            serving.artifact_env(recipe, root, art, offline=offline)
            if art is not None
            else serving.vllm_env(recipe, root)
        )
        return env, None
    uid = owner[0] if owner else os.geteuid()
    cold = serving.cold_root(recipe, uid)
    return serving.vllm_env(recipe, cold), (
        f"{root} is not writable by uid {uid}, the user vLLM runs as: {problem}; vLLM would crash on its lock "
        f"files there, so the env points it at {cold} (a cold start). {restore.ownership_fix(root, uid)}"
    )


def _older(offered, active) -> bool:
    """Whether the offered artifact was created before the active one (both signed, same key)."""
    a, b = offered.created(), active.created()
    return a is not None and b is not None and a < b


def _fetch(
    recipe: Recipe,
    store: Store,
    root: Path,
    node,
    key: str,
    out: dict,
    *,
    max_bytes: int,
    trusted_keys: tuple,
    offline: bool,
    serving_env: Mapping[str, str],
    lock_timeout: float,
    progress: bool,
    check_recipe: Callable[[], None],
    deadline: Deadline,
    owner: tuple[int, int] | None,
):
    """Sets out's status (and what it found); returns the artifact when it was restored or found
    active, None otherwise."""
    warnings = out["warnings"]
    unfit = compat.unfit_reasons(node)
    if unfit:  # no artifact fits this node: do not even look
        out["status"] = "miss"
        warnings += unfit
        return None
    try:
        raw = deadline.call(
            lambda: store.get_index(recipe.name, key),
            f"reading the index entry {recipe.name}/{key[:16]} from {store.url}",
        )
    except (StoreError, UntrustedInput) as e:  # an unreachable store is a slow start too, not a failed pod
        out["status"] = "miss"
        warnings.append(f"{e}; vLLM will compile from cold")
        return None
    if raw is None:
        out["status"] = "miss"
        try:
            out["nearest"] = deadline.call(
                lambda: explain.nearest(store, recipe, node), f"looking for the nearest artifact in {store.url}"
            )
        except (StoreError, UntrustedInput) as e:  # e.g. nodes may read entries but not list them
            warnings.append(f"no nearest artifact to show: {e}")
        warnings.append(
            f"no artifact for recipe {recipe.name} and this node (key {key[:16]}): vLLM will compile from cold"
        )
        return None
    try:
        entry = IndexEntry.read(raw, recipe.name, key, trusted_keys)  # the signature first, then the rest
        del raw  # artifact.json's bytes again (8 MiB at 45,000 files): not held through the download
    except EntrySchemaError as e:
        out["status"] = "error"
        warnings.append(f"not activated: {e}")
        return None
    except UntrustedInput as e:  # a bad signature, a malformed entry, or one copied from another slot
        out["status"] = "untrusted"
        warnings.append(f"not activated: {e}")
        return None
    art = entry.artifact
    out["signed_by"] = entry.signed_by
    decided = compat.decisions(art.fingerprint, node, recipe.identity())
    out["decisions"] = tuple(decided)
    if not compat.fits(decided):
        out["status"] = "misfit"
        warnings += [d.line() for d in decided if not d.ok]
        return None
    marker = restore.active(root, expect=art) if trusted_keys else None  # only signed artifacts can be rolled back
    if (
        marker
        and marker.artifact.key == art.key
        and marker.artifact.id != art.id
        and _older(art, marker.artifact)
        and restore.still_intact(marker, root, trusted_keys) is None
    ):
        out["status"] = "rollback"
        warnings.append(
            f"not activated: the store offers an artifact created {art.created_at}, older than the "
            f"signed one active in {root} (created {marker.artifact.created_at}) for the same key: "
            "a rollback; remove the old entry from the store (`warmer rm`) if it is intended"
        )
        return None
    served = {**serving_env, **serving.artifact_env(recipe, root, art, offline=offline).vars}
    warnings += art.path_contract.warnings(
        root, recipe.model, [n for n, c in art.components.items() if not c.relocatable], served
    )

    def open_blob():
        stream = store.stream_blob(entry.blob.sha256, entry.blob.size)
        try:
            check_recipe()  # the first ranges are on their way: this fits in their wait
        except BaseException:
            stream.close()
            raise
        return stream

    result = restore.restore(
        art,
        open_blob,
        root,
        archive_sha256=entry.blob.sha256,
        max_bytes=max_bytes,
        trusted_keys=trusted_keys,
        signature=entry.signature,
        lock_timeout=lock_timeout,
        owner=owner,
        progress=progress,
        deadline=deadline,
    )
    out["status"] = "hit" if result.status == "restored" else result.status
    out["restore"] = result
    out["build_timings"] = art.timings
    # ninja's dry run of every restored JIT module, in the env vLLM will start with
    out["flashinfer"] = flashinfer_jit.dry_run(root, served)
    if out["flashinfer"]["clean"] is False:
        dirty = [m for m, r in out["flashinfer"]["modules"].items() if not r["clean"]]
        warnings.append(
            f"ninja would rebuild FlashInfer module(s) {', '.join(dirty)}: see `warmer flashinfer-check --root {root}`"
        )
    if art.vllm:
        out["vllm_differences"] = tuple(art.vllm.differences(served))
        warnings += [d.line() for d in out["vllm_differences"]]
    return art
