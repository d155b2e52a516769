"""A store in an OCI registry (distribution, Harbor, ECR, GHCR, Quay, Artifactory, Zot ...).

    oci://REGISTRY[:PORT]/REPOSITORY      e.g. oci://registry.example.com/ml/warmer-caches

One OCI image manifest per artifact, in ORAS's conventions, so `oras pull`, `crane` and a plain
`curl` read it too:

    manifest   artifactType application/vnd.warmer.artifact.v1, tagged RECIPE--KEY16
    config     artifact.json itself, in its canonical bytes (what ids and signatures are over),
               media type application/vnd.warmer.artifact.v1+json
    layer      the tar.zst, media type application/vnd.warmer.cache.tar+zstd; its digest is
               "sha256:" + the index entry's blob sha256
    annotations  vnd.warmer.recipe, vnd.warmer.key (all 64 hex), org.opencontainers.image.created
               (published_at), vnd.warmer.signature (the signature's JSON, when signed)

The store's index entry is rebuilt from these on read: {"schema", "recipe", "key", "blob",
"artifact", "signature", "published_at"}. An exact lookup is one manifest GET and one config GET;
the tag list (/v2/REPO/tags/list, paginated) is the index.

Tags. A tag is RECIPE--KEY16. Recipe names (^[a-z0-9][a-z0-9._-]{0,99}$) are a subset of the
tag grammar ([A-Za-z0-9_][A-Za-z0-9._-]{0,127}) and 100 + 2 + 16 characters fit in 128, so every
valid recipe name is a valid tag as it is; a name the tag grammar would not take (should the
recipe grammar ever widen) is refused at publish with a StoreError, never rewritten, so that a
tag always reads back as the recipe it names. The recipe is the part before the last "--" (a
recipe may contain "--" itself), and the full key is the manifest's annotation: two keys sharing
16 hex digits read as "absent" for the one not tagged, never as the other.

Audit records (Store.write_audit, kept by `warmer rm`) are manifests of their own, artifactType
application/vnd.warmer.audit.v1, whose config is the record; tagged "_audit.NAME" (truncated with a
digest suffix past 128 characters). No recipe starts with "_", so audit tags never read as index
entries.

First writer wins, as far as a registry allows. Registries have no conditional tag write (no
If-None-Match on a manifest PUT), so publishing is a check and a digest pin: the layer and the
config first (skipped when the registry has them); HEAD the tag (present: already-published); PUT
the manifest under the tag; read the tag back at once and again a settle time later (SETTLE_S, or
twice this publisher's own HEAD-to-read-back time when longer). A tag that then names another
digest means a racer overwrote ours or wrote after us, and this publisher reports
already-published: of publishers whose HEADs all found the tag absent, the last PUT keeps the tag
and every other one is told. The limit: a racer whose PUT lands later than the settle time after
ours overwrites a manifest whose publisher already reported "published" (both artifacts fit the
key; nodes that fetched in between hold the first). A registry with immutable tags (Harbor's
immutability rules, ECR's IMMUTABLE repositories, Artifact Registry) refuses the second PUT, and
that refusal reads as already-published: a true first writer wins. On S3 the same step is one
conditional PutObject (If-None-Match: *), with no settle time.

gc deletes a manifest by its digest (DELETE /v2/REPO/manifests/sha256:...), only after checking
that no tag outside warmer's own names the same digest; the registry's garbage collection then
frees its layer. Registries that refuse deletes through the distribution API: distribution
without storage.delete.enabled, Docker Hub and GHCR (they delete through their own APIs or
retention rules). A registry lists no blobs: list_blobs names the layers whose manifests this
handle deleted, which gc then unlinks (DELETE /v2/REPO/blobs/...) where the registry allows it.

The client: a small one on `requests`, following the OCI distribution spec, rather than the
`oras` Python SDK (oras 0.2.x, evaluated for this store):
  - upload: the SDK's monolithic upload reads the whole blob into memory; its chunked upload is
    sequential PATCHes that restart nothing: a dropped PATCH is resent at the same offset (416)
    instead of asking the registry where the upload stands (GET on the upload's Location) and
    resuming there, which this client does;
  - download: one streamed GET, no ranged parallel parts, no digest check;
  - auth: it reads ~/.docker/config.json only, ignoring DOCKER_CONFIG (how Kubernetes mounts an
    image-pull secret) and REGISTRY_AUTH_FILE; it does run credential helpers and Bearer tokens;
  - retries: every failure (a 400 included) is retried after 2 + 3**n seconds, 503 not at all,
    and errors surface as "Issue with URL: reason" with log lines, not one line naming the fix;
  - custom media types and annotations: fine in both.
What this client needs from the spec is small (blobs: HEAD, POST/PATCH/PUT uploads, ranged GET,
DELETE; manifests: HEAD, GET, PUT, DELETE; tags/list; the token flow), and requests is already
what boto3 and most of the Python world use for HTTP.

Auth, as docker, podman and oras find it: REGISTRY_AUTH_FILE (else podman's
$XDG_RUNTIME_DIR/containers/auth.json), then $DOCKER_CONFIG/config.json (else
~/.docker/config.json); in each, credHelpers[registry], then auths[registry] (auth,
username/password, identitytoken, registrytoken), then credsStore. Challenges: Basic, and Bearer
(the token endpoint asked with those credentials, or anonymously). Credentials are never printed.
Plain HTTP only for a loopback registry (localhost, 127.0.0.1, ::1) or with insecure_registry.

Transfer: uploads are a POST then PATCHes of WARMER_OCI_CHUNK_MIB (16) MiB and a closing PUT;
after a failed PATCH the client asks the registry for the upload's offset and resumes from it.
Downloads are parallel ranged GETs streamed in order into the extraction (warmer.store.stream:
a window of parts in memory, the digest computed on the way), read again twice at most when
the bytes do not hash to the digest, then refused; a registry that ignores Range gets one
streamed GET through the same window. Resets, timeouts, 429, 500, 502, 503 and 504 are retried with backoff, 8 attempts
unless WARMER_OCI_MAX_ATTEMPTS says otherwise, never past the store's deadline, each retry one line
on the "warmer" logger; every request has a connect and a read timeout (warmer.deadline).

requests is imported here only, when an oci:// store is opened.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import random
import re
import subprocess
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from warmer.deadline import Deadline, unbounded
from warmer.errors import UsageError
from warmer.store import (
    HEX64,
    NAME,
    Blob,
    BlobCorrupt,
    BlobMissing,
    BlobStream,
    IndexTooLarge,
    Store,
    StoreError,
    parse_index_path,
)
from warmer.store.progress import Progress
from warmer.store.stream import Cut

MiB = 1 << 20

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.warmer.artifact.v1"
CONFIG_TYPE = "application/vnd.warmer.artifact.v1+json"
LAYER_TYPE = "application/vnd.warmer.cache.tar+zstd"
AUDIT_TYPE = "application/vnd.warmer.audit.v1"
AUDIT_CONFIG_TYPE = "application/vnd.warmer.audit.v1+json"
EMPTY_TYPE = "application/vnd.oci.empty.v1+json"  # OCI 1.1's layer for an artifact without one
EMPTY = b"{}"
ACCEPT = ", ".join(
    [
        MANIFEST_TYPE,
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    ]
)

ANN_RECIPE = "vnd.warmer.recipe"
ANN_KEY = "vnd.warmer.key"
ANN_SIGNATURE = "vnd.warmer.signature"
ANN_SCHEMA = "vnd.warmer.entry-schema"
ANN_EXTRA = "vnd.warmer.entry-extra"  # index entry fields this version does not know, kept as JSON
ANN_AUDIT = "vnd.warmer.audit"
ANN_CREATED = "org.opencontainers.image.created"
ANN_TITLE = "org.opencontainers.image.title"
ENTRY_FIELDS = ("schema", "recipe", "key", "blob", "artifact", "signature", "published_at")

TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
INDEX_TAG = re.compile(r"^(?P<recipe>[a-z0-9][a-z0-9._-]{0,99})--(?P<key16>[0-9a-f]{16})$")
AUDIT_PREFIX = "_audit."
REPO_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
REPOSITORY = re.compile(rf"^{REPO_PART}(?:/{REPO_PART})*$")
HOST = re.compile(r"^(?:\[[0-9a-fA-F:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?$")

MAX_MANIFEST_BYTES = 4 * MiB  # the spec's own suggested limit for manifests
RETRY_STATUS = {429, 500, 502, 503, 504}
MAX_ATTEMPTS = 8
CHUNK_ENV, ATTEMPTS_ENV = "WARMER_OCI_CHUNK_MIB", "WARMER_OCI_MAX_ATTEMPTS"
DOCKER_HUB = ("docker.io", "index.docker.io", "registry-1.docker.io")
# After tagging, a publisher reads the tag back twice: at once, and again after this long (or
# twice its own HEAD-to-read-back time, when longer), so that a racer whose HEAD also found the
# tag absent has landed its PUT by then. See "First writer wins" above.
SETTLE_S = 1.0


def canonical(doc: dict) -> bytes:
    """artifact.json's one byte form (warmer.artifact.dumps): the config blob, byte for byte."""
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


