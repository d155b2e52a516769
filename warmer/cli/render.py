"""Formatting several commands' reports share. Every number shown is one that was measured."""

from __future__ import annotations

from warmer import api


def seconds(value: object) -> str:
    return f"{value:.1f} s" if isinstance(value, (int, float)) else "-"


def megabytes(n: object) -> str:
    return f"{n / 1e6:.1f} MB" if isinstance(n, (int, float)) else "-"


def pairs(doc: dict) -> str:
    return "\n".join(f"{k}: {v}" for k, v in doc.items() if not isinstance(v, (dict, list)))


def shown(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def grace_hours() -> float:
    """How old a blob no index entry names must be before gc deletes it (ls and gc say it)."""
    return api.ORPHAN_GRACE.total_seconds() / 3600


def damaged(raced: tuple[tuple[str, str, str], ...], by: str) -> list[str]:
    """gc's and rm's word on an entry published while they ran that lost a blob to them."""
    return [
        f"damaged: {recipe} {key[:16]} was published while {by} ran and names blob {blob[:16]}, which {by} "
        "deleted: publish that artifact file again (it uploads what the entry lacks)"
        for recipe, key, blob in raced
    ]
