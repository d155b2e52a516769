"""Registry credentials, found as docker, podman and oras find them, and the Authorization header
they give (Basic, or a Bearer token from the registry's token endpoint). Credentials are never
printed; they go over plain HTTP only to a loopback host or with --insecure-registry.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import re
import subprocess
import threading
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from warmer.errors import StoreError

if TYPE_CHECKING:
    from warmer.store.oci.client import Registry

DOCKER_HUB = ("docker.io", "index.docker.io", "registry-1.docker.io")


def is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1 : host.index("]")]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def login_hint(host: str) -> str:
    return (
        f"run `docker login {host}` (or oras/podman login), or mount an image-pull secret as "
        "DOCKER_CONFIG, or point REGISTRY_AUTH_FILE at an auth.json"
    )


def _auth_files() -> list[Path]:
    """Where docker, podman and oras keep registry credentials, in the order they look."""
    files = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(Path(os.environ["REGISTRY_AUTH_FILE"]))
    elif os.environ.get("XDG_RUNTIME_DIR"):
        files.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    if os.environ.get("DOCKER_CONFIG"):
        files.append(Path(os.environ["DOCKER_CONFIG"]) / "config.json")
    elif (home := os.path.expanduser("~")) != "~":  # no HOME and no passwd entry (a bare uid): no ~/.docker
        files.append(Path(home) / ".docker" / "config.json")
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
            f"check that it works with `echo {host} | {binary} get`"
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
    """In each auth file: credHelpers[registry], then auths[registry], then credsStore."""
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
        # docker keeps Docker Hub's under its v1 address, in a helper as in auths
        asked = "https://index.docker.io/v1/" if host in DOCKER_HUB else host
        for name, helper in (doc.get("credHelpers") or {}).items():
            if _same_registry(name, host):
                found = _helper(helper, asked, str(path))
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
            found = _helper(doc["credsStore"], asked, str(path))
            if found:
                return found
    return None


def challenge(header: str) -> tuple[str, dict[str, str]]:
    """(scheme, parameters) of a WWW-Authenticate header."""
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), {k.lower(): v for k, v in re.findall(r'([A-Za-z_]+)="([^"]*)"', rest)}


class Auth:
    """The Authorization header to send, renewed on a challenge; shared by the transfer threads."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._lock = threading.Lock()
        self._loaded = False
        self.creds: Credentials | None = None
        self.header: str | None = None
        self.generation = 0
        self._scopes: list[str] = []

    def credentials(self) -> Credentials | None:
        if not self._loaded:
            self.creds, self._loaded = find_credentials(self.registry.host), True
        return self.creds

    def where(self) -> str:
        return f"the credentials from {self.creds.source}" if self.creds else "no credentials"

    def answer(self, resp, generation: int) -> bool:
        """Renew the header for the 401 resp; False when renewing cannot help."""
        with self._lock:
            if self.generation != generation:  # another thread renewed it meanwhile
                return True
            scheme, params = challenge(resp.headers.get("WWW-Authenticate", ""))
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
        registry = self.registry
        realm = params.get("realm", "")
        parsed = urllib.parse.urlsplit(realm)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise StoreError(
                f"registry {registry.host} named no usable token endpoint ({realm!r}): "
                "check the registry's auth configuration"
            )
        if parsed.scheme == "http" and not (registry.insecure or is_loopback(parsed.netloc)):
            raise StoreError(
                f"registry {registry.host} asks for credentials to be sent to {realm} over plain "
                "HTTP: refused; serve the token endpoint over HTTPS, or pass --insecure-registry"
            )
        creds = self.credentials()
        query = [("service", params["service"])] if params.get("service") else []
        query += [("scope", s) for s in self._scopes]
        session = registry.session
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
                    timeout=registry.timeouts(),
                )
            else:
                headers = {"Authorization": creds.basic()} if creds and creds.basic() else {}
                resp = session.get(realm, params=query, headers=headers, timeout=registry.timeouts())
        except registry.requests.RequestException as e:
            raise StoreError(
                f"cannot reach the token endpoint {realm} of {registry.host} ({type(e).__name__}): check the network"
            ) from None
        if resp.status_code in (401, 403):
            if creds is None:
                raise StoreError(
                    f"registry {registry.host} asks for credentials and none were found: {login_hint(registry.host)}"
                )
            raise StoreError(
                f"registry {registry.host} rejected the credentials from {creds.source} "
                f"({resp.status_code} from its token endpoint): log in again "
                f"(docker login {registry.host}), or fix that file"
            )
        try:
            doc = resp.json()
            token = doc.get("token") or doc.get("access_token")
            if resp.status_code != 200 or not isinstance(token, str) or not token:
                raise ValueError
        except ValueError:
            raise StoreError(
                f"the token endpoint {realm} of {registry.host} answered {resp.status_code} "
                "without a token: check the registry's auth service"
            ) from None
        return token
