"""The node journey: fingerprint → key → one index lookup → download, check, restore → env.

A miss is a slow start, never a failed pod: fetch still prepares the root and the env so that
vLLM writes its caches there, and says why it missed. That holds for anything that goes wrong
past the operator's own input (an unreachable, slow or silent store, a hostile or newer entry, a
corrupt blob, a full disk, a bug): the result is a miss with the reason, within the deadline, and
--require turns it into a failure. The operator's own input (the store URL, a key file, the
recipe) is a UsageError, raised before anything is read: a typo must not be a cold start forever.

The journey is three stages, each a value the next takes: choose (what the store offers this
node: no root needed), activate (restore it into the root, or ready the root for a cold start;
the rollback check runs under the lock, from one read of the marker) and the outlook (will vLLM
hit there, and why not: warmer.outlook, the same answer serve and doctor give). The result is
built once, from the three.

The env describes what is active and usable: after a refused or failed restore it names no
artifact (no cubin directory, no download ban), and a root the serving user cannot write is
never handed to vLLM (it writes lock files there even on a full hit).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from warmer import compat, components, explain, fingerprint, restore, serving, signing
from warmer.artifact import Artifact, Layer
from warmer.compat import Decision
from warmer.deadline import Deadline, DeadlineExceeded
from warmer.entry import EntrySchemaError, IndexEntry
from warmer.envfile import EnvFile
from warmer.errors import StoreError, Terminated, UntrustedInput, UsageError
from warmer.fingerprint import Fingerprint, Gpus
from warmer.outlook import Outlook, outlook
from warmer.recipe import Recipe
from warmer.store import BlobStream, Store, open_store
from warmer.vllmkey import FactorDifference

HIT_STATUSES = restore.ACTIVE
COLD = "vLLM will compile from cold"
# Every status a fetch ends with (metrics name each one): the hits, a partial hit (the components
# of an artifact that fit this node), then why not.
STATUSES = (*HIT_STATUSES, restore.PARTIAL, "miss", "misfit", "untrusted", "rollback", "unwritable", "error")


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
    components: tuple[str, ...] = ()  # the artifact's components active in root (all of them on a hit)
    layers: tuple[explain.LayerFit, ...] = ()  # on a partial hit: each component's fit, and why

    @property
    def hit(self) -> bool:
        return self.status in HIT_STATUSES

    def holds(self, required: tuple[str, ...]) -> bool:
        """--require: a hit, or (given component names) at least those components active."""
        return (
            self.hit
            if not required
            else self.status in (*HIT_STATUSES, restore.PARTIAL) and all(c in self.components for c in required)
        )

    def to_json(self) -> dict:
        doc: dict[str, Any] = {
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
        doc["components"] = list(self.components)
        if self.layers:
            doc["layers"] = [layer.to_json() for layer in self.layers]
        for name in ("build_timings", "flashinfer", "signed_by", "for_gpus"):
            if getattr(self, name) is not None:
                doc[name] = getattr(self, name)
        doc["vllm_key"] = {
            "differences": [d.to_json() for d in self.vllm_differences],
            "predicted_recompile": any(d.recompiles for d in self.vllm_differences),
        }
        return doc


@dataclass(frozen=True)
class Choice:
    """What the store offers this node for a recipe. entry is set when its artifact may be
    activated here; otherwise status says why not (miss, misfit, untrusted, error). components:
    a partial hit, the components of entry's artifact that fit this node (None: all of it)."""

    key: str
    status: str | None = None
    entry: IndexEntry | None = None
    decisions: tuple[Decision, ...] = ()
    nearest: explain.Nearest | None = None
    warnings: tuple[str, ...] = ()
    components: tuple[str, ...] | None = None
    layers: tuple[explain.LayerFit, ...] = ()

    def partial_line(self) -> str | None:
        """On a partial hit, what it restores and why the rest compiles from cold (from layers)."""
        if self.components is None or self.entry is None:
            return None
        left = "; ".join(layer.line() for layer in self.layers if not layer.fits)
        return (
            f"partial hit from the artifact built on {self.entry.artifact.fingerprint.describe()} "
            f"(key {self.entry.key[:16]}): {', '.join(self.components)} fit this node; {left}: those compile from cold"
        )


