"""What a store holds, and keeping it small: ls, inspect (of a published entry), gc.

gc keeps the newest N artifacts of each recipe on each kind of machine (CPU architecture and
GPU model): a recipe built for three GPU types keeps N for each, so no fleet loses its
artifact to another's newer builds. It deletes index entries first and blobs after, and never
a blob that a remaining index entry names. A blob no entry has ever named is a publish in
flight or one that lost a race; it is deleted only once it is older than ORPHAN_GRACE.
"""

from __future__ import annotations

import json
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

from warmer.store import HEX64, Store, StoreError, open_store

ORPHAN_GRACE = timedelta(hours=6)


def _published(entry: dict) -> datetime:
    when = datetime.fromisoformat(entry["published_at"])
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def machine_kind(fp: dict) -> str:
    """CPU architecture and GPU model(s): what one artifact per build round is made for."""
    names = sorted({d.get("name", "?") for d in (fp.get("gpu") or {}).get("devices") or []})
    return f"{fp.get('machine', '?')}/{'+'.join(names) or 'cpu'}"


def _read(store: Store, names: list[tuple[str, str]]) -> list[dict]:
    """The index entries named (one GET each, in parallel); ones deleted meanwhile are skipped."""
    with ThreadPoolExecutor(8) as pool:  # within boto3's connection pool
        raws = list(pool.map(lambda rk: store.get_index(*rk), names))
    out = []
    for (recipe, key), raw in zip(names, raws, strict=True):
        if raw is None:
            continue
        try:
            entry = json.loads(raw)
            _published(entry)
            if not HEX64.match(entry["blob"]["sha256"]):
                raise ValueError("its blob is not a sha256 digest")
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"index entry {recipe}/{key} in {store.url} is unreadable ({e}): remove it, "
                             "or publish again under a new key") from None
        out.append(entry)
    return out


def row(entry: dict) -> dict:
    doc = entry["artifact"]
    return {"recipe": entry["recipe"], "key": entry["key"], "machine": machine_kind(doc.get("fingerprint", {})),
            "published_at": entry["published_at"], "blob": entry["blob"]["sha256"],
            "archive_bytes": entry["blob"]["size"], "files": len(doc.get("files", [])),
            "cache_bytes": sum(f.get("size", 0) for f in doc.get("files", [])),
            "verify": (doc.get("timings", {}).get("verify") or {}).get("verdict"),
            "signed": bool(entry.get("signature")), "warmer": doc.get("warmer")}


def ls(store: Store, recipe: str | None = None) -> list[dict]:
    rows = [row(e) for e in _read(store, store.list_index(recipe))]
    rows.sort(key=lambda r: r["published_at"], reverse=True)
    rows.sort(key=lambda r: (r["recipe"], r["machine"]))
    return rows


def render_ls(store: Store, rows: list[dict]) -> str:
    if not rows:
        return f"{store.url}: no artifacts"
    lines = [f"{'RECIPE':<28} {'KEY':<16} {'MACHINE':<28} {'PUBLISHED':<25} {'SIZE':>10} {'VERIFY':<8}"]
    for r in rows:
        lines.append(f"{r['recipe']:<28} {r['key'][:16]:<16} {r['machine']:<28} {r['published_at']:<25} "
                     f"{r['archive_bytes'] / 1e6:>7.1f} MB {r['verify'] or '-':<8}")
    lines.append(f"{len(rows)} artifact(s) in {store.url}; details: warmer inspect {store.url}/index/RECIPE/KEY")
    return "\n".join(lines)


def split_entry_url(url: str) -> tuple[str, str, str]:
    """STORE/index/RECIPE/KEY[.json] → (STORE, RECIPE, KEY or a key prefix)."""
    base, sep, rest = url.rstrip("/").rpartition("/index/")
    recipe, _, key = rest.partition("/")
    key = key.removesuffix(".json")
    if not sep or not base or not recipe or "/" in key or len(key) < 8 or not HEX64.match(key.ljust(64, "0")):
        raise StoreError(f"{url!r} does not name a published artifact: use STORE/index/RECIPE/KEY, e.g. "
                         "s3://bucket/prefix/index/my-recipe/3fa2c1d4e5f60718 (at least 8 hex digits of the "
                         "key, as `warmer ls` prints it)")
    return base, recipe, key


