"""`warmer serve`'s plan against vLLM's own `vllm serve` parser: the flags it renders from a recipe
are ones vLLM takes, and an extra flag after `--` that sets an arg vLLM hashes is caught in every
spelling vLLM takes (-tp 2, -O0, --compilation-config.mode=0). The CLI's errors on a miss."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

from tests.conftest import run_warmer, tiny_recipe, write_tiny_recipe
from warmer import restore, serving
from warmer.recipe import ENGINE_ARGS

# (extra flags, flagged): each spelling vLLM 0.32's parser takes, and server flags it must leave alone.
SPELLINGS = [
    (["--tensor-parallel-size", "2"], ["--tensor-parallel-size"]),
    (["-tp", "2"], ["-tp"]),
    (["-tp=2"], ["-tp"]),
    (["-pp", "2"], ["-pp"]),
    (["-dp", "2"], ["-dp"]),
    (["-q", "fp8"], ["-q"]),
    (["-qfp8"], ["-qfp8"]),  # argparse: a one-letter option joined to its value
    (["-O0"], ["-O0"]),
    (["-O3"], ["-O3"]),
    (["-O=2"], ["-O"]),
    (["-O", "1"], ["-O"]),
    (["--optimization-level", "0"], ["--optimization-level"]),
    (["--compilation-config.mode=0"], ["--compilation-config.mode"]),
    (["--compilation_config.mode", "0"], ["--compilation_config.mode"]),
    (["-cc.mode=0"], ["-cc.mode"]),
    (["-cc", '{"mode": 0}'], ["-cc"]),
    (["--max-num-seq", "8"], ["--max-num-seq"]),  # argparse takes a unique prefix
    (["--max_num_seqs=8"], ["--max_num_seqs"]),
    (["--no-enable-chunked-prefill"], ["--no-enable-chunked-prefill"]),
    (["-ep"], ["-ep"]),
    (["--port", "8000", "--host=0.0.0.0", "--uds", "/tmp/v.sock", "--api-key", "k"], []),
    (["-asc", "2", "--served-model-name", "x", "--seed", "-1", "--disable-log-stats"], []),
    (["--jit-monitor-mode", "warn", "--jit-monitor-verbose", "--uvicorn-log-level", "debug"], []),
    (["--gpu-memory-utilization", "0.9", "--no-enable-prefix-caching", "--distributed-executor-backend", "mp"], []),
]


@pytest.mark.parametrize("extra, flagged", SPELLINGS, ids=[" ".join(e) for e, _ in SPELLINGS])
def test_an_extra_flag_vllm_hashes_is_caught_in_every_spelling(extra, flagged):
    assert serving.hashed_extra_flags(extra) == flagged


def test_a_config_file_counts_as_hashed():
    # vLLM reads any engine arg from it (FlexibleArgumentParser._pull_args_from_config).
    assert serving.hashed_extra_flags(["--config", "more.yaml"]) == ["--config"]


def test_a_short_alias_predicts_the_miss(tmp_path, packed):
    recipe = tiny_recipe()
    root = tmp_path / "root"
    restore.restore_file(packed("a", recipe=recipe).path, root)
    restore.prepare(root)
    assert not serving.plan(recipe, root, ["--port", "8000"]).predicted_miss
    got = serving.plan(recipe, root, ["-tp", "2"])
    assert got.predicted_miss and got.hashed_extra == ("-tp",)
    assert any("-tp are engine args vLLM hashes" in w for w in got.warnings), got.warnings


def test_false_of_a_store_true_arg_is_no_flag():
    # store_true in `vllm serve` (no --no- form: vLLM exits 2 on one), or no flag at all; False is the default.
    assert serving.engine_flags({"disable_log_stats": False, "aggregate_engine_logging": False,
                                 "data_parallel_multi_port_external_lb": False,
                                 "enable_mm_processor_stats": False}) == []
    assert serving.engine_flags({"disable_log_stats": True}) == ["--disable-log-stats"]
    assert serving.engine_flags({"enforce_eager": False}) == ["--no-enforce-eager"]


# --- against vLLM's real parser (argparse only: no engine starts) -------------------------------

PARSE = r"""
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = make_arg_parser(FlexibleArgumentParser())
defaults = vars(parser.parse_args(["/m"]))
out = []
for argv in json.load(sys.stdin):
    try:
        got = vars(parser.parse_args(["/m", *argv]))
    except SystemExit as e:
        out.append({"exit": e.code})
        continue
    out.append({"set": sorted(k for k, v in got.items() if v != defaults.get(k)),
                "bools": {k: v for k, v in got.items() if isinstance(v, bool)}})
