"""oci:// on a real registry: CNCF distribution 2.8 on loopback (tests/integration/oci_registry.py),
with no auth, with htpasswd, with distribution's token flow, and behind the fault proxy.

The CLI runs in a fresh process as users run it; what is checked is its --json output and what
the registry then holds, read back with plain HTTP (curl) where it matters.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, make_cache_tree, publish_at_once, run_warmer, tiny_recipe, write_tiny_recipe
from tests.integration.conftest import pack_with_big_file
from tests.integration.oci_registry import PASSWORD, READER, READER_PASSWORD, USER, docker_config, free_port
from warmer import archive, build, fetch, restore
from warmer.errors import UsageError
from warmer.store import NAME, BlobCorrupt, StoreError, open_store
from warmer.store.oci import (ARTIFACT_TYPE, CONFIG_TYPE, LAYER_TYPE, MANIFEST_TYPE, TAG, OCIStore, audit_tag,
                              index_tag)

MiB = 1 << 20


def http(method: str, url: str, headers: dict | None = None, auth: tuple[str, str] | None = None,
         data: bytes | None = None):
    """(status, headers, body) of one plain request: what any HTTP client sees."""
    headers = dict(headers or {})
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    req = urllib.request.Request(url, method=method, headers=headers, data=data)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def cli_json(*args, **kw) -> dict | list:
    out = run_warmer(*args, "--json", **kw)
    assert out.returncode == 0, f"warmer {' '.join(map(str, args))} exited {out.returncode}: {out.stderr[-3000:]}"
    return json.loads(out.stdout)


@pytest.fixture
def artifact(tmp_path):
    """The tiny recipe's artifact (55 KB) and its files."""
    root = tmp_path / "build-root"
    files = make_cache_tree(root)
    art = tmp_path / "tiny.tar.zst"
    doc = build.pack_root(root, tiny_recipe(), art, timings={"build": {"init_engine_s": 30.0}}).to_json()
    return {"artifact": art, "doc": doc, "files": files, "sha256": hashlib.sha256(art.read_bytes()).hexdigest(),
            "root": root}


def entry_bytes(art: dict, **over) -> bytes:
    entry = {"schema": 1, "recipe": "tiny", "key": art["doc"]["key"],
             "blob": {"sha256": art["sha256"], "size": art["artifact"].stat().st_size}, "artifact": art["doc"],
             "signature": None, "published_at": "2026-01-02T03:04:05+00:00", **over}
    return json.dumps(entry, separators=(",", ":")).encode()


# -- the store contract, in the three auth setups ---------------------------------------------------

@pytest.fixture(params=["none", "htpasswd", "token"])
def any_registry(request, oci_env):
    """Each registry setup, with a builder's credentials in DOCKER_CONFIG where it needs them."""
    reg = request.getfixturevalue({"none": "oci_registry", "htpasswd": "oci_htpasswd_registry",
                                   "token": "oci_token_registry"}[request.param])
    if reg.auth != "none":
        docker_config(oci_env, reg.host, USER, PASSWORD)
    return reg


def test_the_store_contract(any_registry, artifact, tmp_path):
    reg = any_registry
    repo = reg.repo()
    store = open_store(reg.url(repo))
    sha, key = artifact["sha256"], artifact["doc"]["key"]
    assert not store.has_blob(sha)
    assert store.put_blob(str(artifact["artifact"]), sha) is True
    assert store.has_blob(sha) and store.put_blob(str(artifact["artifact"]), sha) is False
    with store.stream_blob(sha) as f:
        assert f.read() == artifact["artifact"].read_bytes()

    signature = {"alg": "ed25519", "key_id": "ab" * 8, "signature": "c2ln"}
    assert store.put_index("tiny", key, entry_bytes(artifact, signature=signature)) is True
    assert store.put_index("tiny", key, entry_bytes(artifact, published_at="2026-02-02T00:00:00+00:00")) is False
    entry = json.loads(store.get_index("tiny", key))
    assert entry == json.loads(entry_bytes(artifact, signature=signature))  # the first writer's, whole
    assert store.get_index("tiny", "0" * 64) is None
    assert store.get_index("tiny", key[:16] + "0" * 48) is None  # same tag, another key: not this entry
    assert store.list_index() == [("tiny", key)] and store.list_index("other") == []

    store.write_audit("20260102T030405Z-rm-tiny-" + key[:16], b'{"action":"rm"}')
    assert store._read_index(f"audit/20260102T030405Z-rm-tiny-{key[:16]}.json", 1000) == b'{"action":"rm"}'
    assert store.list_index() == [("tiny", key)]  # an audit record is not an index entry

    store.delete_index("tiny", key)
    assert store.get_index("tiny", key) is None and store.list_index() == []
    [released] = store.list_blobs()
    assert (released.sha256, released.size) == (sha, artifact["artifact"].stat().st_size)
    store.delete_blob(sha)
    assert not store.has_blob(sha) and store.list_blobs() == []
    if reg.issuer:  # the token flow ran for real: pushes and deletes asked for, with the builder's name
        asked = {s for r in reg.issuer.requests if r["user"] == USER for s in r["scopes"]}
        assert any(s.startswith(f"repository:{repo}:") and "push" in s for s in asked)
        assert f"repository:{repo}:delete" in asked
        assert {r["service"] for r in reg.issuer.requests if r["status"] == 200} == {"warmer-test-registry"}


def test_without_credentials_the_registry_says_what_to_do(oci_htpasswd_registry, oci_token_registry, oci_env):
    for reg in (oci_htpasswd_registry, oci_token_registry):
        with pytest.raises(StoreError, match=r"asks for credentials .*none were found: run `docker login 127\.0\.0\.1"):
            open_store(reg.url(reg.repo())).list_index()
    docker_config(oci_env, oci_htpasswd_registry.host, USER, "wrong")
    with pytest.raises(StoreError, match=r"rejected the credentials from .*config\.json: log in again"):
        open_store(oci_htpasswd_registry.url("warmer/x")).get_index("tiny", "0" * 64)


def test_a_reader_token_pulls_but_may_not_push(oci_token_registry, oci_env, artifact, tmp_path):
    reg = oci_token_registry
    url = reg.url(reg.repo())
    docker_config(oci_env, reg.host, USER, PASSWORD)
    assert build.publish(open_store(url), artifact["artifact"]).status == "published"
    docker_config(oci_env, reg.host, READER, READER_PASSWORD)
    node = open_store(url)
    got = fetch.fetch(tiny_recipe(), node, tmp_path / "node-root")
    assert got.status == "hit", got.warnings
    with pytest.raises(StoreError, match=r"access denied to upload .* with the credentials from .*config\.json: "
                                         r"grant push on the repository"):
        node.put_blob(str(artifact["artifact"]), "ab" * 32)
    assert {r["user"] for r in reg.issuer.requests} >= {USER, READER}


# -- the loop through the CLI -----------------------------------------------------------------------

