"""A kernel change against this tree's kernels, in one process, the two builds taking turns step
by step over the same decode steps.

    python benchmarks/kernel_ab.py smollm2-135m:int4 --variant DIR [--seqs 1,32] [--tokens 64]
    python benchmarks/kernel_ab.py smollm2-135m:bf16 --variant DIR --prefill 1,32

DIR holds changed copies of server/kernels files (paged_attention.c, decode_step.c,
avx512_gemm.c, a header, ...): build B is this tree's sources with those in their place, build A
the tree's own. Each all-decode step runs the decode plan (decode_plan.py: decode_step.c and the
int4/int8 GEMMs it is handed) of A or B in turn, alternating which goes first each round; the
LM head and everything outside the plan stay the tree's. Prints each build's mean and median
step and B / A. With --prefill, prompt steps instead: N prompts of --prompt-tokens random tokens
in 512-token steps through the modules, each step's layer_ops and GEMM library A's or B's in
turn (the libraries the modules look up at every call).

Why in one process: on a shared host the memory's speed drifts within minutes (a 2-thread read
probe gave 39-79 GB/s within one hour on a Zen 5 VM, 2026-12-06), so servers or processes taking
turns tell 5% changes apart only with many rounds; steps taking turns see the same drift. Two
identical builds read B / A 1.000-1.003 by medians there (means 0.999-1.010; 1 and 32 sequences,
189-398 steps each): trust the medians, and more steps at one sequence. Prompt steps are fewer
and longer: two identical builds read 0.97-0.99 by means over 3 rounds (2 and 15 steps each,
Intel Xeon with AMX), so give --prefill more rounds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from engine_throughput import prefilled  # beside this script

import server.kernels.cpu_gemm as cpu_gemm
import server.kernels.layer_ops as layer_ops
import server.kernels.loader as loader
import server.models.decode_plan as decode_plan
from server.engine.engine import Engine, EngineConfig
from server.engine.sequence import SamplingParams, Sequence
from server.models.device import pick_device, pick_dtype
from server.models.loader import load_model
from server.models.tokenizer import load_tokenizer
from storage.models import ModelStore

KERNELS = Path(layer_ops.__file__).parent


def builds(variant: Path, into: Path) -> tuple[tuple, tuple]:
    """(layer_ops, GEMM library) of this tree, and of a copy of it with `variant`'s files in."""
    changed = [f for f in variant.iterdir() if f.suffix in (".c", ".h")]
    unknown = [f.name for f in changed if not (KERNELS / f.name).is_file()]
    if not changed or unknown:
        raise SystemExit(f"--variant {variant}: no .c or .h file of server/kernels in it"
                         if not changed else f"not in server/kernels: {', '.join(unknown)}")
    copy = into / "kernels"
    shutil.copytree(KERNELS, copy)
    for f in changed:
        shutil.copy(f, copy / f.name)
    ops_b = loader.library(tuple(copy / s.name for s in layer_ops.SOURCES))
    kind_sources = cpu_gemm.sources(cpu_gemm.KIND) if cpu_gemm.KIND else ()
    gemm_b = loader.library(tuple(copy / s.name for s in kind_sources)) if kind_sources else None
    if ops_b is None or (kind_sources and gemm_b is None):
        raise SystemExit("the variant did not build (a compiler error is logged above)")
    a = (layer_ops._lib(), cpu_gemm.checked())
    b = (layer_ops.typed(ops_b), cpu_gemm.typed(gemm_b) if gemm_b is not None else a[1])
    # what loading does to A's before its check: AMX tiles for bf16 layers, and the GEMM
    # library's AMX state asked for (without it amx_gemm.c declines every call)
    layer_ops.take_tiles(b[0])
    if gemm_b is not None and hasattr(b[1], "gemm_available"):
        b[1].gemm_available()
    return a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--variant", type=Path, required=True, metavar="DIR")
    ap.add_argument("--seqs", default="1,32", help="sequences decoding together (default 1,32)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each (default 64)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prefill", default=None, metavar="N,...",
                    help="prompt steps instead, of N prompts at a time (e.g. 1,32)")
    ap.add_argument("--prompt-tokens", type=int, default=158, help="with --prefill (158)")
    args = ap.parse_args()
    stored = ModelStore().resolve(args.model)
    device = pick_device()
    dtype = pick_dtype(device, None, stored.manifest["bits"])
    model, tokenizer = load_model(stored, device, dtype).model, load_tokenizer(stored)
    with tempfile.TemporaryDirectory() as tmp:
        a, b = builds(args.variant, Path(tmp))
        turn = {"libs": a}
        run = decode_plan.DecodePlan.run

        def run_with(plan, *rest, **kw):
            plan.ops, plan.gemm_lib = turn["libs"]
            return run(plan, *rest, **kw)

        decode_plan.DecodePlan.run = run_with
        if args.prefill:
            prefill_ab(model, device, dtype, stored.name, a, b, args)
            return
        for seqs in (int(s) for s in args.seqs.split(",")):
            times: dict[str, list[float]] = {"A": [], "B": []}
            for r in range(args.rounds):
                engine = prefilled(model, tokenizer, device, dtype, seqs, args.tokens)
                i = 0
                while engine.has_unfinished:
                    name = "AB"[(i + r) % 2]
                    turn["libs"] = a if name == "A" else b
                    start = time.perf_counter()
                    out = engine.step().scheduled
                    seconds = time.perf_counter() - start
                    if all(n == 1 for n in out.num_new_tokens):
                        times[name].append(seconds)
                    i += 1
            report(f"{stored.name}, {seqs} sequences x {args.tokens} tokens", times)


def prefill_ab(model, device, dtype, name: str, a: tuple, b: tuple, args) -> None:
    """Prompt steps of each --prefill count, A's and B's libraries taking turns step by step."""
    gemm_state = list(cpu_gemm._state)
    ops_of = layer_ops._lib
    turn = {"libs": a}
    layer_ops._lib = lambda: turn["libs"][0]
    try:
        for n in (int(s) for s in args.prefill.split(",")):
            times: dict[str, list[float]] = {"A": [], "B": []}
            for r in range(args.rounds):
                engine = Engine(model, EngineConfig(num_blocks=4096, max_num_seqs=max(64, n),
                                                    max_num_batched_tokens=512,
                                                    enable_prefix_caching=False), device, dtype)
                g = torch.Generator().manual_seed(r)
                for _ in range(n):
                    ids = torch.randint(100, 40000, (args.prompt_tokens,), generator=g).tolist()
                    engine.add(Sequence(ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                            ignore_eos=True)))
                i = 0
                while engine.has_unfinished:
                    key = "AB"[(i + r) % 2]
                    turn["libs"] = a if key == "A" else b
                    cpu_gemm._state[:] = [turn["libs"][1]]
                    start = time.perf_counter()
                    engine.step()
                    times[key].append(time.perf_counter() - start)
                    i += 1
            report(f"{name}, {n} prompts x {args.prompt_tokens} tokens", times)
    finally:
        layer_ops._lib, cpu_gemm._state[:] = ops_of, gemm_state


def report(what: str, times: dict[str, list[float]]) -> None:
    mean = {k: statistics.mean(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"{what}, {len(times['A'])} steps each: A {mean['A'] * 1e3:.3f} ms (median "
          f"{median['A'] * 1e3:.3f}), B {mean['B'] * 1e3:.3f} ms (median "
          f"{median['B'] * 1e3:.3f}); B / A {mean['B'] / mean['A']:.3f} (medians "
          f"{median['B'] / median['A']:.3f})", flush=True)


if __name__ == "__main__":
    main()
