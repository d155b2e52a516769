"""artifact.json: what an artifact is, what it holds, and where it came from.

Schema 1 (a JSON object):
    schema          1
    warmer          the warmer version that packed it
    key             compat.key(fingerprint, recipe identity): what a node looks up
    recipe          {"name", "digest", "identity"}: the recipe the caches were warmed with
    fingerprint     the build node (warmer.fingerprint.Fingerprint)
    path_contract   the absolute paths the caches were built at (warmer.contract.PathContract)
    components      per cache kind: env var(s), relocatable, files, bytes
    files           [{"path", "size", "sha256", "mode", "mtime_ns"}], paths relative to the root
    timings         {"build": {...}, "verify": {...}} measured, in seconds
    created_at      UTC, ISO 8601
    vllm            optional: what vLLM itself hashed at build (warmer.vllmkey.VllmKey)
    serve_env       optional: env the build added to the recipe's and every node must serve with
                    (VLLM_USE_AOT_COMPILE=0 where vLLM could not reload its AOT artifact)
    cubins          optional: the FlashInfer cubins the warm-up downloaded (root-relative paths)
    layers          optional: [{"component", "key", "sha256", "size", "offset"}], one per component
                    with files: its zstd frame in the archive's body (offset from the body's start),
                    which a store keeps as a blob of its own, and the layer's key
                    (compat.layer_key: what that cache's loader checks)

Newer warmers may add optional fields to schema 1; a reader keeps them (they are signed and
hashed with the rest) and ignores what it does not know. The byte form (canonical()) is what
ids and signatures are computed over, so an Artifact keeps the exact bytes it was parsed from:
the files list compressed (FileList), the rest as it is (warmer.archive.manifest.Canonical, the
one place that knows those bytes).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from warmer import __version__
from warmer.archive import MANIFEST_LIMIT, FileEntry, FileList, manifest
from warmer.archive.manifest import canonical as canonical  # artifact.canonical, for its callers
from warmer.archive.manifest import load as load  # artifact.load, for entry's and restore's
from warmer.components import flashinfer
from warmer.contract import PathContract
from warmer.fingerprint import Fingerprint
from warmer.names import HEX64, NAME
from warmer.untrusted import Fields, InvalidDocument
from warmer.vllmkey import VllmKey

SCHEMA_VERSION = 1
CUBINS = flashinfer.CUBINS
# What a build may add to the env every node serves with, and the values it may take: nothing
# else from a store ever reaches the env file.
SERVE_ENV_ALLOWED = {"VLLM_USE_AOT_COMPILE": ("0",)}


class ArtifactError(InvalidDocument):
    """artifact.json is missing, malformed, or of a schema this warmer does not read."""


class ArtifactSchemaError(ArtifactError):
    """artifact.json of a schema this warmer does not read (written by another warmer version)."""


def _layers(f: Fields, components: Mapping[str, Any]) -> tuple[Layer, ...]:
    """artifact.json's layers: one per component it holds, each a frame after the one before it."""
    out: list[Layer] = []
    end = 0
    for i, lf in enumerate(f.objs("layers")):
        layer = Layer(
            lf.text("component", max_len=100),
            lf.text("key", max_len=64),
            lf.text("sha256", max_len=64),
            lf.integer("size", low=1),
            lf.integer("offset", low=0),
        )
        if not (HEX64.match(layer.key) and HEX64.match(layer.sha256)):
            raise ArtifactError(f"layers[{i}]: key and sha256 must be 64 lower-case hex digits")
        if layer.offset != end:
            raise ArtifactError(f"layers[{i}] starts at {layer.offset}, where the layer before it ends at {end}")
        end = layer.offset + layer.size
        out.append(layer)
    names = [layer.component for layer in out]
    if sorted(names) != sorted(components):
        raise ArtifactError(f"layers name {', '.join(names) or 'nothing'}, the components {', '.join(components)}")
    return tuple(out)


def canonical_of(doc: Any, files: memoryview | None = None) -> bytes:
    """canonical(doc), or with files (from load) as its files list."""
    try:
        return manifest.canonical_of(doc, files)
    except InvalidDocument as e:
        raise ArtifactError(str(e)) from None


@dataclass(frozen=True)
class RecipeRef:
    """The recipe an artifact was warmed with: its name, digest and identity (model, engine args,
    env, workload) as Recipe.identity() gave them."""

    name: str
    digest: str
    identity: dict[str, Any] = field(hash=False)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "digest": self.digest, "identity": self.identity}


@dataclass(frozen=True)
class ComponentSummary:
    subdir: str
    env: tuple[str, ...]
    relocatable: bool
    files: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "subdir": self.subdir,
            "env": list(self.env),
            "relocatable": self.relocatable,
            "files": self.files,
            "bytes": self.bytes,
        }


@dataclass(frozen=True)
class Layer:
    """One component's files as one zstd frame of the body: stored once, named by its sha256."""

    component: str
    key: str  # compat.layer_key: the fields that component's loader checks
    sha256: str
    size: int
    offset: int  # from the start of the body (the byte after the manifest frame)

    def to_json(self) -> dict[str, Any]:
        return {
            "component": self.component,
            "key": self.key,
            "sha256": self.sha256,
            "size": self.size,
            "offset": self.offset,
        }


