"""Signed artifacts: with a trusted key configured, unsigned or wrongly signed ones are refused."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from tests.conftest import REPO, run_warmer, tiny_recipe, write_tiny_recipe
from warmer import api, build, fetch, restore, signing
from warmer.store import open_store


def _keypair(dir: Path, name: str) -> tuple[Path, Path]:
    key = ed25519.Ed25519PrivateKey.generate()
    private, public = dir / f"{name}.key", dir / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture
def setup(tmp_path, packed):
    art = packed("a").path
    keys = {name: _keypair(tmp_path, name) for name in ("builder", "stranger")}
    return {"artifact": art, "keys": keys, "store": f"file://{tmp_path / 'store'}", "tmp": tmp_path}


def test_signed_artifact_is_accepted_by_its_key_only(setup):
    private, public = setup["keys"]["builder"]
    published = build.publish(open_store(setup["store"]), setup["artifact"], str(private))
    assert Path(str(setup["artifact"]) + ".sig").exists()
    node = setup["tmp"] / "node"
    ok = fetch.fetch(tiny_recipe(), setup["store"], node, trusted_keys=[public])
    assert ok.status == "hit" and ok.signed_by == json.loads(Path(str(setup["artifact"]) + ".sig").read_text())["key_id"]
    other = setup["tmp"] / "other"
    refused = fetch.fetch(tiny_recipe(), setup["store"], other, trusted_keys=[setup["keys"]["stranger"][1]])
    assert refused.status == "untrusted" and "not among the trusted keys" in " ".join(refused.warnings)
    assert restore.active(other) is None
    assert published.status == "published"


def test_unsigned_artifact_is_refused_when_keys_are_configured(setup):
    build.publish(open_store(setup["store"]), setup["artifact"])
    node = setup["tmp"] / "node"
    got = fetch.fetch(tiny_recipe(), setup["store"], node, trusted_keys=[setup["keys"]["builder"][1]])
    assert got.status == "untrusted" and "unsigned" in " ".join(got.warnings)
    assert restore.active(node) is None
    # Without trusted keys the same artifact is restored: signing is opt-in.
    assert fetch.fetch(tiny_recipe(), setup["store"], node).status == "hit"


def _served_root(got) -> str:
    return got.env.vars["TORCHINDUCTOR_CACHE_DIR"].rsplit("/", 1)[0]


def test_a_root_the_trusted_keys_do_not_cover_is_not_served(setup):
    """Signing turned on after nodes restored unsigned, or a leaked key dropped: the refused (or
    absent) entry leaves the root's old code in place, and vLLM must not be pointed at it."""
    private, public = setup["keys"]["builder"]
    stranger = setup["keys"]["stranger"][1]
    build.publish(open_store(setup["store"]), setup["artifact"], str(private))
    node = setup["tmp"] / "node"
    assert fetch.fetch(tiny_recipe(), setup["store"], node, trusted_keys=[public, stranger]).status == "hit"
    before = restore.active(node).artifact.id
    rotated = fetch.fetch(tiny_recipe(), setup["store"], node, trusted_keys=[stranger])
    assert rotated.status == "untrusted" and _served_root(rotated) != str(node)
    assert any("not signed by a trusted key" in w and "cold start" in w for w in rotated.warnings), rotated.warnings
    assert restore.active(node).artifact.id == before  # left as it is: a trusted artifact replaces it
    # `warmer serve` without fetch's env file (the systemd path: fetch --all, then serve): the same.
    recipe_file = write_tiny_recipe(setup["tmp"] / "tiny.toml")
    for how in (["--trusted-key", str(stranger)], []):
        env = {**os.environ, "WARMER_TRUSTED_KEY": str(stranger)} if not how else None
        served = run_warmer("serve", recipe_file, "--root", node, "--dry-run", *how, env=env)
        assert served.returncode == 0, served.stderr
        assert f"TORCHINDUCTOR_CACHE_DIR={node}/" not in served.stdout and "its code is not loaded" in served.stderr
    trusted = run_warmer("serve", recipe_file, "--root", node, "--dry-run", "--trusted-key", public)
    assert f"TORCHINDUCTOR_CACHE_DIR={node}/inductor" in trusted.stdout, trusted.stdout
    # doctor, which the image's entrypoint runs before serve, tells the same story (it said all was well)
    checked = run_warmer("doctor", "--root", node, env={**os.environ, "WARMER_TRUSTED_KEY": str(stranger)})
    assert checked.returncode == 5 and "ERROR   artifact:" in checked.stdout, checked.stdout + checked.stderr
    assert "not signed by a trusted key" in checked.stdout and "vLLM compiles from cold" in checked.stdout
    assert "not signed by" not in run_warmer("doctor", "--root", node, "--trusted-key", public).stdout
    empty = fetch.fetch(tiny_recipe(), f"file://{setup['tmp'] / 'empty-store'}", node, trusted_keys=[stranger])
    assert empty.status == "miss" and _served_root(empty) != str(node)
    # Still trusted: the root holds this node's own key whole, kept and served (already-active).
    kept = fetch.fetch(tiny_recipe(), f"file://{setup['tmp'] / 'empty-store'}", node, trusted_keys=[public])
    assert kept.status == "already-active" and _served_root(kept) == str(node)
    unsigned = setup["tmp"] / "unsigned"
    assert fetch.fetch(tiny_recipe(), f"file://{setup['tmp'] / 'empty-store'}", unsigned).status == "miss"
    restore.restore_file(setup["artifact"], unsigned)  # restored before signing was turned on
    later = fetch.fetch(tiny_recipe(), f"file://{setup['tmp'] / 'empty-store'}", unsigned, trusted_keys=[public])
    assert _served_root(later) != str(unsigned) and any("unsigned" in w for w in later.warnings)


