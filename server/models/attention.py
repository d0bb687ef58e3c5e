"""Attention over a paged KV cache, batched per step.

The cache is one flat pool of slots per layer: slot = block_id * block_size + offset. A step
writes its new keys/values to `slot_mapping`, then each query attends to the slots of its own
sequence (gathered through the block table) up to its own position.

Sequences are grouped so no layer loops over sequences on the decode path: every one-token
(decode) sequence goes into one group with one query each; each multi-token chunk (prefill) is
its own group, since prefill is compute-bound and few chunks run per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together, padded to the group's longest query and context."""

    token_index: torch.Tensor  # [B, max_q] index of each query in the step's tokens (padded)
    context_slots: torch.Tensor  # [B, max_ctx] cache slot of each context position (padded)
    mask: torch.Tensor  # [1, B, 1, max_q, max_ctx] additive: 0 where allowed, -inf elsewhere
    valid: torch.Tensor  # [num_valid] flat indices into [B * max_q] of real queries
    dest: torch.Tensor  # [num_valid] step-token index each real query's output goes to
    whole_step: bool  # the group is every token of the step, in order, unpadded
    flat_slots: torch.Tensor | None = None  # context_slots as [B * max_ctx] indices >= 0
    fp32: bool = False  # attend in fp32 (short-context decodes under a 16-bit compute dtype)


NULL_SLOT = -1  # the KV caches' extra last slot: zeros, read by padding, never written
# Decoding sequences with at most this many tokens of context attend in fp32 under a bf16
# compute dtype: bf16 bmm has a floor of ~35 us per call (oneDNN) that fp32 does not; beyond
# it fp32 is slower. Measured (engine, int4, AVX-512 BF16): see the README. The rule looks at
# the sequence's own context only, so its numbers never depend on what else is in the batch.
FP32_DECODE_MAX_CONTEXT = 256


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the layers need for one step; built once, shared by all layers."""

    positions: torch.Tensor  # [num_tokens] position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's k/v is written to
    groups: list[AttentionGroup]
    num_tokens: int


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> AttentionMetadata:
    """Step metadata for sequences that each add query_lens[i] tokens, ending at seq_lens[i]."""
    q_lens = torch.tensor(query_lens, dtype=torch.long)
    s_lens = torch.tensor(seq_lens, dtype=torch.long)
    num_tokens = int(q_lens.sum())
    # Position of every new token: seq_len - q_len + [0, q_len).
    starts = torch.cumsum(q_lens, 0) - q_lens  # [B] first token index of each sequence
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)  # [T]
    offset_in_seq = torch.arange(num_tokens) - starts[seq_of_token]
    positions = (s_lens - q_lens)[seq_of_token] + offset_in_seq  # [T]
    max_blocks = max(len(b) for b in block_tables)
    tables = torch.tensor([b + [0] * (max_blocks - len(b)) for b in block_tables], dtype=torch.long)
    block_of_token = tables[seq_of_token, positions // block_size]
    slot_mapping = block_of_token * block_size + positions % block_size

    decode = [i for i, q in enumerate(query_lens) if q == 1]
    prefill = [[i] for i, q in enumerate(query_lens) if q > 1]
    low_precision = dtype in (torch.bfloat16, torch.float16)
    short = {i for i in decode if low_precision and seq_lens[i] <= FP32_DECODE_MAX_CONTEXT}
    decode_groups = [([i for i in decode if i in short], True),
                     ([i for i in decode if i not in short], False)]
    groups = [
        _build_group(idx, q_lens, s_lens, starts, tables, block_size, dtype, device, kind)
        for idx, kind in [g for g in decode_groups if g[0]] + [(i, False) for i in prefill]
    ]
    if len(groups) == 1 and groups[0].valid.numel() == num_tokens:
        groups[0].whole_step = True
    return AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        groups=groups,
        num_tokens=num_tokens,
    )


def _build_group(
    idx: list[int],
    q_lens: torch.Tensor,
    s_lens: torch.Tensor,
    starts: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    fp32: bool = False,
) -> AttentionGroup:
    sel = torch.tensor(idx, dtype=torch.long)
    q, s, st = q_lens[sel], s_lens[sel], starts[sel]  # [B]
    max_q, max_ctx = int(q.max()), int(s.max())
    qi = torch.arange(max_q)  # [max_q]
    is_real_query = qi[None, :] < q[:, None]  # [B, max_q]
    token_index = torch.where(is_real_query, st[:, None] + qi[None, :], 0)
    ctx = torch.arange(max_ctx)  # [max_ctx]
    context_slots = tables[sel][:, ctx // block_size] * block_size + ctx % block_size
    # Padding past a sequence's length reads the zero slot, never an unwritten one.
    context_slots = torch.where(ctx[None, :] < s[:, None], context_slots, NULL_SLOT)
    query_pos = (s - q)[:, None] + qi[None, :]  # [B, max_q]
    allowed = ctx[None, None, :] <= query_pos[:, :, None]  # [B, max_q, max_ctx]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    valid = torch.nonzero(is_real_query.flatten()).flatten()
    return AttentionGroup(
        token_index=token_index.to(device),
        context_slots=context_slots.to(device),
        mask=mask[None, :, None].to(device),
        valid=valid.to(device),
        dest=token_index.flatten()[valid].to(device),
        whole_step=False,
        fp32=fp32,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [Hkv, num_slots, D] already holding this step's k/v -> [T, Hq*D].

    Batched matmuls + softmax (much faster than masked SDPA for one-token decode on CPU), laid
    out [Hkv, B, ...] so the gathered keys/values are contiguous and the G query heads of a kv
    head share it without copies (GQA).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group_size = num_heads // num_kv_heads
    out = None
    for g in meta.groups:
        b, max_q = g.token_index.shape
        rows = group_size * max_q
        qg = q if g.whole_step else q[g.token_index]
        # [B, max_q, Hkv, G, D] -> [Hkv, B, G, max_q, D] -> [Hkv * B, G * max_q, D]
        qg = qg.view(b, max_q, num_kv_heads, group_size, head_dim).permute(2, 0, 3, 1, 4)
        qg = (qg * scale).reshape(num_kv_heads * b, rows, head_dim)
        adt = torch.float32 if g.fp32 else q.dtype
        qg = qg.to(adt)
        if g.flat_slots is None:  # once per step: index_select takes no negative index
            g.flat_slots = g.context_slots.view(-1).remainder(k_cache.shape[1])
        slots, ctx = g.flat_slots, g.context_slots.shape[1]
        # A pool stored in another dtype (bf16 under fp32 compute) converts after the gather.
        k = k_cache.index_select(1, slots).view(num_kv_heads * b, ctx, head_dim).to(adt)
        v = v_cache.index_select(1, slots).view(num_kv_heads * b, ctx, head_dim).to(adt)
        scores = torch.bmm(qg, k.transpose(1, 2))  # [Hkv * B, G * max_q, C]
        scores.view(num_kv_heads, b, group_size, max_q, ctx).add_(g.mask)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(adt)
        o = torch.bmm(probs, v).to(q.dtype)
        o = o.view(num_kv_heads, b, group_size, max_q, head_dim)
        o = o.permute(1, 3, 0, 2, 4).reshape(b * max_q, num_heads * head_dim)
        if g.whole_step:
            return o
        if out is None:
            out = q.new_empty(num_tokens, num_heads * head_dim)
        out[g.dest] = o[g.valid]
    return out
