"""What a store holds, and keeping it small: ls, inspect (of a published entry), gc, rm.

An entry is known by where it is found (index/RECIPE/KEY), never by what it says of itself:
IndexEntry.read refuses an entry whose contents name another recipe or key, so an entry copied
into another slot can neither hide nor get the real one deleted.

gc keeps the newest N artifacts of each recipe on each kind of machine (CPU architecture and
GPU model): a recipe built for three GPU types keeps N for each, so no fleet loses its
artifact to another's newer builds. It deletes index entries first and blobs after, and never
a blob that a remaining index entry names. A blob no entry has ever named is a publish in
flight or one that lost a race; it is deleted only once it is older than ORPHAN_GRACE. An
unreadable entry stops gc (it cannot know which blob that entry needs): `warmer rm` it first.

An entry names one blob (schema 1) or one per layer (a layered entry, schema 2), and a layer blob
may be named by many entries: everything here goes through IndexEntry.blobs, and a blob stays
while any entry names it.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from warmer import __version__
from warmer.contract import user_name
from warmer.deadline import map_on_daemon_threads
from warmer.entry import IndexEntry
from warmer.errors import StoreError, UntrustedInput, UsageError
from warmer.names import HEX64
from warmer.store import Blob, Scrap, Store, open_store

ORPHAN_GRACE = timedelta(hours=6)


@dataclass(frozen=True)
class Unreadable:
    recipe: str
    key: str
    why: str


def read_entries(store: Store, names: list[tuple[str, str]]) -> tuple[list[IndexEntry], list[Unreadable]]:
    """The index entries named (one GET each, in parallel); ones deleted meanwhile are skipped."""

    def read(rk):
        try:
            raw = store.get_index(*rk)
            return None if raw is None else IndexEntry.read(raw, *rk)
        except UntrustedInput as e:
            return Unreadable(*rk, str(e))

    # 8: within boto3's connection pool; daemon threads, that stop at the store's deadline
    found = [e for e in map_on_daemon_threads(read, names, 8, store.deadline, "reading entries") if e is not None]
    return ([e for e in found if isinstance(e, IndexEntry)], [e for e in found if isinstance(e, Unreadable)])


def named_blobs(entries: Iterable[IndexEntry]) -> set[str]:
    """The sha256 of every blob the entries name (layer blobs included)."""
    return {b.sha256 for e in entries for b in e.blobs}


def namings(entries: Iterable[IndexEntry]) -> Counter[str]:
    """How many of the entries name each blob."""
    return Counter(sha for e in entries for sha in {b.sha256 for b in e.blobs})


@dataclass(frozen=True)
class LayerRow:
    """One layer blob of a layered entry; shared: another entry (of those read) names it too."""

    component: str
    sha256: str
    size: int
    shared: bool

    def to_json(self) -> dict:
        return dict(vars(self))


@dataclass(frozen=True)
class Row:
    recipe: str
    key: str
    machine: str
    published_at: datetime
    blob: str | None  # the one blob of a single-blob entry; None: a layered entry (see layers)
    archive_bytes: int  # the bytes of every blob the entry names
    files: int
    cache_bytes: int
    verify: str | None
    signed: bool
    warmer: str
    layers: tuple[LayerRow, ...] = ()  # a layered entry's blobs, one per cache component
    shared_bytes: int = 0  # of archive_bytes, those in blobs another entry names too

    @classmethod
    def of(cls, e: IndexEntry, named_by: Mapping[str, int] | None = None) -> Row:
        """named_by: how many entries name each blob (namings), to tell the shared ones."""
        art, counts = e.artifact, named_by or {}
        shared = {b.sha256 for b in e.blobs if counts.get(b.sha256, 0) > 1}
        return cls(
            e.recipe,
            e.key,
            art.fingerprint.machine_kind(),
            e.published_at,
            e.blob.sha256 if e.blob is not None else None,
            sum(b.size for b in e.blobs),
            len(art.files),
            art.total_bytes,
            (art.timings.get("verify") or {}).get("verdict"),
            e.signature is not None,
            art.warmer,
            tuple(LayerRow(x.component, x.sha256, x.size, x.sha256 in shared) for x in art.layers) if e.layered else (),
            sum(b.size for b in e.blobs if b.sha256 in shared),
        )

    @property
    def blobs(self) -> tuple[tuple[str, int], ...]:
        """(sha256, size) of every blob the entry names."""
        if self.blob is not None:
            return ((self.blob, self.archive_bytes),)
        return tuple((x.sha256, x.size) for x in self.layers)

    def to_json(self) -> dict:
        doc = {**vars(self), "published_at": self.published_at.isoformat()}
        if self.layers:
            doc["layers"] = [x.to_json() for x in self.layers]
        else:
            del doc["layers"]  # a single-blob entry: its row as before layers
        return doc


def blob_json(b: Blob) -> dict:
    return {"orphan_blob": b.sha256, "bytes": b.size, "modified": b.modified.isoformat(timespec="seconds")}


@dataclass(frozen=True)
class Listing:
    store: str
    rows: tuple[Row, ...]
    unreadable: tuple[Unreadable, ...]
    # Blobs no entry names (an upload in flight, a lost publish race); None: not known (a listing
    # of one recipe reads only its entries, and an unreadable entry may name any blob).
    orphans: tuple[Blob, ...] | None = None

    @property
    def stored_bytes(self) -> int:
        """The bytes the listed entries take in the store: each blob they name, once."""
        return sum(dict(b for r in self.rows for b in r.blobs).values())

    @property
    def unshared_bytes(self) -> int:
        """The bytes they would take if no blob were shared: each entry's blobs, whole."""
        return sum(r.archive_bytes for r in self.rows)

    @property
    def blob_count(self) -> int:
        return len({sha for r in self.rows for sha, _ in r.blobs})

    @property
    def shared_blobs(self) -> int:
        """How many blobs more than one listed entry names."""
        counts = Counter(sha for r in self.rows for sha in {sha for sha, _ in r.blobs})
        return sum(1 for n in counts.values() if n > 1)

    @property
    def sharing(self) -> bool:
        """Whether any entry is layered or any blob is shared: then stored and unshared bytes differ, or may."""
        return self.shared_blobs > 0 or any(r.blob is None for r in self.rows)

    def summary_json(self) -> dict:
        return {
            "artifacts": len(self.rows),
            "blobs": self.blob_count,
            "stored_bytes": self.stored_bytes,
            "unshared_bytes": self.unshared_bytes,
            "shared_blobs": self.shared_blobs,
        }

    def to_json(self) -> list[dict]:
        """The rows, the unreadable entries, the orphan blobs; and last, where blobs are shared or
        layered, the summary (the one element with "stored_bytes")."""
        return (
            [r.to_json() for r in self.rows]
            + [{"recipe": u.recipe, "key": u.key, "unreadable": u.why} for u in self.unreadable]
            + [blob_json(b) for b in self.orphans or ()]
            + ([self.summary_json()] if self.sharing else [])
        )