def test_publish_fetch_explain_ls_inspect_gc_through_the_cli(oci_registry, oci_env, artifact, tmp_path):
    url = oci_registry.url(oci_registry.repo())
    recipe_file = write_tiny_recipe(tmp_path / "tiny.toml")
    key = artifact["doc"]["key"]

    pub = cli_json("publish", artifact["artifact"], "--store", url)
    assert pub["status"] == "published" and pub["blob_uploaded"] and pub["blob"] == artifact["sha256"]
    again = cli_json("publish", artifact["artifact"], "--store", url)
    assert again["status"] == "already-published" and not again["blob_uploaded"]

    node = tmp_path / "node-root"
    got = cli_json("fetch", recipe_file, "--store", url, "--root", node, "--require")
    assert got["status"] == "hit" and got["key"] == key
    for rel, content in artifact["files"].items():
        assert (node / rel).read_bytes() == content
    assert cli_json("fetch", recipe_file, "--store", url, "--root", node)["status"] == "already-active"

    [row] = cli_json("ls", "--store", url)
    assert (row["recipe"], row["key"], row["blob"]) == ("tiny", key, artifact["sha256"])
    assert row["archive_bytes"] == artifact["artifact"].stat().st_size and row["signed"] is False
    shown = cli_json("inspect", f"{url}/index/tiny/{key[:16]}")
    assert shown["key"] == key and shown["blob"]["sha256"] == artifact["sha256"]
    explained = cli_json("explain", recipe_file, "--store", url)
    assert explained["accepted"] == 1 and explained["candidates"][0]["key"] == key

    # A newer artifact of the same recipe and machine (another engine arg, so another key):
    # gc --keep 1 deletes the older manifest and unlinks its layer.
    newer = tmp_path / "newer.tar.zst"
    newer_doc = build.pack_root(artifact["root"], tiny_recipe(max_model_len=256), newer).to_json()
    newer_entry = json.loads(entry_bytes(artifact))
    newer_entry.update(key=newer_doc["key"], artifact=newer_doc, published_at="2099-01-01T00:00:00+00:00",
                       blob={"sha256": hashlib.sha256(newer.read_bytes()).hexdigest(), "size": newer.stat().st_size})
    store = open_store(url)
    store.put_blob(str(newer), newer_entry["blob"]["sha256"])
    assert store.put_index("tiny", newer_doc["key"], json.dumps(newer_entry).encode())
    assert len(cli_json("ls", "--store", url)) == 2
    dry = cli_json("gc", "--store", url, "--keep", "1", "--dry-run")
    assert [e["key"] for e in dry["deleted_entries"]] == [key] and len(cli_json("ls", "--store", url)) == 2
    gc = cli_json("gc", "--store", url, "--keep", "1")
    assert [e["key"] for e in gc["deleted_entries"]] == [key]
    assert gc["deleted_blobs"] == [artifact["sha256"]] and gc["freed_bytes"] == artifact["artifact"].stat().st_size
    # The dry run said the same (a registry lists no blobs: it said 0 blobs, 0 MB, and the real run unlinked one)
    assert (dry["deleted_blobs"], dry["freed_bytes"]) == (gc["deleted_blobs"], gc["freed_bytes"])
    assert [r["key"] for r in cli_json("ls", "--store", url)] == [newer_doc["key"]]
    base = f"http://{oci_registry.host}/v2/{url.split('/', 3)[3]}"
    assert http("HEAD", f"{base}/manifests/{index_tag('tiny', key)}", {"Accept": MANIFEST_TYPE})[0] == 404
    assert http("HEAD", f"{base}/blobs/sha256:{artifact['sha256']}")[0] == 404
    assert http("HEAD", f"{base}/manifests/{index_tag('tiny', newer_doc['key'])}", {"Accept": MANIFEST_TYPE})[0] == 200


def _older_and_newer(url: str, artifact: dict, tmp_path: Path) -> tuple[str, str]:
    """Two entries of the tiny recipe for one machine kind (the older one the artifact's): keys."""
    store = open_store(url)
    build.publish(store, artifact["artifact"])
    newer = tmp_path / "newer.tar.zst"
    newer_doc = build.pack_root(artifact["root"], tiny_recipe(max_model_len=256), newer).to_json()
    entry = json.loads(entry_bytes(artifact))
    entry.update(key=newer_doc["key"], artifact=newer_doc, published_at="2099-01-01T00:00:00+00:00",
                 blob={"sha256": hashlib.sha256(newer.read_bytes()).hexdigest(), "size": newer.stat().st_size})
    store.put_blob(str(newer), entry["blob"]["sha256"])
    assert store.put_index("tiny", newer_doc["key"], json.dumps(entry).encode())
    return artifact["doc"]["key"], newer_doc["key"]


def test_gc_keeps_an_artifact_that_a_tag_of_its_own_names(oci_registry, oci_env, artifact, tmp_path):
    """A tag someone added to an artifact's manifest (`oras tag ... pinned`) keeps it: gc says so,
    deletes nothing of it, and exits 0 (run after run), as the README promises."""
    url = oci_registry.url(oci_registry.repo())
    older, newer = _older_and_newer(url, artifact, tmp_path)
    base = f"http://{oci_registry.host}/v2/{url.split('/', 3)[3]}"
    status, _, manifest = http("GET", f"{base}/manifests/{index_tag('tiny', older)}", {"Accept": MANIFEST_TYPE})
    assert status == 200
    assert http("PUT", f"{base}/manifests/pinned", {"Content-Type": MANIFEST_TYPE}, data=manifest)[0] == 201
    for args in (("--dry-run",), (), ()):
        out = run_warmer("gc", "--store", url, "--keep", "1", *args)
        assert out.returncode == 0, out.stderr
        assert f"kept: tiny {older[:16]}" in out.stdout and "pinned" in out.stdout, out.stdout
    doc = cli_json("gc", "--store", url, "--keep", "1")
    assert doc["deleted_entries"] == [] and [(p["key"], p["by"]) for p in doc["pinned"]] == [(older, "pinned")]
    assert sorted(r["key"] for r in cli_json("ls", "--store", url)) == sorted([older, newer])
    assert http("HEAD", f"{base}/blobs/sha256:{artifact['sha256']}")[0] == 200


