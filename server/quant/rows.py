"""Which kernel computes which rows of an engine step, so that no row depends on the others.

The packed int4/int8 kernels win at a few rows (decode) but stay near 300 GFLOP/s from 16 rows
on, where a bf16 GEMM reaches 400-700 (benchmarks/kernels.py). So in an engine step, rows
holding prompt tokens run a bf16 GEMM on the layer's weight unpacked to bf16, and rows of
generated tokens keep the packed kernel; a dense layer runs the GEMM on its own weight for both.
The split is by what a row holds, never by how many rows there are.

Each kernel must also give a row the same numbers whatever else shares the call. The packed
kernels do (every row takes the same instructions). A GEMM library does not: it picks its
kernel and blocking by shape (MKL's fp32 GEMM takes another path below 4 rows, oneDNN's bf16
GEMM changes its blocking at 512 rows of a 1536-wide input, both measured on AVX-512 BF16; on
AMX machines oneDNN chooses between AMX and AVX-512 kernels by shape). So `tiled_mm` calls the
GEMM with exactly a fixed number of rows each time, the last call zero-padded. Then a prompt
computed whole, in chunks or from the prefix cache, a request alone or batched, and a preempted
one recomputed all give the same logprobs bit for bit.

A quantized layer takes part by having `unpacked_numel()` (0: it cannot) and
`unpack_into(flat)` (its weight as bf16 [in, out], possibly a transposed view, written into
`flat`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

UNPACKED_DTYPE = torch.bfloat16

# Rows per GEMM call: prompt rows (of dense layers, and of quantized layers through their
# unpacked weights) and generated rows of dense layers, the LM head's sampling rows included.
# Measured (bf16, AVX-512 BF16): a call of 8 rows costs 1.1-1.4x one of 1 row, 16 rows 1.5-1.8x;
# smollm2-135m:bf16 decodes 26/270/277 tok/s at 1/16/32 sequences with tiles of 8, 23/320/321
# with 16. Prompts in tiles of 32 cost 9% more than 64 at 1,000 tokens and 25% less for a short
# prompt after a prefix hit.
PROMPT_TILE = 32
GENERATED_TILE = 16


# A weight bigger than this (an LM head: 49,152 x 576 bf16 is 57 MB) is multiplied a block of
# columns at a time, every row tile within a block, so it streams from memory once per step
# instead of once per row tile.
COLUMN_BLOCK_BYTES = 4 << 20


def tiled_mm(x: torch.Tensor, weight_t: torch.Tensor, tile: int) -> torch.Tensor:
    """x [M, K] @ weight_t [K, N] -> [M, N], in GEMM calls of exactly `tile` rows (the last
    zero-padded) and, for a big weight, a fixed block of columns: every call of a layer has one
    of a few shapes fixed by the layer, never by M."""
    m, (k, n) = x.shape[0], weight_t.shape
    y = x.new_empty(m, n)
    cols = max(64, COLUMN_BLOCK_BYTES // (k * weight_t.element_size()) // 64 * 64)
    padded = None
    if m % tile:
        padded = x.new_zeros(tile, k)
        padded[:m % tile] = x[m - m % tile:]
    scratch = x.new_empty(tile * min(cols, n))
    for c in range(0, n, cols):
        w = weight_t[:, c:c + cols]
        width = w.shape[1]
        for i in range(0, m, tile):
            rows = min(tile, m - i)
            a = x[i:i + tile] if rows == tile else padded
            if rows == tile and width == n:  # straight into the output rows
                torch.mm(a, w, out=y[i:i + tile])
            else:  # every call writes a contiguous [tile, width] block, as above
                out = scratch[:tile * width].view(tile, width)
                torch.mm(a, w, out=out)
                y[i:i + rows, c:c + width] = out[:rows]
    return y

# While a prompt spans several steps (a long prompt's paced chunks), the engine keeps every
# layer's unpacked weight in one block, freed after the step where no prompt goes on, if the
# block is at most this big; a prompt done in one step unpacks layer by layer into a small
# reused scratch buffer instead (a fresh 214 MB block costs ~35 ms of page faults).
UNPACKED_MAX_BYTES = 1 << 30

_step = threading.local()  # the row kinds of the forward running in this thread
_scratch = threading.local()  # per thread: one bf16 buffer reused by every layer in turn


def scratch(numel: int) -> torch.Tensor:
    """This thread's scratch buffer of at least `numel` bf16 values (valid until next use)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(numel, dtype=UNPACKED_DTYPE)
    return buf[:numel]