def _dropped(pairs) -> None:
    return None


def index_tag(recipe: str, key: str) -> str:
    tag = f"{recipe}--{key[:16]}"
    if not TAG.match(tag):  # unreachable while recipe names follow NAME; see the module's doc
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


def is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1 : host.index("]")]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
        if value < 1:
            raise ValueError
        return value
    except ValueError:
        raise StoreError(f"{name}={raw!r}: give a whole number of at least 1") from None


# -- credentials ------------------------------------------------------------------------------------


def _auth_files() -> list[Path]:
    """Where docker, podman and oras keep registry credentials, in the order they look."""
    files = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(Path(os.environ["REGISTRY_AUTH_FILE"]))
    elif os.environ.get("XDG_RUNTIME_DIR"):
        files.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    docker = Path(os.environ["DOCKER_CONFIG"]) if os.environ.get("DOCKER_CONFIG") else Path.home() / ".docker"
    files.append(docker / "config.json")
    return files


def _same_registry(name: str, host: str) -> bool:
    """docker's keys come as host, https://host, https://host/v1/ ...: compare hosts only."""
    bare = name.split("://", 1)[-1].split("/", 1)[0].lower()
    if host in DOCKER_HUB:
        return bare in DOCKER_HUB
    return bare == host.lower()


class Credentials:
    """Where credentials for one registry came from (for messages), and what they are."""

    def __init__(
        self,
        source: str,
        username: str | None = None,
        secret: str | None = None,
        identity_token: str | None = None,
        registry_token: str | None = None,
    ):
        self.source, self.username, self.secret = source, username, secret
        self.identity_token, self.registry_token = identity_token, registry_token

    def basic(self) -> str | None:
        if self.username is None or self.secret is None:
            return None
        return "Basic " + base64.b64encode(f"{self.username}:{self.secret}".encode()).decode()


def _helper(name: str, host: str, source: str) -> Credentials | None:
    binary = f"docker-credential-{name}"
    try:
        out = subprocess.run([binary, "get"], input=host.encode(), capture_output=True, timeout=60)
    except FileNotFoundError:
        raise StoreError(
            f"credential helper {binary}, named in {source}, is not on PATH: install it, or "
            "remove credsStore/credHelpers from that file"
        ) from None
    except subprocess.TimeoutExpired:
        raise StoreError(
            f"credential helper {binary} (named in {source}) did not answer in 60 s: "
            "check that it works with `echo HOST | {binary} get`"
        ) from None
    if out.returncode != 0:
        return None  # "credentials not found in native keychain": none for this registry
    try:
        doc = json.loads(out.stdout)
        user, secret = doc["Username"], doc["Secret"]
    except (ValueError, KeyError, TypeError):
        raise StoreError(f"credential helper {binary} answered something other than its JSON: update it") from None
    where = f"{binary} (from {source})"
    if user == "<token>":  # docker's convention for an identity (refresh) token
        return Credentials(where, identity_token=secret)
    return Credentials(where, user, secret)


