"""artifact.json: what an artifact is, what it holds, and where it came from.

Schema 1 (a JSON object):
    schema          1
    warmer          the warmer version that packed it
    key             compat.key(fingerprint, recipe identity): what a node looks up
    recipe          {"name", "digest", "identity"}: the recipe the caches were warmed with
    fingerprint     the build node (fingerprint.probe())
    path_contract   the absolute paths the caches were built at: root, model, python prefix
    components      per cache kind: env var(s), relocatable, files, bytes
    files           [{"path", "size", "sha256", "mode", "mtime_ns"}], paths relative to the root
    timings         {"build": {...}, "verify": {...}} measured, in seconds
    created_at      UTC, ISO 8601
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from warmer import __version__
from warmer.archive import FileEntry

SCHEMA_VERSION = 1
REQUIRED = ("schema", "key", "recipe", "fingerprint", "path_contract", "components", "files", "timings")


class ArtifactError(Exception):
    """artifact.json is missing, malformed, or of a schema this warmer does not read."""


def new(*, key: str, recipe: dict, fingerprint: dict, path_contract: dict, components: dict,
        files: list[FileEntry], timings: dict) -> dict:
    return {
        "schema": SCHEMA_VERSION,
        "warmer": __version__,
        "key": key,
        "recipe": recipe,
        "fingerprint": fingerprint,
        "path_contract": path_contract,
        "components": components,
        "files": [f.to_dict() for f in files],
        "timings": timings,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def dumps(doc: dict) -> bytes:
    """The one byte form of an artifact.json: its id and signature are over these bytes. Compact, so
    that json's C encoder writes it (indent takes the pure-Python one: 0.1 s at 10,000 files)."""
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


def loads(data: bytes) -> dict:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"artifact.json is not valid JSON: {e}") from e
    return validate(doc)


def validate(doc) -> dict:
    """doc, if it is an artifact.json this warmer reads (as parsed from an index entry)."""
    if not isinstance(doc, dict):
        raise ArtifactError("artifact.json is not a JSON object")
    schema = doc.get("schema")
    if schema != SCHEMA_VERSION:
        raise ArtifactError(f"artifact.json has schema {schema!r}; this warmer ({__version__}) reads "
                            f"schema {SCHEMA_VERSION}: use the warmer version that built it")
    missing = [k for k in REQUIRED if k not in doc]
    if missing:
        raise ArtifactError(f"artifact.json lacks {', '.join(missing)}")
    return doc


def entries(doc: dict) -> dict[str, FileEntry]:
    """The files an artifact lists, by path; refuses a list that names a path twice."""
    out: dict[str, FileEntry] = {}
    try:
        for d in doc["files"]:
            e = FileEntry.from_dict(d)
            if e.path in out:
                raise ArtifactError(f"artifact.json lists {e.path!r} twice")
            out[e.path] = e
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"artifact.json has a malformed file entry: {e}") from e
    return out


def total_bytes(doc: dict) -> int:
    return sum(int(f["size"]) for f in doc["files"])
