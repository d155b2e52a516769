"""Why each published artifact of a recipe fits this node or not, field by field, ranked.

Like HF kernels' variant decision trace and NIM's compatible / incompatible profile lists:
every artifact of the recipe in the store is listed, accepted ones first, then the rejected
ones nearest first (fewest failed hard fields, then fewest failed ranged fields, then fewest
advisory differences, then the newest), each with the rules it fails and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from warmer import compat, components
from warmer.artifact import Artifact, Layer
from warmer.compat import Decision
from warmer.deadline import map_on_daemon_threads
from warmer.entry import BlobRef, IndexEntry
from warmer.errors import UntrustedInput
from warmer.fingerprint import Fingerprint
from warmer.recipe import Recipe
from warmer.store import Store

# How many index entries a miss reads to name the nearest artifact (and offer a partial hit), 8
# at a time: the listing is in key order, which says nothing of fit, so a recipe's whole history
# (its SKUs times gc's --keep) is read where it can be.
NEAREST_LIMIT = 400


@dataclass(frozen=True)
class LayerFit:
    """One cache component of an artifact judged on its own rule (compat.LAYER_RULES) against a node."""

    component: str
    fits: bool
    bytes: int
    decided_by: tuple[str, ...]  # the hard and ranged fields of its rule ("recipe" when it enters)
    failed: tuple[Decision, ...]  # the decisions that fail
    unknown: bool = False  # a component this warmer does not know (a newer warmer's): it never fits

    def line(self) -> str:
        """'inductor: NO, gpu.name: built with ..., this node has ...' or 'triton: fits (decided by ...)'."""
        if self.unknown:
            return f"{self.component}: NO, a cache this warmer does not know (packed by a newer one: upgrade warmer)"
        if self.fits and compat.layer_rule(self.component).fields == ("*",):
            return f"{self.component}: fits (decided by every field, as for the whole artifact, and the recipe)"
        if self.fits:
            return f"{self.component}: fits (decided by {', '.join(self.decided_by) or 'nothing'})"
        return f"{self.component}: NO, {'; '.join(d.line() for d in self.failed)}"

    def to_json(self) -> dict:
        return {
            "component": self.component,
            "fits": self.fits,
            "bytes": self.bytes,
            "decided_by": list(self.decided_by),
            "failed": [d.to_json() for d in self.failed],
            **({"unknown": True} if self.unknown else {}),
        }


def layer_fits(artifact: Artifact, recipe_identity: Mapping[str, Any], node: Fingerprint) -> tuple[LayerFit, ...]:
    """Each component the artifact holds files of, fitted to node on its own rule."""
    out = []
    for name, summary in artifact.components.items():
        if not summary.files:
            continue
        if name not in components.BY_NAME:  # its files, its env: neither is this warmer's to restore or set
            out.append(LayerFit(name, False, summary.bytes, (), (), unknown=True))
            continue
        rule = compat.layer_rule(name)
        decided = compat.layer_decisions(name, artifact.fingerprint, node, artifact.recipe.identity, recipe_identity)
        decided_by = tuple(d.field for d in decided if d.kind != compat.ADVISORY and not d.field.startswith("recipe."))
        failed = tuple(d for d in decided if not d.ok)
        out.append(
            LayerFit(
                component=name,
                fits=not failed,
                bytes=summary.bytes,
                decided_by=decided_by + (("recipe",) if rule.recipe else ()),
                failed=failed,
            )
        )
    return tuple(out)


@dataclass(frozen=True)
class Candidate:
    """One artifact judged against this node and this recipe."""

    key: str
    exact: bool
    accepted: bool
    failed_hard: tuple[str, ...]
    failed_ranged: tuple[str, ...]
    advisory_differences: tuple[str, ...]
    published_at: datetime
    blob: BlobRef | None  # None: a layered entry, whose blobs are stored_layers
    built_on: str
    decisions: tuple[Decision, ...]
    layers: tuple[LayerFit, ...] = ()  # one per component the artifact holds files of
    stored_layers: tuple[Layer, ...] = ()  # a layered entry's blobs, one per component

    @property
    def blobs(self) -> tuple[BlobRef, ...]:
        """Every blob the entry names: its one blob, or its layers."""
        if self.blob is not None:
            return (self.blob,)
        return tuple(BlobRef(x.sha256, x.size) for x in self.stored_layers)

    @property
    def partial(self) -> tuple[str, ...]:
        """The components that fit this node on their own rules, when the whole artifact does not."""
        return () if self.accepted else tuple(layer.component for layer in self.layers if layer.fits)

    @property
    def fitting_bytes(self) -> int:
        """The bytes of the components that fit this node on their own rules."""
        return sum(layer.bytes for layer in self.layers if layer.fits)

    def differences(self) -> list[str]:
        """The failed rules, one line each: 'field: reason'."""
        return [d.line() for d in self.decisions if not d.ok]

    def to_json(self) -> dict:
        doc = {
            "key": self.key,
            "exact": self.exact,
            "accepted": self.accepted,
            "failed": {"hard": list(self.failed_hard), "ranged": list(self.failed_ranged)},
            "advisory_differences": list(self.advisory_differences),
            "published_at": self.published_at.isoformat(),
            "blob": vars(self.blob).copy() if self.blob is not None else None,  # None: layered, see stored_layers
            "built_on": self.built_on,
            "decisions": [d.to_json() for d in self.decisions],
            "layers": [layer.to_json() for layer in self.layers],
            "partial": list(self.partial),
        }
        if self.blob is None:
            doc["stored_layers"] = [
                {"component": x.component, "sha256": x.sha256, "size": x.size} for x in self.stored_layers
            ]
        return doc


@dataclass(frozen=True)
class Nearest:
    """On a miss: the published artifact of this recipe that fails the fewest rules on this node."""

    key: str
    accepted: bool
    differences: tuple[str, ...]

    def to_json(self) -> dict:
        return {"key": self.key, "accepted": self.accepted, "differences": list(self.differences)}


@dataclass(frozen=True)
class Explanation:
    recipe: str
    store: str
    node_key: str
    node: str
    unfit: tuple[str, ...]
    volatile_env: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    unreadable: tuple[tuple[str, str], ...]  # (key, why)
    unread: int = 0  # entries past the limit asked for, not judged

    @property
    def accepted(self) -> int:
        return sum(c.accepted for c in self.candidates)

    @property
    def rejected(self) -> int:
        return sum(not c.accepted for c in self.candidates)

    def to_json(self) -> dict:
        return {
            "recipe": self.recipe,
            "store": self.store,
            "node_key": self.node_key,
            "node": self.node,
            "problems": list(self.unfit),
            "volatile_env": list(self.volatile_env),
            "accepted": self.accepted,
            "rejected": self.rejected,
            "candidates": [c.to_json() for c in self.candidates],
            "unreadable": [{"key": k, "error": e} for k, e in self.unreadable],
            "unread": self.unread,
        }


def candidate(entry: IndexEntry, recipe: Recipe, node: Fingerprint, node_key: str) -> Candidate:
    art = entry.artifact
    decided = compat.recipe_decisions(art.recipe.identity, recipe.identity())
    decided += compat.decisions(art.fingerprint, node, recipe.identity())
    failed = [d for d in decided if not d.ok]
    layers = layer_fits(art, recipe.identity(), node)
    # a layer of a cache only a newer warmer packs: fetch restores the others (a partial hit)
    unknown = entry.layered and any(layer.unknown for layer in layers)
    return Candidate(
        key=entry.key,
        exact=entry.key == node_key,
        accepted=not failed and not unknown and not compat.unfit_reasons(node),
        failed_hard=tuple(d.field for d in failed if d.kind == compat.HARD),
        failed_ranged=tuple(d.field for d in failed if d.kind == compat.RANGED),
        advisory_differences=tuple(d.field for d in decided if d.kind == compat.ADVISORY and d.built != d.node),
        published_at=entry.published_at,
        blob=entry.blob,
        built_on=art.fingerprint.describe(),
        decisions=tuple(decided),
        layers=layers,
        stored_layers=art.layers if entry.layered else (),
    )


def _rank(c: Candidate) -> tuple:
    return (
        not c.accepted,
        not c.exact,
        len(c.failed_hard),
        len(c.failed_ranged),
        len(c.advisory_differences),
        -c.published_at.timestamp(),
        c.key,
    )


def explain(store: Store, recipe: Recipe, node: Fingerprint, *, limit: int | None = None) -> Explanation:
    """Every artifact of recipe in store (the first `limit` index entries when given), ranked."""
    node_key = compat.key(node, recipe.identity())

    def judged(rk: tuple[str, str]) -> Candidate | tuple[str, str] | None:
        name, key = rk
        try:
            raw = store.get_index(name, key)
            if raw is None:
                return None  # removed since the listing (gc)
            return candidate(IndexEntry.read(raw, name, key), recipe, node, node_key)
        except UntrustedInput as e:
            return key, f"index entry unreadable: {e}"

    # daemon threads: a fetch's deadline abandons a stalled read (deadline.call)
    listed = store.list_index(recipe.name)
    found = map_on_daemon_threads(judged, listed[:limit], 8, store.deadline, "judging entries")
    candidates = sorted((c for c in found if isinstance(c, Candidate)), key=_rank)
    unreadable = [u for u in found if isinstance(u, tuple)]
    return Explanation(
        recipe.name,
        store.url,
        node_key,
        node.describe(),
        tuple(compat.unfit_reasons(node)),
        tuple(compat.volatile_warnings(recipe.env)),
        tuple(candidates),
        tuple(unreadable),
        len(listed[limit:]) if limit is not None else 0,
    )


def nearest(store: Store, recipe: Recipe, node: Fingerprint, *, limit: int = NEAREST_LIMIT) -> Nearest | None:
    found = explain(store, recipe, node, limit=limit).candidates
    if not found:
        return None
    return Nearest(found[0].key, found[0].accepted, tuple(found[0].differences()))