def read_entry(url: str, **store_options) -> dict:
    """The index entry a URL names; a unique key prefix will do."""
    base, recipe, key = split_entry_url(url)
    store = open_store(base, **store_options)
    if len(key) < 64:
        keys = [k for _, k in store.list_index(recipe) if k.startswith(key)]
        if len(keys) != 1:
            raise StoreError(f"{len(keys)} artifacts of {recipe} in {store.url} have a key starting with {key}: "
                             "give more of the key" if keys else
                             f"no artifact of {recipe} in {store.url} has a key starting with {key}: "
                             f"see warmer ls --store {store.url} --recipe {recipe}")
        key = keys[0]
    raw = store.get_index(recipe, key)
    if raw is None:
        raise StoreError(f"no artifact {recipe}/{key} in {store.url}: see warmer ls --store {store.url}")
    return json.loads(raw)


def gc(store: Store, keep: int, *, older_than_days: float | None = None, dry_run: bool = False,
       now: datetime | None = None) -> dict:
    if keep < 1:
        raise StoreError(f"--keep {keep}: keep at least 1 artifact per recipe and machine kind, or nodes of "
                         "that kind all start cold")
    now = now or datetime.now(timezone.utc)
    entries = _read(store, store.list_index())
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for e in entries:
        groups[(e["recipe"], machine_kind(e["artifact"].get("fingerprint", {})))].append(e)
    drop = []
    for group in groups.values():
        group.sort(key=lambda e: (_published(e), e["key"]), reverse=True)
        drop += [e for e in group[keep:]
                 if older_than_days is None or now - _published(e) > timedelta(days=older_than_days)]
    dropped = {(e["recipe"], e["key"]) for e in drop}
    kept = [e for e in entries if (e["recipe"], e["key"]) not in dropped]

    if not dry_run:
        for recipe, key in sorted(dropped):
            store.delete_index(recipe, key)
    referenced = {e["blob"]["sha256"] for e in kept}
    if not dry_run:  # entries published while gc ran keep their blobs too
        known = {(e["recipe"], e["key"]) for e in entries}
        referenced |= {e["blob"]["sha256"] for e in _read(store, [rk for rk in store.list_index()
                                                                   if rk not in known])}
    freed = {e["blob"]["sha256"] for e in drop}
    blobs = [b for b in store.list_blobs() if b.sha256 not in referenced
             and (b.sha256 in freed or now - b.modified > ORPHAN_GRACE)]
    if not dry_run:
        for b in blobs:
            store.delete_blob(b.sha256)
    return {"store": store.url, "keep": keep, "older_than_days": older_than_days, "dry_run": dry_run,
            "entries": len(entries), "kept_entries": len(kept),
            "deleted_entries": [{"recipe": e["recipe"], "key": e["key"], "published_at": e["published_at"],
                                 "machine": machine_kind(e["artifact"].get("fingerprint", {}))} for e in drop],
            "deleted_blobs": [b.sha256 for b in blobs], "freed_bytes": sum(b.size for b in blobs)}


def render_gc(result: dict) -> str:
    verb = "would delete" if result["dry_run"] else "deleted"
    lines = [f"{verb}: {e['recipe']} {e['key'][:16]} ({e['machine']}, published {e['published_at']})"
             for e in result["deleted_entries"]]
    lines.append(f"{result['store']}: {verb} {len(result['deleted_entries'])} of {result['entries']} index "
                 f"entries and {len(result['deleted_blobs'])} blob(s), {result['freed_bytes'] / 1e6:.1f} MB; "
                 f"kept {result['kept_entries']} (newest {result['keep']} per recipe and machine kind)")
    return "\n".join(lines)