def choose(
    store: Store,
    recipe: Recipe,
    node: Fingerprint,
    *,
    trusted_keys: tuple = (),
    deadline: Deadline,
    root: str | None = None,
) -> Choice:
    """One index lookup under this node's key, the entry's checks (its signature first), and the
    fit of its artifact to this node. A store that fails or is slow is a miss, said in one line.
    root: where a partial hit would be restored: only its layers that fit there are offered
    (_at_root), and a candidate of which none does is passed over."""
    key = compat.key(node, recipe.identity())
    unfit = compat.unfit_reasons(node)
    if unfit:  # no artifact fits this node: do not even look
        return Choice(key, "miss", warnings=tuple(unfit))
    try:
        raw = deadline.call(
            lambda: store.get_index(recipe.name, key),
            f"reading the index entry {recipe.name}/{key[:16]} from {store.url}",
        )
    except (StoreError, UntrustedInput) as e:  # an unreachable store is a slow start too, not a failed pod
        return Choice(key, "miss", warnings=(f"{e}; {COLD}",))
    if raw is None:
        # a root holding this key whole is kept (_own_kept): no other entry is worth reading
        if root is not None and _whole_own(Path(root), key, trusted_keys, node):
            return Choice(
                key, "miss", warnings=(f"no artifact for recipe {recipe.name} and this node (key {key[:16]}): {COLD}",)
            )
        return _nothing_for(store, recipe, node, key, deadline, trusted_keys, root)
    try:
        entry = IndexEntry.read(raw, recipe.name, key, trusted_keys)  # the signature first, then the rest
        del raw  # artifact.json's bytes again (8 MiB at 45,000 files): not held through the download
    except EntrySchemaError as e:
        if root is not None and _whole_own(Path(root), key, trusted_keys, node):  # as with no entry: kept
            return Choice(key, "miss", warnings=(f"{e}; {COLD}",))
        return Choice(key, "error", warnings=(f"not activated: {e}",))
    except UntrustedInput as e:  # a bad signature, a malformed entry, or one copied from another slot
        return Choice(key, "untrusted", warnings=(f"not activated: {e}",))
    decided = tuple(compat.decisions(entry.artifact.fingerprint, node, recipe.identity()))
    if not compat.fits(list(decided)):
        misfit = tuple(d.line() for d in decided if not d.ok)
        if any(not d.ok and d.field in ("gpu.driver", "gpu.cuda_driver") for d in decided):
            misfit += (  # the drivers are ranged, not keyed: this node's own build of the key would stop
                f"this key's artifact was built on a newer driver than this node's, and a key holds one: "
                f"`warmer rm {store.url}/index/{recipe.name}/{key} --yes` and build again on the fleet's "
                "oldest driver",
            )
        part = _part_of(entry, recipe, node, key, decided, misfit)
        if part is not None and root is not None:
            part = _at_root(part, root)
        if part is None:  # nothing of it fits: another build's layers may (one bad build must not hide them)
            other = _nothing_for(store, recipe, node, key, deadline, trusted_keys, root)
            if other.status is None:
                return replace(other, warnings=(*misfit, *other.warnings))
        return part or Choice(key, "misfit", entry, decided, warnings=misfit)
    if entry.layered and any(x.component not in components.BY_NAME for x in entry.artifact.layers):
        # a layer of a cache a newer warmer packs: the rest is restored, that one compiles from cold
        part = _part_of(entry, recipe, node, key, decided)
        return (_at_root(part, root) if part and root is not None else part) or Choice(key, "misfit", entry, decided)
    return Choice(key, None, entry, decided)