def test_signing_a_key_published_already_says_what_the_entry_keeps(setup):
    """A published entry never changes: publishing it again with --sign-key cannot sign it, and
    must not say so with a quiet `already-published` while every node refuses the entry."""
    private, public = setup["keys"]["builder"]
    store = open_store(setup["store"])
    first = build.publish(store, setup["artifact"])
    with pytest.raises(build.BuildError, match="already published unsigned") as e:
        build.publish(store, setup["artifact"], str(private))
    assert f"warmer rm {store.url}/index/tiny/{first.key} --yes" in str(e.value)
    api.rm(f"{store.url}/index/tiny/{first.key}", yes=True)
    assert build.publish(store, setup["artifact"], str(private)).status == "published"
    assert fetch.fetch(tiny_recipe(), setup["store"], setup["tmp"] / "node", trusted_keys=[public]).status == "hit"
    rotated = build.publish(store, setup["artifact"], str(setup["keys"]["stranger"][0]))
    assert rotated.status == "already-published"
    assert "stays published signed by key" in " ".join(rotated.warnings or ()), rotated
    assert build.publish(store, setup["artifact"], str(private)).warnings is None


def test_a_signature_that_cannot_be_saved_beside_the_file_still_publishes_signed(setup):
    """An artifact on a read-only mount (here: a directory where FILE.sig would go, which even root
    cannot replace): the signature nodes check is the entry's."""
    private, public = setup["keys"]["builder"]
    signing.sidecar(setup["artifact"]).mkdir()
    published = build.publish(open_store(setup["store"]), setup["artifact"], str(private))
    assert published.status == "published" and "not saved beside the file" in " ".join(published.warnings or ())
    assert fetch.fetch(tiny_recipe(), setup["store"], setup["tmp"] / "node", trusted_keys=[public]).status == "hit"


def test_build_reads_its_signing_key_before_the_warm_up(setup):
    root = setup["tmp"] / "root"
    with pytest.raises(signing.KeyFileError, match="cannot read the private key"):
        build.build(tiny_recipe(), setup["store"], root, setup["tmp"] / "work", sign_key=str(setup["tmp"] / "typo.key"))
    assert not root.exists() and not (setup["tmp"] / "store").exists()


