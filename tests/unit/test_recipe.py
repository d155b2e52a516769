from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_recipe
from warmer.recipe import RecipeError, load, parse


def test_every_shipped_recipe_loads(monkeypatch):
    monkeypatch.setenv("WARMER_TINY_MODEL", "/models/tiny")
    recipes = sorted((REPO / "manifests" / "models").glob("*.toml"))
    assert len(recipes) >= 3
    names = {load(p).name for p in recipes}
    assert {"tiny-llama-cpu", "qwen3.6-27b-nvfp4-sm120", "llama-3.1-8b-h200"} <= names
    qwen = load(REPO / "manifests/models/qwen3.6-27b-nvfp4-sm120.toml")
    assert qwen.engine["moe_backend"] == "flashinfer_b12x"
    assert set(qwen.targets) == {"rtx-5090", "rtx-pro-6000"}


def test_served_path_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("WARMER_TINY_MODEL", "/srv/models/tiny")
    assert load(REPO / "manifests/models/tiny-llama-cpu.toml").model == "/srv/models/tiny"
    monkeypatch.delenv("WARMER_TINY_MODEL")
    with pytest.raises(RecipeError, match=r"WARMER_TINY_MODEL.*not set"):
        load(REPO / "manifests/models/tiny-llama-cpu.toml")


def test_identity_tracks_what_changes_the_caches():
    base = tiny_recipe()
    assert tiny_recipe().digest() == base.digest()
    assert tiny_recipe(max_num_seqs=8).digest() != base.digest()
    assert tiny_recipe(model_path="/other/tiny").digest() != base.digest()


def test_description_and_targets_do_not_change_identity():
    doc = {"name": "t", "model": {"path": "/m"}, "workload": {"prompt_lengths": [4]}}
    a = parse(doc, Path("a.toml"))
    b = parse({**doc, "description": "x", "targets": ["h200"]}, Path("b.toml"))
    assert a.digest() == b.digest()


@pytest.mark.parametrize("doc, message", [
    ({"name": "Bad Name", "model": {"path": "/m"}, "workload": {"prompt_lengths": [4]}}, "name must be"),
    ({"name": "t", "workload": {"prompt_lengths": [4]}}, r"\[model\]"),
    ({"name": "t", "model": {"path": "models/m"}, "workload": {"prompt_lengths": [4]}}, "must be absolute"),
    ({"name": "t", "model": {"id": "org/m"}, "workload": {"prompt_lengths": [4]}}, "needs model.revision"),
    ({"name": "t", "model": {"path": "/m"}, "engine": {"model": "x"}, "workload": {"prompt_lengths": [4]}},
     r"not engine.model"),
    ({"name": "t", "model": {"path": "/m"}, "env": {"X": 1}, "workload": {"prompt_lengths": [4]}}, "strings"),
    ({"name": "t", "model": {"path": "/m"}}, r"\[workload\]"),
    ({"name": "t", "model": {"path": "/m"}, "workload": {"prompt_lengths": [0]}}, "positive integers"),
    ({"name": "t", "model": {"path": "/m"}, "workload": {"prompt_lengths": [4], "sampling": [{"temp": 1}]}},
     "unknown key"),
])
def test_bad_recipes_name_the_problem(doc, message):
    with pytest.raises(RecipeError, match=message):
        parse(doc, Path("r.toml"))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = ")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load(bad)


def test_unpinned_scheduler_args_are_warned_about(monkeypatch):
    monkeypatch.setenv("WARMER_TINY_MODEL", "/models/tiny")
    for path in sorted((REPO / "manifests" / "models").glob("*.toml")):
        assert load(path).warnings() == [], path  # every shipped recipe pins them
    loose = tiny_recipe()  # sets max_model_len only
    warned = loose.warnings()
    assert len(warned) == 2 and "max_num_batched_tokens" in warned[0] and "vllm serve" in warned[0]
    assert tiny_recipe(max_num_batched_tokens=64, max_num_seqs=2).warnings() == []
