"""Why each published artifact of a recipe fits this node or not, field by field, ranked.

Like HF kernels' variant decision trace and NIM's compatible / incompatible profile lists:
every artifact of the recipe in the store is listed, accepted ones first, then the rejected
ones nearest first (fewest failed hard fields, then fewest failed ranged fields, then fewest
advisory differences, then the newest), each with the rules it fails and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from warmer import compat
from warmer.compat import Decision
from warmer.entry import BlobRef, IndexEntry
from warmer.errors import UntrustedInput
from warmer.fingerprint import Fingerprint
from warmer.recipe import Recipe
from warmer.store import Store


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
    blob: BlobRef
    built_on: str
    decisions: tuple[Decision, ...]

    def differences(self) -> list[str]:
        """The failed rules, one line each: 'field: reason'."""
        return [d.line() for d in self.decisions if not d.ok]

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "exact": self.exact,
            "accepted": self.accepted,
            "failed": {"hard": list(self.failed_hard), "ranged": list(self.failed_ranged)},
            "advisory_differences": list(self.advisory_differences),
            "published_at": self.published_at.isoformat(),
            "blob": vars(self.blob).copy(),
            "built_on": self.built_on,
            "decisions": [d.to_json() for d in self.decisions],
        }


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
        }


def candidate(entry: IndexEntry, recipe: Recipe, node: Fingerprint, node_key: str) -> Candidate:
    art = entry.artifact
    decided = compat.recipe_decisions(art.recipe.identity, recipe.identity())
    decided += compat.decisions(art.fingerprint, node, recipe.identity())
    failed = [d for d in decided if not d.ok]
    return Candidate(
        key=entry.key,
        exact=entry.key == node_key,
        accepted=not failed and not compat.unfit_reasons(node),
        failed_hard=tuple(d.field for d in failed if d.kind == compat.HARD),
        failed_ranged=tuple(d.field for d in failed if d.kind == compat.RANGED),
        advisory_differences=tuple(d.field for d in decided if d.kind == compat.ADVISORY and d.built != d.node),
        published_at=entry.published_at,
        blob=entry.blob,
        built_on=art.fingerprint.describe(),
        decisions=tuple(decided),
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
    candidates, unreadable = [], []
    for name, key in store.list_index(recipe.name)[:limit]:
        try:
            raw = store.get_index(name, key)
            if raw is None:
                continue  # removed since the listing (gc)
            candidates.append(candidate(IndexEntry.read(raw, name, key), recipe, node, node_key))
        except UntrustedInput as e:
            unreadable.append((key, f"index entry unreadable: {e}"))
    candidates.sort(key=_rank)
    return Explanation(
        recipe.name,
        store.url,
        node_key,
        node.describe(),
        tuple(compat.unfit_reasons(node)),
        tuple(compat.volatile_warnings(recipe.env)),
        tuple(candidates),
        tuple(unreadable),
    )


def nearest(store: Store, recipe: Recipe, node: Fingerprint, *, limit: int = 50) -> Nearest | None:
    found = explain(store, recipe, node, limit=limit).candidates
    if not found:
        return None
    return Nearest(found[0].key, found[0].accepted, tuple(found[0].differences()))
