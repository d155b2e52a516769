"""The recipe served against the one the active artifact was warmed with: an operator edits the
recipe (max_num_seqs in the ConfigMap) and rolls out; fetch misses (another key) and leaves the old
artifact active; serve, doctor and fetch's outlook must then predict the miss, naming the field,
where they had compared the recipe's name only."""

import json
from dataclasses import replace

import pytest

from tests.conftest import run_warmer, tiny_recipe, write_tiny_recipe
from warmer import doctor, restore, serving
from warmer.outlook import outlook


@pytest.fixture
def root(tmp_path, packed):
    """A node root holding an artifact of the tiny recipe (max_num_seqs 4)."""
    root = tmp_path / "root"
    restore.restore_file(packed("a", recipe=tiny_recipe(max_num_seqs=4)).path, root)
    restore.prepare(root)  # the cache directories vLLM writes into, as fetch leaves them
    return root


def _recipe_findings(recipe, root):
    art = restore.active(root).artifact
    env = dict(serving.artifact_env(recipe, root, art).vars)
    return [f for f in outlook(recipe, root, art, env).findings if f.check == "recipe"]


@pytest.mark.parametrize(
    "edited, field",
    [
        (tiny_recipe(max_num_seqs=8), "engine.max_num_seqs 4 at build, 8 here"),
        (tiny_recipe(max_num_seqs=4, max_num_batched_tokens=256), "engine.max_num_batched_tokens unset at build"),
        (tiny_recipe("/models/other", max_num_seqs=4), "model '/models/tiny' at build, '/models/other' here"),
        (
            (lambda r: replace(r, workload=replace(r.workload, max_tokens=16)))(tiny_recipe(max_num_seqs=4)),
            "workload.max_tokens 4 at build, 16 here",
        ),
    ],
)
def test_an_edited_recipe_is_an_error_naming_the_field(root, edited, field):
    assert _recipe_findings(tiny_recipe(max_num_seqs=4), root) == []  # the recipe it was warmed with
    (found,) = _recipe_findings(edited, root)
    assert found.severity == "error" and field in found.what and "compiles from cold" in found.what, found.what
    assert serving.plan(edited, root).predicted_miss
    assert not serving.plan(tiny_recipe(max_num_seqs=4), root).predicted_miss


def test_an_edit_vllm_leaves_out_of_its_compile_key_is_no_predicted_miss(tmp_path):
    """gpu_memory_utilization tuned in the recipe, or VLLM_CPU_KVCACHE_SPACE (on vLLM's env-hash
    ignore list): vLLM's own hash does not move, so its caches serve the edited recipe. It was an
    error, and `serve --require-hit` refused to start."""
    from warmer import build
    from warmer.recipe import parse
    from warmer.vllmkey import VllmKey
    from tests.conftest import _tiny_doc, make_cache_tree

    def recipe(env=None, **engine):
        doc = _tiny_doc("/models/tiny", {"max_num_seqs": 4, **engine})
        doc["env"].update(env or {})
        return parse(doc, tmp_path / "tiny.toml")

    make_cache_tree(tmp_path / "src")
    factors = {"VLLM_USE_AOT_COMPILE": "0", "VLLM_USE_FLASHINFER_SAMPLER": None}  # as the warm-up records them
    build.pack_root(tmp_path / "src", recipe(), tmp_path / "a.tar.zst", vllm=VllmKey("0.32.0", factors))
    root = tmp_path / "root"
    restore.restore_file(tmp_path / "a.tar.zst", root)
    restore.prepare(root)
    for unhashed in (recipe(gpu_memory_utilization=0.85), recipe({"VLLM_CPU_KVCACHE_SPACE": "2"})):
        (found,) = _recipe_findings(unhashed, root)
        assert found.severity == "info" and "leaves these out of its compile key" in found.what, found.what
        assert not serving.plan(unhashed, root).predicted_miss
    for hashed in (recipe(gpu_memory_utilization=0.85, max_num_batched_tokens=256),
                   recipe({"VLLM_USE_FLASHINFER_SAMPLER": "0"})):
        (found,) = _recipe_findings(hashed, root)
        assert found.severity == "error" and "compiles from cold" in found.what, found.what
        assert serving.plan(hashed, root).predicted_miss


