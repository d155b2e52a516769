"""warmer as a uid with no /etc/passwd entry and no USER: a Kubernetes runAsUser the image does not
name, OpenShift's arbitrary uids. getpass.getuser() raises KeyError there; `warmer build` (at pack
time, after the whole cold warm-up) and `warmer doctor` must carry on, naming the user as torch
does (uid_N).

Most tests here stand in for such a uid by making pwd.getpwuid fail for every uid and clearing the
env vars getpass.getuser() reads: a real unnamed uid needs root and setpriv (util-linux), which a
developer's machine or CI runner need not have. The last test runs the real thing where they are."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, make_cache_tree, tiny_recipe
from warmer import build, doctor
from warmer.contract import user_name

MOUNTINFO = REPO / "tests" / "fixtures" / "mountinfo" / "hostpath.txt"
USER_VARS = ("LOGNAME", "USER", "LNAME", "USERNAME")  # what getpass.getuser() reads before passwd


@pytest.fixture
def unnamed(monkeypatch) -> str:
    """This process as a uid without a passwd entry or a USER; the name torch would give it."""

    def no_entry(uid: int):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    for var in USER_VARS:
        monkeypatch.delenv(var, raising=False)
    return f"uid_{os.getuid()}"


def test_the_name_comes_from_the_env_then_passwd_then_the_uid(unnamed, monkeypatch):
    assert user_name() == unnamed
    assert user_name({}, uid=4242) == "uid_4242"
    assert user_name({"USER": "vllm"}) == "vllm" and user_name({"LOGNAME": "a", "USER": "b"}) == "a"
    monkeypatch.undo()  # passwd answers again
    assert user_name({}, uid=0) == pwd.getpwuid(0).pw_name


def test_rm_audits_the_unnamed_user_instead_of_crashing(tmp_path, unnamed):
    """`warmer rm --yes` writes who removed what: as an unnamed uid, torch's name for it."""
    from warmer import catalog
    from warmer.store import open_store

    root = tmp_path / "root"
    make_cache_tree(root)
    art = tmp_path / "tiny.tar.zst"
    key = build.pack_root(root, tiny_recipe(), art).key
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, art)
    assert catalog.rm(f"{store.url}/index/tiny/{key}", yes=True).blob_deleted
    [audit] = (tmp_path / "store" / "audit").glob("*-rm-tiny-*.json")
    assert json.loads(audit.read_text())["by"] == unnamed and store.list_index() == []


def test_pack_records_the_unnamed_user_instead_of_crashing(tmp_path, unnamed):
    root = tmp_path / "root"
    make_cache_tree(root)
    art = tmp_path / "tiny.tar.zst"
    assert build.pack_root(root, tiny_recipe(), art).path_contract.user == unnamed
    artifact, _ = build.check_artifact_file(art)  # what a node reads back
    assert artifact.path_contract.user == unnamed


def test_doctor_runs_and_names_torchs_directory_for_the_unnamed_user(unnamed, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", "/tmp")
    result = doctor.diagnose_here(mountinfo_file=str(MOUNTINFO))
    (inductor,) = [r for r in result.locations if r["var"] == "TORCHINDUCTOR_CACHE_DIR"]
    assert inductor["path"] == f"/tmp/torchinductor_{unnamed}"


def _unnamed_uid() -> int:
    uid = 4242
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv (util-linux) to run as a uid without a passwd entry")
def test_doctor_as_a_real_unnamed_uid():
    uid = _unnamed_uid()
    home = Path(tempfile.mkdtemp(prefix="warmer-unnamed-", dir="/tmp"))
    try:
        home.chmod(0o777)
        # CAP_DAC_READ_SEARCH: the interpreter and the checkout may sit under a 0700 home.
        argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=+dac_read_search",
                "--ambient-caps=+dac_read_search", sys.executable, "-m", "warmer", "doctor",
                "--mountinfo", str(MOUNTINFO), "--json"]
        # torch's cache_dir() writes its default into os.environ when a test in this process asked
        # for it (TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor_root): the child must find torch's default.
        env = {k: v for k, v in os.environ.items() if k not in (*USER_VARS, "TORCHINDUCTOR_CACHE_DIR")}
        out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120,
                             env={**env, "HOME": str(home), "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"})
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert "Traceback" not in out.stderr and out.returncode in (0, 5), out.stderr
    paths = {r["var"]: r["path"] for r in json.loads(out.stdout)["locations"]}
    assert paths["TORCHINDUCTOR_CACHE_DIR"] == f"/tmp/torchinductor_uid_{uid}"


# torch's precompiled header as the real torch looks for it, in a child process given env.
HEADER_DIR = "from torch._inductor import codecache; print(codecache._HEADER_DIR)"


def test_a_pod_serving_as_another_user_finds_the_builders_precompiled_header(tmp_path, unnamed):
    """Built as root (a CI job), served as a pod's unnamed uid: torch looks for its precompiled
    header under $TMPDIR/torchinductor_<user name>, so without the builder's name every start
    rebuilt it (149 MB, ~8 s on the tiny recipe). The env a node serves with names the builder."""
    from tests.conftest import run_python
    from warmer import restore, serving

    built = tmp_path / "built"
    make_cache_tree(built)  # its header: tmp/torchinductor_root/precompiled_headers/
    art_file = tmp_path / "tiny.tar.zst"
    art = build.pack_root(built, tiny_recipe(), art_file)
    node = tmp_path / "node"
    restore.restore(art, lambda: open(art_file, "rb"), node)
    env = dict(serving.artifact_env(tiny_recipe(), node, art).vars)
    assert env["LOGNAME"] == "root" and env["TMPDIR"] == str(node / "tmp")

    # The real torch, as this unnamed uid with another USER besides, looks where the header is.
    child = {k: v for k, v in os.environ.items() if k not in USER_VARS}
    out = run_python("-c", HEADER_DIR, env={**child, "USER": "uid_1000", **env})
    assert Path(out.stdout.split()[-1]) == node / "tmp" / "torchinductor_root" / "precompiled_headers"
    assert (node / "tmp" / "torchinductor_root" / "precompiled_headers" / "cipcx.h.gch").is_file()

    # A partial hit without the headers' layer, an artifact without headers, and one whose header
    # dir names no plain user (its file list is the store's word: the env file must stay plain) name no one.
    partial = serving.artifact_env(tiny_recipe(), node, art, components=("vllm", "inductor"))
    assert "LOGNAME" not in partial.vars
    shutil.rmtree(built / "tmp")
    bare = build.pack_root(built, tiny_recipe(), tmp_path / "bare.tar.zst")
    assert "LOGNAME" not in serving.artifact_env(tiny_recipe(), node, bare).vars
    odd = built / "tmp" / "torchinductor_a'$(id)" / "precompiled_headers" / "c.h.gch"
    odd.parent.mkdir(parents=True)
    odd.write_bytes(b"\0")
    hostile = build.pack_root(built, tiny_recipe(), tmp_path / "odd.tar.zst")
    assert "LOGNAME" not in serving.artifact_env(tiny_recipe(), node, hostile).vars
