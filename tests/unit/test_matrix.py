"""`warmer matrix`: the recipe x SKU matrix for a CI job per GPU SKU, and the build's step summary."""

import json
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import REPO, run_warmer, write_tiny_recipe
from warmer import matrix
from warmer.cli.build import step_summary
from warmer.errors import UsageError
from warmer.recipe import read_doc
from warmer.build import BuildResult, PublishResult
from warmer.restore import RestoreResult
from warmer.verify import FileDelta, VerifyResult

MANIFESTS = REPO / "manifests"
CATALOGUE = MANIFESTS / "skus.toml"

RECIPE = """
name = "{name}"
targets = {targets}
[model]
path = "/models/m"
[engine]
tensor_parallel_size = {tp}
[workload]
prompt_lengths = [8]
"""


def _recipes(tmp_path: Path, **recipes) -> Path:
    """A manifests dir with models/NAME.toml for each (targets, tp) and the shipped catalogue."""
    models = tmp_path / "manifests" / "models"
    models.mkdir(parents=True)
    (tmp_path / "manifests" / "skus.toml").write_text(CATALOGUE.read_text())
    for name, (targets, tp) in recipes.items():
        (models / f"{name}.toml").write_text(RECIPE.format(name=name, targets=json.dumps(targets), tp=tp))
    return tmp_path / "manifests"




