"""A real OCI registry on loopback for the tests: CNCF distribution (Debian's docker-registry, 2.8),
started here with a config file of its own, in three setups:

    no auth     anyone pulls and pushes
    htpasswd    Basic auth against a bcrypt htpasswd file
    token       distribution's `auth: token`: the registry answers with a Bearer challenge, and a
                small token issuer below (a loopback HTTP server) checks Basic credentials and
                signs a JWT with a throwaway RSA key whose self-signed certificate the registry
                trusts (its rootcertbundle); the JWT carries the certificate in its x5c header.

`make test` installs the registry where it can (as root, through apt). Where it is missing the
tests skip with the reason, except under CI=true, where they fail: CI must run them.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.s3server import free_port, start_on_its_own_port

from tests.integration.faultproxy import FaultProxy

BINARIES = ("docker-registry", "registry")  # Debian's name, upstream's
SERVICE, ISSUER = "warmer-test-registry", "warmer-test-issuer"
USER, PASSWORD = "builder", "warmer-oci-secret-must-never-be-printed"
READER, READER_PASSWORD = "node", "warmer-oci-reader-secret"


def registry_binary() -> str:
    for name in BINARIES:
        path = shutil.which(name)
        if path:
            return path
    why = ("the OCI registry (CNCF distribution) is not installed: `apt-get install docker-registry` as root, "
           "or `make test`, which does it where it can")
    if os.environ.get("CI") == "true":
        pytest.fail(why + " (CI must run the OCI tests, not skip them)", pytrace=False)
    pytest.skip(why)


def bcrypt_line(user: str, password: str) -> str:
    """An htpasswd line as distribution reads it (bcrypt only)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # glibc's libxcrypt does bcrypt; the module is gone from Python 3.13

            hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=1 << 4))
        if hashed and hashed.startswith("$2"):
            return f"{user}:{hashed}"
    except ImportError:
        pass
    if shutil.which("htpasswd"):
        out = subprocess.run(["htpasswd", "-nbB", user, password], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    pytest.skip("no bcrypt for the htpasswd file: Python's crypt module (Python < 3.13) or `htpasswd` "
                "(apt-get install apache2-utils)")


@dataclass
class Registry:
    """One running registry; `host` is 127.0.0.1:PORT."""

    proc: subprocess.Popen
    port: int
    storage: Path
    log: Path
    auth: str  # none | htpasswd | token
    issuer: "TokenIssuer | None" = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def repo(self) -> str:
        """A repository of its own for each test."""
        return f"warmer/t{uuid.uuid4().hex[:12]}"

    def url(self, repo: str) -> str:
        return f"oci://{self.host}/{repo}"

    def blob_file(self, repo: str, sha256: str) -> Path:
        """Where distribution's filesystem driver keeps a blob's bytes."""
        return self.storage / "docker/registry/v2/blobs/sha256" / sha256[:2] / sha256 / "data"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.issuer:
            self.issuer.close()


def start_registry(workdir: Path, auth: str = "none", external_host: str | None = None) -> Registry:
    """external_host: the name distribution puts into the URLs it generates (http.host), as a
    registry configured with another address than the one clients use."""
    binary = registry_binary()
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port() if external_host else 0  # 0: it binds one and says which (start_on_its_own_port)
    storage = workdir / "storage"
    lines = ["version: 0.1", "log:", "  level: info", "  accesslog:", "    disabled: true",
             "storage:", "  filesystem:", f"    rootdirectory: {storage}", "  delete:", "    enabled: true",
             "  maintenance:", "    uploadpurging:", "      enabled: false",
             "http:", f"  addr: 127.0.0.1:{port}", f"  secret: {uuid.uuid4().hex}"]
    if external_host:
        lines.append(f"  host: http://{external_host}:{port}")
    issuer = None
    if auth == "htpasswd":
        (workdir / "htpasswd").write_text(bcrypt_line(USER, PASSWORD) + "\n" + bcrypt_line(READER, READER_PASSWORD)
                                          + "\n")
        lines += ["auth:", "  htpasswd:", "    realm: warmer-test", f"    path: {workdir / 'htpasswd'}"]
    elif auth == "token":
        issuer = TokenIssuer(workdir)
        lines += ["auth:", "  token:", f"    realm: {issuer.url}/token", f"    service: {SERVICE}",
                  f"    issuer: {ISSUER}", f"    rootcertbundle: {issuer.cert_file}"]
    elif auth != "none":
        raise ValueError(auth)
    config = workdir / "config.yml"
    config.write_text("\n".join(lines) + "\n")
    log = workdir / "registry.log"
    proc, port = start_on_its_own_port([binary, "serve", str(config)], rb"listening on 127\.0\.0\.1:(\d+)",
                                       log, f"the registry ({binary})")
    return Registry(proc, port, storage, log, auth, issuer)


# -- the token issuer -------------------------------------------------------------------------------

def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenIssuer:
    """distribution's token flow, the issuing half: GET /token?service=&scope=... with Basic auth
    (or none: anonymous), answered with {"token": JWT} granting what the user may do."""

    workdir: Path
    grants: dict[str, tuple[str, set[str]]] = field(default_factory=lambda: {
        USER: (PASSWORD, {"pull", "push", "delete"}), READER: (READER_PASSWORD, {"pull"})})
    requests: list[dict] = field(default_factory=list)

    def __post_init__(self):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import NameOID

        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "warmer test token issuer")])
        now = dt.datetime.now(dt.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self._key.public_key())
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(self._key, hashes.SHA256()))
        self.cert_file = self.workdir / "token-issuer.pem"
        self.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self._x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
        self._lock = threading.Lock()
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                issuer._answer(self)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, h: BaseHTTPRequestHandler) -> None:
        query = parse_qs(urlsplit(h.path).query)
        user = None
        auth = h.headers.get("Authorization", "")
        if auth.startswith("Basic "):
            name, _, password = base64.b64decode(auth[6:]).decode().partition(":")
            if self.grants.get(name, (None,))[0] != password:
                with self._lock:
                    self.requests.append({"user": name, "scopes": query.get("scope", []), "status": 401})
                return self._send(h, 401, {"errors": [{"code": "UNAUTHORIZED", "message": "wrong credentials"}]})
            user = name
        allowed = self.grants[user][1] if user else set()
        access = []
        for scope in query.get("scope", []):
            kind, _, rest = scope.partition(":")
            repo, _, actions = rest.rpartition(":")
            granted = [a for a in actions.split(",") if a in allowed]
            access.append({"type": kind, "name": repo, "actions": granted})
        with self._lock:
            self.requests.append({"user": user, "scopes": query.get("scope", []), "status": 200,
                                  "service": query.get("service", [None])[0]})
        self._send(h, 200, {"token": self.sign(user or "", access), "expires_in": 300})

    def sign(self, subject: str, access: list[dict]) -> str:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self._x5c]}
        claims = {"iss": ISSUER, "sub": subject, "aud": SERVICE, "exp": now + 300, "nbf": now - 10, "iat": now,
                  "jti": uuid.uuid4().hex, "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = self._key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{_b64url(signature)}"

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)


