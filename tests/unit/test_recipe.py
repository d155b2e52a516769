import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_warmer, tiny_recipe, write_tiny_recipe
from warmer import recipe as recipe_module
from warmer.components import cache_env
from warmer.errors import UsageError
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


# --- strict recipes ------------------------------------------------------------------------

TABLE_VERSION = recipe_module.ENGINE_ARGS["x-vllm-version"]
GOOD = """\
name = "strict"

[model]
path = "/models/strict"

[engine]
max_model_len = 256
max_num_seqs = 4
max_num_batched_tokens = 256

[env]
HF_HUB_OFFLINE = "1"

[workload]
prompt_lengths = [8]
"""


@pytest.fixture
def vllm_version(monkeypatch):
    """Pretend the installed vLLM is this version (None: not installed): decides whether an
    unknown engine arg is an error or a warning."""
    def pretend(version):
        monkeypatch.setattr(recipe_module, "_installed_vllm", lambda: version)
    pretend(TABLE_VERSION)
    return pretend


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "r.toml"
    path.write_text(text)
    return path


def refused(path: Path) -> list[str]:
    with pytest.raises(RecipeError) as e:
        load(path)
    lines = str(e.value).splitlines()
    assert lines == e.value.errors if len(lines) == 1 else lines == [f"{path}: {len(lines) - 1} problems:"] + e.value.errors
    return e.value.errors


def test_the_base_recipe_of_these_tests_loads(tmp_path, vllm_version):
    r = load(write(tmp_path, GOOD))
    assert r.engine["max_num_seqs"] == 4 and r.warnings() == []


def test_recipe_errors_are_usage_errors():
    assert issubclass(RecipeError, UsageError)


def test_a_typo_is_refused_with_a_suggestion_and_its_line_and_column(tmp_path, vllm_version):
    path = write(tmp_path, GOOD.replace("max_num_batched_tokens = 256", "  max_num_batched_tokn = 256"))
    [error] = refused(path)
    assert error.startswith(f"{path}:9:3: unknown engine arg engine.max_num_batched_tokn; "
                            "did you mean max_num_batched_tokens?"), error


def test_typos_outside_engine_are_refused_too(tmp_path, vllm_version):
    path = write(tmp_path, GOOD.replace("path =", "revison = \"abc\"\npath =")
                 .replace("prompt_lengths = [8]", "prompt_lengths = [8]\nmax_token = 4"))
    assert refused(path) == [f"{path}:4:1: unknown key model.revison; did you mean revision?",
                             f"{path}:17:1: unknown key workload.max_token; did you mean max_tokens?"]


def test_a_wrong_type_is_refused(tmp_path, vllm_version):
    path = write(tmp_path, GOOD.replace("max_num_seqs = 4", 'max_num_seqs = "four"'))
    assert refused(path) == [f'{path}:8:1: engine.max_num_seqs must be an integer, got "four"']
    # TOML tells 4 from 4.0, and so does the digest: a float is not an integer arg.
    path = write(tmp_path, GOOD.replace("max_num_seqs = 4", "max_num_seqs = 4.0"))
    assert refused(path) == [f"{path}:8:1: engine.max_num_seqs must be an integer, got 4.0"]


def test_a_value_outside_a_literal_names_the_closest_choice(tmp_path, vllm_version):
    path = write(tmp_path, GOOD.replace("[engine]", '[engine]\ndtype = "bf16"'))
    [error] = refused(path)
    assert error.startswith(f'{path}:7:1: engine.dtype must be one of "auto", "half"'), error
    assert error.endswith('got "bf16"; did you mean "bfloat16"?'), error


def test_an_unknown_table_is_refused(tmp_path, vllm_version):
    path = write(tmp_path, GOOD.replace("[env]", "[envv]"))
    assert refused(path) == [f"{path}:11:1: unknown table [envv]; did you mean [env]?"]


def test_an_unknown_array_of_tables_entry_names_its_index(tmp_path, vllm_version):
    path = write(tmp_path, GOOD + "\n[[workload.sampling]]\ntemperature = 0.0\n\n[[workload.sampling]]\ntemp = 0.7\n")
    assert refused(path) == [f"{path}:21:1: unknown key workload.sampling[1].temp; did you mean temperature?"]