def ls(store: Store, recipe: str | None = None) -> Listing:
    entries, unreadable = read_entries(store, store.list_index(recipe))
    counts = namings(entries)
    rows = sorted((Row.of(e, counts) for e in entries), key=lambda r: r.published_at, reverse=True)
    rows.sort(key=lambda r: (r.recipe, r.machine))
    orphans = None
    if recipe is None and not unreadable:
        named = named_blobs(entries)
        # An entry published since the index was listed names its blob too: list the blobs first, then
        # take out what the index names now.
        blobs: list[Blob] | None = [b for b in store.list_blobs() if b.sha256 not in named]
        if blobs:
            known = {(e.recipe, e.key) for e in entries}
            late, late_unreadable = read_entries(store, [rk for rk in store.list_index() if rk not in known])
            named |= named_blobs(late)
            blobs = None if late_unreadable else [b for b in blobs if b.sha256 not in named]
        orphans = None if blobs is None else tuple(sorted(blobs, key=lambda b: b.modified))
    return Listing(store.url, tuple(rows), tuple(unreadable), orphans)


def split_entry_url(url: str) -> tuple[str, str, str]:
    """STORE/index/RECIPE/KEY[.json] → (STORE, RECIPE, KEY or a key prefix)."""
    # From the right: a recipe may itself be named "index" (STORE/index/index/KEY).
    parts = url.rstrip("/").rsplit("/", 3)
    base, sep, recipe, key = parts if len(parts) == 4 else ("", "", "", "")
    key = key.removesuffix(".json")
    if sep != "index" or not base or not recipe or len(key) < 8 or not HEX64.match(key.ljust(64, "0")):
        raise UsageError(
            f"{url!r} does not name a published artifact: use STORE/index/RECIPE/KEY, e.g. "
            "s3://bucket/prefix/index/my-recipe/3fa2c1d4e5f60718 (at least 8 hex digits of the "
            "key, as `warmer ls` prints it)"
        )
    return base, recipe, key


