"""Ed25519 signatures over artifact.json, which lists every file's sha256: who built an artifact.

Keys are PEM files (`openssl genpkey -algorithm ed25519 -out build.key` and
`openssl pkey -in build.key -pubout -out build.pub`). A signature is a small JSON document:
{"alg": "ed25519", "key_id": ..., "signature": base64, "signed_at": ..., "time_signature": base64}
(the last two since signed times order rollbacks); it travels in the store's index entry
and, for local files, beside the artifact as FILE.sig.

What is signed is artifact.json's canonical bytes, and artifact.json names its recipe and its
key: a signature binds the artifact to both, and fetch checks them against its own lookup
(warmer.entry) so that a signed entry copied into another recipe's or key's slot is refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from warmer.atomic import write_bytes
from warmer.errors import UntrustedInput, UsageError
from warmer.untrusted import Fields, InvalidDocument, load_json

ALG = "ed25519"
MAX_SIDECAR_BYTES = 4096


class SignatureError(UntrustedInput):
    """An artifact is unsigned, wrongly signed, or signed by a key that is not trusted."""


class KeyFileError(UsageError):
    """A key file given on the command line cannot be used."""


@dataclass(frozen=True)
class Signature:
    alg: str
    key_id: str
    signature: str  # base64, over artifact.json's canonical bytes
    # When the key signed, and its own signature (over the time and artifact.json's sha256): orders
    # two builds of one key that SOURCE_DATE_EPOCH dates alike, for rollback refusal. A second
    # signature, not a wider first one, so that a node of an older warmer still verifies the first.
    signed_at: str | None = None
    time_signature: str | None = None

    @classmethod
    def from_json(cls, doc: Any, where: str = "signature") -> Signature | None:
        if doc is None:
            return None
        f = Fields(doc, where)
        timed = f.has("signed_at") or f.has("time_signature")
        return cls(
            f.text("alg", max_len=32),
            f.text("key_id", max_len=64),
            f.text("signature", max_len=256),
            f.text("signed_at", max_len=40) if timed else None,
            f.text("time_signature", max_len=256) if timed else None,
        )

    def to_json(self) -> dict:
        timed = {"signed_at": self.signed_at, "time_signature": self.time_signature} if self.signed_at else {}
        return {"alg": self.alg, "key_id": self.key_id, "signature": self.signature, **timed}


def _key_id(public_key) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _load(path: str | Path, private: bool):
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    kind = "private" if private else "public"
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise KeyFileError(f"cannot read the {kind} key {path}: {e.strerror}") from None
    try:
        key = (
            serialization.load_pem_private_key(data, password=None)
            if private
            else serialization.load_pem_public_key(data)
        )
    except (ValueError, TypeError) as e:
        raise KeyFileError(f"{path}: not an unencrypted PEM {kind} key ({e})") from e
    except UnsupportedAlgorithm as e:  # a curve this OpenSSL does not load (SM2, or one a FIPS build bars)
        raise KeyFileError(
            f"{path}: not an Ed25519 key ({e}); make one with `openssl genpkey -algorithm ed25519`"
        ) from e
    wanted = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, wanted):
        raise KeyFileError(f"{path}: not an Ed25519 key; make one with `openssl genpkey -algorithm ed25519`")
    return key


def check_public_keys(paths) -> None:
    """Load every trusted key once, so that a key file the operator mistyped is a KeyFileError
    (a usage error) before anything is fetched, not an artifact refused on every pod."""
    for p in paths:
        _load(p, private=False)


def key_id(private_key: str | Path) -> str:
    """The key id of a private key file's signatures; a KeyFileError (a usage error) when it cannot
    sign, said before a build's warm-up rather than at its publish."""
    return _key_id(_load(private_key, private=True).public_key())


def _time_message(manifest: bytes, signed_at: str) -> bytes:
    return b"warmer signed_at\n" + hashlib.sha256(manifest).hexdigest().encode() + b"\n" + signed_at.encode()