def test_every_error_of_a_recipe_is_listed_at_once_in_file_order(tmp_path, vllm_version):
    path = write(tmp_path, GOOD.replace("max_num_batched_tokens", "max_num_batched_tokn")
                 .replace("max_num_seqs = 4", 'max_num_seqs = "four"')
                 .replace("[env]", "[envv]")
                 .replace("prompt_lengths = [8]", "prompt_lengths = [0]")
                 .replace('name = "strict"', 'name = "Strict"'))
    errors = refused(path)
    assert [e.split(": ", 1)[0] for e in errors] == [f"{path}:{n}:1" for n in (1, 8, 9, 11, 15)], errors
    assert "name must be lower-case" in errors[0]
    assert "max_num_seqs must be an integer" in errors[1]
    assert "did you mean max_num_batched_tokens?" in errors[2]
    assert "unknown table [envv]" in errors[3]
    assert "workload.prompt_lengths must be a non-empty list of positive integers" in errors[4]


def test_a_missing_key_points_at_its_table(tmp_path, vllm_version):
    path = write(tmp_path, GOOD.replace("prompt_lengths = [8]", "max_tokens = 4"))
    [error] = refused(path)
    assert error.startswith(f"{path}:14:1: a workload.prompt_lengths is required"), error


@pytest.mark.parametrize("var", ["LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PATH", "TRITON_CACHE_DIR",
                                 "VLLM_CACHE_ROOT", "TMPDIR", "VLLM_RPC_BASE_PATH"])
def test_reserved_env_is_refused_naming_why(tmp_path, vllm_version, var):
    path = write(tmp_path, GOOD.replace('HF_HUB_OFFLINE = "1"', f'{var} = "/elsewhere"'))
    assert refused(path) == [f"{path}:12:1: env.{var} is reserved: {recipe_module.RESERVED_ENV[var]}; remove it from [env]"]


def test_every_cache_variable_warmer_sets_is_reserved():
    owned = set(cache_env(Path("/root-of-caches"))) | {"VLLM_RPC_BASE_PATH", "TMPDIR"}
    assert owned <= set(recipe_module.RESERVED_ENV)
    assert all(why.strip() for why in recipe_module.RESERVED_ENV.values())


@pytest.mark.parametrize("key", ['"X=1; touch /tmp/p; Y"', '"A\\nB"', '"X\\n"', '"1X"', '"X-Y"', '""'])
def test_an_env_key_that_is_not_an_identifier_is_refused(tmp_path, vllm_version, key):
    path = write(tmp_path, GOOD.replace('HF_HUB_OFFLINE = "1"', f'HF_HUB_OFFLINE = "1"\n{key} = "1"'))
    [error] = refused(path)
    assert error.startswith(f"{path}:13:1: env keys must be shell identifiers"), error
    assert "\n" not in error  # one line, whatever the key holds


def test_an_env_value_must_be_a_string_without_nul(tmp_path, vllm_version):
    path = write(tmp_path, GOOD.replace('HF_HUB_OFFLINE = "1"', 'A = "x\\u0000y"\nB = 1'))
    errors = refused(path)
    assert [e.split(": ", 1)[0] for e in errors] == [f"{path}:12:1", f"{path}:13:1"]
    assert all("must be a string without NUL bytes" in e for e in errors)


@pytest.mark.parametrize("escape, code", [("\\r", "000D"), ("\\u001b", "001B"), ("\\u0085", "0085"), ("\\u2028", "2028")])
def test_an_env_value_with_a_control_character_is_refused_at_load_naming_it(tmp_path, vllm_version, escape, code):
    # fetch would otherwise find it only when it writes the env file, after the download
    path = write(tmp_path, GOOD.replace('HF_HUB_OFFLINE = "1"', f'A = "x{escape}y"'))
    assert refused(path) == [f"{path}:12:1: env.A holds U+{code}, a control character or line separator: the env "
                             "file vLLM starts with carries only text, tabs and newlines; remove it"]
    with pytest.raises(RecipeError, match="env.A holds"):
        load(path, schema_later=True)  # as fetch loads it: before anything is fetched


def test_an_engine_arg_vllm_serve_has_no_flag_for_is_refused_at_load(tmp_path, vllm_version):
    """LLM() takes any engine arg, so the warm-up would run; `vllm serve` has no flag for these,
    so every pod would exit at start-up (a crash loop). False of a store_true arg is no flag at all."""
    path = write(tmp_path, GOOD.replace("[engine]", "[engine]\nenable_mm_processor_stats = true"))
    [message] = refused(path)
    assert "engine.enable_mm_processor_stats = true: `vllm serve` has no --enable-mm-processor-stats flag" in message
    assert message.endswith("remove it from [engine]")
    for fine in ("enable_mm_processor_stats = false", "disable_log_stats = false", "disable_log_stats = true"):
        assert load(write(tmp_path, GOOD.replace("[engine]", f"[engine]\n{fine}"))).engine