def find_credentials(host: str) -> Credentials | None:
    for path in _auth_files():
        try:
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            raise StoreError(
                f"cannot read registry credentials from {path} ({type(e).__name__}): fix the file, "
                "or point DOCKER_CONFIG / REGISTRY_AUTH_FILE elsewhere"
            ) from None
        if not isinstance(doc, dict):
            continue
        for name, helper in (doc.get("credHelpers") or {}).items():
            if _same_registry(name, host):
                found = _helper(helper, host, str(path))
                if found:
                    return found
        for name, entry in (doc.get("auths") or {}).items():
            if not _same_registry(name, host) or not isinstance(entry, dict):
                continue
            user, secret = entry.get("username"), entry.get("password")
            if entry.get("auth"):
                try:
                    user, _, secret = base64.b64decode(entry["auth"]).decode().partition(":")
                except (ValueError, UnicodeDecodeError):
                    raise StoreError(
                        f"the auth of {name} in {path} is not base64 of user:password: "
                        "log in again (docker login / oras login)"
                    ) from None
            if user or entry.get("identitytoken") or entry.get("registrytoken"):
                return Credentials(str(path), user, secret, entry.get("identitytoken"), entry.get("registrytoken"))
        if doc.get("credsStore"):
            found = _helper(doc["credsStore"], host, str(path))
            if found:
                return found
    return None


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), {k.lower(): v for k, v in re.findall(r'([A-Za-z_]+)="([^"]*)"', rest)}


class Auth:
    """The Authorization header to send, renewed on a challenge; shared by the transfer threads."""

    def __init__(self, store: OCIStore):
        self.store = store
        self._lock = threading.Lock()
        self._loaded = False
        self.creds: Credentials | None = None
        self.header: str | None = None
        self.generation = 0
        self._scopes: list[str] = []

    def credentials(self) -> Credentials | None:
        if not self._loaded:
            self.creds, self._loaded = find_credentials(self.store.host), True
        return self.creds

    def where(self) -> str:
        return f"the credentials from {self.creds.source}" if self.creds else "no credentials"

    def answer(self, resp, generation: int) -> bool:
        """Renew the header for the 401 resp; False when renewing cannot help."""
        with self._lock:
            if self.generation != generation:  # another thread renewed it meanwhile
                return True
            scheme, params = _challenge(resp.headers.get("WWW-Authenticate", ""))
            creds = self.credentials()
            if scheme == "basic":
                if creds is None or creds.basic() is None or self.header == creds.basic():
                    return False
                self.header = creds.basic()
            elif scheme == "bearer":
                scopes = (params.get("scope") or "").split()
                if (
                    params.get("error") == "insufficient_scope"
                    and (self.header or "").startswith("Bearer ")
                    and all(s in self._scopes for s in scopes)
                ):
                    return False  # the token endpoint granted less than this request needs
                if creds and creds.registry_token and self.header != "Bearer " + creds.registry_token:
                    self.header = "Bearer " + creds.registry_token
                else:
                    self._scopes += [s for s in scopes if s not in self._scopes]
                    self.header = "Bearer " + self._token(params)
            else:
                return False
            self.generation += 1
            return True

    def _token(self, params: dict[str, str]) -> str:
        realm = params.get("realm", "")
        parsed = urllib.parse.urlsplit(realm)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise StoreError(
                f"registry {self.store.host} named no usable token endpoint ({realm!r}): "
                "check the registry's auth configuration"
            )
        if parsed.scheme == "http" and not (self.store.insecure or is_loopback(parsed.netloc)):
            raise StoreError(
                f"registry {self.store.host} asks for credentials to be sent to {realm} over plain "
                "HTTP: refused; serve the token endpoint over HTTPS, or pass --insecure-registry"
            )
        creds = self.credentials()
        query = [("service", params["service"])] if params.get("service") else []
        query += [("scope", s) for s in self._scopes]
        session = self.store.session
        try:
            if creds and creds.identity_token:
                resp = session.post(
                    realm,
                    data=[
                        ("grant_type", "refresh_token"),
                        ("client_id", "warmer"),
                        ("refresh_token", creds.identity_token),
                        *query,
                    ],
                    timeout=self.store._timeouts(),
                )
            else:
                headers = {"Authorization": creds.basic()} if creds and creds.basic() else {}
                resp = session.get(realm, params=query, headers=headers, timeout=self.store._timeouts())
        except self.store.requests.RequestException as e:
            raise StoreError(
                f"cannot reach the token endpoint {realm} of {self.store.host} ({type(e).__name__}): check the network"
            ) from None
        if resp.status_code in (401, 403):
            if creds is None:
                raise StoreError(
                    f"registry {self.store.host} asks for credentials and none were found: {self.store.login_hint()}"
                )
            raise StoreError(
                f"registry {self.store.host} rejected the credentials from {creds.source} "
                f"({resp.status_code} from its token endpoint): log in again "
                f"(docker login {self.store.host}), or fix that file"
            )
        try:
            doc = resp.json()
            token = doc.get("token") or doc.get("access_token")
            if resp.status_code != 200 or not isinstance(token, str) or not token:
                raise ValueError
        except ValueError:
            raise StoreError(
                f"the token endpoint {realm} of {self.store.host} answered {resp.status_code} "
                "without a token: check the registry's auth service"
            ) from None
        return token


# -- the store --------------------------------------------------------------------------------------


class Unreachable(StoreError):
    """The registry could not be reached, or its answers never arrived whole."""


