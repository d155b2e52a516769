"""OCIStore: warmer's store layout in one repository of a registry (docs/oci-store.md): an
artifact is a manifest tagged RECIPE--KEY16, its config artifact.json and its layer the tar.zst
(a layered entry, schema 2: its layers, one per cache component, each a blob the registry keeps
once whatever number of manifests name it); the index entry is rebuilt from them on read; the
tag list is the index. Every request goes through client.Registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from datetime import UTC, datetime

from warmer.deadline import Deadline, map_on_daemon_threads
from warmer.errors import UsageError
from warmer.store import (
    HEX64,
    NAME,
    Blob,
    BlobMissing,
    BlobStream,
    IndexTooLarge,
    Store,
    StoreError,
    UnreadableEntry,
    parse_index_path,
)
from warmer.store.oci.client import (
    MANIFEST_TYPE,
    RETRY_STATUS,
    Garbled,
    MiB,
    Registry,
    Unreachable,
    error_codes,
)
from warmer.store.progress import Progress
from warmer.store.stream import Answer

ARTIFACT_TYPE = "application/vnd.warmer.artifact.v1"
CONFIG_TYPE = "application/vnd.warmer.artifact.v1+json"
LAYER_TYPE = "application/vnd.warmer.cache.tar+zstd"
AUDIT_TYPE = "application/vnd.warmer.audit.v1"
AUDIT_CONFIG_TYPE = "application/vnd.warmer.audit.v1+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"  # OCI 1.1's layer for an artifact without one
EMPTY = b"{}"

ANN_RECIPE = "vnd.warmer.recipe"
ANN_KEY = "vnd.warmer.key"
ANN_SIGNATURE = "vnd.warmer.signature"
ANN_SCHEMA = "vnd.warmer.entry-schema"
ANN_EXTRA = "vnd.warmer.entry-extra"  # index entry fields this version does not know, kept as JSON
ANN_AUDIT = "vnd.warmer.audit"
ANN_CREATED = "org.opencontainers.image.created"
ANN_TITLE = "org.opencontainers.image.title"
ENTRY_FIELDS = ("schema", "recipe", "key", "blob", "artifact", "signature", "published_at")
LAYERED_SCHEMA = 2  # warmer.entry.LAYERED_SCHEMA: no "blob"; its blobs are artifact.json's layers
LAYER_FIELDS = frozenset(("component", "key", "sha256", "size", "offset"))
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}\Z")

TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}\Z")
INDEX_TAG = re.compile(r"^(?P<recipe>[a-z0-9][a-z0-9._-]{0,99})--(?P<key16>[0-9a-f]{16})\Z")
AUDIT_PREFIX = "_audit."
REPO_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPOSITORY = re.compile(rf"^{REPO_PART}(?:/{REPO_PART})*\Z")
HOST = re.compile(r"^(?:\[[0-9a-fA-F:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?\Z")

# After tagging, a publisher reads the tag back twice: at once, and again after this long (or
# twice its own HEAD-to-read-back time, when longer), so that a racer whose HEAD also found the
# tag absent has landed its PUT by then (docs/oci-store.md, "First writer wins").
SETTLE_S = 1.0


def canonical(doc: dict) -> bytes:
    """artifact.json's one byte form (warmer.artifact.dumps): the config blob, byte for byte."""
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


def _dropped(pairs) -> None:
    return None


def _layers_kept(pairs):
    """json.loads' object hook that builds nothing but artifact.json's layers: an object with a
    "layers" member becomes {"layers": ...}, a layer's object (every field of one, at least) a dict,
    every other object None (the files list of 45,000 objects is dropped as it is read)."""
    keys = {k for k, _ in pairs}
    if "layers" in keys:
        return {"layers": dict(pairs)["layers"]}
    return dict(pairs) if LAYER_FIELDS <= keys else None


def _layer_descriptors(layers: object, tag: str) -> list[dict]:
    """A layered entry's layers (artifact.json's, as publish wrote them) as the manifest's
    descriptors; ValueError when they are not."""
    if not isinstance(layers, list) or not layers:
        raise ValueError("a layered entry whose artifact lists no layers")
    out = []
    for layer in layers:
        sha, size, component = layer["sha256"], layer["size"], layer["component"]
        if not isinstance(sha, str) or not HEX64.match(sha) or not isinstance(size, int) or size < 1:
            raise ValueError(f"layer {component!r} has no sha256 and size")
        if not isinstance(component, str) or not re.match(r"^[a-z0-9][a-z0-9._-]{0,99}$", component):
            raise ValueError(f"layer {component!r} is not a component's name")
        out.append(
            {
                "mediaType": LAYER_TYPE,
                "digest": f"sha256:{sha}",
                "size": size,
                "annotations": {ANN_TITLE: f"{tag}-{component}.tar.zst"},
            }
        )
    return out