class UnpackedWeights:
    """The bf16 copies of a model's quantized layers, made on demand and dropped together."""

    def __init__(self, model: nn.Module) -> None:
        self.offsets: dict[int, tuple[int, int]] = {}
        total = 0
        for name, m in model.named_modules():
            if name.split(".")[-1] == "lm_head":  # its rows sample; it keeps its kernel
                continue
            numel = m.unpacked_numel() if hasattr(m, "unpacked_numel") else 0
            if numel:
                self.offsets[id(m)] = (total, numel)
                total += numel
        self.numel = total if total * 2 <= UNPACKED_MAX_BYTES else 0
        self.block: torch.Tensor | None = None
        self.views: dict[int, torch.Tensor] = {}

    def get(self, layer: nn.Module, keep: bool) -> torch.Tensor | None:
        """The layer's bf16 [in, out] weight; None when the layer cannot (it then keeps its
        packed kernel for every row). `keep`: prompt work goes on after this step, so unpack
        into the kept block (once until the next release) rather than the scratch buffer. Both
        hold the same values: where they live never changes a result."""
        view = self.views.get(id(layer))
        if view is not None:
            return view
        place = self.offsets.get(id(layer))
        if place is None:
            return None
        if not keep or not self.numel:
            return layer.unpack_into(scratch(place[1]))
        if self.block is None:
            self.block = torch.empty(self.numel, dtype=UNPACKED_DTYPE)
        view = layer.unpack_into(self.block[place[0]:place[0] + place[1]])
        if view is not None:
            self.views[id(layer)] = view
        return view

    def release(self) -> None:
        self.block, self.views = None, {}


@contextlib.contextmanager
def row_kinds(prompt_rows: list[int], num_rows: int, device: torch.device,
              unpacked: UnpackedWeights, prompts_continue: bool = False) -> Iterator[None]:
    """Within an engine step: rows `prompt_rows` of the flat batch hold prompt tokens;
    `prompts_continue`: some prompt still has tokens left for later steps. The kept unpacked
    weights are released after a step that no prompt continues past."""
    if not prompt_rows:
        kinds: Any = "generated"
    elif len(prompt_rows) == num_rows:
        kinds = "prompt"
    elif prompt_rows[0] + len(prompt_rows) == num_rows:  # the usual case: prompts come last
        kinds = prompt_rows[0]
    else:
        prompt = set(prompt_rows)
        kinds = (torch.tensor(prompt_rows, device=device),
                 torch.tensor([i for i in range(num_rows) if i not in prompt], device=device))
    _step.kinds, _step.unpacked, _step.keep = kinds, unpacked, prompts_continue
    try:
        yield
    finally:
        _step.kinds = _step.unpacked = None
        if not prompts_continue:
            unpacked.release()


def rows_mm(layer: nn.Module, x2: torch.Tensor,
            packed_mm: Callable[[torch.Tensor], torch.Tensor],
            weight_t: torch.Tensor | None = None) -> torch.Tensor | None:
    """x2 @ weight for an engine step's rows, each through its kind's kernel: generated rows
    through `packed_mm`, prompt rows through a GEMM on `weight_t` (a dense layer's own weight)
    or else on the layer's unpacked weight. None outside an engine step (the caller decides)."""
    kinds = getattr(_step, "kinds", None)
    if kinds is None:
        return None
    if weight_t is None and kinds != "generated":
        weight_t = _step.unpacked.get(layer, _step.keep)
    if kinds == "generated" or weight_t is None:
        return packed_mm(x2)
    if kinds == "prompt":
        return tiled_mm(x2, weight_t, PROMPT_TILE)
    y = x2.new_empty(x2.shape[0], weight_t.shape[1])
    if isinstance(kinds, int):  # rows [kinds, end) are the prompt rows
        y[:kinds] = packed_mm(x2[:kinds])
        y[kinds:] = tiled_mm(x2[kinds:], weight_t, PROMPT_TILE)
        return y
    prompt, generated = kinds
    y.index_copy_(0, prompt, tiled_mm(x2.index_select(0, prompt), weight_t, PROMPT_TILE))
    return y.index_copy_(0, generated, packed_mm(x2.index_select(0, generated)))