class Garbled(StoreError):
    """A small body (a manifest, a config) arrived cut short or altered every time it was read."""


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
        import requests
        from requests.adapters import HTTPAdapter

        rest = url[len("oci://") :] if url.startswith("oci://") else url
        host, _, repo = rest.strip("/").partition("/")
        if not host or not HOST.match(host) or not repo or not REPOSITORY.match(repo):
            raise UsageError(
                f"store {url!r} is not oci://REGISTRY/REPOSITORY: use e.g. "
                "oci://registry.example.com/team/warmer-caches (a lowercase repository path, "
                "no tag or digest)"
            )
        self.host = "registry-1.docker.io" if host in DOCKER_HUB else host.lower()
        self.repo = repo
        self.url = f"oci://{host}/{repo}"
        self.insecure = insecure_registry
        scheme = "http" if insecure_registry or is_loopback(self.host) else "https"
        self.base = f"{scheme}://{self.host}/v2/{repo}"
        self.progress = progress
        self.deadline = deadline or unbounded()
        self.chunk_size = chunk_size or _env_int(CHUNK_ENV, 16) * MiB
        self.attempts = _env_int(ATTEMPTS_ENV, MAX_ATTEMPTS)
        self.part_size, self.concurrency, self.settle_s = part_size, concurrency, settle_s
        self.requests = requests
        import urllib3

        self.urllib3 = urllib3
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=concurrency + 8, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.session.headers["User-Agent"] = "warmer-oci"
        self.auth = Auth(self)
        self._released: dict[str, Blob] = {}  # layers whose manifests this handle deleted
        from warmer.store.s3 import cap_malloc_arenas  # the same per-thread arena growth as S3's

        cap_malloc_arenas()

    # -- HTTP ---------------------------------------------------------------------------------

    def login_hint(self) -> str:
        return (
            f"run `docker login {self.host}` (or oras/podman login), or mount an image-pull secret as "
            "DOCKER_CONFIG, or point REGISTRY_AUTH_FILE at an auth.json"
        )

    def _timeouts(self) -> tuple[float, float]:
        """requests' (connect, read) timeouts, within the deadline (warmer.deadline)."""
        return self.deadline.connect_timeout, self.deadline.read_timeout

    def _url(self, path: str) -> str:
        return f"{self.base}/{path}"

    def _backoff(self, attempt: int, why: str, what: str, resp=None) -> None:
        """Wait before attempt + 1, saying so; DeadlineExceeded, naming why, when the deadline
        leaves no time for it."""
        after = resp.headers.get("Retry-After") if resp is not None else None
        if after and after.isdigit():
            delay = min(int(after), 30)
        else:  # full jitter: 0.1 s, 0.2 s ... capped at 10 s
            delay = random.uniform(0, min(10.0, 0.1 * 2**attempt))
        if not self.deadline.allows(delay):
            self.deadline.note(f"{why} ({what})")
            raise self.deadline.error(f"{what} from {self.host}")
        self.deadline.retrying(attempt + 1, self.attempts, delay, why, f"{what} from {self.host}")
        time.sleep(delay)

    def _request(
        self,
        method: str,
        url: str,
        *,
        what: str,
        action: str,
        headers: dict | None = None,
        data: bytes | None = None,
        stream: bool = False,
        retry: bool = True,
        params=None,
    ):
        """One request, answered: Authorization added and renewed on a 401; resets, timeouts and
        429/5xx retried with backoff (when retry); anything else returned for the caller to read.
        A connection that fails every time raises Unreachable."""
        renewals = attempt = 0
        while True:
            generation = self.auth.generation
            sent = dict(headers or {})
            if self.auth.header:
                sent["Authorization"] = self.auth.header
            try:
                resp = self.session.request(
                    method, url, headers=sent, data=data, stream=stream, params=params, timeout=self._timeouts()
                )
            except self.requests.exceptions.SSLError as e:
                raise StoreError(
                    f"TLS to {self.host} failed ({_reason(e)}): trust the registry's CA "
                    "(REQUESTS_CA_BUNDLE), or for a plain-HTTP registry pass --insecure-registry"
                ) from None
            except (
                self.requests.ConnectionError,
                self.requests.Timeout,
                self.requests.exceptions.ChunkedEncodingError,
            ) as e:
                attempt += 1
                if retry and attempt < self.attempts:
                    self._backoff(attempt, _reason(e), f"{method} {what}")
                    continue
                tries = f", {attempt} attempts" if attempt > 1 else ""
                raise Unreachable(
                    f"cannot reach the registry {self.host} to {action} {what} ({_reason(e)}{tries}): "
                    "check the store URL and the network"
                ) from None
            if resp.status_code == 401:
                resp.close()
                if renewals == 3 or not self.auth.answer(resp, generation):
                    raise self._unauthorized(resp, action, what)
                renewals += 1
                continue
            if resp.status_code in RETRY_STATUS and retry:
                attempt += 1
                if attempt < self.attempts:
                    resp.close()
                    self._backoff(attempt, f"HTTP {resp.status_code}", f"{method} {what}", resp)
                    continue
            return resp

    def _get_small(self, url: str, what: str, limit: int, headers: dict | None = None, check=None):
        """(response, body) of a GET whose body is at most limit bytes (more is cut off at limit + 1),
        read again when it arrives cut short or check(body) refuses it; body None unless 200."""
        for attempt in range(1, self.attempts + 1):
            resp = self._request("GET", url, what=what, action="read", stream=True, headers=headers)
            with resp:
                if resp.status_code != 200:
                    resp.content  # noqa: B018 - the error body, read before the connection is released
                    return resp, None
                try:
                    body = resp.raw.read(limit + 1, decode_content=True)
                except Exception:
                    body = None
            if body is not None and (check is None or check(body)):
                return resp, body
            if attempt < self.attempts:
                self._backoff(attempt, "cut short or altered", f"GET {what}")
        raise Garbled(
            f"{what} from {self.host} arrived cut short or altered {self.attempts} times: check the "
            "network and the registry"
        )

    def _unauthorized(self, resp, action: str, what: str) -> StoreError:
        scheme, params = _challenge(resp.headers.get("WWW-Authenticate", ""))
        creds = self.auth.credentials()
        if creds is None:
            return StoreError(
                f"registry {self.host} asks for credentials to {action} {what} and none were found: {self.login_hint()}"
            )
        if params.get("error") == "insufficient_scope":
            return self._denied(action, what)
        return StoreError(
            f"registry {self.host} rejected the credentials from {creds.source}: log in again "
            f"(docker login {self.host}), or fix that file"
        )

    def _denied(self, action: str, what: str) -> StoreError:
        need = {"read": "pull", "list": "pull", "publish": "push", "upload": "push", "delete": "delete"}.get(
            action, action
        )
        return StoreError(
            f"access denied to {action} {what} in {self.host}/{self.repo} with {self.auth.where()}: "
            f"grant {need} on the repository (nodes pull; publishers push; gc deletes)"
        )

    def _error(self, resp, action: str, what: str, size: int | None = None) -> StoreError:
        """One line for an answer the caller did not expect: what went wrong and what to do."""
        codes, message = _errors(resp)
        status = resp.status_code
        where = f"{self.host}/{self.repo}"
        if status == 413:
            mib = f"a {size / MiB:.0f} MiB request" if size else "a request"
            return StoreError(
                f"registry {self.host} (or a proxy in front of it) refused {mib} as too large (413) "
                f"to {action} {what}: raise its body limit (nginx: client_max_body_size 0), or lower "
                f"{CHUNK_ENV} (now {self.chunk_size // MiB})"
            )
        if "NAME_UNKNOWN" in codes or (status == 404 and action in ("list", "upload")):
            return StoreError(
                f"repository {self.repo} does not exist in {self.host}: fix the store URL, or create "
                "it (most registries create it on the first publish; ECR: aws ecr create-repository; "
                "Harbor: create the project)"
            )
        if status == 403 or "DENIED" in codes:
            return self._denied(action, what)
        if "UNSUPPORTED" in codes or status == 405:
            if action == "delete":
                return StoreError(
                    f"registry {self.host} does not allow deletes through the registry API ({status}): "
                    "enable them (distribution: storage.delete.enabled: true), or remove old tags with "
                    "the registry's own retention rules"
                )
            return StoreError(
                f"registry {self.host} does not support what {action} {what} needs ({status} "
                f"{', '.join(codes) or resp.reason}): it must speak the OCI distribution API"
            )
        if action == "publish" and (status == 415 or codes & {"MANIFEST_INVALID", "MANIFEST_UNVERIFIED"}):
            return StoreError(
                f"registry {self.host} refused an OCI artifact manifest ({status} "
                f"{', '.join(codes) or resp.reason}{': ' + message if message else ''}): it must take "
                f"OCI image manifests with a custom config media type ({CONFIG_TYPE}); upgrade it "
                "(distribution 2.7+, Harbor 2+) or allow the type (Quay: ALLOWED_OCI_ARTIFACT_TYPES)"
            )
        detail = f"{status} {', '.join(sorted(codes)) or resp.reason}" + (f": {message}" if message else "")
        if status in RETRY_STATUS:
            detail += f" after {self.attempts} attempts"
        return StoreError(f"{action} {what} in {where} failed: {detail}")

    # -- blobs --------------------------------------------------------------------------------

    def _blob_url(self, digest: str) -> str:
        return self._url(f"blobs/{digest}")

    def _has(self, digest: str) -> bool:
        resp = self._request("HEAD", self._blob_url(digest), what=f"blob {digest[7:19]}", action="read")
        resp.close()
        if resp.status_code == 200:
            return True
        if resp.status_code == 404:
            return False
        raise self._error(resp, "read", f"blob {digest[7:19]}")

    def has_blob(self, sha256: str) -> bool:
        if not HEX64.match(sha256):
            raise StoreError(f"{sha256!r} is not a sha256 hex digest")
        return self._has(f"sha256:{sha256}")

    def _upload_blob(self, path: str, sha256: str) -> None:
        size = os.path.getsize(path)
        bar = Progress(f"upload {sha256[:12]}", size) if self.progress else None
        try:
            with open(path, "rb") as f:
                self._upload(f"sha256:{sha256}", size, lambda off, n: os.pread(f.fileno(), n, off), bar)
        finally:
            if bar:
                bar.close()

    def _upload_bytes(self, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if not self._has(digest):
            self._upload(digest, len(data), lambda off, n: data[off : off + n], None)
        return digest

    def _start_upload(self, what: str) -> str:
        resp = self._request(
            "POST", self._url("blobs/uploads/"), what=what, action="upload", headers={"Content-Length": "0"}
        )
        resp.close()
        if resp.status_code != 202 or not resp.headers.get("Location"):
            raise self._error(resp, "upload", what)
        return urllib.parse.urljoin(self.base, resp.headers["Location"])

    def _upload(self, digest: str, size: int, read, bar) -> None:
        """POST a session; PATCH chunks, and after a failed one ask the registry how many bytes it
        holds and go on from there; PUT ?digest= to close it. A blob no larger than a chunk goes
        in the closing PUT alone. A session the registry lost is started again."""
        what = f"blob {digest[7:19]}"
        for _ in range(3):  # whole sessions
            location = self._start_upload(what)
            offset, lost, failures = 0, False, 0
            while size > self.chunk_size and offset < size:
                if failures > self.attempts:
                    raise StoreError(
                        f"upload of {what} to {self.host}/{self.repo} failed {failures} times in a row "
                        "at one offset: check the registry and the network, and publish again"
                    )
                n = min(self.chunk_size, size - offset)
                try:
                    resp = self._request(
                        "PATCH",
                        location,
                        what=what,
                        action="upload",
                        data=read(offset, n),
                        retry=False,
                        headers={
                            "Content-Type": "application/octet-stream",
                            "Content-Range": f"{offset}-{offset + n - 1}",
                            "Content-Length": str(n),
                        },
                    )
                except Unreachable:
                    resp = None
                if resp is not None:
                    resp.close()
                    if resp.status_code == 202:
                        location = urllib.parse.urljoin(self.base, resp.headers.get("Location") or location)
                        offset, failures = offset + n, 0
                        if bar:
                            bar(n)
                        continue
                    if resp.status_code == 404:
                        lost = True
                        break
                    if resp.status_code not in RETRY_STATUS | {416}:
                        raise self._error(resp, "upload", what, size=n)
                    self._backoff(1, f"HTTP {resp.status_code}", f"PATCH {what}", resp)
                # Reset, cut short, 5xx or out of step: where does the upload stand?
                failures += 1
                if failures > 1:
                    self._backoff(failures, "the upload broke off", f"PATCH {what}")
                location, held = self._upload_status(location, what)
                if held is None or held > size:
                    lost = True
                    break
                if bar:
                    bar(held - offset)
                offset = held
            if lost:
                if bar:
                    bar(-offset)
                continue
            body = read(offset, size - offset) if size > offset else b""
            if self._close_upload(location, digest, body, what):
                if bar:
                    bar(len(body))
                return
            if bar:
                bar(-offset)
        raise StoreError(f"upload of {what} to {self.host}/{self.repo} kept losing its session: publish again")

    def _upload_status(self, location: str, what: str) -> tuple[str, int | None]:
        """(Location, bytes the registry holds) of an upload session; None when it is gone."""
        resp = self._request("GET", location, what=what, action="upload")
        resp.close()
        if resp.status_code == 404:
            return location, None
        if resp.status_code != 204:
            raise self._error(resp, "upload", what)
        # "0-N": N+1 bytes held. distribution also answers "0-0" for an empty upload, which the spec
        # leaves ambiguous: read as nothing held (a PATCH from 0 then gets 416 if one byte was).
        m = re.match(r"^(?:bytes=)?0-(-?\d+)$", resp.headers.get("Range", "").strip())
        held = int(m.group(1)) + 1 if m and int(m.group(1)) > 0 else 0
        return urllib.parse.urljoin(self.base, resp.headers.get("Location") or location), max(held, 0)

    def _close_upload(self, location: str, digest: str, body: bytes, what: str) -> bool:
        """PUT ?digest= with the last bytes; False when the session is gone and must start again."""
        parts = urllib.parse.urlsplit(location)
        query = urllib.parse.urlencode(urllib.parse.parse_qsl(parts.query) + [("digest", digest)])
        url = urllib.parse.urlunsplit(parts._replace(query=query))
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(body))}
        try:
            resp = self._request("PUT", url, what=what, action="upload", data=body, headers=headers)
        except Unreachable:
            if self._has(digest):  # the PUT landed and every answer was lost
                return True
            raise
        resp.close()
        if resp.status_code in (201, 204):
            return True
        if resp.status_code in (404, 416) or "BLOB_UPLOAD_UNKNOWN" in _errors(resp)[0]:
            # An earlier try of this PUT landed (its answer lost), or the session is gone.
            return self._has(digest)
        if "DIGEST_INVALID" in _errors(resp)[0]:
            raise StoreError(
                f"{self.host} received bytes for {what} that do not hash to {digest}: something on "
                "the way altered them; publish again"
            )
        raise self._error(resp, "upload", what, size=len(body))

    def stream_blob(self, sha256: str, size: int | None = None) -> BlobStream:
        """Ranged GETs of part_size, concurrency at a time, streamed in order to the reader
        (stream.BlobStream). The first answer tells the size (Content-Range) and whether the
        registry honours Range at all; one that does not is read as one streamed GET. Resets,
        timeouts, 429 and 5xx are retried before a body (_request); a body cut short is asked for again
        from where it broke off."""
        if not HEX64.match(sha256):
            raise StoreError(f"{sha256!r} is not a sha256 hex digest")
        url, what = self._blob_url(f"sha256:{sha256}"), f"blob {sha256[:12]}"

        def open_range(start: int, end: int) -> _Answer:
            resp = self._request(
                "GET",
                url,
                what=what,
                action="read",
                stream=True,
                headers={"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"},
            )
            if resp.status_code == 404:
                resp.close()
                raise BlobMissing(
                    f"blob {sha256} is missing from {self.url}: the registry is damaged or it was "
                    "deleted; publish the artifact again"
                )
            if resp.status_code == 416 and start == 0:  # an empty blob
                resp.close()
                return _Answer(None, 0, False, self.urllib3)
            if resp.status_code == 206:
                m = re.match(r"^bytes (\d+)-(\d+)/(\d+)$", resp.headers.get("Content-Range", ""))
                if not m or int(m.group(1)) != start:
                    resp.close()
                    raise StoreError(
                        f"registry {self.host} answered a ranged GET of {what} with the range "
                        f"{resp.headers.get('Content-Range')!r}: report it to its operators"
                    )
                return _Answer(resp, int(m.group(3)), False, self.urllib3)
            if resp.status_code == 200:  # Range ignored: the whole blob in one stream
                length = resp.headers.get("Content-Length", "")
                return _Answer(resp, int(length) if length.isdigit() else None, True, self.urllib3)
            with resp:
                raise self._error(resp, "read", what)

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

    def list_blobs(self) -> list[Blob]:
        """A registry lists no blobs: the layers whose manifests this handle deleted (gc unlinks
        them); a layer no manifest names is freed by the registry's own garbage collection."""
        return sorted(self._released.values())

    def delete_blob(self, sha256: str) -> None:
        """Unlink the layer from the repository where the registry allows it; its storage is freed
        by the registry's garbage collection either way (a refusal is not an error here)."""
        digest = f"sha256:{sha256}"
        resp = self._request("DELETE", self._blob_url(digest), what=f"blob {sha256[:12]}", action="delete")
        resp.close()
        self._released.pop(sha256, None)
        if resp.status_code in (200, 202, 204, 404, 405) or "UNSUPPORTED" in _errors(resp)[0]:
            return
        raise self._error(resp, "delete", f"blob {sha256[:12]}")

    # -- manifests ----------------------------------------------------------------------------

    def _manifest_url(self, ref: str) -> str:
        return self._url(f"manifests/{ref}")

    def _get_manifest(self, ref: str) -> tuple[str, dict] | None:
        """(digest, manifest) of a tag or digest; None when absent."""

        def check(body: bytes) -> bool:
            if len(body) > MAX_MANIFEST_BYTES:
                return True  # refused below, without reading it again
            if ref.startswith("sha256:"):
                return "sha256:" + hashlib.sha256(body).hexdigest() == ref
            try:
                return isinstance(json.loads(body), dict)
            except ValueError:
                return False

        try:
            resp, body = self._get_small(
                self._manifest_url(ref), f"manifest {ref}", MAX_MANIFEST_BYTES, headers={"Accept": ACCEPT}, check=check
            )
        except Garbled:
            raise StoreError(
                f"manifest {ref} from {self.host}/{self.repo} never arrived whole, or is not JSON, or "
                f"does not hash to its digest: remove it, or check the network"
            ) from None
        if resp.status_code == 404:
            return None
        if body is None:
            raise self._error(resp, "read", f"manifest {ref}")
        if len(body) > MAX_MANIFEST_BYTES:
            raise StoreError(
                f"manifest {ref} in {self.host}/{self.repo} is larger than {MAX_MANIFEST_BYTES} bytes: "
                "refused (not written by warmer)"
            )
        return "sha256:" + hashlib.sha256(body).hexdigest(), json.loads(body)

    def _tag_digest(self, tag: str) -> str | None:
        resp = self._request(
            "HEAD", self._manifest_url(tag), what=f"tag {tag}", action="read", headers={"Accept": ACCEPT}
        )
        resp.close()
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise self._error(resp, "read", f"tag {tag}")
        digest = resp.headers.get("Docker-Content-Digest")
        if digest and digest.startswith("sha256:"):
            return digest
        got = self._get_manifest(tag)  # the header is a SHOULD of the spec: hash the body instead
        return got[0] if got else None

    def _get_config(self, desc: dict, limit: int, what: str) -> bytes:
        digest, size = desc.get("digest", ""), desc.get("size")
        if not isinstance(digest, str) or not re.match(r"^sha256:[0-9a-f]{64}$", digest) or not isinstance(size, int):
            raise StoreError(
                f"{what} in {self.host}/{self.repo} names no sha256 config: not written by warmer; remove the tag"
            )
        if size >= limit:
            raise IndexTooLarge(
                f"{what} in {self.url} is larger than {limit - 1} bytes: refused (not written by "
                "warmer); remove it with `warmer rm`"
            )
        try:
            resp, body = self._get_small(
                self._blob_url(digest),
                f"the config of {what}",
                size,
                check=lambda b: "sha256:" + hashlib.sha256(b).hexdigest() == digest,
            )
        except Garbled:
            raise BlobCorrupt(
                f"the config of {what} from {self.url} did not hash to {digest} in {self.attempts} "
                "reads: corrupt in the registry or altered on the way; not used"
            ) from None
        if resp.status_code == 404:
            raise BlobMissing(f"the config blob of {what} is missing from {self.url}: publish it again")
        if body is None:
            raise self._error(resp, "read", f"the config of {what}")
        return body

    def _put_manifest(self, tag: str, manifest: bytes, digest: str, what: str) -> bool:
        """Tag manifest unless the tag exists; True when the tag still names it once racers have
        landed. Either way the tag has settled when this returns, so that a loser's next read
        shows the winner."""
        began = time.monotonic()
        tagged = self._tag_digest(tag) is None and self._put_tag(tag, manifest, digest, what)
        if self.settle_s > 0:  # any racer whose HEAD also found the tag absent has landed its PUT by then
            time.sleep(max(self.settle_s, 2 * (time.monotonic() - began)))
        return tagged and self._tag_digest(tag) == digest

    def _put_tag(self, tag: str, manifest: bytes, digest: str, what: str) -> bool:
        """PUT the manifest under tag; False when an immutable tag refused it (another was first)."""
        url = self._manifest_url(tag)
        for attempt in range(self.attempts):
            try:
                resp = self._request(
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
                    now = self._tag_digest(tag)
                    if now is not None and now != digest:  # an immutable tag refused: another was first
                        return False
                    raise self._error(resp, "publish", what, size=len(manifest))
            # Reset or 5xx: did it land? A blind retry could overwrite a publisher who came since.
            now = self._tag_digest(tag)
            if now is not None:
                return now == digest
            why = f"HTTP {resp.status_code}" if resp is not None else "no answer"
            self._backoff(attempt + 1, why, f"PUT {what}")
        raise StoreError(
            f"publish {what} to {self.host}/{self.repo} failed after {self.attempts} attempts: "
            "check the registry and publish again"
        )

    def _manifest(
        self, config: bytes, config_type: str, artifact_type: str, layer: dict, annotations: dict[str, str]
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
            "layers": [layer],
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
        try:
            doc = json.loads(entry)
            blob, art = doc["blob"], doc["artifact"]
            if doc["recipe"] != recipe or doc["key"] != key or not HEX64.match(blob["sha256"]):
                raise ValueError("names another artifact")
            size = int(blob["size"])
            created = str(doc["published_at"])
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(f"index entry {recipe}/{key} to publish is malformed ({e}): a bug in warmer") from None
        tag = index_tag(recipe, key)
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
        layer = {
            "mediaType": LAYER_TYPE,
            "digest": f"sha256:{blob['sha256']}",
            "size": size,
            "annotations": {ANN_TITLE: f"{tag}.tar.zst"},
        }
        manifest = self._manifest(config, CONFIG_TYPE, ARTIFACT_TYPE, layer, annotations)
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        if not self._has(layer["digest"]):
            raise BlobMissing(f"blob {blob['sha256']} is not in {self.url}: upload it before its index entry")
        self._upload_bytes(config)
        return self._put_manifest(tag, manifest, digest, f"{recipe}/{key[:16]}")

    def _create_audit(self, name: str, record: bytes) -> bool:
        tag = audit_tag(name)
        self._upload_bytes(record)
        empty = self._upload_bytes(EMPTY)
        layer = {"mediaType": EMPTY_TYPE, "digest": empty, "size": len(EMPTY)}
        annotations = {ANN_AUDIT: name, ANN_CREATED: datetime.now(UTC).isoformat(timespec="seconds")}
        manifest = self._manifest(record, AUDIT_CONFIG_TYPE, AUDIT_TYPE, layer, annotations)
        return self._put_manifest(tag, manifest, "sha256:" + hashlib.sha256(manifest).hexdigest(), f"audit {name}")

    def _read_index(self, rel: str, limit: int) -> bytes | None:
        if rel.startswith("audit/") and rel.endswith(".json"):
            name = rel[len("audit/") : -len(".json")]
            got = self._get_manifest(audit_tag(name))
            if got is None or got[1].get("annotations", {}).get(ANN_AUDIT) != name:
                return None
            return self._get_config(got[1].get("config") or {}, limit, f"audit {name}")[:limit]
        names = parse_index_path(rel)
        if not names:
            raise StoreError(f"{rel!r} is not an index entry's name")
        recipe, key = names
        got = self._get_manifest(index_tag(recipe, key))
        if got is None:
            return None
        what = f"index entry {recipe}/{key[:16]}"
        manifest = self._warmer_manifest(got[1], index_tag(recipe, key))
        ann = manifest.get("annotations") or {}
        if ann.get(ANN_KEY) != key or ann.get(ANN_RECIPE) != recipe:
            return None  # another key sharing the first 16 hex digits: not this artifact
        config = self._get_config(manifest["config"], limit, what)
        return self._entry(manifest, config, what)[:limit]

    def _warmer_manifest(self, manifest: dict, tag: str) -> dict:
        config, layers = manifest.get("config") or {}, manifest.get("layers")
        if config.get("mediaType") != CONFIG_TYPE or not isinstance(layers, list) or len(layers) != 1:
            raise StoreError(
                f"tag {tag} in {self.host}/{self.repo} is not a warmer artifact (config "
                f"{config.get('mediaType')!r}): remove the tag, or keep warmer's artifacts in a "
                "repository of their own"
            )
        return manifest

    def _entry(self, manifest: dict, config: bytes, what: str) -> bytes:
        ann, layer = manifest.get("annotations") or {}, manifest["layers"][0]
        try:
            digest, size = layer["digest"], layer["size"]
            if (
                layer.get("mediaType") != LAYER_TYPE
                or not re.match(r"^sha256:[0-9a-f]{64}$", digest)
                or not isinstance(size, int)
            ):
                raise ValueError("its layer is not a warmer cache")
            entry = {
                "schema": json.loads(ann.get(ANN_SCHEMA, "1")),
                "recipe": ann[ANN_RECIPE],
                "key": ann[ANN_KEY],
                "blob": {"sha256": digest[len("sha256:") :], "size": size},
                "signature": json.loads(ann[ANN_SIGNATURE]) if ANN_SIGNATURE in ann else None,
                "published_at": ann[ANN_CREATED],
            }
            extra = json.loads(ann[ANN_EXTRA]) if ANN_EXTRA in ann else {}
            if not isinstance(extra, dict):
                raise ValueError("its extra fields are not an object")
            entry.update({k: v for k, v in extra.items() if k not in entry and k != "artifact"})
            # One JSON object, checked as such without building it (every object is dropped as it
            # is read): the entry takes config's bytes as they are, and the node's reader of
            # entries finds artifact.json's files list as written (warmer.artifact.load).
            if not config.lstrip().startswith(b"{") or json.loads(config, object_pairs_hook=_dropped) is not None:
                raise ValueError("its config is not a JSON object")
        except (ValueError, KeyError, TypeError) as e:
            raise StoreError(
                f"{what} in {self.url} is unreadable ({e}): remove it, or publish again under a new key"
            ) from None
        return b"".join((b'{"artifact":', config.strip(), b",", json.dumps(entry, separators=(",", ":")).encode()[1:]))

    def _tags(self) -> list[str]:
        """Every tag of the repository, following the Link header page by page."""
        url, params, tags, seen = self._url("tags/list"), {"n": "1000"}, [], set()
        while url:
            resp = self._request(
                "GET", url, what="tags", action="list", params=params, headers={"Accept": "application/json"}
            )
            with resp:
                if resp.status_code != 200:  # 404 NAME_UNKNOWN: a repository nothing was pushed to
                    raise self._error(resp, "list", "tags")
                try:
                    page = resp.json().get("tags") or []
                except ValueError:
                    raise StoreError(
                        f"registry {self.host} answered the tag list of {self.repo} with something "
                        "other than JSON: check that the store URL names a registry"
                    ) from None
                tags += [t for t in page if isinstance(t, str)]
                nxt = resp.links.get("next", {}).get("url")
            if not nxt or nxt in seen:
                break
            seen.add(nxt)
            url, params = urllib.parse.urljoin(url, nxt), None
        return tags

    def list_index(self, recipe: str | None = None) -> list[tuple[str, str]]:
        candidates = [
            t
            for t in self._tags()
            if (m := INDEX_TAG.match(t)) and NAME.match(m["recipe"]) and (recipe is None or m["recipe"] == recipe)
        ]

        def key_of(tag: str) -> tuple[str, str] | None:
            got = self._get_manifest(tag)
            if got is None:
                return None  # deleted since the listing
            ann = got[1].get("annotations") or {}
            m = INDEX_TAG.match(tag)
            key, name = ann.get(ANN_KEY), ann.get(ANN_RECIPE)
            if isinstance(key, str) and HEX64.match(key) and key[:16] == m["key16"] and name == m["recipe"]:
                return name, key
            return None  # not a warmer artifact, or annotated for another tag: not an entry

        with ThreadPoolExecutor(8) as pool:
            found = list(pool.map(key_of, candidates))
        return sorted({rk for rk in found if rk})

    def delete_index(self, recipe: str, key: str) -> None:
        tag = index_tag(recipe, key)
        got = self._get_manifest(tag)
        if got is None:
            return
        digest, manifest = got
        ann = manifest.get("annotations") or {}
        if ann.get(ANN_KEY) != key:
            return  # the tag holds another key's artifact
        others = [t for t in self._tags() if t != tag and not INDEX_TAG.match(t) and not t.startswith(AUDIT_PREFIX)]
        for other in others:  # a tag someone added by hand (`oras tag`, `crane tag`) to this manifest
            if self._tag_digest(other) == digest:
                raise StoreError(
                    f"manifest {digest} of {recipe}/{key[:16]} is also tagged {other} in "
                    f"{self.host}/{self.repo}: deleting it would delete that tag too; remove the tag "
                    "first, or keep the artifact"
                )
        resp = self._request("DELETE", self._manifest_url(digest), what=f"{recipe}/{key[:16]}", action="delete")
        resp.close()
        if resp.status_code not in (200, 202, 204, 404):
            raise self._error(resp, "delete", f"{recipe}/{key[:16]}")
        layers = manifest.get("layers") or []
        if layers and isinstance(layers[0], dict) and str(layers[0].get("digest", "")).startswith("sha256:"):
            sha = layers[0]["digest"][len("sha256:") :]
            try:
                when = datetime.fromisoformat(ann.get(ANN_CREATED, ""))
                when = when if when.tzinfo else when.replace(tzinfo=UTC)
            except ValueError:
                when = datetime.now(UTC)
            if HEX64.match(sha):
                self._released[sha] = Blob(sha, int(layers[0].get("size") or 0), when)


def _errors(resp) -> tuple[set[str], str]:
    """The OCI error codes and the first message of an error answer."""
    try:
        errors = json.loads(resp.content[:65536] or b"{}").get("errors") or []
        codes = {str(e.get("code")) for e in errors if isinstance(e, dict)}
        message = next((str(e.get("message")) for e in errors if isinstance(e, dict) and e.get("message")), "")
        return codes, message.splitlines()[0][:200] if message else ""
    except Exception:
        return set(), ""


def _reason(e: BaseException | None) -> str:
    """A short reason for a transport error, without the URL repeated three levels deep."""
    if e is None:
        return "no answer"
    text = str(e)
    for known in (
        "Connection refused",
        "Connection reset by peer",
        "Read timed out",
        "timed out",
        "Name or service not known",
        "IncompleteRead",
        "Connection aborted",
        "RemoteDisconnected",
        "certificate verify failed",
        "Response ended prematurely",
        "connection broken",
    ):
        if known.lower() in text.lower():
            return known
    return type(e).__name__


class _Answer:
    """A blob GET's answer (206 for a range, 200 for the whole blob), as stream.BlobStream reads it."""

    def __init__(self, resp, total: int | None, whole: bool, urllib3):
        self.resp, self.total, self.whole, self._urllib3 = resp, total, whole, urllib3

    def readinto(self, view) -> int:
        if self.resp is None:
            return 0
        try:
            # read1: what one read of the connection brings (readinto would wait to fill the view,
            # and a trickle would hold this thread past any stop).
            data = self.resp.raw.read1(len(view))
        except (self._urllib3.exceptions.HTTPError, OSError) as e:  # a body cut short, a reset, a timeout
            raise Cut(_reason(e)) from None
        view[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if self.resp is not None:
            self.resp.close()
