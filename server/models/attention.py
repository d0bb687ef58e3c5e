"""Attention over a paged KV cache, batched per step.

The cache is one flat pool of slots per layer: slot = block_id * block_size + offset. A step
writes its new keys/values to `slot_mapping`, then each query attends to the slots of its own
sequence (gathered through the block table) up to its own position.

Queries are grouped so no layer loops over sequences on the decode path: every generated token
(a decode, or a generated token recomputed after preemption) is one query of the decode group,
attending to its own context; each sequence's prompt tokens in the step are a group of their own,
since prefill is compute-bound and few chunks run per step.

Batch invariance: a matmul kernel's rounding can depend on the shape of the call (oneDNN and
MKL pick kernels and blockings by shape: an fp32 GEMM with fewer than 4 rows takes another path,
a column of scores in a tail block another order). So every matmul here has a shape fixed by
constants, never by the other sequences of the step or by how a prompt was chunked: queries in
tiles of QUERY_TILE (prompt) or 1 (generated), context in tiles of CONTEXT_TILE positions. A
query's scores are computed per context tile, the softmax denominator and the weighted values
are summed tile by tile in order (cumsum: a sequential scan), and padding (masked positions,
zero slots, padded tiles) adds exact zeros. So a query's output is a function of its own
sequence alone, whatever the batch, the chunking or the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUERY_TILE = 32  # prompt queries per matmul tile (a chunk is padded up to a multiple)
CONTEXT_TILE = 64  # context positions per matmul tile (a context is padded up to a multiple)


@dataclass(slots=True)
class AttentionGroup:
    """Queries attended together, padded to the group's tile-rounded query and context sizes."""

    token_index: torch.Tensor  # [B, max_q] index of each query in the step's tokens (padded)
    context_slots: torch.Tensor  # [B, max_ctx] cache slot of each context position (padded)
    mask: torch.Tensor  # [B, max_q, max_ctx] fp32 additive: 0 where allowed, -inf elsewhere
    valid: torch.Tensor  # [num_valid] flat indices into [B * max_q] of real queries
    dest: torch.Tensor  # [num_valid] step-token index each real query's output goes to
    whole_step: bool  # the group is every token of the step, in order, unpadded
    flat_slots: torch.Tensor | None = None  # context_slots as [B * max_ctx] indices >= 0
    fp32: bool = False  # attend in fp32 (short-context decodes under a 16-bit compute dtype)