def _part_of(
    entry: IndexEntry,
    recipe: Recipe,
    node: Fingerprint,
    key: str,
    decided: tuple[Decision, ...] = (),
    said: tuple[str, ...] = (),
    nearest: explain.Nearest | None = None,
) -> Choice | None:
    """A partial hit on entry: the components whose own rules (compat.LAYER_RULES) this node
    passes, when some do; None when none does."""
    layers = explain.layer_fits(entry.artifact, recipe.identity(), node)
    fitting = tuple(layer.component for layer in layers if layer.fits)
    if not fitting:
        return None
    whole = len(fitting) == len(layers)  # all of it fits: published under another key (an older warmer's rules)
    return Choice(key, None, entry, decided, nearest, said, None if whole else fitting, layers)


def _at_root(choice: Choice, root: str) -> Choice:
    """A partial hit at this root: a layer whose files hold absolute paths (compat.ROOT's rules)
    fits only at the root it was built at, elsewhere it would be rebuilt, so it is left out, said
    by the field. A whole artifact is as before: restored, and the outlook says what rebuilds."""
    if choice.components is None or choice.entry is None:
        return choice
    built = choice.entry.artifact.path_contract.root
    if built == root:
        return choice
    moved = Decision(
        compat.ROOT, compat.HARD, built, root, False, f"built at {built}, this root is {root}", compat.AT_ROOT
    )
    layers = tuple(
        replace(layer, fits=False, failed=(*layer.failed, moved))
        if layer.fits and compat.ROOT in compat.layer_rule(layer.component).hard
        else layer
        for layer in choice.layers
    )
    kept = tuple(layer.component for layer in layers if layer.fits)
    if kept:
        return replace(choice, components=kept, layers=layers)
    lines = "; ".join(layer.line() for layer in layers if layer.component in choice.components)
    why = f"no layer of {choice.entry.key[:16]} fits at this root: {lines}; {COLD}"
    return Choice(choice.key, "miss", nearest=choice.nearest, warnings=(*choice.warnings, why))


