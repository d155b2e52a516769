"""Generate a tiny random-weight Llama that vLLM's CPU engine can serve: no model hub needed.

Sizes follow what the CPU attention backend accepts (head_dim 64: hidden 256, 4 heads). The
weights are seeded, so two runs write the same model. Needs the `cpu` extra (torch,
transformers, tokenizers); run as `python -m warmer.tinymodel DIR`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FILES = ("config.json", "model.safetensors", "tokenizer.json")


def generate(out: Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and tokenizer.json into out; return out."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if all((out / f).exists() for f in FILES):
        return out
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["warm caches start fast; cold caches recompile what was already compiled."] * 64
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(out / "tokenizer.json"))

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained may add files vLLM does not need; keep the three it reads.
    for extra in out.iterdir():
        if extra.name not in FILES:
            extra.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m warmer.tinymodel", description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="where to write the model")
    args = p.parse_args(argv)
    path = generate(args.dir.resolve())
    print(json.dumps({"model": str(path), "files": sorted(f.name for f in path.iterdir())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
