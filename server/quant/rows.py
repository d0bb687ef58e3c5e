"""Which kernel computes which rows of an engine step, so that no row depends on the others.

The packed int4/int8 kernels win at a few rows (decode) but stay near 300 GFLOP/s from 16 rows
on, where a bf16 GEMM reaches 400-700 (benchmarks/kernels.py). So in an engine step, rows
holding prompt tokens run a bf16 GEMM on the layer's weight unpacked to bf16 (or, where the
machine's int4 kernels have one, their own prompt kernel: amx_gemm.c's, on the weight
dequantized to bf16 inside the call), and rows of generated tokens keep the packed kernel; a
dense layer runs the GEMM on its own weight for prompt rows and layer_ops.dense_mm (the weight
read in place) for generated ones (linear.py). The split is by what a row holds, never by how
many rows there are.

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

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

UNPACKED_DTYPE = torch.bfloat16

# Rows per GEMM call: prompt rows (of dense layers, and of quantized layers through their
# unpacked weights) and generated rows of dense layers that layer_ops.dense_mm does not take
# (GPUs, shapes it declines), the LM head's sampling rows included.
# benchmarks/engine_throughput.py, smollm2-135m:bf16 at 1/16/32 sequences (Zen 4): 26/270/277
# tok/s with generated tiles of 8, 23/320/321 with 16. Prompt tiles of 32 against 64: a 1,000-
# token prompt 9% slower, a short prompt after a prefix hit 25% faster.
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

def dequantized_linear(x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for a quantized layer that no kernel takes, its weight dequantized: one call on
    a CPU (there only the exactness tests' reference path comes here), tiled_linear elsewhere,
    where it serves (a GPU's int8 LM head, an int4 shape tinygemm declines): cuBLAS, too, picks
    its kernel by the number of rows."""
    if x.device.type == "cpu":
        return torch.nn.functional.linear(x, weight, bias)
    return tiled_linear(x, weight, bias)


def tiled_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear (x [..., K], weight [N, K]) in GEMM calls of GENERATED_TILE rows (tiled_mm)."""
    y = tiled_mm(x.reshape(-1, weight.shape[1]), weight.t(), GENERATED_TILE)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


# While a prompt spans several steps (a long prompt's paced chunks), the engine keeps every
# layer's unpacked weight in one block, freed after the step where no prompt goes on, if the
# block is at most this big; a prompt done in one step unpacks layer by layer into a small
# reused scratch buffer instead (a fresh 214 MB block costs ~35 ms of page faults).
UNPACKED_MAX_BYTES = 1 << 30

# Rows per call of a packed kernel found not to compute rows independently (see
# kernel_rows_independent); PyTorch's CPU kernels so far all do, and keep one call.
PACKED_TILE = 16
_independent: dict[str, bool] = {}


def kernel_rows_independent(kind: str, kernel: Callable[[torch.Tensor], torch.Tensor],
                            num_inputs: int) -> bool:
    """Whether a packed kernel (x [M, num_inputs] bf16 -> [M, N]) gives each row the same values
    whatever rows share its call, checked once per kind on this machine against the rows computed
    one at a time. PyTorch's tinygemm kernels do (every row the same instructions), but a
    release could send some row counts elsewhere (a oneDNN brgemm path exists in forks); a kernel
    that fails is called in tiles of PACKED_TILE rows, so its rows stay independent anyway."""
    if kind not in _independent:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(72, num_inputs, generator=g).to(UNPACKED_DTYPE)
        alone = torch.cat([kernel(x[i:i + 1]) for i in range(x.shape[0])])
        _independent[kind] = all(torch.equal(kernel(x[:m]), alone[:m])
                                 for m in (2, 3, 4, 5, 8, 16, 17, 32, 33, 64, 72))
    return _independent[kind]


def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
               tile: int) -> torch.Tensor:
    """fn(x) for x [M, K], calling fn on exactly `tile` rows at a time (the last zero-padded)."""
    m = x.shape[0]
    if m % tile:
        x = torch.cat([x, x.new_zeros(tile - m % tile, x.shape[1])])
    return torch.cat([fn(x[i:i + tile]) for i in range(0, x.shape[0], tile)])[:m]


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
        self.buffer: torch.Tensor | None = None  # the scratch buffer every layer reuses in turn

    def scratch(self, numel: int) -> torch.Tensor:
        """The scratch buffer, at least `numel` bf16 values (valid until the next layer's)."""
        if self.buffer is None or self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=UNPACKED_DTYPE)
        return self.buffer[:numel]

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
            return layer.unpack_into(self.scratch(place[1]))
        if self.block is None:
            self.block = torch.empty(self.numel, dtype=UNPACKED_DTYPE)
        view = layer.unpack_into(self.block[place[0]:place[0] + place[1]])
        if view is not None:
            self.views[id(layer)] = view
        return view

    def release(self) -> None:
        self.block, self.views = None, {}