def test_an_unreadable_entry_is_listed_so_and_rm_removes_it(oci_registry, oci_env, artifact, tmp_path):
    """An entry whose config blob went bad in the registry is one unreadable entry, as in the other
    stores: ls lists it, gc names the rm that removes it, and rm does."""
    url = oci_registry.url(oci_registry.repo())
    older, newer = _older_and_newer(url, artifact, tmp_path)
    base = f"http://{oci_registry.host}/v2/{url.split('/', 3)[3]}"
    status, _, body = http("GET", f"{base}/manifests/{index_tag('tiny', older)}", {"Accept": MANIFEST_TYPE})
    config = oci_registry.blob_file(url.split("/", 3)[3], json.loads(body)["config"]["digest"][7:])
    data = bytearray(config.read_bytes())
    data[len(data) // 2] ^= 1
    config.write_bytes(bytes(data))

    few_tries = {**os.environ, "WARMER_OCI_MAX_ATTEMPTS": "2"}  # the corrupt config is read again that often
    out = run_warmer("ls", "--store", url, env=few_tries)
    assert out.returncode == 0 and f"{older[:16]} UNREADABLE" in out.stdout and newer[:16] in out.stdout, out
    gc = run_warmer("gc", "--store", url, "--keep", "1", env=few_tries)
    assert gc.returncode != 0 and f"warmer rm {url}/index/tiny/{older}" in gc.stderr, gc.stderr
    rm = run_warmer("rm", f"{url}/index/tiny/{older}", "--yes", env=few_tries)
    assert rm.returncode == 0, rm.stderr
    assert [r["key"] for r in cli_json("ls", "--store", url)] == [newer]


def test_an_entry_whose_config_blob_is_gone_names_the_fix_that_works(oci_registry, oci_env, artifact, tmp_path):
    """The config blob deleted from the registry (by hand, or its own cleanup): fetch said "publish it
    again", and publishing again failed with that same line (it cannot read the entry to mend it).
    The line now names rm and publish; pasted as printed, the node hits again."""
    repo = oci_registry.repo()
    url = oci_registry.url(repo)
    build.publish(open_store(url), artifact["artifact"])
    key = artifact["doc"]["key"]
    base = f"http://{oci_registry.host}/v2/{repo}"
    manifest = json.loads(http("GET", f"{base}/manifests/{index_tag('tiny', key)}", {"Accept": MANIFEST_TYPE})[2])
    assert http("DELETE", f"{base}/blobs/{manifest['config']['digest']}")[0] == 202
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    fetched = run_warmer("fetch", recipe, "--store", url, "--root", tmp_path / "root")
    assert "miss" in fetched.stderr or "error" in fetched.stderr, fetched.stderr
    fix = re.search(r"`(warmer rm [^`]+)`, then publish the artifact again", fetched.stderr)
    assert fix, fetched.stderr
    assert run_warmer(*fix[1].split()[1:]).returncode == 0
    assert run_warmer("publish", artifact["artifact"], "--store", url).returncode == 0
    again = run_warmer("fetch", recipe, "--store", url, "--root", tmp_path / "root", "--require")
    assert again.returncode == 0, again.stderr


def test_a_tag_someone_else_pushed_at_an_entrys_name_is_not_said_removed(oci_registry, oci_env, artifact, tmp_path):
    """An image pushed by another tool under warmer's tag for a key: fetch misses and publish fails,
    naming it. rm said `removed` and left the tag, so both went on failing: rm now fails, naming the
    registry's own tools; with the tag removed as it says, publish and fetch work."""
    repo = oci_registry.repo()
    url, base = oci_registry.url(repo), f"http://{oci_registry.host}/v2/{repo}"
    key = artifact["doc"]["key"]
    tag = index_tag("tiny", key)

    def blob(data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        status, headers, _ = http("POST", f"{base}/blobs/uploads/")
        where = headers["Location"]
        where = where if where.startswith("http") else f"http://{oci_registry.host}{where}"
        sep = "&" if "?" in where else "?"
        assert http("PUT", f"{where}{sep}digest={digest}", {"Content-Type": "application/octet-stream"}, data=data)[0] == 201
        return {"digest": digest, "size": len(data)}

    image = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
             "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **blob(b'{"os":"linux"}')},
             "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **blob(b"not a cache")}]}
    assert http("PUT", f"{base}/manifests/{tag}", {"Content-Type": image["mediaType"]},
                data=json.dumps(image).encode())[0] == 201
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    fetched = run_warmer("fetch", recipe, "--store", url, "--root", tmp_path / "root")
    # plain HTTP on loopback, as warmer reached it: skopeo must be told so
    assert f"skopeo delete --tls-verify=false docker://{oci_registry.host}/{repo}:{tag}" in fetched.stderr, fetched.stderr
    dry = run_warmer("rm", f"{url}/index/tiny/{key}")  # a dry run must not promise it either
    assert dry.returncode == 1 and "holds no warmer artifact" in dry.stderr, dry.stderr
    rm = run_warmer("rm", f"{url}/index/tiny/{key}", "--yes")
    assert rm.returncode == 1 and "holds no warmer artifact" in rm.stderr and "skopeo delete" in rm.stderr, rm.stderr
    tags = json.loads(http("GET", f"{base}/tags/list")[2])["tags"]
    assert not [t for t in tags if t.startswith("_audit.")], tags  # nothing removed: nothing recorded
    command = re.search(r"`(skopeo delete [^`]+)`", rm.stderr)[1]
    if shutil.which("skopeo"):  # as printed
        assert subprocess.run(command.split(), capture_output=True, text=True, timeout=60).returncode == 0
    else:  # what it does: the tag's manifest deleted by its digest
        digest = http("HEAD", f"{base}/manifests/{tag}", {"Accept": image["mediaType"]})[1]["Docker-Content-Digest"]
        assert http("DELETE", f"{base}/manifests/{digest}")[0] == 202
    assert run_warmer("publish", artifact["artifact"], "--store", url).returncode == 0
    again = run_warmer("fetch", recipe, "--store", url, "--root", tmp_path / "root", "--require")
    assert again.returncode == 0, again.stderr


def test_a_config_that_never_arrives_whole_is_a_store_error_not_an_unreadable_entry(oci_registry, oci_proxy,
                                                                                    oci_env, artifact, tmp_path):
    """A link that cuts every read of an entry's config short says nothing of the entry: ls fails
    with the network to blame, and lists no healthy artifact as UNREADABLE (for gc to refuse, or
    for someone to rm)."""
    repo = oci_registry.repo()
    build.publish(open_store(oci_registry.url(repo)), artifact["artifact"])
    base = f"http://{oci_registry.host}/v2/{repo}"
    manifest = json.loads(http("GET", f"{base}/manifests/{index_tag('tiny', artifact['doc']['key'])}",
                               {"Accept": MANIFEST_TYPE})[2])
    config = manifest["config"]["digest"]
    oci_proxy.inject("truncate", lambda r: r.method == "GET" and r.path.endswith(f"/blobs/{config}"), times=None)
    url = f"oci://127.0.0.1:{oci_proxy.url.rsplit(':', 1)[1]}/{repo}"
    out = run_warmer("ls", "--store", url, env={**os.environ, "WARMER_OCI_MAX_ATTEMPTS": "2"})
    assert out.returncode != 0 and "never arrived whole" in out.stderr, out.stdout + out.stderr
    assert "UNREADABLE" not in out.stdout


def test_the_cli_finds_credentials_where_docker_keeps_them(oci_htpasswd_registry, oci_env, artifact, tmp_path,
                                                           monkeypatch):
    reg = oci_htpasswd_registry
    url = reg.url(reg.repo())
    recipe_file = write_tiny_recipe(tmp_path / "tiny.toml")
    denied = run_warmer("publish", artifact["artifact"], "--store", url)
    assert denied.returncode == 1 and "Traceback" not in denied.stderr
    assert len(denied.stderr.strip().splitlines()) == 1 and "docker login 127.0.0.1" in denied.stderr

    docker_config(oci_env, reg.host, USER, PASSWORD)  # DOCKER_CONFIG, as an image-pull secret mounts it
    assert cli_json("publish", artifact["artifact"], "--store", url)["status"] == "published"
    # REGISTRY_AUTH_FILE (podman, skopeo) comes first, even over a DOCKER_CONFIG with other credentials
    auth_file = tmp_path / "auth.json"
    auth_file.write_text(json.dumps({"auths": {f"http://{reg.host}/v2/": {"username": READER,
                                                                          "password": READER_PASSWORD}}}))
    docker_config(oci_env, reg.host, USER, "wrong")
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth_file))
    outs = [run_warmer("fetch", recipe_file, "--store", url, "--root", tmp_path / "node", "--json"),
            run_warmer("ls", "--store", url), denied]
    assert json.loads(outs[0].stdout)["status"] == "hit", outs[0].stderr
    assert "1 artifact(s)" in outs[1].stdout
    for out in outs:  # never a credential in what warmer prints
        for secret in (PASSWORD, READER_PASSWORD, base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()):
            assert secret not in out.stdout + out.stderr


