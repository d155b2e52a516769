"""Generate a tiny random-weight model that vLLM can serve: no model hub needed.

Two architectures, both seeded (two runs write the same bytes):
- `llama` (the default, `generate`): what vLLM's CPU attention backend accepts (head_dim 64:
  hidden 256, 4 heads); the demo and the CPU end-to-end tests serve it;
- `qwen3-moe` (`generate_qwen3_moe`): a Qwen3-MoE (8 experts, top-2) in sizes FlashInfer's
  attention (head_dim 64) and vLLM's fused-MoE kernels, FlashInfer CUTLASS included, accept
  (hidden and expert intermediate sizes multiples of 128): scripts/gpu-accept.sh serves it.

Needs the `cpu` extra (torch, transformers, tokenizers); run as
`python -m warmer.tinymodel DIR [--arch llama|qwen3-moe]`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FILES = ("config.json", "model.safetensors", "tokenizer.json")


def _tokenizer(out: Path):
    """Train the tiny byte-level BPE tokenizer (512 tokens) and save it as out/tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["warm caches start fast; cold caches recompile what was already compiled."] * 64
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(out / "tokenizer.json"))
    return tok


def _save(model, out: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained may add files vLLM does not need; keep the three it reads.
    for extra in out.iterdir():
        if extra.name not in FILES:
            extra.unlink()
    return out


def generate(out: Path, seed: int = 0) -> Path:
    """Write config.json, model.safetensors and tokenizer.json of the tiny Llama into out; return out."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if all((out / f).exists() for f in FILES):
        return out
    tok = _tokenizer(out)
    torch.manual_seed(seed)
    # transformers 5's typed signature lacks torch_dtype (4.x's name), which it still takes.
    config = LlamaConfig(  # type: ignore[call-arg]
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        torch_dtype="bfloat16",
    )
    # transformers types its decorated .to() as if it took the model first: wrong, as run time shows.
    return _save(LlamaForCausalLM(config).to(torch.bfloat16), out)  # type: ignore[arg-type]


def generate_qwen3_moe(out: Path, seed: int = 0) -> Path:
    """Write the tiny Qwen3-MoE (same tokenizer) into out; return out.

    Every layer is sparse: 8 experts, 2 per token, expert intermediate 256; attention with 4
    query heads and 2 KV heads of head_dim 64 (q/k norms, as Qwen3 has)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if all((out / f).exists() for f in FILES):
        return out
    tok = _tokenizer(out)
    torch.manual_seed(seed)
    # As above; head_dim too is taken at run time but missing from the typed signature.
    config = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        torch_dtype="bfloat16",
    )
    return _save(Qwen3MoeForCausalLM(config).to(torch.bfloat16), out)  # type: ignore[arg-type]


ARCHS = {"llama": generate, "qwen3-moe": generate_qwen3_moe}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m warmer.tinymodel", description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="where to write the model")
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama", help="which tiny model (default: llama)")
    args = p.parse_args(argv)
    path = ARCHS[args.arch](args.dir.resolve())
    print(json.dumps({"model": str(path), "arch": args.arch, "files": sorted(f.name for f in path.iterdir())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
