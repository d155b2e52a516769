"""The HTTP client of an oci:// store: one repository of a registry, spoken to in the OCI
distribution API on `requests` (blobs: HEAD, chunked resumable upload, ranged GET; manifests: HEAD,
GET; tags/list). It retries with backoff within the store's deadline, renews credentials on a 401
(auth.py) and turns an answer it did not expect into one line naming the fix. It knows nothing of
warmer's tags and index entries (store.py). requests is imported only when a client is made.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
import urllib.parse

from warmer.deadline import Deadline, unbounded
from warmer.errors import StoreError, Terminated, UsageError
from warmer.store.oci.auth import DOCKER_HUB, Auth, challenge, is_loopback, login_hint
from warmer.store.stream import Cut

MiB = 1 << 20

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
ACCEPT = ", ".join(
    [
        MANIFEST_TYPE,
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    ]
)
MAX_MANIFEST_BYTES = 4 * MiB  # the spec's own suggested limit for manifests
RETRY_STATUS = {429, 500, 502, 503, 504}
MAX_ATTEMPTS = 8
CHUNK_ENV, ATTEMPTS_ENV = "WARMER_OCI_CHUNK_MIB", "WARMER_OCI_MAX_ATTEMPTS"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:  # unset, or set blank (an empty ConfigMap key): the default, as for every other variable
        return default
    try:
        value = int(raw)
        if value < 1:
            raise ValueError
        return value
    except ValueError:
        raise UsageError(f"{name}={raw!r}: give a whole number of at least 1") from None


class Unreachable(StoreError):
    """The registry could not be reached, or its answers never arrived whole."""


class Garbled(StoreError):
    """A small body (a manifest, a config) arrived cut short or altered every time it was read.
    mismatched: some read arrived whole and was refused (its bytes are bad), not only broken off."""

    def __init__(self, message: str, mismatched: bool = False):
        super().__init__(message)
        self.mismatched = mismatched


class Registry:
    """One repository in a registry: the session, the credentials and every request to it.

    host and repo as the store URL names them (validated by the caller); plain HTTP for a loopback
    host or with insecure. chunk_size: the PATCH size of uploads (WARMER_OCI_CHUNK_MIB, 16 MiB);
    deadline bounds every request and retry, and may be replaced later."""

    def __init__(
        self,
        host: str,
        repo: str,
        *,
        insecure: bool = False,
        chunk_size: int | None = None,
        concurrency: int = 8,
        deadline: Deadline | None = None,
    ):
        import requests
        import urllib3
        from requests.adapters import HTTPAdapter

        self.host = "registry-1.docker.io" if host in DOCKER_HUB else host.lower()
        self.repo = repo
        self.insecure = insecure
        scheme = "http" if insecure or is_loopback(self.host) else "https"
        self.base = f"{scheme}://{self.host}/v2/{repo}"
        self.deadline = deadline or unbounded()
        self.chunk_size = chunk_size or _env_int(CHUNK_ENV, 16) * MiB
        self.attempts = _env_int(ATTEMPTS_ENV, MAX_ATTEMPTS)
        self.requests, self.urllib3 = requests, urllib3
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=4, pool_maxsize=concurrency + 8, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.session.headers["User-Agent"] = "warmer-oci"
        self.auth = Auth(self)

    # -- requests -----------------------------------------------------------------------------

    def timeouts(self) -> tuple[float, float]:
        """requests' (connect, read) timeouts, within the deadline (warmer.deadline) and never past it."""
        left = max(0.1, self.deadline.left())
        return min(self.deadline.connect_timeout, left), min(self.deadline.read_timeout, left)

    def url(self, path: str) -> str:
        return f"{self.base}/{path}"

    def _ours(self, url: str) -> bool:
        """Whether url is on the registry's own scheme, host and port: only there do credentials go
        (an upload Location or a tags Link may name any URL), as docker's client keeps them."""
        return _origin(url) == _origin(self.base)

    def _elsewhere(self, url: str, what: str, asks: bool) -> StoreError:
        """The error for a URL off the registry's origin that wants credentials (asks: it answered
        401; else it is the registry's host over plain http, where they would cross in clear)."""
        there = urllib.parse.urlsplit(url)
        if not asks:
            return StoreError(
                f"registry {self.host} sent warmer to http://{there.netloc} for {what}: its credentials "
                "are not sent in clear. A TLS proxy in front of the registry must set "
                "X-Forwarded-Proto: https (or set distribution's http.relativeurls: true)"
            )
        return StoreError(
            f"registry {self.host} sent warmer to {there.scheme}://{there.netloc} for {what}, which asks "
            f"for credentials: warmer sends them to {self.host} alone. Give the registry the address "
            "the store URL names as its external one (distribution's http.host), or use relative URLs "
            "(http.relativeurls: true)"
        )

    def blob_url(self, digest: str) -> str:
        return self.url(f"blobs/{digest}")

    def manifest_url(self, ref: str) -> str:
        return self.url(f"manifests/{ref}")

    def backoff(self, attempt: int, why: str, what: str, resp=None) -> None:
        """Wait before attempt + 1, saying so; DeadlineExceeded, naming why, when the deadline
        leaves no time for it."""
        after = resp.headers.get("Retry-After") if resp is not None else None
        delay: float
        if after and after.isdigit():
            delay = min(int(after), 30)
        else:  # full jitter: 0.1 s, 0.2 s ... capped at 10 s
            delay = random.uniform(0, min(10.0, 0.1 * 2**attempt))
        if not self.deadline.allows(delay):
            self.deadline.note(f"{why} ({what})")
            raise self.deadline.error(f"{what} from {self.host}")
        self.deadline.retrying(attempt + 1, self.attempts, delay, why, f"{what} from {self.host}")
        time.sleep(delay)

    def request(
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
            # none started past the deadline: a listing abandoned by it (Deadline.call) stops here
            self.deadline.check(f"{method} {what} from {self.host}")
            generation = self.auth.generation
            sent = dict(headers or {})
            if self.auth.header and self._ours(url):
                sent["Authorization"] = self.auth.header
            elif self.auth.header and self.base.startswith("https:") and url.startswith("http:"):
                raise self._elsewhere(url, what, asks=False)
            try:
                resp = self.session.request(
                    method, url, headers=sent, data=data, stream=stream, params=params, timeout=self.timeouts()
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
                    self.backoff(attempt, _reason(e), f"{method} {what}")
                    continue
                tries = f", {attempt} attempts" if attempt > 1 else ""
                raise Unreachable(
                    f"cannot reach the registry {self.host} to {action} {what} ({_reason(e)}{tries}): "
                    "check the store URL and the network"
                ) from None
            if resp.status_code == 401:
                resp.close()
                if not self._ours(url):
                    raise self._elsewhere(url, what, asks=True)
                if renewals == 3 or not self.auth.answer(resp, generation):
                    raise self._unauthorized(resp, action, what)
                renewals += 1
                continue
            if resp.status_code in RETRY_STATUS and retry:
                attempt += 1
                if attempt < self.attempts:
                    resp.close()
                    self.backoff(attempt, f"HTTP {resp.status_code}", f"{method} {what}", resp)
                    continue
            return resp

    def get_small(self, url: str, what: str, limit: int, headers: dict | None = None, check=None):
        """(response, body) of a GET whose body is at most limit bytes (more is cut off at limit + 1),
        read again when it arrives cut short or check(body) refuses it; body None unless 200."""
        refused = False
        for attempt in range(1, self.attempts + 1):
            resp = self.request("GET", url, what=what, action="read", stream=True, headers=headers)
            with resp:
                if resp.status_code != 200:
                    resp.content  # noqa: B018 - the error body, read before the connection is released
                    return resp, None
                try:
                    body = resp.raw.read(limit + 1, decode_content=True)
                except Terminated:  # SIGTERM mid-read: stop, not a body to read again
                    raise
                except Exception:
                    body = None
            if body is not None and (check is None or check(body)):
                return resp, body
            refused = refused or body is not None
            if attempt < self.attempts:
                self.backoff(attempt, "cut short or altered", f"GET {what}")
        raise Garbled(
            f"{what} from {self.host} arrived cut short or altered {self.attempts} times: check the "
            "network and the registry",
            mismatched=refused,
        )

    # -- errors -------------------------------------------------------------------------------

    def _unauthorized(self, resp, action: str, what: str) -> StoreError:
        scheme, params = challenge(resp.headers.get("WWW-Authenticate", ""))
        creds = self.auth.credentials()
        if creds is None:
            return StoreError(
                f"registry {self.host} asks for credentials to {action} {what} and none were found: "
                f"{login_hint(self.host)}"
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

    def error(
        self, resp, action: str, what: str, size: int | None = None, config_type: str | None = None
    ) -> StoreError:
        """One line for an answer the caller did not expect: what went wrong and what to do.
        config_type: the config media type of a manifest being published, named if it is refused."""
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
                f"OCI image manifests with a custom config media type ({config_type}); upgrade it "
                "(distribution 2.7+, Harbor 2+) or allow the type (Quay: ALLOWED_OCI_ARTIFACT_TYPES)"
            )
        detail = f"{status} {', '.join(sorted(codes)) or resp.reason}" + (f": {message}" if message else "")
        if status in RETRY_STATUS:
            detail += f" after {self.attempts} attempts"
        return StoreError(f"{action} {what} in {where} failed: {detail}")

    # -- blobs --------------------------------------------------------------------------------

    def has(self, digest: str) -> bool:
        resp = self.request("HEAD", self.blob_url(digest), what=f"blob {digest[7:19]}", action="read")
        resp.close()
        if resp.status_code == 200:
            return True
        if resp.status_code == 404:
            return False
        raise self.error(resp, "read", f"blob {digest[7:19]}")

    def upload_bytes(self, data: bytes) -> str:
        """Upload data as a blob unless the registry has it; its digest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if not self.has(digest):
            self.upload(digest, len(data), lambda off, n: data[off : off + n], None)
        return digest

    def _start_upload(self, what: str) -> str:
        resp = self.request(
            "POST", self.url("blobs/uploads/"), what=what, action="upload", headers={"Content-Length": "0"}
        )
        resp.close()
        if resp.status_code != 202 or not resp.headers.get("Location"):
            raise self.error(resp, "upload", what)
        return urllib.parse.urljoin(self.base, resp.headers["Location"])

    def upload(self, digest: str, size: int, read, bar) -> None:
        """POST a session; PATCH chunks, and after a failed one ask the registry how many bytes it
        holds and go on from there; PUT ?digest= to close it. A blob no larger than a chunk goes
        in the closing PUT alone. A session the registry lost is started again. read(offset, n)
        gives the bytes; bar(n), when given, counts them (negative: taken back)."""
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
                    resp = self.request(
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
                        raise self.error(resp, "upload", what, size=n)
                    self.backoff(1, f"HTTP {resp.status_code}", f"PATCH {what}", resp)
                # Reset, cut short, 5xx or out of step: where does the upload stand?
                failures += 1
                if failures > 1:
                    self.backoff(failures, "the upload broke off", f"PATCH {what}")
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
        resp = self.request("GET", location, what=what, action="upload")
        resp.close()
        if resp.status_code == 404:
            return location, None
        if resp.status_code != 204:
            raise self.error(resp, "upload", what)
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
            resp = self.request("PUT", url, what=what, action="upload", data=body, headers=headers)
        except Unreachable:
            if self.has(digest):  # the PUT landed and every answer was lost
                return True
            raise
        resp.close()
        if resp.status_code in (201, 204):
            return True
        if resp.status_code in (404, 416) or "BLOB_UPLOAD_UNKNOWN" in _errors(resp)[0]:
            # An earlier try of this PUT landed (its answer lost), or the session is gone.
            return self.has(digest)
        if "DIGEST_INVALID" in _errors(resp)[0]:
            raise StoreError(
                f"{self.host} received bytes for {what} that do not hash to {digest}: something on "
                "the way altered them; publish again"
            )
        raise self.error(resp, "upload", what, size=len(body))

    def blob_part(self, digest: str, start: int, end: int, what: str) -> _Answer | None:
        """Bytes start to end - 1 of a blob, as they arrive (206); the whole blob from a registry
        that ignores Range (200); None when the registry has no such blob."""
        resp = self.request(
            "GET",
            self.blob_url(digest),
            what=what,
            action="read",
            stream=True,
            headers={"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"},
        )
        if resp.status_code == 404:
            resp.close()
            return None
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
            raise self.error(resp, "read", what)

    # -- manifests and tags -------------------------------------------------------------------

    def get_manifest(self, ref: str) -> tuple[str, dict] | None:
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
            resp, body = self.get_small(
                self.manifest_url(ref), f"manifest {ref}", MAX_MANIFEST_BYTES, headers={"Accept": ACCEPT}, check=check
            )
        except Garbled:
            raise StoreError(
                f"manifest {ref} from {self.host}/{self.repo} never arrived whole, or is not JSON, or "
                f"does not hash to its digest: remove it, or check the network"
            ) from None
        if resp.status_code == 404:
            return None
        if body is None:
            raise self.error(resp, "read", f"manifest {ref}")
        if len(body) > MAX_MANIFEST_BYTES:
            raise StoreError(
                f"manifest {ref} in {self.host}/{self.repo} is larger than {MAX_MANIFEST_BYTES} bytes: "
                "refused (not written by warmer)"
            )
        return "sha256:" + hashlib.sha256(body).hexdigest(), json.loads(body)

    def tag_digest(self, tag: str) -> str | None:
        """The digest of the manifest tag names; None when there is no such tag."""
        resp = self.request(
            "HEAD", self.manifest_url(tag), what=f"tag {tag}", action="read", headers={"Accept": ACCEPT}
        )
        resp.close()
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise self.error(resp, "read", f"tag {tag}")
        digest = resp.headers.get("Docker-Content-Digest")
        if digest and digest.startswith("sha256:"):
            return digest
        got = self.get_manifest(tag)  # the header is a SHOULD of the spec: hash the body instead
        return got[0] if got else None

    def tags(self) -> list[str]:
        """Every tag of the repository, following the Link header page by page."""
        url = self.url("tags/list")
        params: dict[str, str] | None = {"n": "1000"}
        tags: list[str] = []
        seen: set[str] = set()
        while url:
            resp = self.request(
                "GET", url, what="tags", action="list", params=params, headers={"Accept": "application/json"}
            )
            with resp:
                if resp.status_code != 200:  # 404 NAME_UNKNOWN: a repository nothing was pushed to
                    raise self.error(resp, "list", "tags")
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


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(parts.scheme)


def _errors(resp) -> tuple[set[str], str]:
    """The OCI error codes and the first message of an error answer."""
    try:
        errors = json.loads(resp.content[:65536] or b"{}").get("errors") or []
        codes = {str(e.get("code")) for e in errors if isinstance(e, dict)}
        message = next((str(e.get("message")) for e in errors if isinstance(e, dict) and e.get("message")), "")
        return codes, message.splitlines()[0][:200] if message else ""
    except Exception:
        return set(), ""


def error_codes(resp) -> set[str]:
    """The OCI error codes of an error answer."""
    return _errors(resp)[0]


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