def test_another_model_at_the_warmed_path_is_said(tmp_path):
    """A model synced again to its path (`revision = "main"`, a moved link): warmer's key keeps the
    path, vLLM hashes the config (eos_token_id alone moves its hash). fetch said hit and doctor saw
    nothing, while vLLM compiled from cold. A warning: vLLM hashes the config as transformers loads
    it, which the file's digest only approaches (a new transformers_version is no change there)."""
    import json as _json

    from warmer import build
    from warmer.vllmkey import VllmKey, model_config_digest
    from tests.conftest import make_cache_tree

    model = tmp_path / "model"
    model.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "eos_token_id": 2, "hidden_size": 64}
    (model / "config.json").write_text(_json.dumps(config))
    recipe = tiny_recipe(str(model), max_num_seqs=4)
    make_cache_tree(tmp_path / "src")
    key = VllmKey("0.32.0", {}, "2922b69698", (), model_config_digest(str(model)))
    build.pack_root(tmp_path / "src", recipe, tmp_path / "a.tar.zst", vllm=key)
    root = tmp_path / "root"
    restore.restore_file(tmp_path / "a.tar.zst", root)
    restore.prepare(root)

    def model_findings():
        art = restore.active(root).artifact
        env = dict(serving.artifact_env(recipe, root, art).vars)
        return [f for f in outlook(recipe, root, art, env).findings if f.check == "model"]

    assert model_findings() == [] and not serving.plan(recipe, root).predicted_miss
    same = {**config, "transformers_version": "9.0.0"}  # re-saved by a newer transformers
    (model / "config.json").write_text(_json.dumps(same, indent=4, sort_keys=True))
    assert model_findings() == []
    (model / "config.json").write_text(_json.dumps({**config, "eos_token_id": 3}))
    (found,) = model_findings()
    assert found.severity == "warning" and "config.json differs" in found.what and "compiles from cold" in found.what
    assert any("config.json differs" in w for w in serving.plan(recipe, root).warnings)
    (model / "config.json").unlink()  # not mounted here (an init container): nothing to say
    assert model_findings() == []
    # a config read from elsewhere (hf_config_path, params.json): not this file's to judge
    assert model_config_digest(str(model), {"hf_config_path": "/configs/x"}) is None
    assert model_config_digest(str(model), {"config_format": "mistral"}) is None


def test_a_renamed_recipe_is_still_only_a_warning(root):
    # vLLM hashes no recipe name: the same model, args and workload under another name still hit.
    renamed = replace(tiny_recipe(max_num_seqs=4), name="tiny-copy")
    assert [f.severity for f in _recipe_findings(renamed, root)] == ["warning"]


def test_doctor_with_the_edited_recipe_reports_an_error(root):
    env = dict(serving.artifact_env(tiny_recipe(max_num_seqs=4), root, restore.active(root).artifact).vars)
    clean = doctor.diagnose(env, "", root=root, recipe=tiny_recipe(max_num_seqs=4))
    assert not [f for f in clean.findings if f.check == "recipe"]
    edited = doctor.diagnose(env, "", root=root, recipe=tiny_recipe(max_num_seqs=8))
    assert [f.severity for f in edited.findings if f.check == "recipe"] == ["error"] and not edited.ok


def test_serve_require_hit_refuses_the_edited_recipe(tmp_path, root):
    """The review's repro: the edited recipe file served over the old artifact."""
    old = write_tiny_recipe(tmp_path / "tiny.toml", max_num_seqs=4)
    new = write_tiny_recipe(tmp_path / "edited.toml", max_num_seqs=8)
    ok = run_warmer("serve", old, "--root", root, "--dry-run", "--require-hit", "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    refused = run_warmer("serve", new, "--root", root, "--dry-run", "--require-hit", "--json")
    assert refused.returncode == 3, refused.stdout + refused.stderr
    doc = json.loads(refused.stdout)
    assert doc["predicted_miss"] and any("engine.max_num_seqs 4 at build, 8 here" in w for w in doc["warnings"])


def test_fetch_of_the_same_recipe_is_a_clean_hit_and_of_the_edited_one_leaves_a_predicted_miss(tmp_path, packed):
    """The whole rollout: fetch's own outlook after a real hit says nothing of the recipe; after the
    edit, fetch misses and leaves the old artifact active, and serve predicts the miss."""
    from warmer import build, fetch
    from warmer.store import open_store

    store = open_store(f"file://{tmp_path / 'store'}")
    build.publish(store, packed("a", recipe=tiny_recipe(max_num_seqs=4)).path)
    root = tmp_path / "node-root"
    hit = fetch.fetch(tiny_recipe(max_num_seqs=4), store, root)
    assert hit.status == "hit" and not any("another version" in w for w in hit.warnings), hit.warnings
    assert not serving.plan(tiny_recipe(max_num_seqs=4), root).predicted_miss
    miss = fetch.fetch(tiny_recipe(max_num_seqs=8), store, root)
    assert miss.status == "miss" and restore.active(root).artifact.key == hit.key
    plan = serving.plan(tiny_recipe(max_num_seqs=8), root)
    assert plan.predicted_miss and any("engine.max_num_seqs 4 at build, 8 here" in w for w in plan.warnings)
