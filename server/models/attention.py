"""Attention over a paged KV cache, batched per step.

The cache is one flat pool of slots per layer: slot = block_id * block_size + offset. A step
writes its new keys/values to `slot_mapping`, then each query attends to the slots of its own
sequence (gathered through the block table) up to its own position.

Queries are grouped so no layer loops over sequences on the decode path: every generated token
(a decode, or a generated token recomputed after preemption) is one query of the decode group,
attending to its own context; each sequence's prompt tokens in the step are a group of their own,
since prefill is compute-bound and few chunks run per step.

Batch invariance: a matmul kernel's rounding can depend on the shape of the call (MKL's fp32
GEMM takes another path below 4 rows and for a tail of columns; oneDNN picks blockings by
shape), so every matmul here has a shape that depends on the query's own position only, never
on the other sequences of the step or on how a prompt was chunked:
- prompt queries at positions below layer_ops.prompt_positions() (512) attend
  in layer_ops.paged_prompt, each over its own context in a fixed order, shared loads aside;
- the other prompt queries run in tiles of QUERY_TILE positions aligned to the sequence start;
  tile k attends to the context [0, (k + 1) * QUERY_TILE) (future positions masked), so its
  matmuls and softmax have one shape whether the prompt came whole, in chunks or after a prefix
  hit;
- a generated query attends in tiles of CONTEXT_TILE positions, batched with the other decodes
  and padded to the longest context; the softmax denominator and the weighted values are summed
  over tiles pairwise by tile position (_tile_sum), so padding tiles, which hold exact zeros,
  never change the sum of the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

import server.kernels.layer_ops as layer_ops

QUERY_TILE = 64  # prompt positions per attention tile (tiles aligned to the sequence start)
CONTEXT_TILE = 64  # context positions per tile of a generated token's attention


@dataclass(slots=True)
class AttentionGroup:
    """Queries attended together: the decodes of a step ([B, 1] queries, each over its own
    context padded to the longest) or one sequence's prompt chunk ([num_tiles, QUERY_TILE]
    aligned query tiles, tile j over the context up to its end)."""

    token_index: torch.Tensor  # [B, 1] or [num_tiles, QUERY_TILE] step-token index (padded)
    context_slots: torch.Tensor  # [B, max_ctx] or [1, max_ctx] cache slot of each position
    # Additive, 0 where allowed, -inf elsewhere. Decodes: [B, max_ctx]; a prompt chunk: the
    # diagonal block of each tile, [num_tiles, QUERY_TILE, QUERY_TILE] (earlier context is
    # always allowed).
    mask: torch.Tensor
    dest: torch.Tensor  # [num real queries] step-token index each one's output goes to
    whole_step: bool = False  # the group is every token of the step, in order, unpadded
    flat_slots: torch.Tensor | None = None  # context_slots as [B * max_ctx] indices >= 0
    fp32: bool = False  # attend in fp32 (short-context decodes under a 16-bit compute dtype)
    first_tile: int = -1  # a prompt chunk's first tile (its position // QUERY_TILE); -1: decodes
    start: int = 0  # a prompt chunk's first position
    first_token: int = -1  # a prompt chunk's first step-token index (its rows follow it)
    in_place: bool = False  # a prompt chunk for layer_ops.paged_prompt (tiles without it)
    lens: torch.Tensor | None = None  # decodes: [B] context length of each (int64)
    # Decodes as a windowed layer sees them (within()), by window, built once per step
    windows: dict[int, AttentionGroup] = field(default_factory=dict)

    def within(self, window: int | None) -> AttentionGroup:
        """The group as a layer attending over the last `window` positions sees it. Decodes:
        each entry's context starts `window` positions before its end (its slots shifted, its
        length cut), so every path attends over exactly those; prompt chunks: the same group,
        their tiles mask each query's window (_prompt_tiles)."""
        if window is None or self.first_tile >= 0:
            return self
        if window not in self.windows:
            first = (self.lens - window).clamp(min=0)  # [B] positions before each window
            if not bool(first.any()):
                self.windows[window] = self
            else:
                b, max_ctx = self.context_slots.shape
                ctx = torch.arange(max_ctx, device=self.lens.device)
                lens = self.lens - first
                shifted = self.context_slots.gather(
                    1, (ctx[None] + first[:, None]).clamp(max=max_ctx - 1))
                past = ctx[None] >= lens[:, None]
                self.windows[window] = replace(
                    self, context_slots=shifted.masked_fill(past, NULL_SLOT), lens=lens,
                    mask=torch.zeros_like(self.mask).masked_fill_(past, float("-inf")),
                    flat_slots=None, windows={})
        return self.windows[window]


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
    # The same step in the sliding-window layers' own pool (window_blocks.py), where the
    # engine keeps one: its slots, its groups.
    windowed: AttentionMetadata | None = None

    def pool(self, window: int | None) -> AttentionMetadata:
        """The metadata of the pool a layer with this window keeps its keys and values in."""
        return self.windowed if window is not None and self.windowed is not None else self


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
    # one decode group where layer_ops.paged_decode attends (fp32 at every length), else two
    cpu_ops = torch.device(device).type == "cpu" and layer_ops.enabled()
    low_precision = dtype in (torch.bfloat16, torch.float16) and not cpu_ops
    if not low_precision and not any(prompt_lens) and len(query_lens) == sum(query_lens):
        return _decode_step(seq_lens, block_tables, block_size, device)
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

    in_place = layer_ops.prompt_positions() if torch.device(device).type == "cpu" else 0
    decode: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
    groups = []
    start_list, pos_list = starts.tolist(), (s_lens - q_lens).tolist()
    for i, (q, p) in enumerate(zip(query_lens, prompt_lens, strict=True)):
        # Prompt positions below `in_place` attend in layer_ops.paged_prompt, the rest in tiles.
        done = min(p, max(0, in_place - pos_list[i]))
        for first, count in ((0, done), (done, p - done)):
            if count:
                groups.append(_prompt_group(tables[i], start_list[i] + first, pos_list[i] + first,
                                            count, block_size, device, first == 0 and done > 0))
        for j in range(p, q):  # (sequence, token index, context length)
            ctx = pos_list[i] + j + 1
            decode[low_precision and ctx <= FP32_DECODE_MAX_CONTEXT].append(
                (i, start_list[i] + j, ctx))
    decode_entries = [(e, fp32) for e, fp32 in [(decode[True], True), (decode[False], False)] if e]
    # Decodes only, all in one group, in step order: the layers skip gathering the queries.
    whole_step = not groups and len(decode_entries) == 1 and [
        token for _, token, _ in decode_entries[0][0]] == list(range(num_tokens))
    groups = [_decode_group(e, tables, block_size, device, fp32) for e, fp32 in decode_entries
              ] + groups
    groups[0].whole_step = whole_step
    return AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        groups=groups,
        num_tokens=num_tokens,
    )