Rows = slice | torch.Tensor  # a run of rows, or their indices


@dataclass(slots=True, frozen=True)
class RowSplit:
    """Which rows of an engine step's flat batch hold prompt tokens and which generated ones,
    and where quantized layers find their unpacked weights for the prompt rows. Built once per
    step by the runner (split_rows) and handed to every layer."""

    prompt: Rows | None  # None: no prompt rows
    generated: Rows | None  # None: no generated rows
    unpacked: UnpackedWeights
    keep: bool  # some prompt goes on in a later step: keep the unpacked weights until then


def split_rows(prompt_rows: list[int], num_rows: int, device: torch.device,
               unpacked: UnpackedWeights, prompts_continue: bool = False) -> RowSplit:
    """Rows `prompt_rows` of `num_rows` hold prompt tokens; `prompts_continue`: some prompt
    still has tokens left for later steps."""
    if not prompt_rows or len(prompt_rows) == num_rows:
        whole = slice(0, num_rows)
        prompt, generated = (whole, None) if prompt_rows else (None, whole)
    elif prompt_rows[0] + len(prompt_rows) == num_rows:  # the usual case: prompts come last
        prompt, generated = slice(prompt_rows[0], num_rows), slice(0, prompt_rows[0])
    else:
        chosen = set(prompt_rows)
        prompt = torch.tensor(prompt_rows, device=device)
        generated = torch.tensor([i for i in range(num_rows) if i not in chosen], device=device)
    return RowSplit(prompt, generated, unpacked, prompts_continue)


def end_step(rows: RowSplit) -> None:
    """After the step's forward: the kept unpacked weights go once no prompt continues."""
    if not rows.keep:
        rows.unpacked.release()


def rows_mm(layer: nn.Module, x2: torch.Tensor, rows: RowSplit | None,
            packed_mm: Callable[[torch.Tensor], torch.Tensor],
            weight_t: torch.Tensor | None = None,
            prompt_mm: Callable[[torch.Tensor], torch.Tensor] | None = None
            ) -> torch.Tensor | None:
    """x2 @ weight for an engine step's rows, each through its kind's kernel: generated rows
    through `packed_mm`, prompt rows through `prompt_mm` (a quantized layer's own prompt kernel,
    cpu_gemm.gemm_prompt) or else a GEMM on `weight_t` (a dense layer's own weight) or on the
    layer's unpacked weight. None outside an engine step (the caller decides)."""
    if rows is None:
        return None
    if rows.prompt is not None and prompt_mm is None:
        if weight_t is None:
            weight_t = rows.unpacked.get(layer, rows.keep)
        if weight_t is not None:
            prompt_mm = functools.partial(tiled_mm, weight_t=weight_t, tile=PROMPT_TILE)
    if rows.prompt is None or prompt_mm is None:
        return packed_mm(x2)
    if rows.generated is None:
        return prompt_mm(x2)
    generated, prompt = packed_mm(x2[rows.generated]), prompt_mm(x2[rows.prompt])
    y = x2.new_empty(x2.shape[0], prompt.shape[1], dtype=prompt.dtype)
    y[rows.generated] = generated
    y[rows.prompt] = prompt
    return y
