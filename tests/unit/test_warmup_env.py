"""The env an engine run (the build's warm-up, verify) starts with: every cache lands under the root or
in the HOME sandbox, whatever the env warmer itself runs in holds."""

import dataclasses
import hashlib
import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import tiny_recipe
from warmer import components, warmup

# A cubin fetched the way FlashInfer fetches every cubin (flashinfer/jit/cubin_loader.py get_artifact):
# FLASHINFER_CUBINS_REPOSITORY may be a local directory, which it copies from.
CUBIN = b"\x7fELF a cubin"
FETCH = (
    "from flashinfer.jit.cubin_loader import get_artifact\n"
    f"assert get_artifact('abc123/fmha/trtllm-gen/k.cubin', {hashlib.sha256(CUBIN).hexdigest()!r})\n"
)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer-python is not installed")
def test_an_inherited_cubin_dir_does_not_send_the_warm_ups_cubins_out_of_the_root(tmp_path, monkeypatch):
    # The builder's shell eval'ed an earlier `warmer fetch` (or the image sets it): FLASHINFER_CUBIN_DIR
    # names another root's cubins. The warm-up's cubins must still land in this root, packed.
    elsewhere = tmp_path / "old-root" / "flashinfer" / ".cache" / "flashinfer" / "cubins"
    monkeypatch.setenv("FLASHINFER_CUBIN_DIR", str(elsewhere))
    repo = tmp_path / "repo" / "abc123" / "fmha" / "trtllm-gen"
    repo.mkdir(parents=True)
    (repo / "k.cubin").write_bytes(CUBIN)
    root, sandbox = tmp_path / "root", tmp_path / "work" / "cold.home"
    sandbox.mkdir(parents=True)
    env = warmup.engine_env(tiny_recipe(), root, sandbox)
    env["FLASHINFER_CUBINS_REPOSITORY"] = str(tmp_path / "repo")
    subprocess.run([sys.executable, "-c", FETCH], env=env, check=True, capture_output=True)

    assert not elsewhere.exists()
    packed = [rel for _, rel in components.collect(root)]
    assert "flashinfer/.cache/flashinfer/cubins/abc123/fmha/trtllm-gen/k.cubin" in packed
    assert warmup.census(root, warmup._files(root), sandbox) == ()


def test_no_inherited_variable_moves_a_cache_out_of_the_root_but_the_recipe_may_set_one(tmp_path, monkeypatch):
    for var in components.MOVED_OUT:
        monkeypatch.setenv(var, f"/elsewhere/{var}")
    env = warmup.engine_env(tiny_recipe(), tmp_path / "root", tmp_path / "home")
    assert not set(components.MOVED_OUT) & set(env)
    recipe = dataclasses.replace(tiny_recipe(), env={"FLASHINFER_CUBIN_DIR": "/opt/cubins"})
    assert warmup.engine_env(recipe, tmp_path / "root", tmp_path / "home")["FLASHINFER_CUBIN_DIR"] == "/opt/cubins"


def test_what_moves_a_cache_out_is_what_the_census_found_lands_in_a_component():
    assert set(components.MOVED_OUT) <= set(components.NOT_PACKED)


def test_a_hub_model_resolves_through_the_builders_hugging_face_cache_not_the_sandbox(tmp_path, monkeypatch):
    # A recipe may name its model by hub id and revision alone. The builder downloaded it (or holds the
    # token of a gated one) in its own ~/.cache/huggingface; the engine runs with HOME in a sandbox.
    home, commit = tmp_path / "builder", "0123456789abcdef0123456789abcdef01234567"
    repo = home / ".cache" / "huggingface" / "hub" / "models--acme--tiny"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    recipe = dataclasses.replace(tiny_recipe(), model="acme/tiny", model_id="acme/tiny", revision=commit)
    sandbox = tmp_path / "work" / "cold.home"
    env = {**warmup.engine_env(recipe, tmp_path / "root", sandbox), "HF_HUB_OFFLINE": "1"}
    code = (
        "import huggingface_hub\n"
        f"print(huggingface_hub.snapshot_download('acme/tiny', revision={commit!r}, local_files_only=True))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(repo / "snapshots" / commit)
    # One the env names stays as named.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert warmup.engine_env(recipe, tmp_path / "root", sandbox)["HF_HOME"] == str(tmp_path / "hf")