def _decode_step(seq_lens: list[int], block_tables: list[list[int]], block_size: int,
                 device: torch.device | str) -> AttentionMetadata:
    """build_metadata's tensors for one generated token per sequence, at a third of its cost (a
    window pool's NO_BLOCK, -1, gives negative slots: the zero slot, as in _slots)."""
    b, s = len(seq_lens), torch.tensor(seq_lens, dtype=torch.long)
    max_ctx = _round_up(max(seq_lens), CONTEXT_TILE)
    cols = -(-max_ctx // block_size)
    tables = torch.tensor([t[:cols] + [0] * (cols - len(t[:cols])) for t in block_tables],
                          dtype=torch.long)
    slots = (tables[:, :, None] * block_size + torch.arange(block_size)).view(b, -1)[:, :max_ctx]
    past = torch.arange(max_ctx)[None] >= s[:, None]
    context_slots = slots.masked_fill(past | (slots < 0), NULL_SLOT)
    token = torch.arange(b)
    group = AttentionGroup(
        token_index=token[:, None].to(device), context_slots=context_slots.to(device),
        mask=torch.zeros(b, max_ctx).masked_fill_(past, float("-inf")).to(device),
        dest=token.to(device), whole_step=True,
        lens=s.to(device))
    return AttentionMetadata(positions=(s - 1).to(device),
                             slot_mapping=context_slots[token, s - 1].to(device),
                             groups=[group], num_tokens=b)


def _slots(table: torch.Tensor, ctx: torch.Tensor, seq_len: torch.Tensor,
           block_size: int) -> torch.Tensor:
    """Cache slot of each context position; positions at or past seq_len, or in a block the
    table no longer holds (a window pool's NO_BLOCK, -1), read the zero slot."""
    block_col = (ctx // block_size).clamp(max=table.shape[-1] - 1)
    blocks = table[..., block_col]
    slots = blocks * block_size + ctx % block_size
    return torch.where((ctx < seq_len) & (blocks >= 0), slots, NULL_SLOT)


def _decode_group(entries: list[tuple[int, int, int]], tables: torch.Tensor, block_size: int,
                  device: torch.device | str, fp32: bool) -> AttentionGroup:
    seq, token, s = (torch.tensor(c, dtype=torch.long) for c in zip(*entries, strict=True))
    ctx = torch.arange(_round_up(int(s.max()), CONTEXT_TILE))  # [max_ctx]
    # Every position before the query's own end is allowed (the query is the last one).
    mask = torch.zeros(len(entries), ctx.numel()).masked_fill_(ctx[None] >= s[:, None],
                                                                float("-inf"))
    return AttentionGroup(
        token_index=token[:, None].to(device),
        context_slots=_slots(tables[seq], ctx, s[:, None], block_size).to(device),
        mask=mask.to(device),
        dest=token.to(device),
        fp32=fp32,
        lens=s.to(device),
    )


def _prompt_group(table: torch.Tensor, first_token: int, start: int, num: int, block_size: int,
                  device: torch.device | str, in_place: bool = False) -> AttentionGroup:
    """Prompt positions [start, start + num) of one sequence, their tokens from first_token."""
    end = start + num
    first_tile, last_tile = start // QUERY_TILE, (end - 1) // QUERY_TILE
    pos = torch.arange(first_tile * QUERY_TILE, (last_tile + 1) * QUERY_TILE)  # tiles' positions
    is_real = (pos >= start) & (pos < end)
    token_index = torch.where(is_real, pos - start + first_token, 0)
    ctx = torch.arange(pos.numel() + first_tile * QUERY_TILE)  # up to the last tile's end
    # The diagonal block: a query sees positions up to its own, and none past the chunk.
    diag = pos.view(-1, QUERY_TILE)  # [num_tiles, QUERY_TILE] positions of each tile
    allowed = (diag[:, None, :] <= diag[:, :, None]) & (diag[:, None, :] < end)
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    valid = torch.nonzero(is_real).flatten()
    return AttentionGroup(
        token_index=token_index.view(-1, QUERY_TILE).to(device),
        context_slots=_slots(table, ctx, torch.tensor(end), block_size)[None].to(device),
        mask=mask.to(device), dest=token_index[valid].to(device),
        first_tile=first_tile, start=start, in_place=in_place, first_token=first_token)


def _tile_sum(x: torch.Tensor) -> torch.Tensor:
    """[A, n, ...] -> [A, ...]: the n tiles summed pairwise, (0 + 1), (2 + 3), ..., then the
    pairs the same way. A tile's partners depend on its position only, and a tile without a
    partner passes through as if added to zero, so zero tiles appended at the end (padding)
    leave the sum of the real ones exactly as it was."""
    while x.shape[1] > 1:
        n = x.shape[1]
        pairs = x[:, 0:n - 1:2] + x[:, 1:n:2]
        x = torch.cat([pairs, x[:, n - 1:]], dim=1) if n % 2 else pairs
    return x[:, 0]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D]; caches: [Hkv, num_slots, D] already holding this step's k/v -> [T, Hq*D].
    `window`: each query attends over its last `window` positions only (its own included), as
    transformers' sliding-window layers do; None: over all before it. `softcap` (Gemma 2): the
    scores are cap * tanh(scores / cap) before the mask; `sinks` [Hq] (gpt-oss): a logit per
    head that joins each query's softmax and attends nowhere. Both in the PyTorch paths only
    (the C kernels have neither).

    Batched matmuls over fixed-shape tiles (see the module docstring), laid out [Hkv, B, ...] so
    the gathered keys/values are contiguous and the G query heads of a kv head share them
    without copies (GQA). A windowed layer's prompt chunks always take the tiles (paged_prompt
    has no window), whatever their positions: the same path chunked or whole.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group_size = num_heads // num_kv_heads
    plain = softcap is None and sinks is None  # what the C kernels compute
    if meta.groups[0].whole_step:  # the step's decodes, in order: their rows are the output
        return _decodes(q, k_cache, v_cache, meta.groups[0].within(window), scale, num_kv_heads,
                        group_size, softcap, sinks)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    for g in meta.groups:
        g = g.within(window)
        if g.first_tile < 0:  # decodes: one row each, in entry order
            out[g.dest] = _decodes(q, k_cache, v_cache, g, scale, num_kv_heads, group_size,
                                   softcap, sinks)
            continue
        rows = slice(g.first_token, g.first_token + g.dest.numel())  # a chunk's rows are in order
        if g.in_place and window is None and plain and layer_ops.paged_prompt(
                q[rows], k_cache, v_cache, g.context_slots[0], g.start, scale,
                out=out[rows]) is not None:  # the cache read in place, into the step's rows
            continue
        o = _prompt_tiles(q, k_cache, v_cache, g, scale, num_kv_heads, group_size, window,
                          softcap, sinks)  # [padded rows, Hq * D], the real ones from start
        first = g.start - g.first_tile * QUERY_TILE
        out[rows] = o[first:first + g.dest.numel()]
    return out


