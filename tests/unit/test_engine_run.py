"""warmup.run_engine's plumbing: the log it keeps of the engine and the error it raises. The engine
here is a stand-in `vllm` package on PYTHONPATH (the real one takes tens of seconds to start and
cannot be made to fail or stall on cue); warmer.workload, the child process and the log are real."""

from __future__ import annotations

import textwrap
from dataclasses import replace

import pytest

from tests.conftest import tiny_recipe
from warmer import warmup
from warmer.warmup import WarmupError

STAND_IN = '''
import os, sys, time
__version__ = "0.32.0"


def _log_holds(text):
    """Whether the engine log warmer keeps already holds text (warmer writes it as it comes)."""
    path = os.environ["STAND_IN_LOG"]
    return os.path.exists(path) and text in open(path, errors="replace").read()


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


class LLM:
    def __init__(self, model, **engine):
        for i in range(60):
            print(f"(EngineCore pid={os.getpid()}) INFO start-up line {i}", flush=True)
        # tqdm's bar: a carriage return, no newline until the bar closes
        sys.stdout.write("\\rCapturing CUDA graphs (decode, FULL):   0%|          | 0/10")
        sys.stdout.flush()
        while not _log_holds("Capturing CUDA graphs"):  # the log is written as the engine runs
            time.sleep(0.01)
        time.sleep(0.05)  # the capture itself
        sys.stdout.write("\\rCapturing CUDA graphs (decode, FULL): 100%|##########| 10/10\\n")
        print("(Worker pid=1) INFO Graph capturing finished in 1 secs, took 0.53 GiB", flush=True)
        if os.environ.get("STAND_IN_NO_RESULT"):  # the child cannot write its result (a full disk, say)
            os.makedirs(sys.argv[2])
        if os.environ.get("STAND_IN_FAIL"):
            raise ValueError(os.environ["STAND_IN_FAIL"])
        for i in range(60):  # what vLLM prints as it shuts down: the cause scrolls out of any tail
            print(f"(EngineCore pid={os.getpid()}) INFO shutdown line {i}", flush=True)
'''


@pytest.fixture
def stand_in(tmp_path):
    pkg = tmp_path / "stand-in" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(STAND_IN))
    (pkg / "inputs.py").write_text("TokensPrompt = dict\n")
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    return {"PYTHONPATH": str(pkg.parent)}, model


def test_a_failed_engine_is_reported_with_its_cause_and_its_log_as_it_ran(stand_in, tmp_path):
    env, model = stand_in
    work = tmp_path / "work"
    env |= {"STAND_IN_LOG": str(warmup.engine_log(work, "cold")), "STAND_IN_FAIL": "max_num_seqs must be positive"}
    recipe = tiny_recipe(str(model))
    recipe = replace(recipe, workload=replace(recipe.workload, timeout_s=60))  # a log kept back stalls the stand-in
    with pytest.raises(WarmupError) as e:
        warmup.run_engine(recipe, tmp_path / "root", work, "cold", extra_env=env)
    assert "exited with code 1 (ValueError: max_num_seqs must be positive)" in str(e.value), e.value
    log = warmup.engine_log(work, "cold").read_text()
    # the bar's first state is a line of its own, stamped when it came (before the capture ended)
    assert any(line.startswith("[+") and line.endswith("0/10") for line in log.splitlines()), log[-2000:]
    assert warmup.phases(log).get("CUDA graph capture", 0) > 0


def test_an_engine_that_could_not_write_its_result_is_a_warmup_error(stand_in, tmp_path):
    """The child writes the cause into its result file; where that write fails too, the error is
    still warmer's own (exit code, log, tail), not a traceback of reading the file."""
    env, model = stand_in
    work = tmp_path / "work"
    env |= {"STAND_IN_LOG": str(warmup.engine_log(work, "cold")), "STAND_IN_FAIL": "No space left on device",
            "STAND_IN_NO_RESULT": "1"}
    recipe = tiny_recipe(str(model))
    recipe = replace(recipe, workload=replace(recipe.workload, timeout_s=60))
    with pytest.raises(WarmupError, match="the engine exited with code 1; log: "):
        warmup.run_engine(recipe, tmp_path / "root", work, "cold", extra_env=env)