def test_a_prompt_length_that_leaves_no_room_for_output_is_refused_at_load(tmp_path, vllm_version):
    """vLLM refuses a prompt of max_model_len tokens or more (vllm/v1/engine/input_processor.py),
    but only after the whole cold start: the recipe says it at once, at the length's position."""
    path = write(tmp_path, GOOD.replace("prompt_lengths = [8]", "prompt_lengths = [8, 256]"))
    assert refused(path) == [f"{path}:15:1: workload.prompt_lengths holds 256, but engine.max_model_len is 256: "
                             "vLLM refuses a prompt that leaves no room for one output token; give prompt lengths "
                             "below 256, or raise max_model_len"]
    assert load(write(tmp_path, GOOD.replace("prompt_lengths = [8]", "prompt_lengths = [8, 255]"))).workload


def test_an_empty_sampling_list_is_refused(tmp_path, vllm_version):
    """No [[workload.sampling]] table would send no request at all: nothing warmed, nothing said."""
    path = write(tmp_path, GOOD + "sampling = []\n")
    [message] = refused(path)
    assert "workload.sampling must hold at least one [[workload.sampling]] table" in message, message


def test_an_env_value_may_span_lines_and_hold_tabs(tmp_path, vllm_version):
    path = write(tmp_path, GOOD.replace('HF_HUB_OFFLINE = "1"', 'A = """{\n\t"k": 1\n}"""'))
    assert load(path).env["A"] == '{\n\t"k": 1\n}'


def test_an_unknown_engine_arg_is_a_warning_when_vllm_is_not_the_recorded_one(tmp_path, vllm_version):
    path = write(tmp_path, GOOD.replace("[engine]", "[engine]\nnew_in_a_later_vllm = true"))
    vllm_version("999.0.0")
    [warning] = load(path).warnings()
    assert warning.startswith(f"{path}:7:1: unknown engine arg engine.new_in_a_later_vllm"), warning
    assert "vLLM 999.0.0 may have it, so this is only a warning" in warning
    vllm_version(None)
    assert "vLLM is not installed here" in load(path).warnings()[0]
    vllm_version(TABLE_VERSION)
    [error] = refused(path)
    assert "has no such field" in error


def test_a_check_left_for_later_is_the_same_check(tmp_path, vllm_version):
    # fetch loads with schema_later (the check runs while the first bytes download)
    typo = write(tmp_path, GOOD.replace("prompt_lengths = [8]", "prompt_lengths = [8]\nmax_token = 4"))
    later, errors = load(typo, schema_later=True), refused(typo)
    with pytest.raises(RecipeError) as e:
        later.checked()
    assert e.value.errors == errors and len(errors) == 1
    assert later.digest() == load(write(tmp_path, GOOD)).digest()  # what the key is made of
    # what the build itself cannot read is refused at once, by the full check
    with pytest.raises(RecipeError, match="workload must be"):
        parse({"name": "t", "model": {"path": "/m"}, "workload": 3}, Path("r.toml"), schema_later=True)
    # notes (warnings) come with the check
    vllm_version("999.0.0")
    newer = load(write(tmp_path, GOOD.replace("[engine]", "[engine]\nnew_in_a_later_vllm = true")), schema_later=True)
    assert newer.notes == () and len(newer.checked().notes) == 1 and newer.checked().checked().unchecked is None


def test_the_model_stays_out_of_engine(tmp_path, vllm_version):
    path = write(tmp_path, GOOD.replace("[engine]", '[engine]\nmodel = "/models/other"'))
    [error] = refused(path)
    assert error.startswith(f"{path}:7:1: engine.model") and "set the model in [model]" in error


def test_invalid_toml_names_its_line_and_column(tmp_path):
    path = write(tmp_path, 'name = "x"\nmax = = 1\n')
    with pytest.raises(RecipeError, match=rf"^{re.escape(str(path))}:2:7: not valid TOML: "):
        load(path)


def test_the_locator_reads_headers_arrays_and_quoted_keys_but_not_multiline_values():
    text = ('name = "x"\n'
            '[engine]\n'
            'ignore_patterns = [\n'
            '  "a",\n'
            '  "b = c",\n'
            ']\n'
            'doc = """\n'
            '[not.a.table]\n'
            '"""\n'
            '  compilation_config.level = 3  # a dotted key\n'
            '[env]\n'
            '"A\\nB" = "1"\n'
            '[[workload.sampling]]\n'
            '[[workload.sampling]]\n'
            '  top_k = 2\n')
    where = recipe_module.locate(text)
    assert where[("engine", "ignore_patterns")] == (3, 1)
    assert ("engine", "b") not in where and ("not", "a", "table") not in where
    assert where[("engine", "compilation_config", "level")] == (10, 3)
    assert where[("env", "A\nB")] == (12, 1)
    assert where[("workload", "sampling", 1)] == (14, 1)
    assert where[("workload", "sampling", 1, "top_k")] == (15, 3)