def _gather(cache: torch.Tensor, g: AttentionGroup, dtype: torch.dtype) -> torch.Tensor:
    """[Hkv, B * max_ctx, D] keys or values of the group's context, in `dtype`."""
    if g.flat_slots is None:  # once per step: index_select takes no negative index
        g.flat_slots = g.context_slots.view(-1).remainder(cache.shape[1])
    # A pool stored in another dtype (bf16 under fp32 compute) converts after the gather.
    return cache.index_select(1, g.flat_slots).to(dtype)


def _decodes(q, k_cache, v_cache, g: AttentionGroup, scale: float, num_kv_heads: int,
             group_size: int, softcap: float | None = None,
             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per entry, over its context: in layer_ops.paged_decode, reading the cache in
    place, or else (and with a softcap or sinks) in tiles of CONTEXT_TILE."""
    qg = q if g.whole_step else q[g.token_index[:, 0]]
    if softcap is None and sinks is None:
        o = layer_ops.paged_decode(qg.contiguous(), k_cache, v_cache, g.context_slots, g.lens,
                                   scale)
        if o is not None:
            return o
    b, ctx = g.context_slots.shape
    head_dim, nc, hb = q.shape[-1], ctx // CONTEXT_TILE, num_kv_heads * b
    adt = torch.float32 if g.fp32 else q.dtype
    # [B, Hkv, G, D] -> [Hkv, B, G, D], repeated for each context tile: [Hkv * B * nc, G, D]
    qg = (qg.view(b, num_kv_heads, group_size, head_dim).transpose(0, 1) * scale).to(adt)
    if nc > 1:
        qg = qg.reshape(hb, 1, group_size, head_dim).expand(hb, nc, group_size, head_dim)
    qg = qg.reshape(hb * nc, group_size, head_dim)
    k = _gather(k_cache, g, adt).view(hb * nc, CONTEXT_TILE, head_dim)
    v = _gather(v_cache, g, adt).view(hb * nc, CONTEXT_TILE, head_dim)
    scores = torch.bmm(qg, k.transpose(1, 2)).float()  # [Hkv * B * nc, G, CONTEXT_TILE]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(num_kv_heads, b, nc, group_size, CONTEXT_TILE)
    scores += g.mask.view(1, b, nc, 1, CONTEXT_TILE)
    peak = scores.amax(dim=(2, 4), keepdim=True)  # exact in any order
    probs = scores.sub_(peak).exp_()  # [Hkv, B, nc, G, CONTEXT_TILE]
    denom = _tile_sum(probs.sum(-1).view(hb, nc, group_size))  # [Hkv * B, G]
    if sinks is not None:  # each head's sink joins the denominator, against the same peak
        sink = sinks.float().view(num_kv_heads, 1, group_size)
        denom = denom + (sink - peak.view(num_kv_heads, b, group_size)).exp().view(
            hb, group_size)
    part = torch.bmm(probs.view(hb * nc, group_size, CONTEXT_TILE).to(adt), v)
    o = _tile_sum(part.float().view(hb, nc, group_size, head_dim)).div_(denom[..., None])
    # [Hkv, B, G, D] -> [B, Hkv * G * D]
    o = o.to(q.dtype).view(num_kv_heads, b, group_size * head_dim).transpose(0, 1)
    return o.reshape(b, num_kv_heads * group_size * head_dim)


def _prompt_tiles(q, k_cache, v_cache, g: AttentionGroup, scale: float, num_kv_heads: int,
                  group_size: int, window: int | None = None,
                  softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A prompt chunk's aligned query tiles, tile j over the context up to its own end (and
    with a `window`, each query not before its own position - window + 1)."""
    num_tiles = g.token_index.shape[0]
    head_dim, dtype = q.shape[-1], q.dtype
    # [tiles, QT, Hkv, G, D] -> [tiles, Hkv, G, QT, D]
    qg = q[g.token_index].view(num_tiles, QUERY_TILE, num_kv_heads, group_size, head_dim)
    qg = (qg.permute(0, 2, 3, 1, 4) * scale).reshape(
        num_tiles, num_kv_heads, group_size * QUERY_TILE, head_dim)
    k = _gather(k_cache, g, dtype)  # [Hkv, ctx, D]
    v = _gather(v_cache, g, dtype)
    outs = []
    for j in range(num_tiles):
        n = (g.first_tile + j + 1) * QUERY_TILE
        scores = torch.bmm(qg[j], k[:, :n].transpose(1, 2))  # [Hkv, G * QT, n]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores.view(num_kv_heads, group_size, QUERY_TILE, n)[..., n - QUERY_TILE:].add_(
            g.mask[j])
        if window is not None and n > window:  # some query's window starts after position 0
            rows = torch.arange(n - QUERY_TILE, n, device=q.device)[:, None]  # its positions
            early = torch.arange(n, device=q.device)[None] <= rows - window  # [QT, n]
            scores.view(num_kv_heads, group_size, QUERY_TILE, n).masked_fill_(
                early, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
        else:  # each head's sink joins the softmax, then is dropped
            sink = sinks.to(scores.dtype).view(num_kv_heads, group_size, 1, 1).expand(
                num_kv_heads, group_size, QUERY_TILE, 1).reshape(num_kv_heads, -1, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1,
                                  dtype=torch.float32)[..., :-1].to(dtype)
        outs.append(torch.bmm(probs, v[:, :n]))  # [Hkv, G * QT, D]
    o = torch.stack(outs).view(num_tiles, num_kv_heads, group_size, QUERY_TILE, head_dim)
    return o.permute(0, 3, 1, 2, 4).reshape(num_tiles * QUERY_TILE,
                                            num_kv_heads * group_size * head_dim)