NULL_SLOT = -1  # the KV caches' extra last slot: zeros, read by padding, never written
# Decoding sequences with at most this many tokens of context attend in fp32 under a bf16
# compute dtype: bf16 bmm has a floor of ~35 us per call (oneDNN) that fp32 does not; beyond
# it fp32 is slower. The rule looks at the query's own context only, so its numbers never depend
# on what else is in the batch.
FP32_DECODE_MAX_CONTEXT = 256


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the layers need for one step; built once, shared by all layers."""

    positions: torch.Tensor  # [num_tokens] position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] cache slot each new token's k/v is written to
    groups: list[AttentionGroup]
    num_tokens: int


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    prompt_lens: list[int] | None = None,
) -> AttentionMetadata:
    """Step metadata for sequences that each add query_lens[i] tokens, ending at seq_lens[i].

    prompt_lens[i]: how many of those tokens (the first ones) are prompt tokens; the rest are
    generated tokens. Default: a one-token query is generated, a longer one all prompt."""
    if prompt_lens is None:
        prompt_lens = [0 if q == 1 else q for q in query_lens]
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

    # Entries (sequence, first token index, number of queries, context length).
    low_precision = dtype in (torch.bfloat16, torch.float16)
    decode: dict[bool, list[tuple[int, int, int, int]]] = {True: [], False: []}
    prefill = []
    start_list, pos_list = starts.tolist(), (s_lens - q_lens).tolist()
    for i, (q, p) in enumerate(zip(query_lens, prompt_lens, strict=True)):
        if p:
            prefill.append([(i, start_list[i], p, pos_list[i] + p)])
        for j in range(p, q):
            ctx = pos_list[i] + j + 1
            decode[low_precision and ctx <= FP32_DECODE_MAX_CONTEXT].append(
                (i, start_list[i] + j, 1, ctx))
    groups = [_build_group(e, tables, block_size, dtype, device, fp32)
              for e, fp32 in [(decode[True], True), (decode[False], False)] if e]
    groups += [_build_group(e, tables, block_size, dtype, device) for e in prefill]
    if len(groups) == 1 and groups[0].valid.numel() == num_tokens and torch.equal(
            groups[0].token_index.flatten().cpu(), torch.arange(num_tokens)):
        groups[0].whole_step = True
    return AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        groups=groups,
        num_tokens=num_tokens,
    )


def _build_group(
    entries: list[tuple[int, int, int, int]],
    tables: torch.Tensor,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    fp32: bool = False,
) -> AttentionGroup:
    seq, first, q, s = (torch.tensor(c, dtype=torch.long) for c in zip(*entries, strict=True))
    max_q = int(q.max())
    if max_q > 1:
        max_q = _round_up(max_q, QUERY_TILE)
    max_ctx = _round_up(int(s.max()), CONTEXT_TILE)
    qi = torch.arange(max_q)  # [max_q]
    is_real_query = qi[None, :] < q[:, None]  # [B, max_q]
    token_index = torch.where(is_real_query, first[:, None] + qi[None, :], 0)
    ctx = torch.arange(max_ctx)  # [max_ctx]
    max_blocks = tables.shape[1]
    block_col = (ctx // block_size).clamp(max=max_blocks - 1)
    context_slots = tables[seq][:, block_col] * block_size + ctx % block_size
    # Padding past a sequence's length reads the zero slot, never an unwritten one.
    context_slots = torch.where(ctx[None, :] < s[:, None], context_slots, NULL_SLOT)
    query_pos = (s - q)[:, None] + qi[None, :]  # [B, max_q]
    allowed = ctx[None, None, :] <= query_pos[:, :, None]  # [B, max_q, max_ctx]
    allowed &= ctx[None, None, :] < s[:, None, None]
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    valid = torch.nonzero(is_real_query.flatten()).flatten()
    return AttentionGroup(
        token_index=token_index.to(device),
        context_slots=context_slots.to(device),
        mask=mask.to(device),
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

    Batched matmuls over fixed-shape tiles (see the module docstring), laid out [Hkv, B, ...] so
    the gathered keys/values are contiguous and the G query heads of a kv head share them
    without copies (GQA).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group_size = num_heads // num_kv_heads
    out = None
    for g in meta.groups:
        b, max_q = g.token_index.shape
        ctx = g.context_slots.shape[1]
        nc, tile = ctx // CONTEXT_TILE, min(max_q, QUERY_TILE)
        hb = num_kv_heads * b
        qg = q if g.whole_step else q[g.token_index]
        # [B, max_q, Hkv, G, D] -> [Hkv, B, max_q, G, D]
        qg = qg.view(b, max_q, num_kv_heads, group_size, head_dim).permute(2, 0, 1, 3, 4)
        adt = torch.float32 if g.fp32 else q.dtype
        qg = (qg * scale).to(adt)
        if g.flat_slots is None:  # once per step: index_select takes no negative index
            g.flat_slots = g.context_slots.view(-1).remainder(k_cache.shape[1])
        slots = g.flat_slots
        # A pool stored in another dtype (bf16 under fp32 compute) converts after the gather.
        # [Hkv * B * nc, CONTEXT_TILE, D]
        k = k_cache.index_select(1, slots).to(adt).view(hb * nc, CONTEXT_TILE, head_dim)
        v = v_cache.index_select(1, slots).to(adt).view(hb * nc, CONTEXT_TILE, head_dim)
        mask = g.mask.view(1, b, max_q, 1, nc, CONTEXT_TILE)
        outs = []
        for t0 in range(0, max_q, tile):
            # One query tile: rows (query, head) of each kv head, repeated for each context tile.
            qt = qg[:, :, t0:t0 + tile].reshape(hb, 1, tile * group_size, head_dim)
            qt = qt.expand(hb, nc, tile * group_size, head_dim).reshape(
                hb * nc, tile * group_size, head_dim)
            scores = torch.bmm(qt, k.transpose(1, 2)).float()  # [Hkv*B*nc, tile*G, CTX_TILE]
            scores = scores.view(num_kv_heads, b, nc, tile, group_size, CONTEXT_TILE)
            scores = scores.permute(0, 1, 3, 4, 2, 5) + mask[:, :, t0:t0 + tile]
            # [Hkv, B, tile, G, nc, CTX_TILE]: the max is exact in any order
            peak = scores.amax(dim=(-2, -1), keepdim=True)
            probs = torch.exp(scores - peak)
            # Denominator: each tile's sum (a fixed-length reduction), then tiles in order.
            denom = probs.sum(-1).cumsum(-1)[..., -1:]  # [Hkv, B, tile, G, 1]
            probs = probs.permute(0, 1, 4, 2, 3, 5).to(adt).reshape(
                hb * nc, tile * group_size, CONTEXT_TILE)
            part = torch.bmm(probs, v).view(hb, nc, tile * group_size, head_dim)
            o = part.float().cumsum(1)[:, -1].view(num_kv_heads, b, tile, group_size, head_dim)
            outs.append(o / denom)
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [Hkv, B, max_q, G, D]
        o = o.to(q.dtype).permute(1, 2, 0, 3, 4).reshape(b * max_q, num_heads * head_dim)
        if g.whole_step:
            return o
        if out is None:
            out = q.new_empty(num_tokens, num_heads * head_dim)
        out[g.dest] = o[g.valid]
    return out
