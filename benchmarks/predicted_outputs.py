"""One client's reply with and without a prediction (OpenAI's predicted outputs), on the engine.

    python benchmarks/predicted_outputs.py smollm2-135m:int4 [--rounds 3] [--dtype fp32]

Each prompt is answered once without a prediction (greedy, up to --tokens tokens); that reply,
then the reply with one word in four of its middle third changed (an edit a client predicts
but the model does not make), are the predictions. The three runs take turns, --rounds times;
the table gives each one's median seconds a reply and tokens/s over all replies, and the
drafts kept and dropped. Every reply is checked to be the one without a prediction.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from server.engine import speculation
from server.engine.engine import Engine, EngineConfig
from server.engine.sequence import SamplingParams, Sequence
from server.models.device import pick_device, pick_dtype
from server.models.loader import load_model
from server.models.tokenizer import chat_prompt_ids, load_tokenizer
from storage.models import ModelStore

CODE = '''def total(prices):
    result = 0
    for price in prices:
        result += price
    return result
'''
PROMPTS = [
    "Write the days of the week.",
    "List the planets of the solar system, one per line, with a short fact about each.",
    f"Explain what this code does, line by line:\n```python\n{CODE}```",
    "Write a short story about a cat who learns to fly.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Describe how bread is made, step by step.",
]


def edited(tokens: list[int], tokenizer) -> list[int]:
    """The reply with every fourth word of its middle third replaced."""
    words = tokenizer.decode(tokens).split(" ")
    third = len(words) // 3
    for i in range(third, 2 * third, 4):
        words[i] = "banana"
    return tokenizer.encode(" ".join(words), add_special_tokens=False)


def answer(engine: Engine, ids: list[int], params: SamplingParams) -> tuple[Sequence, float]:
    seq = Sequence(ids, params)
    t = time.perf_counter()
    engine.add(seq)
    while engine.has_unfinished:
        engine.step()
    return seq, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default=None, choices=("bf16", "fp32"))
    args = ap.parse_args()
    stored = ModelStore().resolve(args.model)
    device = pick_device()
    dtype = pick_dtype(device, args.dtype, stored.manifest["bits"])
    model = load_model(stored, device, dtype).model
    tokenizer = load_tokenizer(stored)
    engine = Engine(model, EngineConfig(enable_prefix_caching=False), device, dtype)
    engine.warm_up()
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    replies = [answer(engine, ids, greedy)[0].output_token_ids for ids in prompts]
    kinds = {"no prediction": [None] * len(prompts), "the reply": replies,
             "the reply, edited": [edited(r, tokenizer) for r in replies]}
    seconds: dict[str, list[float]] = {k: [] for k in kinds}
    counts = {k: [0, 0] for k in kinds}
    for _ in range(args.rounds):
        for kind, predictions in kinds.items():
            total = 0.0
            for ids, prediction, want in zip(prompts, predictions, replies, strict=True):
                params = greedy if prediction is None else replace(
                    greedy, prediction=tuple(prediction))
                seq, dt = answer(engine, ids, params)
                assert seq.output_token_ids == want, "a prediction changed a reply"
                total += dt
                counts[kind][0] += seq.num_accepted_prediction
                counts[kind][1] += seq.num_rejected_prediction
            seconds[kind].append(total)
    num_tokens = sum(len(r) for r in replies)
    print(f"{stored.name}, {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} "
          f"threads, {len(prompts)} replies of {num_tokens} tokens in all, up to "
          f"{speculation.MAX_DRAFT_TOKENS} drafts a step, {args.rounds} rounds, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print("| prediction | s a reply (median) | tok/s | vs none | drafts kept / dropped |")
    print("| --- | --- | --- | --- | --- |")
    base = statistics.median(seconds["no prediction"])
    for kind in kinds:
        s = statistics.median(seconds[kind])
        kept, dropped = (c // args.rounds for c in counts[kind])
        print(f"| {kind} | {s / len(prompts):.3f} | {num_tokens / s:.0f} | {base / s:.2f}x | "
              f"{kept} / {dropped} |")


if __name__ == "__main__":
    main()