print(json.dumps(out))
"""


def _bool_cases() -> list[tuple[str, bool]]:
    names = sorted(n for n, s in ENGINE_ARGS["properties"].items() if s.get("type") == "boolean")
    # An arg `vllm serve` has no flag for cannot be passed True (recipe.py's to refuse); False is its default.
    return [(n, v) for n in names for v in (True, False)
            if v is False or "--" + n.replace("_", "-") in serving.SERVE_OPTIONS]


@pytest.fixture(scope="module")
def vllm_parsed() -> dict[tuple[str, ...], dict]:
    """What vLLM's `vllm serve` parser makes of each argv these tests ask about, in one child
    process (about 10 s: vLLM's import)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: pip install -e .[cpu]")
    import subprocess

    argvs = [serving.engine_flags({n: v}) for n, v in _bool_cases()] + [extra for extra, _ in SPELLINGS]
    out = subprocess.run([sys.executable, "-c", PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                         timeout=300, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(zip(map(tuple, argvs), json.loads(out.stdout.splitlines()[-1]), strict=True))


def test_every_recipe_boolean_renders_as_flags_vllm_serve_takes(vllm_parsed):
    wrong = []
    for n, v in _bool_cases():
        flags = serving.engine_flags({n: v})
        got = vllm_parsed[tuple(flags)]
        if "exit" in got or got["bools"].get(n, False) is not v:
            wrong.append((n, v, flags, got.get("exit")))
    assert not wrong, wrong


def test_the_flags_caught_are_those_vllm_reads_as_a_hashed_arg(vllm_parsed):
    hashed = set(ENGINE_ARGS["properties"]) - serving.UNHASHED_ENGINE_ARGS
    for extra, _ in SPELLINGS:
        got = vllm_parsed[tuple(extra)]
        assert "exit" not in got, (extra, got)
        assert bool(set(got["set"]) & hashed) == bool(serving.hashed_extra_flags(extra)), (extra, got["set"])


# Each unhashed engine arg set to a value other than its default, as a serve command would.
UNHASHED_PROBES = {
    "served_model_name": ["--served-model-name", "x"], "seed": ["--seed", "7"],
    "disable_log_stats": ["--disable-log-stats"], "enable_log_requests": ["--enable-log-requests"],
    "tokenizer_mode": ["--tokenizer-mode", "slow"], "hf_token": ["--hf-token", "abc"],
    "download_dir": ["--download-dir", "/tmp/warmer-unused"], "load_format": ["--load-format", "safetensors"],
    "show_hidden_metrics_for_version": ["--show-hidden-metrics-for-version", "0.31"],
    "otlp_traces_endpoint": ["--otlp-traces-endpoint", "http://collector:4317"],
    "kv_cache_metrics": ["--kv-cache-metrics"], "enable_mfu_metrics": ["--enable-mfu-metrics"],
    "jit_monitor_mode": ["--jit-monitor-mode", "warn"], "jit_monitor_verbose": ["--jit-monitor-verbose"],
    "gpu_memory_utilization": ["--gpu-memory-utilization", "0.5"],
    "kv_cache_memory_bytes": ["--kv-cache-memory-bytes", "1000000"],
    "num_gpu_blocks_override": ["--num-gpu-blocks-override", "100"],
    "enable_prefix_caching": ["--no-enable-prefix-caching"],
    "prefix_caching_hash_algo": ["--prefix-caching-hash-algo", "sha256"],
    "tokenizer_revision": ["--tokenizer-revision", "main"],
    "distributed_executor_backend": ["--distributed-executor-backend", "mp"],
    "disable_custom_all_reduce": ["--disable-custom-all-reduce"],
    "max_parallel_loading_workers": ["--max-parallel-loading-workers", "2"],
    "ignore_patterns": ["--ignore-patterns", "extra/*"],
    "model_loader_extra_config": ["--model-loader-extra-config", "{}"],
    "pt_load_map_location": ["--pt-load-map-location", "cpu"],
    "safetensors_load_strategy": ["--safetensors-load-strategy", "eager"],
    "use_tqdm_on_load": ["--no-use-tqdm-on-load"],
    "log_level": ["--log-level", "DEBUG"], "logging_config": ["--logging-config.log_level", "DEBUG"],
    "shutdown_timeout": ["--shutdown-timeout", "30"], "scheduling_policy": ["--scheduling-policy", "priority"],
    "stream_interval": ["--stream-interval", "4"], "max_num_queued_reqs": ["--max-num-queued-reqs", "10"],
    "logprobs_mode": ["--logprobs-mode", "processed_logits"], "skip_tokenizer_init": ["--skip-tokenizer-init"],
    "tokens_only": ["--tokens-only"], "use_fp64_gumbel": ["--use-fp64-gumbel"],
    "aggregate_engine_logging": ["--aggregate-engine-logging"],
    "allowed_local_media_path": ["--allowed-local-media-path", "/tmp"],
    "allowed_media_domains": ["--allowed-media-domains", "example.com"],
    "mm_processor_cache_gb": ["--mm-processor-cache-gb", "1"],
    "mm_processor_cache_type": ["--mm-processor-cache-type", "shm"],
    "mm_shm_cache_max_object_size_mb": ["--mm-shm-cache-max-object-size-mb", "129"],
}
# Names only, or needing a set-up of their own (tracing, speculative decoding, multimodal inputs).
UNPROBED = {"tokenizer", "collect_detailed_traces", "per_request_spec_decode_metrics", "kv_cache_metrics_sample",
            "custom_histogram_buckets", "cudagraph_metrics", "enable_layerwise_nvtx_tracing",
            "enable_mm_processor_stats", "enable_logging_iteration_details",
            "log_config_file"}  # names a logging config file: set, it must exist
HASH = """
import json, os, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
model, argvs = sys.argv[1], json.loads(sys.stdin.read())
parser = make_arg_parser(FlexibleArgumentParser())
def key(extra):
    args = parser.parse_args(["--model", model, "--max-model-len", "128", *extra])
    return AsyncEngineArgs.from_cli_args(args).create_engine_config().compute_hash()
base = key([])
print(json.dumps([key(a) != base for a in argvs]))
"""


def test_the_unhashed_engine_args_leave_vllms_compile_key_as_it_is(tmp_path):
    """vLLM's own VllmConfig.compute_hash, on the tiny model, with each arg warmer lets through
    (a serve command's --gpu-memory-utilization 0.9 was called a cold start, and --require-hit
    refused to start); two that vLLM does hash move it, so the probe can tell."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: pip install -e .[cpu]")
    import subprocess

    assert set(UNHASHED_PROBES) | UNPROBED == serving.UNHASHED_ENGINE_ARGS
    model = tmp_path / "tiny"
    made = subprocess.run([sys.executable, "-m", "warmer.tinymodel", str(model)], capture_output=True, text=True,
                          timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    argvs = [*UNHASHED_PROBES.values(), ["--max-num-seqs", "3"], ["--enforce-eager"]]
    out = subprocess.run([sys.executable, "-c", HASH, str(model)], input=json.dumps(argvs), capture_output=True,
                         text=True, timeout=300, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert out.returncode == 0, out.stderr[-3000:]
    *unhashed, seqs, eager = json.loads(out.stdout.splitlines()[-1])
    assert seqs and eager, "the probe cannot tell a hashed arg"
    moved = [name for name, changed in zip(UNHASHED_PROBES, unhashed, strict=True) if changed]
    assert not moved, f"vLLM hashes {moved}: not what was warmed"
    assert not serving.hashed_extra_flags(["--gpu-memory-utilization", "0.9", "--no-enable-prefix-caching"])
    assert not serving.hashed_extra_flags(["--log-level", "DEBUG", "--shutdown-timeout", "30"])


# --- the CLI ----------------------------------------------------------------------------------

def test_require_hit_with_json_is_a_json_error(tmp_path):
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    root = tmp_path / "root"
    root.mkdir()  # writable, and nothing active: vLLM would compile from cold
    out = run_warmer("serve", recipe, "--root", root, "--require-hit", "--json",
                     env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 3, out.stderr
    error = json.loads(out.stdout)
    assert error["exit_code"] == 3 and error["kind"] == "miss" and "refusing to start" in error["error"]


def test_a_root_that_does_not_exist_is_no_warmed_cache_not_an_ownership_problem(tmp_path):
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    root = tmp_path / "typo"
    out = run_warmer("serve", recipe, "--root", root, "--dry-run", "--json",
                     env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert f"no warmed cache is active in {root}: it does not exist" in out.stderr
    assert "not writable" not in out.stderr and "chown" not in out.stderr
    cold = restore.cold_root("tiny", os.geteuid())
    assert json.loads(out.stdout)["env"]["VLLM_CACHE_ROOT"] == str(tmp_path / cold.name / "vllm")
    assert not root.exists()


def test_an_active_root_missing_a_cache_directory_of_this_warmer_is_served_not_sent_cold(tmp_path, packed):
    """A root readied by an older warmer lacks the directory of a cache this one knows (the prefetch
    DaemonSet's image not updated yet, the pod's is): serve, as a user that may write the root, makes
    it as vLLM would and serves from the root. It said "not writable" and started vLLM cold elsewhere."""
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    root = tmp_path / "root"
    restore.restore_file(packed("a").path, root)
    newer = root / "flashinfer" / ".cache" / "flashinfer" / "autotune"  # standing in for a newer cache's
    newer.rmdir()
    out = run_warmer("serve", recipe, "--root", root, "--dry-run", "--require-hit", "--json",
                     env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["env"]["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert newer.is_dir() and "not writable" not in out.stderr


def test_a_root_that_is_a_symlink_is_served_with_the_warning_doctor_gives(tmp_path, packed):
    """fetch and restore refuse a symlink as --root; serve started from one without a word (doctor
    called it an error): FlashInfer's ninja rebuilds what it reaches through a link."""
    recipe = write_tiny_recipe(tmp_path / "tiny.toml")
    real, link = tmp_path / "real", tmp_path / "link"
    restore.restore_file(packed("a").path, real)
    link.symlink_to(real)
    out = run_warmer("serve", recipe, "--root", link, "--dry-run", env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert f"root {link} is a symlink to {real}" in out.stderr and "pass the real path" in out.stderr
    # where the build's root was the link's path, the real path would differ from it too: the other fix
    assert f"make that a real directory: mount the volume at {tmp_path}" in out.stderr


def test_serving_where_vllm_is_not_on_path_says_so(tmp_path):
    """exec's own error names the last PATH entry tried (`No such file or directory: b'/bin/vllm'`):
    warmer says that vLLM is not on PATH, and which PATH."""
    from warmer import api
    from warmer.envfile import EnvFile
    from warmer.errors import UsageError

    plan = serving.ServePlan(("vllm",), EnvFile.of({}, "test"), {"PATH": str(tmp_path)})
    with pytest.raises(UsageError, match=f"vllm is not on PATH \\({tmp_path}\\)"):
        api.serve(plan)