def test_a_tampered_index_entry_fails_its_signature(setup):
    private, public = setup["keys"]["builder"]
    store = open_store(setup["store"])
    published = build.publish(store, setup["artifact"], str(private))
    entry_path = Path(store.base) / "index" / "tiny" / f"{published.key}.json"
    entry = json.loads(entry_path.read_text())
    entry["artifact"]["files"][0]["sha256"] = "0" * 64  # swap in other code for one file
    entry_path.write_text(json.dumps(entry))
    got = fetch.fetch(tiny_recipe(), setup["store"], setup["tmp"] / "node", trusted_keys=[public])
    assert got.status == "untrusted" and "does not match" in " ".join(got.warnings)


def test_restore_of_a_local_file_checks_its_sidecar(setup):
    private, public = setup["keys"]["builder"]
    art = setup["artifact"]
    base = [sys.executable, "-m", "warmer", "restore", str(art), "--trusted-key", str(public), "--root"]
    unsigned = subprocess.run(base + [str(setup["tmp"] / "r1")], capture_output=True, text=True, cwd=REPO)
    assert unsigned.returncode == 1 and "unsigned" in unsigned.stderr
    signing.write_sidecar(art, signing.sign(restore.archive.read_manifest(open(art, "rb")), private))
    signed = subprocess.run(base + [str(setup["tmp"] / "r2")], capture_output=True, text=True, cwd=REPO)
    assert signed.returncode == 0, signed.stderr
    wrong = subprocess.run(base[:-3] + ["--trusted-key", str(setup["keys"]["stranger"][1]), "--root",
                                        str(setup["tmp"] / "r3")], capture_output=True, text=True, cwd=REPO)
    assert wrong.returncode == 1 and "not among the trusted keys" in wrong.stderr
    assert not (setup["tmp"] / "r1").exists() and not (setup["tmp"] / "r3").exists()


@pytest.mark.skipif(not shutil.which("openssl"), reason="openssl is not installed")
def test_keys_made_with_openssl_work(setup):
    key, pub = setup["tmp"] / "ossl.key", setup["tmp"] / "ossl.pub"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", str(key)], check=True)
    subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(pub)], check=True)
    manifest = b'{"files": []}'
    sig = signing.sign(manifest, key)
    assert signing.verify(manifest, sig, [pub]) == sig.key_id
    with pytest.raises(signing.SignatureError, match="does not match"):
        signing.verify(manifest + b" ", sig, [pub])
    with pytest.raises(signing.KeyFileError, match="not an unencrypted PEM"):  # the operator's file: a usage error
        signing.verify(manifest, sig, [setup["artifact"]])
    sm2, sm2_pub = setup["tmp"] / "sm2.key", setup["tmp"] / "sm2.pub"  # a curve cryptography cannot load
    if subprocess.run(["openssl", "genpkey", "-algorithm", "SM2", "-out", str(sm2)], capture_output=True).returncode:
        return
    subprocess.run(["openssl", "pkey", "-in", str(sm2), "-pubout", "-out", str(sm2_pub)], check=True)
    with pytest.raises(signing.KeyFileError, match="not an Ed25519 key"):
        signing.sign(manifest, sm2)
    with pytest.raises(signing.KeyFileError, match="not an Ed25519 key"):
        signing.check_public_keys([sm2_pub])


def test_the_trusted_key_flag_replaces_the_env_keys(setup):
    """Rotating away from a leaked key: --trusted-key NEW beside WARMER_TRUSTED_KEY=OLD trusts NEW alone."""
    old_private, old_public = setup["keys"]["builder"]
    art = setup["artifact"]
    signing.write_sidecar(art, signing.sign(restore.archive.read_manifest(open(art, "rb")), old_private))
    env = {**os.environ, "WARMER_TRUSTED_KEY": str(old_public)}
    cmd = [sys.executable, "-m", "warmer", "restore", str(art), "--root"]
    by_env = subprocess.run(cmd + [str(setup["tmp"] / "r1")], capture_output=True, text=True, cwd=REPO, env=env)
    assert by_env.returncode == 0, by_env.stderr
    new = ["--trusted-key", str(setup["keys"]["stranger"][1])]
    rotated = subprocess.run(cmd + [str(setup["tmp"] / "r2"), *new], capture_output=True, text=True, cwd=REPO, env=env)
    assert rotated.returncode == 1 and "not among the trusted keys" in rotated.stderr
    assert not (setup["tmp"] / "r2").exists()
