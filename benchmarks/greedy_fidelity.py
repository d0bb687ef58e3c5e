"""Greedy answers of a stored model against the same weights computed in fp32 on the reference
path (each layer dequantized, no C kernels): how many chat answers come out whole, and how many
tokens come before the first divergence.

    python benchmarks/greedy_fidelity.py smollm2-135m:int4 --dtype bf16
    python benchmarks/greedy_fidelity.py smollm2-135m:int4 --dtype fp32 --kv-cache-dtype bf16

The engine runs every prompt together, greedy, ignore_eos, 512-token steps; the reference the
same way, all in fp32 (its KV pool too). One line per run: the measure behind
docs/architecture.md's notes on `--dtype` and the KV pool's dtype (16 prompts x 32 tokens of
smollm2-135m:int4 on Zen 5: 7 answers whole in bf16, 14 in fp32).
"""

from __future__ import annotations

import argparse

import torch

from server.engine.engine import Engine, EngineConfig
from server.engine.sequence import SamplingParams, Sequence
from server.models.loader import load_model
from server.models.tokenizer import chat_prompt_ids, load_tokenizer
from storage.models import ModelStore

PROMPTS = [
    "What is the capital of France?", "Name three primary colors.",
    "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "What is 12 times 12?", "Give me a synonym for happy.", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?", "List the planets of the solar system.",
    "Translate 'good morning' to Spanish.", "What does a bee make?",
    "Describe a cat in two sentences.", "Why is the sky blue?",
    "What is the largest ocean on Earth?", "Suggest a name for a pet dog.",
    "How many days are in a leap year?",
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def answers(model: torch.nn.Module, prompts: list[list[int]], dtype: torch.dtype,
            kv_dtype: torch.dtype | None, tokens: int) -> tuple[list[list[int]], str]:
    """The greedy answers, and the KV pool's dtype by name (None: the engine's default)."""
    engine = Engine(model, EngineConfig(num_blocks=2048, max_num_seqs=len(prompts),
                                        max_num_batched_tokens=512, kv_cache_dtype=kv_dtype),
                    torch.device("cpu"), dtype)
    seqs = [Sequence(ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
            for ids in prompts]
    for s in seqs:
        engine.add(s)
    while engine.has_unfinished:
        engine.step()
    names = {v: k for k, v in DTYPES.items()}
    return [list(s.output_token_ids) for s in seqs], names[engine.kv_dtype]


def agreement(outs: list[list[int]], refs: list[list[int]]) -> tuple[int, int]:
    """(answers identical to their reference, tokens before each answer's first divergence)."""
    whole = sum(o == r for o, r in zip(outs, refs, strict=True))
    before = sum(next((i for i, (a, b) in enumerate(zip(o, r, strict=False)) if a != b),
                      min(len(o), len(r))) for o, r in zip(outs, refs, strict=True))
    return whole, before


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--kv-cache-dtype", choices=sorted(DTYPES), default=None,
                    help="default: the engine's (bf16 on CPUs without native bf16, else the "
                    "compute dtype)")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)
    stored = ModelStore().resolve(args.model)
    tokenizer = load_tokenizer(stored)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    cpu, fp32 = torch.device("cpu"), torch.float32
    refs, _ = answers(load_model(stored, cpu, fp32, use_kernels=False).model, prompts, fp32,
                      fp32, args.tokens)
    dtype, kv = DTYPES[args.dtype], args.kv_cache_dtype and DTYPES[args.kv_cache_dtype]
    outs, pool = answers(load_model(stored, cpu, dtype).model, prompts, dtype, kv, args.tokens)
    whole, before = agreement(outs, refs)
    line = (f"{stored.name} --dtype {args.dtype} --kv-cache-dtype "
            f"{pool}: {whole}/{len(prompts)} answers whole, "
            f"{before}/{len(prompts) * args.tokens} tokens before the first divergence")
    print(line)
    return line


if __name__ == "__main__":
    main()
