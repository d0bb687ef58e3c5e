"""Microseconds per call of the kernels a decode step is made of, by number of rows.

    python benchmarks/kernels.py

First our int4/int8 kernel libraries, each kind this CPU runs (amx_gemm.c, avx512_gemm.c,
avx2_gemm.c) on the same weights. Then for smollm2-135m's shapes: a 576 -> 1536 projection and
the 49152 x 576 LM head with int4 (packed, group 32), int8 (packed, per-row scales) and plain
bf16 weights, and decode attention for one kv-head group (3 kv heads x 3 query heads, head dim
64) as two bmm's in bf16 against the same in fp32. Cache-hot (the same weights every call): it
ranks kernels by row count; a model step, whose weights stream from memory, is measured by
engine_throughput.py.
"""

from __future__ import annotations

import time

import torch

from server.quant.int4 import Int4Linear, pack_int4, quantize_int4
from server.quant.int8 import Int8Linear, quantize_int8


def per_call_us(fn, x, calls: int) -> float:
    for _ in range(max(3, calls // 20)):
        fn(x)
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e6


def linears(n: int, k: int) -> dict[str, torch.nn.Module]:
    w = torch.randn(n, k) * 0.02
    int4 = Int4Linear(k, n, 32)
    q, int4.weight_scale, int4.weight_zero = quantize_int4(w, 32)
    int4.weight = pack_int4(q)
    int4.prepare()
    int8 = Int8Linear(k, n)
    int8.weight, int8.weight_scale = quantize_int8(w)
    int8.prepare()
    bf16 = torch.nn.Linear(k, n, bias=False).bfloat16()
    bf16.weight.data = w.bfloat16()
    return {"int4": int4, "int8": int8, "bf16": bf16}


def attention(dtype: torch.dtype, seqs: int, context: int):
    q = torch.randn(3 * seqs, 3, 64, dtype=torch.bfloat16)
    k = torch.randn(3 * seqs, context, 64, dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def run(_):
        scores = torch.bmm(q.to(dtype), k.to(dtype).transpose(1, 2)).float().softmax(-1)
        return torch.bmm(scores.to(dtype), v.to(dtype)).to(torch.bfloat16)
    return run


def our_kernels(rows: tuple[int, ...]) -> None:
    """Our int4/int8 libraries (server/kernels/cpu_gemm.py), every kind this CPU runs, side by
    side on the same weights: microseconds per call, the best of 3 rounds of `calls`."""
    from server.kernels import cpu_gemm

    libs = {kind: lib for kind in cpu_gemm.SOURCES if (lib := cpu_gemm.of_kind(kind))}
    g = torch.Generator().manual_seed(0)
    for n, k, calls in ((1536, 576, 50), (576, 1536, 50), (3072, 576, 50), (49152, 576, 5)):
        if n == 49152:  # the LM head: int8, fp32 logits
            layout = cpu_gemm.pack_int8(torch.randint(-127, 128, (n, k), generator=g,
                                                      dtype=torch.int8))
            scale = torch.rand(n, generator=g) / 100
            def call(x, lib, layout=layout, scale=scale):
                return cpu_gemm.gemm_int8(x, layout, scale, lib, torch.float32)
        else:
            q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
            layout = cpu_gemm.pack_int4(q, torch.rand(n, k // 32, generator=g).half() / 8,
                                        torch.randn(n, k // 32, generator=g).half() / 4, 32)
            def call(x, lib, layout=layout):
                return cpu_gemm.gemm(x, layout, 32, lib)
        kind_of_weight = "int8" if n == 49152 else "int4"
        print(f"\n{kind_of_weight} {n}x{k}, us per call | " + " | ".join(f"{m} rows" for m in rows))
        best = {kind: [float("inf")] * len(rows) for kind in libs}
        for _ in range(3):  # kinds interleaved: the machine drifts
            for kind, lib in libs.items():
                for j, m in enumerate(rows):
                    x = torch.randn(m, k, dtype=torch.bfloat16)
                    us = per_call_us(lambda x, lib=lib: call(x, lib), x, calls)
                    best[kind][j] = min(best[kind][j], us)
        for kind, cells in best.items():
            print(f"{cpu_gemm.SOURCES[kind].name} | " + " | ".join(f"{us:.0f}" for us in cells))


def main() -> None:
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    rows = (1, 4, 16, 32, 64)
    our_kernels(rows)
    for n, k, calls in ((1536, 576, 300), (49152, 576, 30)):
        print(f"\n{n}x{k} | " + " | ".join(f"{m} rows" for m in rows))
        for name, layer in linears(n, k).items():
            cells = []
            for m in rows:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                us = per_call_us(layer, x, calls)
                cells.append(f"{us:.0f} us ({2 * n * k * m / us / 1e3:.0f} GFLOP/s)")
            print(f"{name} | " + " | ".join(cells))
    print("\ndecode attention (3 kv heads x 3 query heads, dim 64), us per layer")
    for context in (64, 256, 1024):
        for seqs in (1, 4, 16):
            bf16 = per_call_us(attention(torch.bfloat16, seqs, context), None, 300)
            fp32 = per_call_us(attention(torch.float32, seqs, context), None, 300)
            print(f"context {context}, {seqs} seqs: bf16 {bf16:.0f}, fp32 (with casts) {fp32:.0f}")


if __name__ == "__main__":
    main()