def test_credentials_are_found_by_a_uid_with_no_home_and_no_passwd_entry(oci_htpasswd_registry, oci_env, artifact,
                                                                         tmp_path):
    """`env -i`, cron, an init container run as a bare uid: no HOME, no passwd entry. Looking for
    ~/.docker raised RuntimeError at the registry's first 401 (ls and publish: a traceback; every
    fetch: a miss), before REGISTRY_AUTH_FILE was even read."""
    import tempfile

    reg = oci_htpasswd_registry
    url = reg.url(reg.repo())
    top = Path(tempfile.mkdtemp(prefix="warmer-auth-", dir="/tmp"))  # readable by that uid
    try:
        top.chmod(0o755)
        auth_file = top / "auth.json"
        auth_file.write_text(json.dumps({"auths": {reg.host: {"username": USER, "password": PASSWORD}}}))
        auth_file.chmod(0o644)
        if os.geteuid() != 0 or not shutil.which("setpriv"):
            pytest.skip("needs root and setpriv (util-linux) to run as a uid with no passwd entry")
        # CAP_DAC_READ_SEARCH alone: that uid reaches this machine's Python (under /root, 0700)
        bare = ["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", "--inh-caps=+dac_read_search",
                "--ambient-caps=+dac_read_search"]
        env = {k: v for k, v in os.environ.items() if k not in ("HOME", "DOCKER_CONFIG")}
        env.update(REGISTRY_AUTH_FILE=str(auth_file), PYTHONDONTWRITEBYTECODE="1")
        for argv in (["publish", str(artifact["artifact"]), "--store", url], ["ls", "--store", url]):
            out = subprocess.run([*bare, sys.executable, "-m", "warmer", *argv], capture_output=True, text=True,
                                 cwd=REPO, env=env, timeout=120)
            assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert "1 artifact(s)" in out.stdout
    finally:
        shutil.rmtree(top)


def test_a_credential_helper_is_asked(oci_htpasswd_registry, oci_env, tmp_path, monkeypatch):
    """credHelpers[registry] names a docker-credential-* program: it is run, and its answer used."""
    reg = oci_htpasswd_registry
    helper = tmp_path / "bin" / "docker-credential-warmertest"
    helper.parent.mkdir()
    asked = tmp_path / "asked"
    helper.write_text(f"#!/bin/sh\ncat > {asked}\n"
                      f"echo '{{\"ServerURL\":\"{reg.host}\",\"Username\":\"{USER}\",\"Secret\":\"{PASSWORD}\"}}'\n")
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{helper.parent}{os.pathsep}{os.environ['PATH']}")
    (oci_env / "config.json").write_text(json.dumps({"credHelpers": {reg.host: "warmertest"}}))
    assert open_store(reg.url(reg.repo())).has_blob("ab" * 32) is False
    assert asked.read_text().strip() == reg.host
    (oci_env / "config.json").write_text(json.dumps({"credsStore": "missing-helper"}))
    with pytest.raises(StoreError, match="docker-credential-missing-helper, named in .* is not on PATH"):
        open_store(reg.url(reg.repo())).has_blob("ab" * 32)
    # one that hangs: its 60 s stood in for by the timeout it ends in; the check to run names this host
    from warmer.store.oci import auth

    def hangs(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw.get("timeout"))

    (oci_env / "config.json").write_text(json.dumps({"credHelpers": {reg.host: "warmertest"}}))
    monkeypatch.setattr(auth.subprocess, "run", hangs)
    with pytest.raises(StoreError, match=rf"did not answer in 60 s: check that it works with "
                                         rf"`echo {re.escape(reg.host)} \| docker-credential-warmertest get`"):
        open_store(reg.url(reg.repo())).has_blob("ab" * 32)


def test_credentials_go_to_the_registrys_own_address_alone(oci_env, tmp_path, artifact):
    """A registry whose generated URLs name another address (distribution's http.host) sends the
    upload there: warmer does not send the store's credentials to it, and says why it stops."""
    from tests.integration.oci_registry import start_registry

    reg = start_registry(tmp_path / "reg", auth="htpasswd", external_host="localhost")
    try:
        docker_config(oci_env, reg.host, USER, PASSWORD)
        with pytest.raises(StoreError) as e:
            build.publish(open_store(reg.url(reg.repo())), artifact["artifact"])
        assert f"localhost:{reg.port}" in str(e.value) and "http.host" in str(e.value), e.value
    finally:
        reg.stop()


def test_docker_hubs_credentials_are_asked_for_under_dockers_own_key(oci_env, tmp_path, monkeypatch):
    """docker login keeps Docker Hub's credentials in a helper under https://index.docker.io/v1/
    (not the registry-1.docker.io that serves the API): that is the key warmer asks the helper for.
    Only the lookup runs here (Docker Hub is not reachable)."""
    from warmer.store.oci.auth import find_credentials

    helper = tmp_path / "bin" / "docker-credential-hubtest"
    helper.parent.mkdir()
    helper.write_text('#!/bin/sh\nread key\n[ "$key" = "https://index.docker.io/v1/" ] || '
                      '{ echo "credentials not found in native keychain"; exit 1; }\n'
                      'echo \'{"Username":"hubuser","Secret":"hubpass"}\'\n')
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{helper.parent}{os.pathsep}{os.environ['PATH']}")
    (oci_env / "config.json").write_text(json.dumps({"auths": {"https://index.docker.io/v1/": {}},
                                                     "credsStore": "hubtest"}))
    found = find_credentials("registry-1.docker.io")
    assert found is not None and (found.username, found.secret) == ("hubuser", "hubpass")
    (oci_env / "config.json").write_text(json.dumps({"credHelpers": {"docker.io": "hubtest"}}))
    found = find_credentials("registry-1.docker.io")
    assert found is not None and found.username == "hubuser"


# -- first writer wins ------------------------------------------------------------------------------