def resolve(url: str, **store_options) -> tuple[Store, str, str]:
    """(store, recipe, full key) that a URL names; a unique key prefix will do."""
    base, recipe, key = split_entry_url(url)
    store = open_store(base, **store_options)
    if len(key) < 64:
        keys = [k for _, k in store.list_index(recipe) if k.startswith(key)]
        if len(keys) != 1:
            raise StoreError(
                f"{len(keys)} artifacts of {recipe} in {store.url} have a key starting with {key}: give more of the key"
                if keys
                else f"no artifact of {recipe} in {store.url} has a key starting with {key}: "
                f"see warmer ls --store {store.url} --recipe {recipe}"
            )
        key = keys[0]
    return store, recipe, key


def read_entry(url: str, **store_options) -> IndexEntry:
    """The index entry a URL names."""
    store, recipe, key = resolve(url, **store_options)
    raw = store.get_index(recipe, key)
    if raw is None:
        raise StoreError(f"no artifact {recipe}/{key} in {store.url}: see warmer ls --store {store.url}")
    return IndexEntry.read(raw, recipe, key)


@dataclass(frozen=True)
class Removal:
    store: str
    recipe: str
    key: str
    blob: str | None  # a single-blob entry's blob; None: a layered entry (see layers), or unreadable
    blob_deleted: bool  # that blob; with dry_run: whether it would be
    dry_run: bool
    layers: tuple[tuple[str, str], ...] = ()  # a layered entry's blobs: (component, sha256)
    deleted_blobs: tuple[str, ...] = ()  # every blob deleted (no other entry names it); with dry_run: would be
    raced: tuple[tuple[str, str, str], ...] = ()  # (recipe, key, blob): published during rm, naming a blob it deleted

    @property
    def blobs(self) -> tuple[str, ...]:
        """Every blob the entry named (none known for an unreadable entry)."""
        return (self.blob,) if self.blob is not None else tuple(sha for _, sha in self.layers)

    def to_json(self) -> dict:
        doc: dict = {
            "store": self.store,
            "recipe": self.recipe,
            "key": self.key,
            "blob": self.blob,
            "dry_run": self.dry_run,
        }
        # A dry run deleted nothing: it says what --yes would do, never that something was deleted.
        doc["would_delete_blob" if self.dry_run else "blob_deleted"] = self.blob_deleted
        if self.layers:
            doc["layers"] = [
                {
                    "component": c,
                    "sha256": sha,
                    "would_delete" if self.dry_run else "deleted": sha in self.deleted_blobs,
                }
                for c, sha in self.layers
            ]
        doc["blobs"] = list(self.blobs)
        doc["would_delete_blobs" if self.dry_run else "deleted_blobs"] = list(self.deleted_blobs)
        doc["raced"] = [{"recipe": r, "key": k, "blob": b} for r, k, b in self.raced]
        return doc