def _nothing_for(
    store: Store, recipe: Recipe, node: Fingerprint, key: str, deadline: Deadline, trusted_keys: tuple, root: str | None
) -> Choice:
    """The store has no entry under this key: a partial hit from the artifact of this recipe whose
    fitting components weigh the most, or a miss that names the nearest artifact and why it missed."""
    warnings: list[str] = []
    nearest: explain.Nearest | None = None
    found: tuple[explain.Candidate, ...] = ()
    try:
        seen = deadline.call(
            lambda: explain.explain(store, recipe, node, limit=explain.NEAREST_LIMIT),
            f"looking for the nearest artifact in {store.url}",
        )
        found = seen.candidates
        if seen.unread:
            warnings.append(
                f"the store holds {seen.unread} entries of recipe {recipe.name} past the {explain.NEAREST_LIMIT} "
                "a miss reads (in key order) for the nearest artifact and a partial hit: those were not looked "
                "at; `warmer gc --keep N` trims old builds"
            )
    except (StoreError, UntrustedInput) as e:  # e.g. nodes may read entries but not list them
        warnings.append(f"no nearest artifact to show: {e}")
    if found:
        nearest = explain.Nearest(found[0].key, found[0].accepted, tuple(found[0].differences()))
    # Best first; one that fails its trust (an unsigned entry beside signed ones) leaves the next.
    for best in sorted(found, key=lambda c: (c.fitting_bytes, c.published_at), reverse=True):
        if not best.fitting_bytes:
            break
        try:  # read again, now with the trusted keys: its signature first
            raw = deadline.call(partial(store.get_index, recipe.name, best.key), f"reading {best.key[:16]}")
            entry = IndexEntry.read(raw or b"", recipe.name, best.key, trusted_keys)
        except DeadlineExceeded as e:
            warnings.append(f"no partial hit from {best.key[:16]}: {e}")
            break
        except (StoreError, UntrustedInput) as e:
            warnings.append(f"no partial hit from {best.key[:16]}: {e}")
            continue
        part = _part_of(entry, recipe, node, key, said=tuple(warnings), nearest=nearest)
        if part is not None and root is not None:
            part = _at_root(part, root)
            if part.status is not None:  # built at another root: nothing of it fits here
                warnings.append(part.warnings[-1])
                continue
        if part is not None:
            return part
    warnings.append(f"no artifact for recipe {recipe.name} and this node (key {key[:16]}): {COLD}")
    return Choice(key, "miss", nearest=nearest, warnings=tuple(warnings))


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
    check = _RecipeCheck(recipe)
    node: Fingerprint | None = None  # unknown when the probe failed: nothing is judged against it
    try:
        # within the deadline too: NVML on a wedged driver answers never, and nvidia-smi, nvcc and
        # ninja 30 s each; the probe left behind ends with the process
        node = check.around(
            lambda: deadline.call(partial(_node, recipe, gpus), "probing this node's GPUs and libraries")
        )
        choice = choose(store, recipe, node, trusted_keys=tuple(trusted_keys), deadline=deadline, root=str(root))
    except (KeyboardInterrupt, SystemExit, Terminated, UsageError):
        raise
    except DeadlineExceeded as e:
        choice = Choice("", "miss", warnings=(f"{e}; {COLD}",))
    except Exception as e:  # a bug or an unforeseen store answer: still a slow start, said
        check()  # but an unchecked recipe may be what failed: then its RecipeError
        why = f"no artifact chosen: unexpected {type(e).__name__}: {e}; {COLD}"
        choice = Choice("", "error", warnings=(why,))
    own = _own_kept(choice, root, tuple(trusted_keys), node)
    if own is not None:  # the root holds this key's whole artifact, kept: said why
        choice = Choice(choice.key, None, nearest=choice.nearest, warnings=own[1])
    entry = choice.entry if choice.status is None else None
    art = own[0] if own else (entry.artifact if entry else None)

    blob = entry.blob if entry else None

    def open_blob() -> BlobStream:
        assert blob is not None  # activate opens only what it was offered
        return check.during(store.stream_blob(blob.sha256, blob.size))

    def open_layer(layer: Layer) -> BlobStream:
        return check.during(store.stream_blob(layer.sha256, layer.size))

    activation = restore.activate(
        root,
        art,
        open_blob,
        recipe=recipe.name,
        owner=owner,
        ready=check,
        node=node,
        archive_sha256=blob.sha256 if blob else None,
        max_bytes=max_bytes,
        trusted_keys=tuple(trusted_keys),
        signature=entry.signature if entry else None,
        lock_timeout=lock_timeout,
        progress=bool((store_options or {}).get("progress")),
        deadline=deadline,
        refuse_rollback=bool(trusted_keys),  # only signed artifacts can be rolled back
        components=choice.components,
        open_layer=open_layer if entry and entry.layered else None,
    )
    part_line = choice.partial_line() if choice.status is None else None
    warnings = [*check.notes, *choice.warnings, *([part_line] if part_line else []), *activation.warnings]
    if not activation.active:
        art = None  # the env describes no artifact: nothing of a refused one (its cubins, no downloads)
        if offline or recipe.offline:
            warnings.append(
                "FLASHINFER_NO_DOWNLOAD (--offline, or the recipe's offline) is not set: no "
                "artifact is active, so FlashInfer must be free to fetch what vLLM needs"
            )
    held = (choice.components or tuple(art.components)) if art else ()
    env = serving.vllm_env(
        recipe,
        activation.vllm_root,
        files=art.files if art else None,
        offline=offline,
        added=art.serve_env if art else None,  # on a partial hit too: serving.artifact_env says why
        components=choice.components,
    )
    served = {**(os.environ if serving_env is None else serving_env), **env.vars}
    look = outlook(recipe, root, art, served, components=choice.components) if art else Outlook()
    return FetchResult(
        recipe=recipe.name,
        key=choice.key,
        store=store.url,
        root=str(root),
        status=activation.status or choice.status or "error",
        env=env,
        warnings=(*warnings, *look.warnings),
        decisions=choice.decisions,
        nearest=choice.nearest,
        restore=activation.restored,
        build_timings=entry.artifact.timings if entry and activation.restored else None,
        flashinfer=look.details.get("flashinfer") if activation.restored else None,
        signed_by=entry.signed_by if entry else None,
        for_gpus=f"{gpus.describe()}, driver {gpus.driver}, from a saved fingerprint" if gpus else None,
        vllm_differences=look.differences,
        components=held,
        layers=choice.layers,
    )