def test_shipped_recipes_make_one_entry_per_target():
    entries, skipped = matrix.entries([MANIFESTS], matrix.load_skus(CATALOGUE), CATALOGUE)
    want = set()
    for f in sorted((MANIFESTS / "models").glob("*.toml")):
        doc = tomllib.loads(f.read_text())
        want |= {(doc["name"], t) for t in doc.get("targets", [])}
    assert {(e["name"], e["sku"]) for e in entries} == want
    # Recipes with no target (the GPU acceptance recipes) are skipped, and said to be.
    untargeted = sorted(f.as_posix() for f in (MANIFESTS / "models").glob("*.toml")
                        if not tomllib.loads(f.read_text()).get("targets"))
    assert sorted(s.split(":")[0] for s in skipped) == untargeted and untargeted
    h200 = next(e for e in entries if e["sku"] == "h200")
    assert h200["node_selector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert "gpu-h200" in h200["runs_on"] and h200["gpus"] == 1
    assert h200["root"] == f"/cache/{h200['name']}" and h200["recipe"].endswith(".toml")


def test_catalogue_gpu_labels_are_the_nvml_name_with_dashes():
    # GPU feature discovery derives nvidia.com/gpu.product from the NVML name this way; a
    # typo here would schedule builds and pods nowhere.
    skus = matrix.load_skus(CATALOGUE)
    gpus = [s for s in skus.values() if s.gpu_name]
    assert len(gpus) >= 8
    for s in gpus:
        assert s.node_selector["nvidia.com/gpu.product"] == s.gpu_name.replace(" ", "-"), s.name
    assert not any(s.gpu_name for s in skus.values() if s.name.startswith("cpu-"))


def test_unknown_sku_is_an_error_naming_it_and_where_to_add_it(tmp_path):
    d = _recipes(tmp_path, good=(["h200"], 1), bad=(["h300"], 1))
    cat = d / "skus.toml"
    with pytest.raises(matrix.MatrixError) as e:
        matrix.entries([d], matrix.load_skus(cat), cat)
    msg = str(e.value)
    assert "'h300'" in msg and "bad.toml" in msg and "[sku.h300]" in msg and str(cat) in msg


def test_gpus_follow_tensor_and_pipeline_parallel_size_and_cpu_gets_none(tmp_path):
    d = _recipes(tmp_path, big=(["h200", "cpu-x86_64"], 4))
    entries, _ = matrix.entries([d], matrix.load_skus(d / "skus.toml"), d / "skus.toml")
    assert {e["sku"]: e["gpus"] for e in entries} == {"h200": 4, "cpu-x86_64": 0}


def test_filter_by_sku_and_skip_recipes_without_targets(tmp_path):
    d = _recipes(tmp_path, a=(["h200", "b200"], 1), b=(["b200"], 1), idle=([], 1))
    cat = d / "skus.toml"
    entries, skipped = matrix.entries([d], matrix.load_skus(cat), cat, only=["b200"])
    assert sorted(e["name"] for e in entries) == ["a", "b"] and {e["sku"] for e in entries} == {"b200"}
    assert len(skipped) == 1 and "idle.toml" in skipped[0]
    with pytest.raises(matrix.MatrixError, match="--sku h999"):
        matrix.entries([d], matrix.load_skus(cat), cat, only=["h999"])


def test_an_empty_matrix_is_an_error_not_an_empty_include(tmp_path):
    d = _recipes(tmp_path, idle=([], 1))
    entries, _ = matrix.entries([d], matrix.load_skus(d / "skus.toml"), d / "skus.toml")
    with pytest.raises(matrix.MatrixError, match="targets"):
        matrix.github(entries)


def test_planning_reads_name_and_targets_alone_and_checks_them(tmp_path, monkeypatch):
    # What CI and a node's fetch --all decide by: never the model path's ${VAR}, which is not set here.
    monkeypatch.delenv("WARMER_TINY_MODEL", raising=False)
    doc, _ = read_doc(MANIFESTS / "models" / "tiny-llama-gpu.toml")
    assert doc["model"]["path"] == "${WARMER_TINY_MODEL}"
    assert matrix.name_and_targets(doc, Path("t.toml")) == ("tiny-llama-gpu", [])
    with pytest.raises(matrix.MatrixError, match="name must be"):
        matrix.name_and_targets({"name": "x\n"}, Path("t.toml"))  # the pattern's `$` would let it through
    with pytest.raises(matrix.MatrixError, match="targets must be"):
        matrix.name_and_targets({"name": "x", "targets": "h200"}, Path("t.toml"))
    d = _recipes(tmp_path, one=(["h200"], 1))
    (d / "models" / "broken.toml").write_text("name = [unclosed\n")
    with pytest.raises(UsageError, match=r"broken.toml:1:\d+: not valid TOML"):
        matrix.entries([d], matrix.load_skus(d / "skus.toml"), d / "skus.toml")


def test_duplicate_recipe_names_are_an_error(tmp_path):
    d = _recipes(tmp_path, one=(["h200"], 1))
    (d / "models" / "two.toml").write_text(RECIPE.format(name="one", targets='["h200"]', tp=1))
    with pytest.raises(matrix.MatrixError, match="both named 'one'"):
        matrix.entries([d], matrix.load_skus(d / "skus.toml"), d / "skus.toml")


def test_catalogue_errors_name_the_sku_and_field(tmp_path):
    bad = tmp_path / "skus.toml"
    bad.write_text('[sku.h200]\ngpu_name = "NVIDIA H200"\nnode_selector = { a = "b" }\nimage = "i"\n')
    with pytest.raises(matrix.MatrixError, match=r"\[sku.h200\]: runs_on"):
        matrix.load_skus(bad)
    bad.write_text('[sku.h200]\nruns_on = ["x"]\nnode_selector = { a = "b" }\n')
    with pytest.raises(matrix.MatrixError, match="no image"):
        matrix.load_skus(bad)
    (tmp_path / "a" / "b").mkdir(parents=True)
    with pytest.raises(matrix.MatrixError, match="--skus"):
        matrix.find_catalogue([tmp_path / "a" / "b"])
    assert matrix.find_catalogue([tmp_path / "a"]) == bad  # beside a models/ dir's parent


@pytest.mark.parametrize(("catalogue", "said"), [
    (b'sku = "h200"\n', "must be tables"),
    (b'defaults = "x"\n[sku.h200]\nruns_on = ["x"]\nnode_selector = { a = "b" }\nimage = "i"\n', "must be tables"),
    (b'# caf\xe9\n[sku.h200]\nruns_on = ["x"]\nnode_selector = { a = "b" }\nimage = "i"\n', "not UTF-8"),
    (b'[sku.h200]\ngpu_name = ""\nruns_on = ["x"]\nnode_selector = { a = "b" }\nimage = "i"\n', "gpu_name"),
])
def test_a_malformed_catalogue_is_a_usage_error_for_matrix_and_for_the_nodes_fetch_all(tmp_path, catalogue, said):
    """The DaemonSet's and the systemd unit's `fetch --all` read the catalogue too: a table that is a
    string, or a byte that is not UTF-8, was a traceback there (and in CI's matrix), not the fix;
    an empty gpu_name made a GPU SKU a CPU one."""
    d = _recipes(tmp_path, one=(["h200"], 1))
    (d / "skus.toml").write_bytes(catalogue)
    for args in (["matrix", d], ["fetch", "--all", d, "--store", f"file://{tmp_path}", "--root-base", tmp_path / "r"]):
        out = run_warmer(*args)
        assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, (args[0], out.stderr)


@pytest.mark.parametrize("tp", ['"two"', "[2]", "0", "true"])
def test_a_parallel_size_that_is_no_whole_number_is_a_usage_error_naming_the_recipe(tmp_path, tp):
    d = _recipes(tmp_path, one=(["h200"], tp))
    out = run_warmer("matrix", d)
    assert out.returncode == 2 and "engine.tensor_parallel_size" in out.stderr and "one.toml" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_cli_github_format_is_one_line_for_github_output():
    out = run_warmer("matrix", "manifests/", "--format", "github")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 1  # `echo "matrix=$(...)" >> $GITHUB_OUTPUT` takes one line
    doc = json.loads(out.stdout)
    assert set(doc) == {"include"} and doc["include"]
    assert all(Path(REPO, e["recipe"]).is_file() for e in doc["include"])  # paths relative to the checkout
    only = json.loads(run_warmer("matrix", "manifests/", "--format", "json", "--sku", "rtx-5090").stdout)
    assert [e["sku"] for e in only] == ["rtx-5090"]
    # The skipped recipes (the GPU acceptance ones, without targets) are said, but not under --quiet.
    assert "warmer: matrix: skipped " in out.stderr
    quiet = run_warmer("-q", "matrix", "manifests/")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == out.stdout


def test_cli_unknown_sku_fails_with_the_message(tmp_path):
    d = _recipes(tmp_path, bad=(["h300"], 1))
    out = run_warmer("matrix", d)
    assert out.returncode == 2 and "h300" in out.stderr and "Traceback" not in out.stderr  # a usage error


# --- the step summary ------------------------------------------------------------------------

def _verify(verdict: str, recompiled: int, restored: dict) -> VerifyResult:
    return VerifyResult(verdict, FileDelta(recompiled, 0, {}), (), {}, {}, {}, restored, {})


BUILD_RESULT = BuildResult(
    recipe="llama", key="ab" * 32, store="s3://bucket/warmer", status="published", files=120, bytes=1_500_000_000,
    archive_bytes=400_000_000, restore=RestoreResult("restored", "/cache/llama", "ab" * 32, 3.2),
    cold={"engine_init_s": 212.4, "init_engine_s": 150.1, "torch_compile_s": 39.0},
    verify=_verify("hit", 0, {"engine_init_s": 61.0, "init_engine_s": 20.3, "torch_compile_s": 4.1}),
    publish=PublishResult("published", "s3://bucket/warmer", "llama", "ab" * 32, "ef" * 32, 400_000_000, True))


def test_step_summary_has_cold_time_size_and_verify():
    md = step_summary(BUILD_RESULT, recipe="llama")
    assert "published" in md.splitlines()[0]
    assert "| engine start (LLM() to ready) | 212.4 s | 61.0 s |" in md
    assert "1500.0 MB packed to 400.0 MB" in md and "**hit**, 0 recompiled" in md
    assert "s3://bucket/warmer" in md


def test_step_summary_of_a_failure_and_of_nothing_to_do():
    md = step_summary(replace(BUILD_RESULT, verify=_verify("miss", 7, {})),
                             recipe="llama", error="verify found 7 recompiled file(s)")
    assert "failed" in md.splitlines()[0] and "> verify found 7" in md and "**miss**, 7 recompiled" in md
    md = step_summary(BuildResult("x", "cd" * 32, "s3://b", "already-published"), recipe="x")
    assert "nothing built" in md and "cdcdcdcd" in md


def test_build_writes_the_summary_when_it_fails_early(tmp_path):
    root = tmp_path / "root"
    (root / "leftover").mkdir(parents=True)
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    (tmp_path / "model").mkdir()
    recipe = write_tiny_recipe(tmp_path / "tiny.toml", model_path=str(tmp_path / "model"))
    out = run_warmer("build", recipe, "--store", f"file://{tmp_path / 's'}", "--root", root, "--step-summary", summary)
    assert out.returncode == 1 and "not empty" in out.stderr
    text = summary.read_text()
    assert text.startswith("earlier step\n")  # appended, as GitHub expects
    assert "tiny" in text and "failed" in text and "not empty" in text