def rm(url: str, *, yes: bool, **store_options) -> Removal:
    """Delete one index entry (readable or not) and each blob it names that no other entry names
    (a layer another entry shares stays); the store keeps an audit record of who removed what."""
    store, recipe, key = resolve(url, **store_options)
    refusal = store.refuses_delete(recipe, key)
    if refusal is not None:  # a dry run must not promise what --yes refuses
        raise StoreError(refusal)
    entry: IndexEntry | None
    try:
        raw = store.get_index(recipe, key)
        if raw is None:
            raise StoreError(f"no artifact {recipe}/{key} in {store.url}: see warmer ls --store {store.url}")
        entry = IndexEntry.read(raw, recipe, key)
    except UntrustedInput:
        entry = None  # a broken or planted entry (the store's or its own bytes): remove it, keep every blob
    blob = entry.blob.sha256 if entry is not None and entry.blob is not None else None
    layers = tuple((x.component, x.sha256) for x in entry.artifact.layers) if entry and entry.layered else ()
    listed = store.list_index()
    others, unreadable = read_entries(store, [rk for rk in listed if rk != (recipe, key)])
    in_use = named_blobs(others)
    # An unreadable entry may name any blob: delete none of them then.
    doomed = (
        ()
        if entry is None or unreadable
        else tuple(dict.fromkeys(b.sha256 for b in entry.blobs if b.sha256 not in in_use))
    )
    removal = Removal(store.url, recipe, key, blob, blob is not None and blob in doomed, not yes, layers, doomed)
    if yes:
        store.delete_index(recipe, key)  # refused or failed: nothing removed, nothing recorded
        # From here the entry is gone: however rm ends, the record and its words say what it removed.
        deleted: list[str] = []
        stopped: BaseException | None = None
        try:
            for sha in doomed:
                store.delete_blob(sha)
                deleted.append(sha)
        except BaseException as e:  # a refused delete, an interrupt: recorded, then raised
            stopped = e
        removed = f"removed {store.url}/index/{recipe}/{key} and {len(deleted)} of its {len(doomed)} blob(s) to delete"
        try:
            _audit(store, recipe, key, blob, removal.blobs, deleted, _why(stopped) if stopped else None)
        except Exception as e:
            raise StoreError(f"{removed}, but the audit record could not be written ({_why(e)})") from (stopped or e)
        if isinstance(stopped, (StoreError, OSError)):
            raise StoreError(
                f"{removed}, then stopped ({_why(stopped)}); `warmer gc` deletes the rest once no entry names "
                f"them ({ORPHAN_GRACE.total_seconds() / 3600:.0f} h old)"
            ) from stopped
        if stopped is not None:
            raise stopped
        removal = replace(removal, raced=_published_meanwhile(store, {*listed, (recipe, key)}, set(doomed)))
    return removal


def _why(e: BaseException) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__


def _audit(
    store: Store,
    recipe: str,
    key: str,
    blob: str | None,
    blobs: tuple[str, ...],
    deleted: list[str],
    error: str | None = None,
) -> None:
    """The store's record of an rm, written once the entry is gone: what it deleted, not what it meant to."""
    now = datetime.now(UTC)
    record = {
        "action": "rm",
        "recipe": recipe,
        "key": key,
        "blob": blob,
        "blob_deleted": blob is not None and blob in deleted,
        "blobs": list(blobs),
        "blobs_deleted": deleted,
        "by": user_name(),  # a uid without a passwd entry too (no KeyError)
        "at": now.isoformat(timespec="seconds"),
        "warmer": __version__,
        **({"error": error} if error else {}),
    }
    store.write_audit(f"{now.strftime('%Y%m%dT%H%M%SZ')}-rm-{recipe}-{key[:16]}", json.dumps(record).encode())


