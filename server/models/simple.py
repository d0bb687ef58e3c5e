"""Single-sequence helpers over the model forward: scoring text and greedy decoding.

They use a one-block cache as long as the sequence. The serving engine (server/engine) is the
batched path; these serve `localserve eval`, quick answers and the reference in tests.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from server.models.attention import NULL_SLOT, build_metadata
from server.models.batch import ForwardBatch
from server.quant.rows import UnpackedWeights, end_step, split_rows

MADV_DONTNEED = 4  # Linux


def allocate_kv(model: nn.Module, num_slots: int, device, dtype,
                own_slots: dict[int, int] | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, (keys, values) of shape [num_kv_heads, num_slots + 1, head_dim]: flat slots
    (`own_slots`: layers with a pool of another size, by index: the sliding-window layers').

    The extra last slot is NULL_SLOT, zeros, never written: padded context reads point there,
    so no other slot is ever read before it is written and the pool can stay uninitialized.
    Left untouched, its pages are not resident on CPU: memory grows with use, not at start.
    """
    c = model.config
    caches = []
    for i in range(c.num_layers):
        shape = (c.num_kv_heads, (own_slots or {}).get(i, num_slots) + 1, c.head_dim)
        k = torch.empty(shape, device=device, dtype=dtype)
        v = torch.empty(shape, device=device, dtype=dtype)
        k[:, NULL_SLOT].zero_()
        v[:, NULL_SLOT].zero_()
        caches.append((k, v))
    return caches


def release_slots(caches: list[tuple[torch.Tensor, ...]], ranges: list[tuple[int, int]]) -> int:
    """Give the OS back the whole pages inside these [start, end) slot ranges of every layer
    (madvise MADV_DONTNEED: they read as zeros when next touched, so only slots that hold
    nothing anyone reads may be passed). CPU only; returns the bytes given back."""
    if not ranges or not caches or caches[0][0].device.type != "cpu" or not hasattr(os, "sysconf"):
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = os.sysconf("SC_PAGE_SIZE")
    released = 0
    for layer in caches:
        for t in layer:  # [num_kv_heads, num_slots + 1, head_dim], contiguous
            slot_bytes = t.shape[2] * t.element_size()
            for h in range(t.shape[0]):
                base = t.data_ptr() + h * t.stride(0) * t.element_size()
                for start, end in ranges:
                    lo = -(-(base + start * slot_bytes) // page) * page
                    hi = (base + end * slot_bytes) // page * page
                    if hi > lo and madvise(lo, hi - lo, MADV_DONTNEED) == 0:
                        released += hi - lo
    return released


def _param_dtype(model: nn.Module) -> torch.dtype:
    return model.model.norm.weight.dtype


@torch.inference_mode()
def prompt_logits(model: nn.Module, ids: list[int], chunk: int = 512,
                  kv_dtype: torch.dtype | None = None, as_prompt: bool = False) -> torch.Tensor:
    """[len(ids), vocab] fp32 logits of every position, prefilled `chunk` tokens at a time,
    the KV cache in kv_dtype (None: the model's dtype). `as_prompt`: every row through the
    kernels an engine step gives prompt rows (server/quant/rows.py), else through those of
    rows outside a step, which generated rows share."""
    device, dtype = model.model.norm.weight.device, _param_dtype(model)
    kv = allocate_kv(model, len(ids), device, kv_dtype or dtype)
    unpacked = UnpackedWeights(model) if as_prompt else None
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        meta = build_metadata([len(piece)], [start + len(piece)], [[0]], len(ids), device, dtype)
        batch = ForwardBatch(torch.tensor(piece, device=device), meta)
        if unpacked is not None:
            batch.rows = split_rows(list(range(len(piece))), len(piece), device, unpacked,
                                    start + chunk < len(ids))
        try:
            hidden = model(batch, kv)
        finally:
            if batch.rows is not None:
                end_step(batch.rows)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


@torch.inference_mode()
def greedy_generate(
    model: nn.Module, ids: list[int], max_new_tokens: int, eos_token_ids: tuple[int, ...] = ()
) -> list[int]:
    """Greedy continuation of `ids`, stopping after an eos token (included) or the budget."""
    device, dtype = model.model.norm.weight.device, _param_dtype(model)
    total = len(ids) + max_new_tokens
    kv = allocate_kv(model, total, device, dtype)
    new: list[int] = []
    step_ids = list(ids)
    seq_len = 0
    while len(new) < max_new_tokens:
        seq_len += len(step_ids)
        meta = build_metadata([len(step_ids)], [seq_len], [[0]], total, device, dtype)
        hidden = model(ForwardBatch(torch.tensor(step_ids, device=device), meta), kv)
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        new.append(token)
        if token in eos_token_ids:
            break
        step_ids = [token]
    return new