def _own_kept(
    choice: Choice, root: Path, trusted_keys: tuple, node: Fingerprint | None
) -> tuple[Artifact, tuple[str, ...]] | None:
    """The whole artifact of this node's own key, active and intact in root, and the lines that say
    why it is kept, where the store offers less: nothing (a miss: the entry of this key is gone from
    the store, `warmer gc --keep`, `warmer rm`, which choose saw without reading other entries, or
    the store did not answer). Or the part of this same build that fits a fetch seeing fewer GPUs
    than the recipe needs: a fetch counts the GPUs of its own container (an init container given
    fewer than vLLM's), and that part would make every start cold."""
    miss = choice.status == "miss" and choice.entry is None
    offer = choice.entry if choice.status is None else None
    fewer_gpus = (
        offer is not None
        and offer.key == choice.key
        and choice.components is not None
        and all(d.field == "gpu.count" for d in choice.decisions if not d.ok)
    )
    if not choice.key or not (miss or fewer_gpus):
        return None
    marker = _whole_own(root, choice.key, trusted_keys, node)
    if marker is None:
        return None
    if fewer_gpus and offer is not None and offer.artifact.id != marker.artifact.id:
        return None  # another build of the key (a rebuild after `warmer rm`): its part is taken, as before
    held = f"the whole artifact of this key active in {root}"
    if offer is None:  # a miss: the root is warm all the same
        said = tuple(w.removesuffix(f": {COLD}").removesuffix(f"; {COLD}") for w in choice.warnings)
        return marker.artifact, (*said, f"{held}, intact, is kept: vLLM starts warm")
    return marker.artifact, (
        f"{held}, intact, is kept, not replaced by the {', '.join(choice.components or ())} layers that fit "
        f"the GPUs this fetch sees ({'; '.join(choice.warnings)}): give the fetch the GPUs vLLM gets",
    )


def _whole_own(root: Path, key: str, trusted_keys: tuple, node: Fingerprint | None) -> restore.Marker | None:
    """root's marker when it holds the whole artifact of key, intact (and trusted, with keys), and
    it fits node: a key does not hold the ranged fields (a driver rolled back below the build's)."""
    marker = restore.active(root)
    if marker is None or marker.artifact.key != key or marker.components is not None:
        return None
    if node is None or restore.unfit(marker, node):
        return None
    return marker if restore.still_intact(marker, root, trusted_keys) is None else None


def _node(recipe: Recipe, gpus: Gpus | None) -> Fingerprint:
    """This node as choose sees it: the root is no part of what fits a whole artifact (the path
    contract is the outlook's; a partial hit's is _at_root's); a saved fingerprint's GPUs stand in
    for this machine's."""
    node = fingerprint.probe(model=recipe.model)
    return node.with_gpus(gpus) if gpus is not None else node


class _RecipeCheck:
    """recipe.checked(), once: at the first moment that costs nothing (the first ranges of a
    download on their way), and at the latest before anything is written. A recipe loaded with
    schema_later that fails raises its RecipeError, the caller's usage error, whatever the store
    said."""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe
        self.notes: tuple[str, ...] = ()
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self.notes = tuple(self.recipe.checked().notes)
            self.done = True

    def around(self, step: Callable[[], Fingerprint]) -> Fingerprint:
        """step, and if it fails, the recipe's check first: an unchecked recipe may be what failed."""
        try:
            return step()
        except Exception:
            self()
            raise

    def during(self, stream: BlobStream) -> BlobStream:
        """The recipe checked while stream's first ranges are on their way."""
        try:
            self()
        except BaseException:
            stream.close()
            raise
        return stream


def _open(store_url: str | Store, deadline: Deadline, options: dict) -> Store:
    if isinstance(store_url, Store):
        store_url.deadline = deadline
        return store_url
    return open_store(store_url, deadline=deadline, **options)