@dataclass(frozen=True)
class Collection:
    store: str
    keep: int
    older_than_days: float | None
    dry_run: bool
    entries: int
    deleted_entries: tuple[Row, ...]
    kept_entries: int
    deleted_blobs: tuple[str, ...]
    freed_bytes: int
    orphans_deleted: tuple[Blob, ...] = ()  # blobs no entry named, older than ORPHAN_GRACE (in deleted_blobs)
    orphans_kept: tuple[Blob, ...] = ()  # blobs no entry names, younger: maybe a publish in flight
    shared_kept: tuple[str, ...] = ()  # blobs of the deleted entries kept: an entry left names them (shared layers)
    scraps_deleted: tuple[Scrap, ...] = ()  # what writers that died left (Store.list_scraps), older than ORPHAN_GRACE
    pinned: tuple[tuple[Row, str], ...] = ()  # entries gc would drop, kept: another name holds them (a registry tag)
    raced: tuple[tuple[str, str, str], ...] = ()  # (recipe, key, blob): published during gc, naming a blob it deleted

    def to_json(self) -> dict:
        return {
            **vars(self),
            "deleted_entries": [r.to_json() for r in self.deleted_entries],
            "deleted_blobs": list(self.deleted_blobs),
            "shared_kept": list(self.shared_kept),
            "orphans_deleted": [blob_json(b) for b in self.orphans_deleted],
            "orphans_kept": [blob_json(b) for b in self.orphans_kept],
            "scraps_deleted": [
                {"path": x.path, "bytes": x.size, "modified": x.modified.isoformat(timespec="seconds")}
                for x in self.scraps_deleted
            ],
            "orphan_grace_hours": ORPHAN_GRACE.total_seconds() / 3600,
            "pinned": [{**r.to_json(), "by": by} for r, by in self.pinned],
            "raced": [{"recipe": r, "key": k, "blob": b} for r, k, b in self.raced],
        }


def _kept_per(fp) -> tuple:
    """What gc keeps N artifacts of: a machine kind, and on vLLM's CPU backend the instruction set
    too (compat's hard cpu.isa and cpu.aten_capability): an AVX2 fleet's only artifact is not pushed
    out by an AVX-512 fleet's newer builds, which it cannot use."""
    cpu = () if fp.gpu.count else (fp.cpu.isa, fp.cpu.aten_capability)
    return (fp.machine_kind(), *cpu)


