"""FlashInfer's JIT cache, built for real by nvcc (no GPU needed: FLASHINFER_CUDA_ARCH_LIST picks the
arch, a stub libcuda satisfies the link), packed, restored, and checked with ninja's dry run."""

import copy
import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import run_python, tiny_recipe
from warmer import build, fetch, restore, serving
from warmer.components import flashinfer as flashinfer_jit
from warmer.archive import FileEntry, FileList
from warmer.components import flashinfer
from warmer.store import open_store

CUDA_HOME = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
pytestmark = [
    pytest.mark.skipif(not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")),
                       reason=f"nvcc is not installed under {CUDA_HOME}"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer-python is not installed"),
]
MODULE = "silu_and_mul"
BUILD = ("from flashinfer.jit.activation import gen_act_and_mul_module\n"
         "gen_act_and_mul_module('silu').build(verbose=False)\n")


@pytest.fixture(scope="module")
def jit_env(tmp_path_factory):
    """The env FlashInfer builds and is served with: venv tools first on PATH, like an activated venv."""
    stub = tmp_path_factory.mktemp("stub")
    subprocess.run(["gcc", "-shared", "-o", str(stub / "libcuda.so"), "-x", "c", "/dev/null"], check=True)
    return {"CUDA_HOME": CUDA_HOME, "FLASHINFER_CUDA_ARCH_LIST": "9.0a", "FLASHINFER_EXTRA_LDFLAGS": f"-L{stub}",
            "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, jit_env):
    """One real module built by nvcc under a root, then packed: (root, artifact file, Artifact)."""
    root = tmp_path_factory.mktemp("fi") / "root"
    env = {**os.environ, **jit_env, "FLASHINFER_WORKSPACE_BASE": str(root / "flashinfer")}
    run_python("-c", BUILD, env=env)
    saved = {k: os.environ.get(k) for k in jit_env}
    os.environ.update(jit_env)  # pack records the contract in the build's env
    try:
        art = root.parent / "fi.tar.zst"
        doc = build.pack_root(root, tiny_recipe(), art)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return root, art, doc


@pytest.fixture
def served(monkeypatch, jit_env):
    for k, v in jit_env.items():
        monkeypatch.setenv(k, v)
    return {**os.environ}


def test_pack_takes_what_ninja_needs_and_records_the_contract(artifact):
    root, _, doc = artifact
    paths = {f.path.rsplit("/", 1)[-1] for f in doc.files}
    assert {"build.ninja", ".ninja_log", ".ninja_deps", f"{MODULE}.so", f"{MODULE}.cu"} <= paths
    assert "flashinfer_jit.log" not in paths and not any(p.endswith(".lock") for p in paths)
    contract = doc.path_contract.flashinfer
    assert contract.modules == (MODULE,)
    assert contract.workspace_base == os.path.realpath(root / "flashinfer")
    assert contract.cuda_home == CUDA_HOME and contract.ninja and contract.git_commit
    assert contract.env["FLASHINFER_CUDA_ARCH_LIST"] == "9.0a"


def test_restore_at_the_same_path_leaves_ninja_no_work(artifact, served, tmp_path):
    root, art, doc = artifact
    shutil.rmtree(root)
    restore.restore_file(art, root)
    result = flashinfer_jit.dry_run(root, served)
    assert result["clean"] is True and result["modules"][MODULE]["clean"], result
    # The node journey says the same, with no FlashInfer warning.
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, art)
    shutil.rmtree(root)
    got = fetch.fetch(tiny_recipe(), store, root)
    assert got.status == "hit" and got.flashinfer["clean"] is True
    assert not [w for w in got.warnings if "FlashInfer" in w or "ninja" in w]


def test_another_base_path_is_predicted_and_confirmed(artifact, served, tmp_path):
    _, art, doc = artifact
    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, art)
    elsewhere = tmp_path / "elsewhere" / "root"
    got = fetch.fetch(tiny_recipe(), store, elsewhere)
    predicted = [w for w in got.warnings if "FlashInfer will rebuild" in w]
    assert predicted and MODULE in predicted[0] and "workspace real path" in predicted[0]
    assert got.flashinfer["clean"] is False  # and ninja agrees
    assert any("ninja would rebuild" in w for w in got.warnings)


def test_a_different_toolchain_is_predicted(artifact):
    _, _, doc = artifact
    built = doc.path_contract.flashinfer
    node = dataclasses.replace(
        built, cuda_home="/usr/local/cuda-13.0",  # the same toolkit through another path still rebuilds
        ninja="1.11.1" if built.ninja != "1.11.1" else "1.13.2",
        env={**built.env, "FLASHINFER_NVCC_THREADS": "4"})
    reasons = flashinfer_jit.compare(built, node)
    assert len(reasons) == 3
    assert any("CUDA_HOME" in r for r in reasons) and any("ninja version" in r for r in reasons)
    assert any("FLASHINFER_NVCC_THREADS" in r for r in reasons)
    assert flashinfer_jit.compare(built, copy.deepcopy(built)) == []
    assert "not installed" in flashinfer_jit.compare(built, None)[0]


def test_newer_inputs_are_found_and_back_dated_on_request(artifact, served):
    root, art, _ = artifact
    shutil.rmtree(root)
    restore.restore_file(art, root)
    source = next((root / "flashinfer").rglob(f"generated/{MODULE}.cu"))
    later = time.time_ns() + 10_000_000_000
    os.utime(source, ns=(later, later))  # like a pip install after the warm-up
    before = flashinfer_jit.report(root, served, restore.active(root).artifact.path_contract.flashinfer)
    assert before["dry_run"]["clean"] is False
    assert any("older than most recent input" in r for r in before["dry_run"]["modules"][MODULE]["reasons"])
    assert [n["file"] for n in before["newer_inputs"]] == [str(source)]
    assert before["contract"] == []
    fixed = flashinfer_jit.report(root, served, None, backdate_inputs=True)
    assert fixed["backdate"]["files"] == [str(source)] and fixed["backdate"]["held_back_site_packages"] == []
    assert fixed["dry_run_after"]["clean"] is True, fixed
    assert source.stat().st_mtime_ns < later


def test_cubins_are_pointed_at_and_downloads_are_off_only_offline(tmp_path):
    def listed(*paths):
        return FileList.of([FileEntry(p, 1, "0" * 64, 0o644, 0) for p in paths])
    files = listed("vllm/x.json", f"flashinfer/{flashinfer.CACHE}/cubins/abc/fmha/checksums.txt")
    cubin_dir = str(tmp_path / "flashinfer" / flashinfer.CACHE / "cubins")
    assert flashinfer.COMPONENT.serve_env(files, tmp_path) == {"FLASHINFER_CUBIN_DIR": cubin_dir}
    assert flashinfer.COMPONENT.serve_env(listed("vllm/x.json", f"flashinfer/{flashinfer.CACHE}/cubinsX"), tmp_path) == {}
    # Downloads are turned off by the serve env, and only for an offline node.
    offline = serving.vllm_env(tiny_recipe(), tmp_path, files=files, offline=True)
    assert offline["FLASHINFER_CUBIN_DIR"] == cubin_dir and offline["FLASHINFER_NO_DOWNLOAD"] == "1"
    online = serving.vllm_env(tiny_recipe(), tmp_path, files=files)
    assert online["FLASHINFER_CUBIN_DIR"] == cubin_dir and "FLASHINFER_NO_DOWNLOAD" not in online
