"""localserve's daemon: engine, models, quantization and the HTTP API."""

import os

# Batch invariance (server/quant/rows.py): MKL's fp32 GEMM, PyTorch's on x86, gives a row of a
# 32-row tile other bits at positions 30 and 31 than elsewhere on its AVX2 code path (measured
# with MKL_ENABLE_INSTRUCTIONS=AVX2; not on its AVX-512 one), so on AVX2-only CPUs a prompt's
# logprobs differed computed whole and in chunks. Its strict reproducibility mode gives every
# position the same bits, no slower at a layer's prompt tile (32 x 576 x 1,536, both paths;
# benchmarks/RESULTS.md). MKL reads this at its first call, so here, before any. A setting of
# the user's stays.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