def test_eight_concurrent_publishers_of_one_key(oci_registry, oci_proxy, oci_env, tmp_path):
    """Eight builders race with different artifacts of the same key: one manifest is tagged, and
    every publisher whose manifest is not the tagged one is told already-published, including
    those whose HEAD found the tag absent and who wrote it (seen through the proxy)."""
    url = f"oci://127.0.0.1:{oci_proxy.url.rsplit(':', 1)[1]}/{oci_registry.repo()}"
    root = tmp_path / "build-root"
    make_cache_tree(root)
    arts = []
    for i in range(8):
        arts.append(tmp_path / f"race{i}.tar.zst")
        build.pack_root(root, tiny_recipe(), arts[-1], timings={"build": {"run": i}})
    stores = [open_store(url) for _ in range(8)]  # one client each, as separate builders have
    results = publish_at_once(stores, arts)
    assert sorted(r.status for r in results) == ["already-published"] * 7 + ["published"]
    winner = next(r for r in results if r.status == "published")
    assert all(r.published_blob == winner.blob for r in results if r is not winner)
    tag_puts = [r for r in oci_proxy.requests if r.method == "PUT" and "/manifests/tiny--" in r.path]
    print(f"{len(tag_puts)} of 8 publishers wrote the tag")
    assert stores[0].list_index() == [("tiny", winner.key)]
    entry = json.loads(stores[0].get_index("tiny", winner.key))
    assert entry["blob"]["sha256"] == winner.blob
    got = fetch.fetch(tiny_recipe(), stores[0], tmp_path / "node-root")
    assert got.status == "hit", got.warnings
    assert restore.active(tmp_path / "node-root").archive_sha256 == winner.blob


