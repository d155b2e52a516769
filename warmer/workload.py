"""The child process that starts vLLM and runs a recipe's warm-up workload.

Run as `python -m warmer.workload SPEC.json RESULT.json` by warmer.warmup, with every cache
env var already pointing under the root: vLLM is imported only here, after that. The
`__main__` guard matters: vLLM's CPU backend spawns its workers, which re-import this module.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path


def _vocab_size(llm) -> int:
    return int(llm.llm_engine.model_config.get_vocab_size())


def vllm_key(llm, env_at_start: dict) -> dict:
    """What vLLM hashed into its compile keys in this process: the names of its env factors
    (vllm/envs.py compile_factors) with their raw values as this process started (before vLLM's
    own os.environ edits, e.g. the CPU platform's), and VllmConfig.compute_hash()."""
    import vllm
    import vllm.envs as envs

    names = sorted(envs.compile_factors())
    try:
        config_hash = llm.llm_engine.vllm_config.compute_hash()
    except Exception:  # an engine without the attribute: the factors still tell most of the story
        config_hash = None
    return {
        "version": getattr(vllm, "__version__", None),
        "config_hash": config_hash,
        "env": {name: env_at_start.get(name) for name in names},
    }


def run(spec: dict) -> dict:
    env_at_start = dict(os.environ)
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_import = time.perf_counter()
    llm = LLM(model=spec["model"], **spec["engine"])
    t_init = time.perf_counter()

    work = spec["workload"]
    rng = random.Random(work.get("seed", 0))
    vocab = _vocab_size(llm)
    # Token ids from the middle of the vocabulary: no special tokens, any tokenizer.
    low, high = min(10, vocab - 1), max(11, vocab - 1)
    requests = tokens = 0
    for sampling in work["sampling"]:
        params = SamplingParams(max_tokens=work["max_tokens"], ignore_eos=True, **sampling)
        for batch in work["batch_sizes"]:
            for length in work["prompt_lengths"]:
                prompts = [
                    TokensPrompt(prompt_token_ids=[rng.randrange(low, high) for _ in range(length)])
                    for _ in range(batch)
                ]
                outputs = llm.generate(prompts, params, use_tqdm=False)
                requests += len(outputs)
                tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    t_work = time.perf_counter()
    key = vllm_key(llm, env_at_start)
    return {
        "vllm_key": key,
        "import_s": round(t_import - t0, 3),
        "engine_init_s": round(t_init - t_import, 3),
        "workload_s": round(t_work - t_init, 3),
        "requests": requests,
        "generated_tokens": tokens,
    }


def main(argv: list[str]) -> int:
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    try:
        result = run(json.loads(spec_path.read_text()))
    except Exception as e:  # the cause, for warmer's error: the log ends in vLLM's shutdown, not in it
        result_path.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"[:1000]}))
        raise
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