def docker_config(directory: Path, host: str, user: str, password: str) -> Path:
    """A DOCKER_CONFIG directory as `docker login` (or a mounted image-pull secret) leaves it."""
    directory.mkdir(parents=True, exist_ok=True)
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    (directory / "config.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    return directory


class GatewayProxy(FaultProxy):
    """A reverse proxy in front of the registry that answers some requests itself, as the
    gateways in front of real registries do: answer(method, target, body) returns (status,
    reason, headers, body) to send instead of forwarding, or None to forward."""

    def __init__(self, upstream: tuple[str, int], answer):
        self.answer = answer
        super().__init__(upstream)

    def _forward(self, method, target, headers, body):
        return self.answer(method, target, body) or super()._forward(method, target, headers, body)


def body_limit(limit: int):
    """nginx's client_max_body_size (1 MiB unless set): a larger request is answered 413."""
    page = b"<html><body><h1>413 Request Entity Too Large</h1></body></html>"
    return lambda method, target, body: ((413, "Request Entity Too Large", [("Content-Type", "text/html")], page)
                                         if len(body) > limit else None)


def no_oci_artifacts(method, target, body):
    """A registry that takes Docker images only (distribution before 2.7, Quay without OCI
    support): an OCI manifest with a config type of its own is refused, as they refuse it."""
    if method == "PUT" and "/manifests/" in target:
        doc = b'{"errors":[{"code":"MANIFEST_INVALID","message":"manifest invalid","detail":"unknown media type"}]}'
        return 400, "Bad Request", [("Content-Type", "application/json")], doc
    return None
