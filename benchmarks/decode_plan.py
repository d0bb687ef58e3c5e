"""Decode tokens/s of a family's layers with the decode plan and with the modules (the plan
switched off), interleaved in one process: what running a family's decode steps through
decode_plan.py is worth. SmolLM2-135M's shape with the family's layer kinds, random weights.

    PYTHONPATH=. python benchmarks/decode_plan.py --arch Qwen3ForCausalLM --bits 4 --rounds 3

(PYTHONPATH: the random weights are the invariance tests' own, tests/engine/test_invariance.py.)
"""

from __future__ import annotations

import argparse
import time

import torch

from server.engine.engine import Engine, EngineConfig
from server.engine.sequence import SamplingParams, Sequence
from server.models.config import ModelConfig
from server.models.decode_plan import DecodePlan
from server.models.device import pick_dtype
from server.models.loader import build_model
from server.quant import quantize_state_dict
from tests.engine.test_invariance import SMOLLM2_135M, prompt, random_state

CPU = torch.device("cpu")


def rate(model, dtype, num_seqs: int, planned: bool, real_takes) -> float:
    """Decode tok/s of num_seqs sequences of 32 greedy tokens (prefill not timed)."""
    DecodePlan.takes = real_takes if planned else (lambda *args: False)
    engine = Engine(model, EngineConfig(num_blocks=1024, max_num_seqs=64), CPU, dtype)
    for i in range(num_seqs):
        engine.add(Sequence(prompt(40, i), SamplingParams(max_tokens=33, temperature=0.0,
                                                          ignore_eos=True)))
    while any(s.num_output_tokens < 1 for s in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    return num_seqs * steps / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="Qwen3ForCausalLM")
    p.add_argument("--bits", type=int, default=4, choices=(4, 8, 16))
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    config = ModelConfig.from_hf(SMOLLM2_135M | {"architectures": [args.arch]})
    state, schemes = random_state(config), {}
    if args.bits != 16:
        state, schemes = quantize_state_dict(state, args.bits)
    dtype = pick_dtype(CPU, None, args.bits)
    model = build_model(config, state, schemes, CPU, dtype)
    real_takes = DecodePlan.takes
    print(f"{args.arch}, SmolLM2-135M's shape, bits {args.bits}, {dtype}")
    for r in range(args.rounds):
        for n in (1, 32):
            modules = rate(model, dtype, n, False, real_takes)
            planned = rate(model, dtype, n, True, real_takes)
            print(f"round {r} {n:2d} seqs: modules {modules:6.1f} plan {planned:6.1f} tok/s "
                  f"({planned / modules:.2f}x)")


if __name__ == "__main__":
    main()