def index_tag(recipe: str, key: str) -> str:
    tag = f"{recipe}--{key[:16]}"
    if not TAG.match(tag):  # unreachable while recipe names follow NAME; see docs/oci-store.md
        raise StoreError(
            f"recipe name {recipe!r} cannot be part of an OCI tag ({tag!r} breaks the tag grammar "
            "[A-Za-z0-9_][A-Za-z0-9._-]{0,127}): rename the recipe"
        )
    return tag


def audit_tag(name: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    tag = AUDIT_PREFIX + clean
    if len(tag) > 128 or clean != name:
        tag = f"{tag[: 128 - 13]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
    return tag


class OCIStore(Store):
    def __init__(
        self,
        url: str,
        *,
        insecure_registry: bool = False,
        progress: bool = False,
        chunk_size: int | None = None,
        part_size: int = 8 * MiB,
        concurrency: int = 8,
        settle_s: float = SETTLE_S,
        deadline: Deadline | None = None,
    ):
        rest = url[len("oci://") :] if url.startswith("oci://") else url
        host, _, repo = rest.strip("/").partition("/")
        if not host or not HOST.match(host) or not repo or not REPOSITORY.match(repo):
            raise UsageError(
                f"store {url!r} is not oci://REGISTRY/REPOSITORY: use e.g. "
                "oci://registry.example.com/team/warmer-caches (a lowercase repository path, "
                "no tag or digest)"
            )
        self.registry = Registry(
            host, repo, insecure=insecure_registry, chunk_size=chunk_size, concurrency=concurrency, deadline=deadline
        )
        self.host, self.repo, self.base = self.registry.host, repo, self.registry.base
        self.url = f"oci://{host}/{repo}"
        self.progress = progress
        self.part_size, self.concurrency, self.settle_s = part_size, concurrency, settle_s
        self._released: dict[str, Blob] = {}  # layers whose manifests this handle deleted
        from warmer.store.s3 import cap_malloc_arenas  # the same per-thread arena growth as S3's

        cap_malloc_arenas()

    # The registry client reads these on every request: a fetch sets the deadline after opening.
    @property
    def deadline(self) -> Deadline:
        return self.registry.deadline

    @deadline.setter
    def deadline(self, value: Deadline) -> None:
        self.registry.deadline = value

    @property
    def chunk_size(self) -> int:
        return self.registry.chunk_size

    @chunk_size.setter
    def chunk_size(self, value: int) -> None:
        self.registry.chunk_size = value

    # -- blobs --------------------------------------------------------------------------------

    def has_blob(self, sha256: str) -> bool:
        if not HEX64.match(sha256):
            raise StoreError(f"{sha256!r} is not a sha256 hex digest")
        return self.registry.has(f"sha256:{sha256}")

    def _upload_blob(self, path: str, sha256: str) -> None:
        size = os.path.getsize(path)
        bar = Progress(f"upload {sha256[:12]}", size) if self.progress else None
        try:
            with open(path, "rb") as f:
                self.registry.upload(f"sha256:{sha256}", size, lambda off, n: os.pread(f.fileno(), n, off), bar)
        finally:
            if bar:
                bar.close()

    def stream_blob(self, sha256: str, size: int | None = None) -> BlobStream:
        """Ranged GETs of part_size, concurrency at a time, streamed in order to the reader
        (stream.BlobStream). The first answer tells the size (Content-Range) and whether the
        registry honours Range at all; one that does not is read as one streamed GET. Resets,
        timeouts, 429 and 5xx are retried before a body (Registry.request); a body cut short is
        asked for again from where it broke off."""
        if not HEX64.match(sha256):
            raise StoreError(f"{sha256!r} is not a sha256 hex digest")
        digest, what = f"sha256:{sha256}", f"blob {sha256[:12]}"

        def open_range(start: int, end: int) -> Answer:
            part = self.registry.blob_part(digest, start, end, what)
            if part is None:
                raise BlobMissing(
                    f"blob {sha256} is missing from {self.url}: the registry is damaged or it was "
                    "deleted; publish the artifact again"
                )
            return part

        return BlobStream(
            sha256,
            open_range,
            size=size,
            where=self.url,
            part_size=self.part_size,
            threads=self.concurrency,
            probe_first=True,
            deadline=self.deadline,
        )

    lists_blobs = False

    def list_blobs(self) -> list[Blob]:
        """A registry lists no blobs: the layers whose manifests this handle deleted (gc unlinks
        them); a layer no manifest names is freed by the registry's own garbage collection."""
        return sorted(self._released.values())

    def delete_blob(self, sha256: str) -> None:
        """Unlink the layer from the repository where the registry allows it; its storage is freed
        by the registry's garbage collection either way (a refusal is not an error here)."""
        registry = self.registry
        resp = registry.request(
            "DELETE", registry.blob_url(f"sha256:{sha256}"), what=f"blob {sha256[:12]}", action="delete"
        )
        resp.close()
        self._released.pop(sha256, None)
        if resp.status_code in (200, 202, 204, 404, 405) or "UNSUPPORTED" in error_codes(resp):
            return
        raise registry.error(resp, "delete", f"blob {sha256[:12]}")

    # -- manifests ----------------------------------------------------------------------------

    def _get_config(self, desc: dict, limit: int, what: str, fix: str = "remove it with `warmer rm`") -> bytes:
        digest, size = desc.get("digest", ""), desc.get("size")
        if not isinstance(digest, str) or not re.match(r"^sha256:[0-9a-f]{64}$", digest) or not isinstance(size, int):
            raise UnreadableEntry(
                f"{what} in {self.host}/{self.repo} names no sha256 config: not written by warmer; remove the tag"
            )
        if size >= limit:
            raise IndexTooLarge(
                f"{what} in {self.url} is larger than {limit - 1} bytes: refused (not written by "
                "warmer); remove it with `warmer rm`"
            )
        try:
            resp, body = self.registry.get_small(
                self.registry.blob_url(digest),
                f"the config of {what}",
                size,
                check=lambda b: "sha256:" + hashlib.sha256(b).hexdigest() == digest,
            )
        except Garbled as e:  # bytes that never hashed (not a body cut short each time): unreadable
            if not e.mismatched:
                raise StoreError(
                    f"the config of {what} never arrived whole from {self.url} in {self.registry.attempts} "
                    "reads: check the network to the registry"
                ) from None
            raise UnreadableEntry(
                f"the config of {what} from {self.url} did not hash to {digest} in {self.registry.attempts} "
                "reads: corrupt in the registry or altered on the way; not used"
            ) from None
        if resp.status_code == 404:
            raise UnreadableEntry(f"the config blob of {what} is missing from {self.url}: {fix}")
        if body is None:
            raise self.registry.error(resp, "read", f"the config of {what}")
        return body

    def _put_manifest(self, tag: str, manifest: bytes, digest: str, what: str) -> bool:
        """Tag manifest unless the tag exists; True when the tag still names it once racers have
        landed. Either way the tag has settled when this returns, so that a loser's next read
        shows the winner."""
        began = time.monotonic()
        tagged = self.registry.tag_digest(tag) is None and self._put_tag(tag, manifest, digest, what)
        if self.settle_s > 0:  # any racer whose HEAD also found the tag absent has landed its PUT by then
            # never past the deadline: the read below then says the deadline passed
            time.sleep(min(max(self.settle_s, 2 * (time.monotonic() - began)), self.registry.deadline.left()))
        return tagged and self.registry.tag_digest(tag) == digest

    def _put_tag(self, tag: str, manifest: bytes, digest: str, what: str) -> bool:
        """PUT the manifest under tag; False when an immutable tag refused it (another was first)."""
        registry = self.registry
        url = registry.manifest_url(tag)
        for attempt in range(registry.attempts):
            try:
                resp = registry.request(
                    "PUT",
                    url,
                    what=what,
                    action="publish",
                    data=manifest,
                    retry=False,
                    headers={"Content-Type": MANIFEST_TYPE},
                )
            except Unreachable:
                resp = None
            if resp is not None:
                resp.close()
                if resp.status_code == 201:
                    got = resp.headers.get("Docker-Content-Digest")
                    if got and got != digest:
                        raise StoreError(
                            f"registry {self.host} stored the manifest of {what} as {got}, not {digest}: "
                            "it rewrites manifests; use another registry"
                        )
                    return True
                if resp.status_code not in RETRY_STATUS:
                    now = registry.tag_digest(tag)
                    if now is not None and now != digest:  # an immutable tag refused: another was first
                        return False
                    raise registry.error(resp, "publish", what, size=len(manifest), config_type=CONFIG_TYPE)
            # Reset or 5xx: did it land? A blind retry could overwrite a publisher who came since.
            now = registry.tag_digest(tag)
            if now is not None:
                return now == digest
            why = f"HTTP {resp.status_code}" if resp is not None else "no answer"
            registry.backoff(attempt + 1, why, f"PUT {what}")
        raise StoreError(
            f"publish {what} to {self.host}/{self.repo} failed after {registry.attempts} attempts: "
            "check the registry and publish again"
        )

    def _manifest(
        self, config: bytes, config_type: str, artifact_type: str, layers: list[dict], annotations: dict[str, str]
    ) -> bytes:
        doc = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "artifactType": artifact_type,
            "config": {
                "mediaType": config_type,
                "digest": "sha256:" + hashlib.sha256(config).hexdigest(),
                "size": len(config),
            },
            "layers": layers,
            "annotations": annotations,
        }
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    # -- index --------------------------------------------------------------------------------

    def _create_index(self, rel: str, entry: bytes) -> bool:
        if rel.startswith("audit/") and rel.endswith(".json"):
            return self._create_audit(rel[len("audit/") : -len(".json")], entry)
        names = parse_index_path(rel)
        if not names:
            raise StoreError(f"{rel!r} is not an index entry's name")
        recipe, key = names
        tag = index_tag(recipe, key)
        try:
            doc = json.loads(entry)
            art = doc["artifact"]
            if doc["recipe"] != recipe or doc["key"] != key:
                raise ValueError("names another artifact")
            if doc.get("schema") == LAYERED_SCHEMA:  # its blobs: a layer per cache component
                if "blob" in doc:
                    raise ValueError("a layered entry names a blob")
                layers = _layer_descriptors(art.get("layers"), tag)
            else:
                blob = doc["blob"]
                if not HEX64.match(blob["sha256"]):
                    raise ValueError("its blob is no sha256")
                layers = [
                    {
                        "mediaType": LAYER_TYPE,
                        "digest": f"sha256:{blob['sha256']}",
                        "size": int(blob["size"]),
                        "annotations": {ANN_TITLE: f"{tag}.tar.zst"},
                    }
                ]
            created = str(doc["published_at"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise StoreError(f"index entry {recipe}/{key} to publish is malformed ({e}): a bug in warmer") from None
        config = canonical(art)
        annotations = {
            ANN_RECIPE: recipe,
            ANN_KEY: key,
            ANN_CREATED: created,
            ANN_SCHEMA: json.dumps(doc.get("schema")),
        }
        if doc.get("signature") is not None:
            annotations[ANN_SIGNATURE] = json.dumps(doc["signature"], separators=(",", ":"), sort_keys=True)
        extra = {k: v for k, v in doc.items() if k not in ENTRY_FIELDS}
        if extra:
            annotations[ANN_EXTRA] = json.dumps(extra, separators=(",", ":"), sort_keys=True)
        manifest = self._manifest(config, CONFIG_TYPE, ARTIFACT_TYPE, layers, annotations)
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        for layer in layers:  # a manifest may name only blobs the repository holds
            if not self.registry.has(layer["digest"]):
                raise BlobMissing(
                    f"blob {layer['digest'][len('sha256:') :]} is not in {self.url}: upload it before its index entry"
                )
        self.registry.upload_bytes(config)
        return self._put_manifest(tag, manifest, digest, f"{recipe}/{key[:16]}")

    def _create_audit(self, name: str, record: bytes) -> bool:
        tag = audit_tag(name)
        self.registry.upload_bytes(record)
        empty = self.registry.upload_bytes(EMPTY)
        layer = {"mediaType": EMPTY_TYPE, "digest": empty, "size": len(EMPTY)}
        annotations = {ANN_AUDIT: name, ANN_CREATED: datetime.now(UTC).isoformat(timespec="seconds")}
        manifest = self._manifest(record, AUDIT_CONFIG_TYPE, AUDIT_TYPE, [layer], annotations)
        return self._put_manifest(tag, manifest, "sha256:" + hashlib.sha256(manifest).hexdigest(), f"audit {name}")

    def _read_index(self, rel: str, limit: int) -> bytes | None:
        if rel.startswith("audit/") and rel.endswith(".json"):
            name = rel[len("audit/") : -len(".json")]
            got = self.registry.get_manifest(audit_tag(name))
            if got is None or got[1].get("annotations", {}).get(ANN_AUDIT) != name:
                return None
            return self._get_config(got[1].get("config") or {}, limit, f"audit {name}")[:limit]
        names = parse_index_path(rel)
        if not names:
            raise StoreError(f"{rel!r} is not an index entry's name")
        recipe, key = names
        got = self.registry.get_manifest(index_tag(recipe, key))
        if got is None:
            return None
        what = f"index entry {recipe}/{key[:16]}"
        manifest = self._warmer_manifest(got[1], index_tag(recipe, key))
        ann = manifest.get("annotations") or {}
        if ann.get(ANN_KEY) != key or ann.get(ANN_RECIPE) != recipe:
            return None  # another key sharing the first 16 hex digits: not this artifact
        # the entry's manifest names it: publish cannot read the entry to mend it, rm can remove it
        fix = f"`warmer rm {self.url}/index/{recipe}/{key} --yes`, then publish the artifact again"
        config = self._get_config(manifest["config"], limit, what, fix)
        return self._entry(manifest, config, what)[:limit]

    def _foreign_fix(self, tag: str) -> str:
        return (
            "remove the tag with the registry's own tools (`skopeo delete "
            f"{'--tls-verify=false ' if self.base.startswith('http://') else ''}"
            f"docker://{self.host}/{self.repo}:{tag}`, "
            "or its UI), or keep warmer's artifacts in a repository of their own"
        )

    def _warmer_manifest(self, manifest: dict, tag: str) -> dict:
        config, layers = manifest.get("config") or {}, manifest.get("layers")
        if config.get("mediaType") != CONFIG_TYPE or not isinstance(layers, list) or not layers:
            raise UnreadableEntry(
                f"tag {tag} in {self.host}/{self.repo} is not a warmer artifact (config "
                f"{config.get('mediaType')!r}): {self._foreign_fix(tag)}"
            )
        return manifest

    def _entry(self, manifest: dict, config: bytes, what: str) -> bytes:
        ann, layers = manifest.get("annotations") or {}, manifest["layers"]
        try:
            blobs = []
            for layer in layers:
                digest, size = layer["digest"], layer["size"]
                if layer.get("mediaType") != LAYER_TYPE or not DIGEST.match(digest) or not isinstance(size, int):
                    raise ValueError("a layer is not a warmer cache")
                blobs.append({"sha256": digest[len("sha256:") :], "size": size})
            schema = json.loads(ann.get(ANN_SCHEMA, "1"))
            entry = {"schema": schema, "recipe": ann[ANN_RECIPE], "key": ann[ANN_KEY]}
            if schema != LAYERED_SCHEMA:
                if len(blobs) != 1:
                    raise ValueError(f"{len(blobs)} layers, not the one blob of a schema {schema} entry")
                entry["blob"] = blobs[0]
            entry |= {
                "signature": json.loads(ann[ANN_SIGNATURE]) if ANN_SIGNATURE in ann else None,
                "published_at": ann[ANN_CREATED],
            }
            extra = json.loads(ann[ANN_EXTRA]) if ANN_EXTRA in ann else {}
            if not isinstance(extra, dict):
                raise ValueError("its extra fields are not an object")
            entry.update({k: v for k, v in extra.items() if k not in entry and k != "artifact"})
            # One JSON object, checked as such without building it (every object but the layers is
            # dropped as it is read): the entry takes config's bytes as they are, and the node's
            # reader of entries finds artifact.json's files list as written (warmer.artifact.load).
            if not config.lstrip().startswith(b"{"):
                raise ValueError("its config is not a JSON object")
            top = json.loads(config, object_pairs_hook=_layers_kept if schema == LAYERED_SCHEMA else _dropped)
            if schema == LAYERED_SCHEMA:
                # The manifest's layers are what the registry keeps: they must be the signed ones.
                listed = [{"sha256": x["sha256"], "size": x["size"]} for x in (top or {}).get("layers") or []]
                if not listed or listed != blobs:
                    raise ValueError("its layers are not those its artifact.json lists")
            elif top is not None:
                raise ValueError("its config is not a JSON object")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise UnreadableEntry(
                f"{what} in {self.url} is unreadable ({e}): remove it, or publish again under a new key"
            ) from None
        return b"".join((b'{"artifact":', config.strip(), b",", json.dumps(entry, separators=(",", ":")).encode()[1:]))

    def list_index(self, recipe: str | None = None) -> list[tuple[str, str]]:
        candidates = [
            t
            for t in self.registry.tags()
            if (m := INDEX_TAG.match(t)) and NAME.match(m["recipe"]) and (recipe is None or m["recipe"] == recipe)
        ]

        def key_of(tag: str) -> tuple[str, str] | None:
            got = self.registry.get_manifest(tag)
            if got is None:
                return None  # deleted since the listing
            ann = got[1].get("annotations") or {}
            m = INDEX_TAG.match(tag)  # matches: every candidate did
            key, name = ann.get(ANN_KEY), ann.get(ANN_RECIPE)
            if m and isinstance(key, str) and HEX64.match(key) and key[:16] == m["key16"] and name == m["recipe"]:
                return name, key
            return None  # not a warmer artifact, or annotated for another tag: not an entry

        return sorted({rk for rk in map_on_daemon_threads(key_of, candidates, 8) if rk})

    def pinned_by(self, recipe: str, key: str) -> str | None:
        got = self.registry.get_manifest(index_tag(recipe, key))
        return None if got is None else self._other_tag(index_tag(recipe, key), got[0])

    def _other_tag(self, tag: str, digest: str) -> str | None:
        """A tag someone added by hand (`oras tag`, `crane tag`) to the manifest that tag names."""
        registry = self.registry
        others = [t for t in registry.tags() if t != tag and not INDEX_TAG.match(t) and not t.startswith(AUDIT_PREFIX)]
        return next((other for other in others if registry.tag_digest(other) == digest), None)

    def refuses_delete(self, recipe: str, key: str) -> str | None:
        got = self.registry.get_manifest(index_tag(recipe, key))
        return None if got is None else self._refusal(recipe, key, *got)

    def _refusal(self, recipe: str, key: str, digest: str, manifest: dict) -> str | None:
        tag = index_tag(recipe, key)
        ann = manifest.get("annotations") or {}
        if ann.get(ANN_KEY) != key and not (ann.get(ANN_RECIPE) == recipe and HEX64.match(str(ann.get(ANN_KEY)))):
            return (  # rm must not say removed: publish and fetch still stop at this tag
                f"tag {tag} in {self.host}/{self.repo} holds no warmer artifact, and warmer deletes only what it "
                f"wrote: {self._foreign_fix(tag)}"
            )
        other = self._other_tag(tag, digest) if ann.get(ANN_KEY) == key else None
        if other is not None:
            return (
                f"manifest {digest} of {recipe}/{key[:16]} is also tagged {other} in "
                f"{self.host}/{self.repo}: deleting it would delete that tag too; remove the tag "
                "first, or keep the artifact"
            )
        return None

    def delete_index(self, recipe: str, key: str) -> None:
        registry = self.registry
        got = registry.get_manifest(index_tag(recipe, key))
        if got is None:
            return
        digest, manifest = got
        refusal = self._refusal(recipe, key, digest, manifest)
        if refusal is not None:
            raise StoreError(refusal)
        ann = manifest.get("annotations") or {}
        if ann.get(ANN_KEY) != key:
            return  # another key's artifact, sharing the tag's 16 hex digits: this key has none
        resp = registry.request("DELETE", registry.manifest_url(digest), what=f"{recipe}/{key[:16]}", action="delete")
        resp.close()
        if resp.status_code not in (200, 202, 204, 404):
            raise registry.error(resp, "delete", f"{recipe}/{key[:16]}")
        try:
            when = datetime.fromisoformat(ann.get(ANN_CREATED, ""))
            when = when if when.tzinfo else when.replace(tzinfo=UTC)
        except ValueError:
            when = datetime.now(UTC)
        layers = manifest.get("layers")
        for layer in layers if isinstance(layers, list) else []:  # every layer: a layered entry has many
            if not isinstance(layer, dict) or layer.get("mediaType") != LAYER_TYPE:
                continue
            found, size = layer.get("digest"), layer.get("size")
            if isinstance(found, str) and DIGEST.match(found):
                sha = found[len("sha256:") :]
                self._released[sha] = Blob(sha, size if isinstance(size, int) else 0, when)
