"""Ed25519 signatures over artifact.json, which lists every file's sha256: who built an artifact.

Keys are PEM files (`openssl genpkey -algorithm ed25519 -out build.key` and
`openssl pkey -in build.key -pubout -out build.pub`). A signature is a small JSON document:
{"alg": "ed25519", "key_id": ..., "signature": base64}; it travels in the store's index entry
and, for local files, beside the artifact as FILE.sig.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

ALG = "ed25519"


class SignatureError(Exception):
    """An artifact is unsigned, wrongly signed, or signed by a key that is not trusted."""


def _key_id(public_key) -> str:
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _load(path: str | Path, private: bool):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    data = Path(path).read_bytes()
    try:
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except (ValueError, TypeError) as e:
        kind = "private" if private else "public"
        raise SignatureError(f"{path}: not an unencrypted PEM {kind} key ({e})") from e
    wanted = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, wanted):
        raise SignatureError(f"{path}: not an Ed25519 key; make one with `openssl genpkey -algorithm ed25519`")
    return key


def sign(manifest: bytes, private_key: str | Path) -> dict:
    key = _load(private_key, private=True)
    return {"alg": ALG, "key_id": _key_id(key.public_key()),
            "signature": base64.b64encode(key.sign(manifest)).decode()}


def check(manifest: bytes, signature: dict | None, trusted_keys: list[str | Path]) -> str:
    """The key id of the trusted key that signed manifest; raises SignatureError otherwise."""
    from cryptography.exceptions import InvalidSignature

    if not signature:
        raise SignatureError("the artifact is unsigned and trusted keys are configured: refused "
                             "(publish it with --sign-key)")
    if signature.get("alg") != ALG:
        raise SignatureError(f"signature algorithm {signature.get('alg')!r} is not {ALG}")
    keys = {_key_id(k): k for k in (_load(p, private=False) for p in trusted_keys)}
    key = keys.get(signature.get("key_id"))
    if key is None:
        raise SignatureError(f"signed by key {signature.get('key_id')}, which is not among the trusted keys "
                             f"({', '.join(sorted(keys))})")
    try:
        key.verify(base64.b64decode(signature["signature"]), manifest)
    except (InvalidSignature, ValueError, KeyError) as e:
        raise SignatureError(f"the signature of key {signature['key_id']} does not match this artifact: "
                             "refused") from e
    return signature["key_id"]


def read_sidecar(artifact_file: Path) -> dict | None:
    path = Path(str(artifact_file) + ".sig")
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise SignatureError(f"{path} is not a signature file: {e}") from e


def write_sidecar(artifact_file: Path, signature: dict) -> Path:
    path = Path(str(artifact_file) + ".sig")
    path.write_text(json.dumps(signature, indent=1) + "\n")
    return path