def test_eight_publisher_processes_of_one_key(oci_registry, oci_env, tmp_path):
    """The same race through the CLI, one process per builder."""
    url = oci_registry.url(oci_registry.repo())
    root = tmp_path / "build-root"
    make_cache_tree(root)
    arts = []
    for i in range(8):
        arts.append(tmp_path / f"race{i}.tar.zst")
        build.pack_root(root, tiny_recipe(), arts[-1], timings={"build": {"run": i}})
    procs = [subprocess.Popen([sys.executable, "-m", "warmer", "publish", str(a), "--store", url, "--json"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in arts]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    assert sorted(r["status"] for r in results) == ["already-published"] * 7 + ["published"]
    winner = next(r for r in results if r["status"] == "published")
    assert json.loads(open_store(url).get_index("tiny", winner["key"]))["blob"]["sha256"] == winner["blob"]


# -- what other tools see ---------------------------------------------------------------------------

def test_plain_http_reads_a_published_artifact(oci_registry, oci_env, artifact, tmp_path):
    """curl (or any OCI client: oras pull, crane) reads the manifest, artifact.json and the tar.zst."""
    repo = oci_registry.repo()
    store = open_store(oci_registry.url(repo))
    build.publish(store, artifact["artifact"])
    base = f"http://{oci_registry.host}/v2/{repo}"
    tag = index_tag("tiny", artifact["doc"]["key"])
    tags = json.loads(subprocess.run(["curl", "-sf", f"{base}/tags/list"], capture_output=True, check=True).stdout)
    assert tags["tags"] == [tag]
    manifest = json.loads(subprocess.run(["curl", "-sf", "-H", f"Accept: {MANIFEST_TYPE}", f"{base}/manifests/{tag}"],
                                         capture_output=True, check=True).stdout)
    assert manifest["mediaType"] == MANIFEST_TYPE and manifest["artifactType"] == ARTIFACT_TYPE
    assert manifest["config"]["mediaType"] == CONFIG_TYPE
    [layer] = manifest["layers"]
    assert layer["mediaType"] == LAYER_TYPE and layer["digest"] == f"sha256:{artifact['sha256']}"
    ann = manifest["annotations"]
    assert ann["vnd.warmer.recipe"] == "tiny" and ann["vnd.warmer.key"] == artifact["doc"]["key"]
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$", ann["org.opencontainers.image.created"])
    config = subprocess.run(["curl", "-sf", f"{base}/blobs/{manifest['config']['digest']}"], capture_output=True,
                            check=True).stdout
    with open(artifact["artifact"], "rb") as f:
        assert config == archive.read_manifest(f)  # artifact.json byte for byte, as signed
    blob = tmp_path / "pulled.tar.zst"
    subprocess.run(["curl", "-sf", "-o", str(blob), f"{base}/blobs/{layer['digest']}"], check=True)
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == artifact["sha256"]
    listing = subprocess.run(["tar", "--zstd", "-tf", str(blob)], capture_output=True, text=True, check=True).stdout
    assert listing.splitlines()[0] == "artifact.json"


# -- corruption and memory --------------------------------------------------------------------------

def _node_with_previous_cache(tmp_path: Path) -> Path:
    root = tmp_path / "node-root"
    restore.prepare(root)  # as a miss leaves it: vLLM compiled into it
    (root / "vllm" / "previous.json").write_text("previous cache")
    return root


def _unchanged(root: Path) -> bool:
    return ((root / "vllm" / "previous.json").read_text() == "previous cache" and not (root / restore.MARKER).exists()
            and sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir())
            == [restore.PREPARED, "vllm/previous.json"]
            and not [p for p in root.parent.iterdir() if ".staging-" in p.name or p.name.startswith(".warmer-blob")])


def test_a_layer_corrupted_in_the_registry_is_refused(oci_registry, oci_env, artifact, tmp_path):
    repo = oci_registry.repo()
    store = open_store(oci_registry.url(repo))
    build.publish(store, artifact["artifact"])
    data = oci_registry.blob_file(repo, artifact["sha256"])
    damaged = bytearray(data.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    data.write_bytes(bytes(damaged))
    root = _node_with_previous_cache(tmp_path)
    got = fetch.fetch(tiny_recipe(), open_store(oci_registry.url(repo)), root)
    assert got.status == "error"
    assert any("not activated" in w and "hashed to" in w and "each of 3 downloads" in w for w in got.warnings), \
        got.warnings
    assert _unchanged(root)
    with pytest.raises(BlobCorrupt), store.stream_blob(artifact["sha256"]) as f:
        f.read()


# The child reports its own high-water mark (VmHWM of its address space) as it exits: the
# ru_maxrss that wait4 returns starts from the forking parent's, and pytest holds the 512 MiB file.
_REPORT_HWM = ("import atexit, re, runpy, sys; atexit.register(lambda: print('VmHWM', re.search(r'VmHWM:\\s+(\\d+)', "
               "open('/proc/self/status').read())[1], file=sys.stderr)); sys.argv[0] = 'warmer'; "
               "runpy.run_module('warmer', run_name='__main__', alter_sys=True)")


def _peak_rss_of_fetch(recipe_file: Path, url: str, root: Path) -> tuple[dict, int]:
    """warmer fetch in a child process, and its peak RSS in bytes."""
    out = subprocess.run([sys.executable, "-c", _REPORT_HWM, "fetch", str(recipe_file), "--store", url,
                          "--root", str(root), "--json"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout), int(re.search(r"^VmHWM (\d+)$", out.stderr, re.M)[1]) * 1024


def test_memory_stays_flat_fetching_a_512_MiB_layer(oci_registry, oci_env, tmp_path):
    recipe_file = write_tiny_recipe(tmp_path / "tiny.toml")
    small_url, big_url = (oci_registry.url(oci_registry.repo()) for _ in range(2))
    small = tmp_path / "small"
    small.mkdir()
    build.publish(open_store(small_url), pack_with_big_file(small, 1 * MiB)["artifact"])
    big = tmp_path / "big"
    big.mkdir()
    packed = pack_with_big_file(big, 512 * MiB)
    del packed["files"]
    build.publish(open_store(big_url), packed["artifact"])
    (big / "build-root").joinpath("inductor/ab/big-kernel.so").unlink()  # keep the disk free
    packed["artifact"].unlink()

    got_small, rss_small = _peak_rss_of_fetch(recipe_file, small_url, tmp_path / "node-small")
    got_big, rss_big = _peak_rss_of_fetch(recipe_file, big_url, tmp_path / "node-big")
    assert got_small["status"] == got_big["status"] == "hit"
    assert (tmp_path / "node-big/inductor/ab/big-kernel.so").stat().st_size == 512 * MiB
    print(f"peak RSS: 1 MiB layer {rss_small / MiB:.0f} MiB, 512 MiB layer {rss_big / MiB:.0f} MiB")
    assert rss_big - rss_small < 64 * MiB, (rss_small, rss_big)


# -- faults on the wire -----------------------------------------------------------------------------

def _blob_get(r):
    return r.method == "GET" and "/blobs/sha256:" in r.path


def _manifest(method):
    return lambda r: r.method == method and "/manifests/" in r.path


def test_publish_survives_throttling_resets_and_lost_answers(oci_registry, oci_proxy, oci_env, tmp_path):
    packed = pack_with_big_file(tmp_path, 3 * MiB)
    repo = oci_registry.repo()
    rules = [
        oci_proxy.inject("503", lambda r: r.method == "HEAD" and "/blobs/" in r.path),
        oci_proxy.inject("503", lambda r: r.method == "POST" and "/blobs/uploads/" in r.path),
        oci_proxy.inject("reset", lambda r: r.method == "PATCH"),
        oci_proxy.inject("reset-after", lambda r: r.method == "PATCH"),  # stored, the answer lost: resumed
        oci_proxy.inject("500", lambda r: r.method == "PATCH"),
        oci_proxy.inject("reset-after", lambda r: r.method == "PUT" and "digest=" in r.path),
        oci_proxy.inject("reset-after", _manifest("PUT")),  # tagged, the answer lost: it is ours
    ]
    store = OCIStore(f"oci://127.0.0.1:{oci_proxy.url.rsplit(':', 1)[1]}/{repo}", chunk_size=1 * MiB)
    result = build.publish(store, packed["artifact"])
    assert [r.fired for r in rules] == [1] * len(rules)
    assert result.status == "published" and result.blob_uploaded
    patches = [r for r in oci_proxy.requests if r.method == "PATCH"]
    assert all(re.match(r"^\d+-\d+$", r.headers["content-range"]) for r in patches)
    assert any(r.method == "GET" and "/blobs/uploads/" in r.path for r in oci_proxy.requests)  # asked where it stood
    blob = oci_registry.blob_file(repo, packed["sha256"]).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == packed["sha256"]
    entry = json.loads(open_store(oci_registry.url(repo)).get_index("tiny", packed["doc"].key))
    assert entry["blob"]["sha256"] == packed["sha256"]


@pytest.fixture
def published_3mib(oci_registry, oci_env, tmp_path):
    packed = pack_with_big_file(tmp_path, 3 * MiB)
    repo = oci_registry.repo()
    build.publish(open_store(oci_registry.url(repo)), packed["artifact"])
    return {**packed, "repo": repo}


def _via_proxy(proxy, repo, **kw) -> OCIStore:
    return OCIStore(f"oci://127.0.0.1:{proxy.url.rsplit(':', 1)[1]}/{repo}", part_size=1 * MiB, **kw)


def test_fetch_survives_throttling_resets_and_cut_bodies(published_3mib, oci_proxy, tmp_path):
    rules = [
        oci_proxy.inject("503", _manifest("GET")),
        oci_proxy.inject("truncate", _manifest("GET")),
        oci_proxy.inject("truncate", lambda r: _blob_get(r) and "range" not in r.headers),  # the config
        oci_proxy.inject("truncate", _blob_get),
        oci_proxy.inject("reset", _blob_get),
        oci_proxy.inject("500", _blob_get),
        oci_proxy.inject("503", _blob_get),
    ]
    root = _node_with_previous_cache(tmp_path)
    got = fetch.fetch(tiny_recipe(), _via_proxy(oci_proxy, published_3mib["repo"]), root)
    assert [r.fired for r in rules] == [1] * len(rules)
    assert got.status == "hit", got.warnings
    for rel, content in published_3mib["files"].items():
        assert (root / rel).read_bytes() == content
    ranged = [r for r in oci_proxy.requests if _blob_get(r) and "range" in r.headers]
    assert len({r.headers["range"] for r in ranged}) == -(-published_3mib["artifact"].stat().st_size // MiB)


def test_an_exact_fetch_is_one_manifest_get_one_config_get_and_the_layer(published_3mib, oci_proxy, tmp_path):
    store = _via_proxy(oci_proxy, published_3mib["repo"], settle_s=0)  # no racers here
    for n in range(20):  # more tags in the repository change nothing
        other = tmp_path / f"other{n}.tar.zst"
        doc = build.pack_root(tmp_path / "build-root", tiny_recipe(max_model_len=256 + n), other).to_json()
        store.put_blob(str(other), hashlib.sha256(other.read_bytes()).hexdigest())
        entry = {"schema": 1, "recipe": "tiny", "key": doc["key"], "artifact": doc, "signature": None,
                 "blob": {"sha256": hashlib.sha256(other.read_bytes()).hexdigest(), "size": other.stat().st_size},
                 "published_at": "2026-01-01T00:00:00+00:00"}
        assert store.put_index("tiny", doc["key"], json.dumps(entry).encode())
    oci_proxy.clear()
    assert fetch.fetch(tiny_recipe(), store, tmp_path / "node-root").status == "hit"
    others = [(r.method, r.path.split("/")[-2]) for r in oci_proxy.requests
              if not (_blob_get(r) and "range" in r.headers)]
    assert others == [("GET", "manifests"), ("GET", "blobs")]  # the tag, then artifact.json
    parts = -(-published_3mib["artifact"].stat().st_size // MiB)
    assert len([r for r in oci_proxy.requests if _blob_get(r) and "range" in r.headers]) == parts


def test_a_corrupted_download_is_fetched_again(published_3mib, oci_proxy, tmp_path):
    rule = oci_proxy.inject("corrupt", lambda r: _blob_get(r) and "range" in r.headers)
    got = fetch.fetch(tiny_recipe(), _via_proxy(oci_proxy, published_3mib["repo"]), tmp_path / "node-root")
    assert rule.fired == 1 and got.status == "hit", got.warnings
    parts = -(-published_3mib["artifact"].stat().st_size // MiB)
    assert len([r for r in oci_proxy.requests if _blob_get(r) and "range" in r.headers]) == 2 * parts


@pytest.mark.parametrize("action", ["corrupt", "short"])
def test_bytes_that_never_match_are_never_activated(published_3mib, oci_proxy, tmp_path, action):
    rule = oci_proxy.inject(action, lambda r: _blob_get(r) and "range" in r.headers, times=None)
    root = _node_with_previous_cache(tmp_path)
    got = fetch.fetch(tiny_recipe(), _via_proxy(oci_proxy, published_3mib["repo"]), root)
    assert rule.fired > 0 and got.status == "error"
    expected = "hashed to" if action == "corrupt" else "was cut short 5 times"
    assert any("not activated" in w and "unchanged" in w and expected in w for w in got.warnings), got.warnings
    assert _unchanged(root)


def test_a_registry_that_keeps_failing_fails_cleanly(published_3mib, oci_proxy, tmp_path, monkeypatch):
    monkeypatch.setenv("WARMER_OCI_MAX_ATTEMPTS", "3")
    rule = oci_proxy.inject("503", _manifest("GET"), times=None)
    recipe_file = write_tiny_recipe(tmp_path / "tiny.toml")
    url = f"oci://127.0.0.1:{oci_proxy.url.rsplit(':', 1)[1]}/{published_3mib['repo']}"
    out = run_warmer("fetch", recipe_file, "--store", url, "--root", tmp_path / "node-root", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["status"] == "miss"  # a slow start, not a failed pod
    assert rule.fired == 3 and "503" in out.stderr and "after 3 attempts" in out.stderr


# -- errors that name the fix -----------------------------------------------------------------------

def test_errors_name_the_fix(oci_registry, oci_env, artifact, tmp_path):
    missing = run_warmer("ls", "--store", oci_registry.url("warmer/never-pushed"))
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    assert "repository warmer/never-pushed does not exist in 127.0.0.1" in missing.stderr

    closed = free_port()
    recipe_file = write_tiny_recipe(tmp_path / "tiny.toml")
    args = ["fetch", recipe_file, "--store", f"oci://127.0.0.1:{closed}/warmer/x", "--root", tmp_path / "r"]
    slow = run_warmer(*args, env={**os.environ, "WARMER_OCI_MAX_ATTEMPTS": "2"})
    assert slow.returncode == 0 and f"cannot reach the registry 127.0.0.1:{closed}" in slow.stderr
    assert "export VLLM_CACHE_ROOT=" in slow.stdout
    assert run_warmer(*args, "--require", env={**os.environ, "WARMER_OCI_MAX_ATTEMPTS": "2"}).returncode == 3

    for bad in ("oci://127.0.0.1:5000", "oci://127.0.0.1:5000/Upper/case", "oci://host/repo:tag"):
        with pytest.raises(UsageError, match="is not oci://REGISTRY/REPOSITORY"):  # the operator's: exit 2
            open_store(bad)
    with pytest.raises(UsageError, match="--endpoint-url and --s3-path-style apply to s3:// stores"):
        open_store("oci://127.0.0.1:5000/x", endpoint_url="http://x")
    with pytest.raises(UsageError, match="--insecure-registry applies to oci:// stores"):
        open_store(f"file://{tmp_path}", insecure_registry=True)


def test_plain_http_only_for_loopback_or_when_asked():
    assert OCIStore("oci://registry.example.com/team/caches").base == "https://registry.example.com/v2/team/caches"
    assert OCIStore("oci://registry.example.com:5000/c", insecure_registry=True).base.startswith("http://")
    for host in ("localhost:5000", "127.0.0.1:5000", "[::1]:5000"):
        assert OCIStore(f"oci://{host}/c").base.startswith("http://")
    assert OCIStore("oci://docker.io/me/caches").base == "https://registry-1.docker.io/v2/me/caches"


def test_a_413_from_a_proxy_and_a_registry_without_oci_artifacts_name_the_fix(oci_registry, oci_env, tmp_path):
    from tests.integration.oci_registry import GatewayProxy, body_limit, no_oci_artifacts

    packed = pack_with_big_file(tmp_path, 3 * MiB)
    proxy = GatewayProxy(("127.0.0.1", oci_registry.port), body_limit(1 * MiB))
    try:
        store = OCIStore(f"oci://127.0.0.1:{proxy.url.rsplit(':', 1)[1]}/{oci_registry.repo()}", chunk_size=2 * MiB)
        with pytest.raises(StoreError, match=r"refused a 2 MiB request as too large \(413\).*client_max_body_size.*"
                                             r"lower WARMER_OCI_CHUNK_MIB"):
            build.publish(store, packed["artifact"])
        store.chunk_size = 1 * MiB - 4096  # under the limit: it goes through
        assert build.publish(store, packed["artifact"]).status == "published"
    finally:
        proxy.close()
    proxy = GatewayProxy(("127.0.0.1", oci_registry.port), no_oci_artifacts)
    try:
        store = OCIStore(f"oci://127.0.0.1:{proxy.url.rsplit(':', 1)[1]}/{oci_registry.repo()}")
        with pytest.raises(StoreError, match=r"refused an OCI artifact manifest \(400 MANIFEST_INVALID.*upgrade it "
                                             r"\(distribution 2.7\+, Harbor 2\+\) or allow the type"):
            build.publish(store, packed["artifact"])
    finally:
        proxy.close()


# -- tags -------------------------------------------------------------------------------------------

def test_every_recipe_name_makes_a_valid_tag():
    for recipe in ("a", "tiny", "llama-3.1-8b-h200", "a--b", "x" * 100, "0._-9" + "z" * 95):
        assert NAME.match(recipe)
        tag = index_tag(recipe, "f" * 64)
        assert TAG.match(tag) and len(tag) <= 128 and tag.rsplit("--", 1) == [recipe, "f" * 16]
    assert TAG.match(audit_tag("20260101T000000Z-rm-" + "x" * 100 + "-" + "f" * 16))
    assert audit_tag("a/b") != audit_tag("a_b") and audit_tag("x").startswith("_audit.")


# -- Kubernetes: the init container of the oci:// variant, with an image-pull secret ----------------

def test_the_k8s_oci_variant_fetches_with_the_image_pull_secret(oci_htpasswd_registry, oci_env, artifact, tmp_path):
    from tests.unit.test_manifests import command_of, container_env

    reg = oci_htpasswd_registry
    path = REPO / "manifests" / "k8s" / "vllm-deployment-oci.yaml"
    [deployment] = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    [init] = [c for c in spec["initContainers"] if c["name"] == "warmer-fetch-oci"]
    env = container_env(init)
    assert env["WARMER_STORE"].startswith("oci://")
    secret_volume = next(v for v in spec["volumes"] if "secret" in v)
    items = secret_volume["secret"]["items"]
    assert items == [{"key": ".dockerconfigjson", "path": "config.json"}]
    mount = next(m for m in init["volumeMounts"] if m["name"] == secret_volume["name"])
    assert env["DOCKER_CONFIG"] == mount["mountPath"] and mount.get("readOnly") is True
    assert spec["imagePullSecrets"] == [{"name": secret_volume["secret"]["secretName"]}]

    # The secret as `kubectl create secret docker-registry` makes it, mounted where the pod has it.
    url = reg.url(reg.repo())
    docker_config(tmp_path / "builder", reg.host, USER, PASSWORD)
    subprocess.run([sys.executable, "-m", "warmer", "publish", str(artifact["artifact"]), "--store", url],
                   cwd=REPO, env={**os.environ, "DOCKER_CONFIG": str(tmp_path / "builder")}, check=True,
                   capture_output=True)
    pull_secret = tmp_path / "pod" / "pull-secret"
    docker_config(pull_secret, reg.host, READER, READER_PASSWORD)
    recipes = tmp_path / "pod" / "recipes"
    recipes.mkdir()
    write_tiny_recipe(recipes / "tiny.toml")
    mounts = {m["mountPath"]: tmp_path / "pod" / m["name"] for m in init["volumeMounts"]}
    mounts[mount["mountPath"]], mounts[next(m["mountPath"] for m in init["volumeMounts"]
                                            if m["name"] == "recipes")] = pull_secret, recipes
    for d in mounts.values():
        d.mkdir(parents=True, exist_ok=True)

    def local(text: str) -> str:
        for m in sorted(mounts, key=len, reverse=True):
            if text == m or text.startswith(m + "/"):
                return str(mounts[m]) + text[len(m):]
        return text

    argv = [local(a) for a in command_of(init, WARMER_STORE=url, WARMER_RECIPE="tiny")]
    assert argv[0] == "warmer"
    run_env = {**os.environ, **{k: local(v) for k, v in env.items()}}
    out = subprocess.run([sys.executable, "-m", "warmer", *argv[1:], "--json"], cwd=REPO, env=run_env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "hit"
    env_file = Path(argv[argv.index("--env-file") + 1])
    assert "VLLM_CACHE_ROOT" in env_file.read_text()


# -- layered artifacts: a manifest whose layers are the artifact's, each stored once ----------------

def test_a_layered_artifact_is_a_manifest_of_its_layers_and_shared_layers_outlive_an_rm(oci_registry, oci_env,
                                                                                        artifact, tmp_path):
    from datetime import datetime, timedelta, timezone

    from warmer import catalog
    from warmer.entry import IndexEntry

    repo = oci_registry.repo()
    url = oci_registry.url(repo)
    store = open_store(url)
    art_a = restore.read_artifact_file(artifact["artifact"])
    first = build.publish(store, artifact["artifact"], layers=True)
    assert first.status == "published" and all(first.layers.values())

    # Read back as a node does: a schema 2 entry, no blob, its layers the artifact's.
    raw = store.get_index("tiny", art_a.key)
    assert "blob" not in json.loads(raw) and json.loads(raw)["schema"] == 2
    entry = IndexEntry.read(raw, "tiny", art_a.key)
    assert entry.layered and [(b.sha256, b.size) for b in entry.blobs] == [(x.sha256, x.size) for x in art_a.layers]
    base = f"http://{oci_registry.host}/v2/{repo}"
    tag = index_tag("tiny", art_a.key)
    status, _, body = http("GET", f"{base}/manifests/{tag}", {"Accept": MANIFEST_TYPE})
    assert status == 200
    manifest = json.loads(body)
    assert [(x["mediaType"], x["digest"], x["size"], x["annotations"]["org.opencontainers.image.title"])
            for x in manifest["layers"]] == [(LAYER_TYPE, f"sha256:{x.sha256}", x.size, f"{tag}-{x.component}.tar.zst")
                                             for x in art_a.layers]
    for x in art_a.layers:  # each layer is a blob of its own: its frame of the file, byte for byte
        status, _, data = http("GET", f"{base}/blobs/sha256:{x.sha256}")
        assert status == 200 and hashlib.sha256(data).hexdigest() == x.sha256
    node = tmp_path / "node-root"
    got = fetch.fetch(tiny_recipe(), store, node)
    assert got.status == "hit", got.warnings
    for rel, content in artifact["files"].items():
        assert (node / rel).read_bytes() == content

    # A second artifact of the recipe (another key) whose vllm/ differs: only that layer goes up.
    src_b = tmp_path / "src-b"
    shutil.copytree(artifact["root"], src_b)
    (src_b / "vllm/modelinfos/vllm-model_executor-models-llama-LlamaForCausalLM.json").write_bytes(b'{"b": 1}')
    path_b = tmp_path / "b.tar.zst"
    art_b = build.pack_root(src_b, tiny_recipe(max_model_len=256), path_b, fp=art_a.fingerprint)
    second = build.publish(store, path_b, layers=True)
    assert second.layers == {c: c == "vllm" for c in art_b.components}
    shared = {x.sha256 for x in art_a.layers} & {x.sha256 for x in art_b.layers}
    assert shared == {x.sha256 for x in art_b.layers if x.component != "vllm"} and shared
    listed = cli_json("ls", "--store", url)
    assert listed[-1]["stored_bytes"] < listed[-1]["unshared_bytes"]
    assert listed[-1]["shared_blobs"] == len(shared)

    # A layer missing from the registry: the manifest is refused before it goes up.
    orphan_entry = json.loads(IndexEntry.new(art_b, None, None).to_bytes())
    orphan_entry["artifact"]["layers"][0]["sha256"] = "0" * 64
    with pytest.raises(StoreError, match="is not in .*upload it before its index entry"):
        store.put_index("tiny", "e" * 64, json.dumps({**orphan_entry, "key": "e" * 64}).encode())

    # rm of the second: its own vllm layer goes, the layers the first still names stay.
    removed = cli_json("rm", f"{url}/index/tiny/{art_b.key}", "--yes")
    assert removed["deleted_blobs"] == [art_b.layer("vllm").sha256]
    assert http("HEAD", f"{base}/blobs/sha256:{art_b.layer('vllm').sha256}")[0] == 404
    for sha in shared | {x.sha256 for x in art_a.layers}:
        assert http("HEAD", f"{base}/blobs/sha256:{sha}")[0] == 200
    assert fetch.fetch(tiny_recipe(), store, tmp_path / "again").status == "hit"

    # Deleting the manifest releases every layer, which gc unlinks once no entry names it (outside
    # gc's own deletions, after the grace that spares a publish in flight).
    store.delete_index("tiny", art_a.key)
    assert {b.sha256 for b in store.list_blobs()} == {x.sha256 for x in art_a.layers}
    later = datetime.now(timezone.utc) + catalog.ORPHAN_GRACE + timedelta(minutes=5)
    assert set(catalog.gc(store, 1, now=later).deleted_blobs) == {x.sha256 for x in art_a.layers}
    for x in art_a.layers:
        assert http("HEAD", f"{base}/blobs/sha256:{x.sha256}")[0] == 404
