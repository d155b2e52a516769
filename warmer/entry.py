"""A store's index entry: which blobs hold an artifact, its artifact.json, its signature.

    {"schema": 1, "recipe": NAME, "key": KEY, "blob": {"sha256", "size"},
     "artifact": artifact.json, "signature": null | {"alg", "key_id", "signature"[, "signed_at", "time_signature"]},
     "published_at": ISO 8601}

Schema 2 (a layered entry, `publish --layers`) has no "blob": its blobs are artifact.json's
layers, one per cache component, each stored once whatever number of entries name it. Its
layers' digests are in artifact.json, so the signature covers them. A warmer that reads only
schema 1 says the entry is another version's (a cold start, not a wrong one): upgrade the
nodes before the builders publish layers.

An entry comes from a store anyone with write access to it may have changed, so read() is the
boundary: it caps the size and depth, checks the signature over artifact.json before anything
else in the entry is interpreted, and binds what it read to where it was found. artifact.json
names its recipe and key, and the signature covers them, so a signed entry copied into another
recipe's or key's slot is refused, not activated.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from warmer import artifact, signing
from warmer.artifact import Artifact, ArtifactError, ArtifactSchemaError
from warmer.names import HEX64, MAX_INDEX_BYTES
from warmer.untrusted import Fields, InvalidDocument

SCHEMA_VERSION = 1
LAYERED_SCHEMA = 2


class EntryError(InvalidDocument):
    """An index entry that is malformed or not bound to where it was found."""


class EntrySchemaError(EntryError):
    """An index entry of a schema this warmer does not read (published by another warmer version)."""


@dataclass(frozen=True)
class BlobRef:
    sha256: str
    size: int


@dataclass(frozen=True)
class IndexEntry:
    recipe: str
    key: str
    blob: BlobRef | None  # None: a layered entry (schema 2), whose blobs are artifact.layers
    artifact: Artifact
    signature: signing.Signature | None
    published_at: datetime  # timezone-aware
    signed_by: str | None = None  # the trusted key that verified it, when read() was given keys

    @property
    def blobs(self) -> tuple[BlobRef, ...]:
        """Every blob the entry names: its one blob, or its layers."""
        if self.blob is not None:
            return (self.blob,)
        return tuple(BlobRef(layer.sha256, layer.size) for layer in self.artifact.layers)

    @property
    def layered(self) -> bool:
        return self.blob is None

    @classmethod
    def new(cls, artifact: Artifact, blob: BlobRef | None, signature: signing.Signature | None) -> IndexEntry:
        """blob None: a layered entry (artifact must have layers)."""
        if blob is None and not artifact.layers:
            raise EntryError("a layered entry needs an artifact packed in layers (by this warmer's pack)")
        return cls(
            artifact.recipe.name, artifact.key, blob, artifact, signature, datetime.now(UTC).replace(microsecond=0)
        )

    def to_bytes(self) -> bytes:
        doc: dict[str, object] = {
            "schema": LAYERED_SCHEMA if self.blob is None else SCHEMA_VERSION,
            "recipe": self.recipe,
            "key": self.key,
        }
        if self.blob is not None:
            doc["blob"] = {"sha256": self.blob.sha256, "size": self.blob.size}
        doc |= {
            "artifact": None,
            "signature": self.signature.to_json() if self.signature else None,
            "published_at": self.published_at.isoformat(timespec="seconds"),
        }
        # artifact.json goes in as its canonical bytes, so that read() finds its files list as written
        head, tail = json.dumps(doc, separators=(",", ":")).encode().split(b'"artifact":null', 1)
        return b"".join((head, b'"artifact":', self.artifact.canonical.rstrip(b"\n"), tail))

    @classmethod
    def read(cls, data: bytes, recipe: str, key: str, trusted_keys: Sequence[str | Path] = ()) -> IndexEntry:
        """The entry found at index/RECIPE/KEY; EntryError (or signing.SignatureError) if it is not one.

        With trusted_keys, the signature is checked over artifact.json's bytes first."""
        where = f"index entry {recipe}/{key[:16]}"
        doc, files = artifact.load(data, where, MAX_INDEX_BYTES, inside=("artifact",))
        f = Fields(doc, where)
        schema = f.integer("schema") if f.has("schema") else None
        if schema not in (SCHEMA_VERSION, LAYERED_SCHEMA):
            raise EntrySchemaError(
                f"{where} has schema {schema}, this warmer reads {SCHEMA_VERSION} and {LAYERED_SCHEMA}: it was "
                "published by another warmer version; fetch with that version or rebuild with this one"
            )
        art_doc = f.obj("artifact").doc
        signature = signing.Signature.from_json(f.raw("signature"), f"{where}.signature")
        signed_by = (
            signing.verify(artifact.canonical_of(art_doc, files), signature, list(trusted_keys))
            if trusted_keys
            else None
        )
        try:
            art = Artifact.from_json(art_doc, files, f"{where}.artifact")
        except ArtifactSchemaError as e:
            raise EntrySchemaError(str(e)) from None
        except ArtifactError as e:
            raise EntryError(str(e)) from None
        found = (f.text("recipe", max_len=100), f.text("key", max_len=64), art.recipe.name, art.key)
        if found != (recipe, key, recipe, key):
            raise EntryError(
                f"{where} holds the artifact of recipe {art.recipe.name} key {art.key[:16]}, not "
                f"{recipe} {key[:16]}: an entry copied into another slot; refused (remove it with "
                "`warmer rm`)"
            )
        blob = None
        if schema == SCHEMA_VERSION:
            b = f.obj("blob")
            sha = b.text("sha256", max_len=64)
            if not HEX64.match(sha):
                raise EntryError(f"{where}.blob.sha256 must be 64 lower-case hex digits")
            blob = BlobRef(sha, b.integer("size", low=0))
        elif not art.layers or f.has("blob"):
            raise EntryError(
                f"{where} is layered (schema {LAYERED_SCHEMA}) but its artifact lists no layers, or it names a blob"
            )
        return cls(
            recipe,
            key,
            blob,
            art,
            signature,
            _timestamp(f.text("published_at", max_len=64), f"{where}.published_at"),
            signed_by,
        )


def _timestamp(text: str, where: str) -> datetime:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise EntryError(f"{where} is not an ISO 8601 time: {text[:40]!r}") from None
    return when if when.tzinfo else when.replace(tzinfo=UTC)