def gc(
    store: Store, keep: int, *, older_than_days: float | None = None, dry_run: bool = False, now: datetime | None = None
) -> Collection:
    if keep < 1:
        raise UsageError(
            f"--keep {keep}: keep at least 1 artifact per recipe and machine kind, or nodes of that kind all start cold"
        )
    # not (0 <= x <= max): also NaN, which no comparison holds (and timedelta refuses it, as it does 1e10 days)
    if older_than_days is not None and not 0 <= older_than_days <= timedelta.max.days:
        raise UsageError(
            f"--older-than {older_than_days}: give a number of days from 0 to {timedelta.max.days} (e.g. 30)"
        )
    now = now or datetime.now(UTC)
    entries, unreadable = read_entries(store, store.list_index())
    if unreadable:
        u = unreadable[0]
        raise StoreError(
            f"index entry {u.recipe}/{u.key[:16]} in {store.url} is unreadable ({u.why}); gc cannot "
            f"tell which blob it needs: remove it with `warmer rm {store.url}/index/{u.recipe}/{u.key} --yes` "
            f"({len(unreadable)} unreadable in all)"
        )
    groups: dict[tuple, list[IndexEntry]] = defaultdict(list)
    for e in entries:
        groups[(e.recipe, *_kept_per(e.artifact.fingerprint))].append(e)
    drop: list[IndexEntry] = []
    for group in groups.values():
        group.sort(key=lambda e: (e.published_at, e.key), reverse=True)
        drop += [
            e for e in group[keep:] if older_than_days is None or now - e.published_at > timedelta(days=older_than_days)
        ]
    pins = [(e, by) for e in drop if (by := store.pinned_by(e.recipe, e.key))]  # deleting would delete the name too
    pinned = {(e.recipe, e.key) for e, _ in pins}
    drop = [e for e in drop if (e.recipe, e.key) not in pinned]
    dropped = {(e.recipe, e.key) for e in drop}
    counts = namings(entries)
    kept = [e for e in entries if (e.recipe, e.key) not in dropped]

    if not dry_run:
        with _stopped("index entries", len(dropped)) as gone:
            for recipe, key in sorted(dropped):
                store.delete_index(recipe, key)
                gone.append(key)
    # A blob (a layer shared by many entries included) stays while any entry left names it.
    referenced = named_blobs(kept)
    named_before = named_blobs(entries)
    if not dry_run:  # entries published while gc ran keep their blobs too
        known = {(e.recipe, e.key) for e in entries}
        late, late_unreadable = read_entries(store, [rk for rk in store.list_index() if rk not in known])
        if late_unreadable:  # cannot know which blob it needs: delete no blob this round
            referenced |= {b.sha256 for b in store.list_blobs()}
        referenced |= named_blobs(late)
    freed = named_blobs(drop)
    listed = store.list_blobs()
    if dry_run and not store.lists_blobs:  # a registry lists only what its deletes released: none yet
        listed = list({b.sha256: Blob(b.sha256, b.size, e.published_at) for e in drop for b in e.blobs}.values())
    unnamed = [b for b in listed if b.sha256 not in referenced]
    orphans = [b for b in unnamed if b.sha256 not in freed and b.sha256 not in named_before]
    blobs = [b for b in unnamed if b.sha256 in freed or now - b.modified > ORPHAN_GRACE]
    scraps = [x for x in store.list_scraps() if now - x.modified > ORPHAN_GRACE]  # younger: maybe still written
    raced: tuple[tuple[str, str, str], ...] = ()
    if not dry_run:
        with _stopped("blobs", len(blobs), f"its {len(dropped)} index entries are deleted") as gone:
            for b in blobs:
                store.delete_blob(b.sha256)
                gone.append(b.sha256)
        for x in scraps:
            store.delete_scrap(x)
        raced = _published_meanwhile(store, {*known, *((e.recipe, e.key) for e in late)}, {b.sha256 for b in blobs})
    return Collection(
        store.url,
        keep,
        older_than_days,
        dry_run,
        len(entries),
        tuple(Row.of(e, counts) for e in drop),
        len(kept),
        tuple(b.sha256 for b in blobs),
        sum(b.size for b in blobs),
        tuple(b for b in orphans if now - b.modified > ORPHAN_GRACE),
        tuple(b for b in orphans if now - b.modified <= ORPHAN_GRACE),
        tuple(sorted(freed & referenced)),
        tuple(scraps),
        tuple((Row.of(e, counts), by) for e, by in pins),
        raced,
    )


@contextmanager
def _stopped(what: str, total: int, before: str = "") -> Iterator[list[str]]:
    """A delete the store refused partway (a read-only directory, a missing permission): said with
    how far gc got, not as the bare error (the next run called what it left orphans in flight)."""
    gone: list[str] = []
    try:
        yield gone
    except (StoreError, OSError) as e:
        why = _why(e)
        done = f"{before}; " if before else ""
        raise StoreError(
            f"gc stopped ({why}): {done}{len(gone)} of {total} {what} deleted; fix that and run gc again, "
            f"it deletes what is left (a blob no entry names once {ORPHAN_GRACE.total_seconds() / 3600:.0f} h old)"
        ) from e


def _published_meanwhile(
    store: Store, seen: set[tuple[str, str]], deleted: set[str]
) -> tuple[tuple[str, str, str], ...]:
    """(recipe, key, blob) of each entry published after gc's or rm's last look that names a blob
    it then deleted: a layered publish skips the layers the store holds, and no lock orders it with
    them. Its own check after creating its entry can run before the delete; this one runs after it,
    so one of the two sees every such entry."""
    if not deleted:
        return ()
    newer, _ = read_entries(store, [rk for rk in store.list_index() if rk not in seen])
    return tuple((e.recipe, e.key, b.sha256) for e in newer for b in e.blobs if b.sha256 in deleted)
