"""Aggregate decode tokens/s of the engine at several batch sizes (no HTTP).

    python benchmarks/engine_throughput.py smollm2-135m:int4 smollm2-135m:bf16
    python benchmarks/engine_throughput.py smollm2-135m:int4 --profile 32  # where time goes

For each model and each number of concurrent sequences, N distinct chat prompts are prefilled,
then decoded for --tokens steps with ignore_eos; only the all-decode steps are timed. The batch
sizes are measured in turn --repeat times (the machine is shared and noisy) and each cell is
the median. Prints a markdown table (the one in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from server.engine.engine import Engine, EngineConfig
from server.engine.sequence import SamplingParams, Sequence
from server.models.device import pick_device, pick_dtype
from server.models.loader import load_model
from server.models.tokenizer import chat_prompt_ids, load_tokenizer
from storage.models import ModelStore

TOPICS = ["rivers", "bread", "chess", "volcanoes", "bees", "trains", "clouds", "music"]


def prefilled(model, tokenizer, device, dtype, num_seqs: int, num_tokens: int) -> Engine:
    """An engine holding num_seqs distinct chat prompts, to decode num_tokens each."""
    engine = Engine(model, EngineConfig(num_blocks=2048, max_num_seqs=max(64, num_seqs),
                                        max_num_batched_tokens=2048), device, dtype)
    for i in range(num_seqs):
        question = f"Tell me about {TOPICS[i % len(TOPICS)]} (note {i})."
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": question}])
        engine.add(Sequence(ids, SamplingParams(max_tokens=num_tokens, temperature=0.0,
                                                ignore_eos=True)))
    return engine


def decode_steps(engine: Engine):
    """Steps the engine to the end; yields after each all-decode step (rows, seconds)."""
    while engine.has_unfinished:
        t = time.perf_counter()
        out = engine.step().scheduled
        dt = time.perf_counter() - t
        if all(n == 1 for n in out.num_new_tokens):
            yield len(out.seqs), dt


def measure(model, tokenizer, device, dtype, num_seqs: int, num_tokens: int) -> float:
    decoded, seconds = 0, 0.0
    for rows, dt in decode_steps(prefilled(model, tokenizer, device, dtype, num_seqs,
                                           num_tokens)):
        decoded += rows
        seconds += dt
    return decoded / seconds


def profile(model, tokenizer, device, dtype, num_seqs: int, num_tokens: int) -> None:
    """torch.profiler over the decode steps at num_seqs sequences: the ops that take the time
    (host and, on a GPU, device), and on a GPU the kernel launches a step."""
    from torch.profiler import ProfilerActivity

    engine = prefilled(model, tokenizer, device, dtype, num_seqs, num_tokens)
    steps = decode_steps(engine)
    next(steps)  # the prompts are done
    on_gpu = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        timed = list(steps)
    seconds = sum(dt for _, dt in timed)
    print(f"\nprofile: {len(timed)} decode steps of {num_seqs} sequences, "
          f"{1000 * seconds / len(timed):.1f} ms a step")
    events = prof.key_averages()
    if on_gpu:
        launches = sum(e.count for e in events if "LaunchKernel" in e.key)
        print(f"kernel launches a step: {launches / len(timed):.0f}")
    sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    print(events.table(sort_by=sort, row_limit=25))
    if on_gpu:
        print(events.table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--dtype", default=None, choices=("bf16", "fp32"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", type=int, default=None, metavar="SEQS",
                        help="then profile the decode steps at this many sequences")
    args = parser.parse_args()
    device = pick_device()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}, device {device}")
    print("| model | dtype | " + " | ".join(f"{b} seqs" for b in args.batch) + " | 16 vs 1 |")
    print("| --- | --- |" + " --- |" * (len(args.batch) + 1))
    for name in args.models:
        stored = ModelStore().resolve(name)
        dtype = pick_dtype(device, args.dtype, stored.manifest["bits"])
        model = load_model(stored, device, dtype).model
        tokenizer = load_tokenizer(stored)
        measure(model, tokenizer, device, dtype, 2, 4)  # warm-up
        runs: dict[int, list[float]] = {b: [] for b in args.batch}
        for _ in range(args.repeat):
            for b in args.batch:
                runs[b].append(measure(model, tokenizer, device, dtype, b, args.tokens))
        rates = {b: statistics.median(r) for b, r in runs.items()}
        ratio = f"{rates[16] / rates[1]:.1f}x" if 1 in rates and 16 in rates else "-"
        cells = " | ".join(f"{rates[b]:.0f} tok/s" for b in args.batch)
        print(f"| {stored.name} | {str(dtype).removeprefix('torch.')} | {cells} | {ratio} |",
              flush=True)
        if args.profile:
            profile(model, tokenizer, device, dtype, args.profile, args.tokens)


if __name__ == "__main__":
    main()