def sign(manifest: bytes, private_key: str | Path, previous: Signature | None = None) -> Signature:
    """manifest's signature by private_key. previous: a signature of manifest by the same key (the
    file's FILE.sig), kept as it is when it verifies, with its time: publishing an older file again
    must not make it the newest of builds that SOURCE_DATE_EPOCH dates alike."""
    from cryptography.exceptions import InvalidSignature

    key = _load(private_key, private=True)
    public = key.public_key()
    if previous is not None and previous.key_id == _key_id(public) and _time_of(manifest, previous, public):
        try:
            public.verify(base64.b64decode(previous.signature, validate=True), manifest)
        except (InvalidSignature, ValueError, binascii.Error):
            pass
        else:
            return previous
    now = datetime.now(UTC).isoformat(timespec="microseconds")
    return Signature(
        ALG,
        _key_id(public),
        base64.b64encode(key.sign(manifest)).decode(),
        now,
        base64.b64encode(key.sign(_time_message(manifest, now))).decode(),
    )


def signed_time(manifest: bytes, signature: Signature | None, trusted_keys: list[str | Path]) -> datetime | None:
    """When the trusted key that signed manifest says it did; None when the signature carries no
    time (an older warmer's) or its time signature does not verify."""
    if signature is None:
        return None
    keys = {_key_id(k): k for k in (_load(p, private=False) for p in trusted_keys)}
    key = keys.get(signature.key_id)
    return _time_of(manifest, signature, key) if key is not None else None


def _time_of(manifest: bytes, signature: Signature, public_key) -> datetime | None:
    """signature's signed time, when its time signature by public_key verifies over manifest."""
    from cryptography.exceptions import InvalidSignature

    if signature.signed_at is None or signature.time_signature is None:
        return None
    try:
        when = datetime.fromisoformat(signature.signed_at)
        if when.tzinfo is None:
            return None
        public_key.verify(
            base64.b64decode(signature.time_signature, validate=True), _time_message(manifest, signature.signed_at)
        )
    except (InvalidSignature, ValueError, binascii.Error):
        return None
    return when


def verify(manifest: bytes, signature: Signature | None, trusted_keys: list[str | Path]) -> str:
    """The key id of the trusted key that signed manifest; raises SignatureError otherwise."""
    from cryptography.exceptions import InvalidSignature

    if signature is None:
        raise SignatureError(
            "the artifact is unsigned and trusted keys are configured: refused (sign it: `warmer rm` its "
            "unsigned entry, then publish it again with --sign-key)"
        )
    if signature.alg != ALG:
        raise SignatureError(f"signature algorithm {signature.alg!r} is not {ALG}")
    keys = {_key_id(k): k for k in (_load(p, private=False) for p in trusted_keys)}
    key = keys.get(signature.key_id)
    if key is None:
        raise SignatureError(
            f"signed by key {signature.key_id}, which is not among the trusted keys ({', '.join(sorted(keys))})"
        )
    try:
        key.verify(base64.b64decode(signature.signature, validate=True), manifest)
    except (InvalidSignature, ValueError, binascii.Error) as e:
        raise SignatureError(f"the signature of key {signature.key_id} does not match this artifact: refused") from e
    return signature.key_id


def sidecar(artifact_file: Path) -> Path:
    return Path(str(artifact_file) + ".sig")


def read_sidecar(path: Path) -> Signature | None:
    """A signature file (FILE.sig beside an artifact, or --signature); None when absent."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SignatureError(f"cannot read the signature file {path}: {e.strerror}") from None
    try:
        return Signature.from_json(load_json(data, what=str(path), max_bytes=MAX_SIDECAR_BYTES), str(path))
    except InvalidDocument as e:
        raise SignatureError(f"{path} is not a signature file: {e}") from None


def write_sidecar(artifact_file: Path, signature: Signature) -> Path:
    path = sidecar(artifact_file)
    write_bytes(path, (json.dumps(signature.to_json(), indent=1) + "\n").encode())
    return path