@dataclass(frozen=True)
class Artifact:
    schema: int
    warmer: str
    key: str
    recipe: RecipeRef
    fingerprint: Fingerprint
    path_contract: PathContract
    components: dict[str, ComponentSummary] = field(hash=False)
    files: FileList = field(hash=False)  # canonical's files list, compressed
    timings: dict[str, Any] = field(hash=False)
    created_at: str
    vllm: VllmKey | None
    serve_env: dict[str, str] = field(hash=False)
    cubins: tuple[str, ...]
    id: str = field(repr=False, compare=False)  # sha256 of canonical: identifies this artifact.json exactly
    form: manifest.Canonical = field(repr=False, compare=False)  # canonical, in pieces (files is its list)
    layers: tuple[Layer, ...] = ()  # empty: an artifact packed before layers (one frame, one blob)

    # -- making one -----------------------------------------------------------------------------

    @classmethod
    def new(
        cls,
        *,
        key: str,
        recipe: RecipeRef,
        fingerprint: Fingerprint,
        path_contract: PathContract,
        components: Mapping[str, ComponentSummary],
        files: list[FileEntry],
        timings: dict[str, Any],
        vllm: VllmKey | None = None,
        serve_env: Mapping[str, str] | None = None,
        created_at: datetime | None = None,
        layers: tuple[Layer, ...] = (),
    ) -> Artifact:
        """created_at: when it was made (default now; a build gives SOURCE_DATE_EPOCH's time)."""
        doc: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "warmer": __version__,
            "key": key,
            "recipe": recipe.to_json(),
            "fingerprint": fingerprint.to_json(),
            "path_contract": path_contract.to_json(),
            "components": {n: c.to_json() for n, c in components.items()},
            "timings": timings,
            "created_at": (created_at or datetime.now(UTC)).isoformat(timespec="seconds"),
        }
        if vllm is not None:
            doc["vllm"] = vllm.to_json()
        if serve_env:
            doc["serve_env"] = dict(serve_env)
        cubins = [f.path for f in files if f.path.startswith(CUBINS)]
        if cubins:
            doc["cubins"] = cubins
        if layers:
            doc["layers"] = [layer.to_json() for layer in layers]
        return cls.from_json(*manifest.with_files(doc, files))

    def with_timings(self, **timings: dict[str, Any]) -> Artifact:
        """The same artifact with timings added (verify's, measured after packing)."""
        doc = self.to_json()
        doc["timings"] = {**doc["timings"], **timings}
        return Artifact.from_json(doc)

    # -- parsing and writing ------------------------------------------------------------------------

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "artifact.json") -> Artifact:
        try:
            return cls.from_json(*load(data, what, MANIFEST_LIMIT), what=what)
        except InvalidDocument as e:
            raise ArtifactError(str(e)) from None

    @classmethod
    def from_json(cls, doc: Any, files: memoryview | None = None, what: str = "artifact.json") -> Artifact:
        """Parse artifact.json; ArtifactError names the field when it is malformed. files: the
        bytes of its files list, when doc holds load's stand-in for it."""
        try:
            f = Fields(doc, what)
            schema = f.integer("schema")
            if schema != SCHEMA_VERSION:
                raise ArtifactSchemaError(
                    f"{what} has schema {schema}; this warmer ({__version__}) reads schema "
                    f"{SCHEMA_VERSION}: use the warmer version that built it, or rebuild"
                )
            key = f.text("key", max_len=64)
            if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
                raise ArtifactError(f"{what}.key must be 64 hex digits")
            r = f.obj("recipe")
            recipe = RecipeRef(r.text("name", max_len=100), r.text("digest", max_len=64), r.obj("identity").doc)
            if not NAME.match(recipe.name):
                raise ArtifactError(f"{what}.recipe.name {recipe.name[:40]!r} is not a recipe name")
            components = {}
            for name, c in f.items("components"):
                components[name] = ComponentSummary(
                    c.text("subdir"),
                    c.str_list("env"),
                    c.flag("relocatable"),
                    c.integer("files", low=0),
                    c.integer("bytes", low=0),
                )
            form = manifest.Canonical.of(doc, files, what)  # the files list checked, the id computed
            timings = f.obj("timings").doc
            vllm = VllmKey.from_json(f.obj("vllm")) if f.raw("vllm") is not None else None
            serve_env = f.str_map("serve_env") if f.raw("serve_env") is not None else {}
            for name, value in serve_env.items():  # it goes into the env file a Deployment sources
                if SERVE_ENV_ALLOWED.get(name) is None or value not in SERVE_ENV_ALLOWED[name]:
                    raise ArtifactError(
                        f"{what}.serve_env sets {name}={value!r}, which a build never adds "
                        f"(only {', '.join(SERVE_ENV_ALLOWED)}): refused"
                    )
            cubins = f.str_list("cubins") if f.raw("cubins") is not None else ()
            layers = _layers(f, components) if f.raw("layers") is not None else ()
            art = cls(
                schema=schema,
                warmer=f.text("warmer", max_len=64) if f.has("warmer") else "?",
                key=key,
                recipe=recipe,
                fingerprint=Fingerprint.from_json(f.raw("fingerprint"), f"{what}.fingerprint"),
                path_contract=PathContract.from_json(f.obj("path_contract")),
                components=components,
                files=form.files,
                timings=timings,
                created_at=f.text("created_at", max_len=64) if f.has("created_at") else "",
                vllm=vllm,
                serve_env=serve_env,
                cubins=cubins,
                id=form.sha256,
                form=form,
                layers=layers,
            )
        except ArtifactError:
            raise
        except InvalidDocument as e:
            raise ArtifactError(str(e)) from None
        return art

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.canonical)
        return doc

    def layer(self, component: str) -> Layer | None:
        return next((layer for layer in self.layers if layer.component == component), None)

    @property
    def canonical(self) -> bytes:
        """The one byte form, whole (9.7 MB at 45,000 files): form.pieces() does not hold it."""
        return self.form.whole()

    # -- what it holds ------------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return self.files.total_bytes

    def created(self) -> datetime | None:
        try:
            when = datetime.fromisoformat(self.created_at)
        except ValueError:
            return None
        return when if when.tzinfo else when.replace(tzinfo=UTC)