def test_every_shipped_recipe_and_the_gpu_check_recipe_load_without_warnings(monkeypatch):
    monkeypatch.setenv("WARMER_TINY_MODEL", "/models/tiny")
    paths = sorted((REPO / "manifests" / "models").glob("*.toml")) + [REPO / "scripts" / "gpu-check.toml"]
    for path in paths:
        r = load(path)
        assert r.notes == () and r.name, path


def test_the_digest_is_what_it_was_before_recipes_were_strict():
    # Computed by the recipe loader that predates the schema: the digest is part of artifact keys.
    doc = {"name": "golden", "description": "not in the identity", "targets": ["h200"],
           "model": {"id": "org/m", "revision": "0123abc", "path": "/models/org/m"},
           "engine": {"dtype": "bfloat16", "max_model_len": 4096, "max_num_seqs": 8,
                      "max_num_batched_tokens": 4096, "gpu_memory_utilization": 0.9},
           "env": {"HF_HUB_OFFLINE": "1"},
           "workload": {"prompt_lengths": [16, 512], "batch_sizes": [1, 8], "max_tokens": 8, "timeout_s": 600,
                        "sampling": [{"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20}]}}
    assert parse(doc, Path("g.toml")).digest() == "c3b85f4240bb2a19f5cc6d2b4d3736279833a1131c4c4dd53bcc89b2e56bda5f"


def test_the_module_constants_are_the_schema_s():
    assert recipe_module.NAME_RE.pattern == recipe_module.SCHEMA["properties"]["name"]["pattern"]
    assert recipe_module.SAMPLING_KEYS == {"temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                     "presence_penalty", "frequency_penalty"}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed: pip install -e .[cpu]")
def test_the_recorded_engine_args_are_what_the_installed_vllm_has():
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "record_engine_args.py"), "--stdout"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    now, committed = json.loads(out.stdout), recipe_module.ENGINE_ARGS
    added = sorted(set(now["properties"]) - set(committed["properties"]))
    gone = sorted(set(committed["properties"]) - set(now["properties"]))
    stale = "vLLM's EngineArgs changed: run scripts/record_engine_args.py and commit warmer/schemas/recipe.schema.json"
    assert (now["x-vllm-version"], added, gone) == (committed["x-vllm-version"], [], []), stale
    assert now == committed, stale
    # The file is kept in the script's layout, so that re-recording changes only the table.
    path = recipe_module.SCHEMAS / "recipe.schema.json"
    assert path.read_text() == json.dumps(recipe_module.SCHEMA, indent=1, ensure_ascii=False) + "\n"


def test_the_schemas_are_valid_draft_2020_12():
    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(recipe_module.SCHEMA)
    assert recipe_module.SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_the_schema_and_the_store_agree_on_recipe_names():
    from warmer.recipe import SCHEMA
    from warmer.store import NAME

    assert SCHEMA["properties"]["name"]["pattern"] == NAME.pattern


def test_observability_flags_are_not_taken_for_compile_key_changes():
    """vLLM hashes no ObservabilityConfig field into its compile key (config/observability.py:
    compute_hash has no factors): the JIT monitor gpu-accept turns on must not read as a miss,
    while an engine arg vLLM does hash still does."""
    from warmer import serving

    assert serving.hashed_extra_flags(["--jit-monitor-mode", "warn", "--jit-monitor-verbose", "--port", "8000"]) == []
    assert serving.hashed_extra_flags(["--jit-monitor-mode=error", "--max-num-seqs", "8"]) == ["--max-num-seqs"]


def test_a_recipe_path_that_is_a_directory_is_a_usage_error_naming_it(tmp_path):
    with pytest.raises(RecipeError, match=f"recipe {re.escape(str(tmp_path))} is a directory: give a recipe file"):
        load(tmp_path)


def test_a_toml_date_inside_an_engine_args_table_is_said_at_its_line_on_fetch_and_pack(tmp_path):
    """Valid TOML the schema leaves open (an object-typed arg's table): json.dumps of the key raised
    a TypeError, a traceback in build and pack and "no artifact chosen: unexpected TypeError" (exit 0)
    on every fetch, where every other bad recipe is a usage error at FILE:LINE:COL."""
    f = write_tiny_recipe(tmp_path / "tiny.toml")
    f.write_text(f.read_text().replace("[engine]\n", "[engine]\nhf_overrides = { released = 1979-05-27T00:32:00 }\n"))
    for args in (["fetch", f, "--store", f"file://{tmp_path}", "--root", tmp_path / "root"],
                 ["pack", tmp_path, "--recipe", f, "-o", tmp_path / "a.tar.zst"]):
        out = run_warmer(*args)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"{f}:5:1: engine.hf_overrides.released is a TOML date or time" in out.stderr, out.stderr
