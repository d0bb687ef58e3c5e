"""The paged KV cache's bookkeeping: blocks, reference counts, the prefix cache, and which
blocks' memory is resident. No torch.

A full block is known by a chained hash of (parent block's hash, its token ids), salted per
tenant so tenants never share cache; a hit is verified against the stored token ids. A block
holding generated tokens hashes apart from the same tokens as prompt: the model computes a
generated token's keys and values with other kernels than a prompt token's (decode attention,
the decode plan), so a follow-up turn whose prompt repeats the last reply computes those tokens
as prompt, as it would cold, instead of reusing the reply's blocks (which would make its
logprobs depend on what the cache held); a preempted sequence still resumes from its own
generated blocks, where they are generated tokens again. Blocks are
reference-counted. A block whose count drops to zero keeps its hash, so a later request can
still reuse it until it is taken for new data (least recently freed first). A sequence's blocks
are freed tail-first, so the end of a chain is evicted before its beginning.

A prompt that shares only the start of a block with a cached one (a common system prompt or
chat template ending mid-block) reuses those tokens too, to the token: its first new block
starts as a copy of the cached block's first keys and values (`copy_slots`, the pool owner's)
and only the rest of the prompt is computed. Cached blocks of prompt tokens are indexed by the
block they follow for that. A copied position holds the numbers the prompt would compute
itself: every kernel gives a prompt row the same numbers whatever shares its step or chunk.

The pool's own mechanics (free blocks and the order they are taken in, resident memory) are
block_pool.py's. A model with sliding-window layers keeps those layers' blocks in a second pool
(window_blocks.py), which this manager keeps in step: it allocates, registers and frees there
too, cuts prefix hits to what that pool still holds, and drops there what no query reads.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from server.engine.block_pool import Block, BlockPool
from server.engine.sequence import Sequence
from server.engine.window_blocks import NO_BLOCK, WindowBlocks


@dataclass(slots=True)
class PrefixHit:
    """What the prefix cache holds of a prompt: whole blocks, then maybe the start of one more."""

    blocks: list[int] = field(default_factory=list)  # cached blocks, reused as they are
    tokens: int = 0  # prompt tokens found: the blocks' and the partial block's
    partial: int | None = None  # a cached block whose first tokens continue the prompt
    # Sliding-window layers (window_blocks.py): the window pool's cached blocks of the hit's
    # last window, and the partial block's counterpart there.
    window_blocks: list[int] = field(default_factory=list)
    window_partial: int | None = None


def chain_hash(parent: bytes | None, token_ids: list[int] | tuple[int, ...], salt: str,
               generated: bool = False) -> bytes:
    """sha256 over the parent's hash (or the tenant salt for a first block), the tokens and
    whether the block holds generated tokens."""
    h = hashlib.sha256(parent if parent is not None else b"root:" + salt.encode())
    h.update(array("q", token_ids).tobytes())
    if generated:
        h.update(b"generated")
    return h.digest()


def root_key(salt: str) -> bytes:
    """What a tenant's first blocks follow, in the index of partial hits."""
    return hashlib.sha256(b"root:" + salt.encode()).digest()


def holds_generated(seq: Sequence, block_index: int, block_size: int) -> bool:
    """Whether seq's block `block_index` holds any of its generated tokens."""
    return (block_index + 1) * block_size > seq.num_prompt_tokens


# Cached blocks compared per partial lookup at most (the most recently cached first): the
# blocks after a shared system prompt can number thousands.
PARTIAL_CANDIDATES = 64


class BlockManager(BlockPool):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_budget: int | None = None,
                 copy_slots: Callable[[int, int, int], None] | None = None,
                 window: WindowBlocks | None = None):
        """copy_slots(src, dst, n): copy the keys and values of block src's first n slots into
        block dst's (None: no partial hits). window: the sliding-window layers' pool, if the
        model keeps one."""
        super().__init__(num_blocks, cache_budget)
        self.block_size = block_size
        self.copy_slots = copy_slots
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        # Cached blocks of prompt tokens by the key of what they follow (the previous block's
        # hash, or root_key), oldest first: where partial hits are looked up.
        self.children: dict[bytes, dict[int, None]] = {}
        self.num_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_cache_hits = 0  # of those, tokens found

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs to hold its first `num_tokens` tokens."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(seq.block_table))

    def fits(self, num_tokens: int, chunk: int) -> bool:
        """Whether one sequence of num_tokens, computing at most `chunk` tokens a step, fits
        in the pools at all."""
        w = self.window
        return -(-num_tokens // self.block_size) <= len(self.blocks) and (
            w is None or w.most_held(num_tokens, chunk) <= len(w.blocks))

    # -- admission: prefix-cache lookup -------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> PrefixHit:
        """Cached blocks holding a prefix of seq's tokens, then a cached block that continues it
        for part of a block; never seq's last token (whose logits are needed, so it is always
        computed), and a partial hit only over prompt tokens (a generated token's keys and
        values come from other kernels). With a window pool, only what that pool serves too."""
        hit = self._match(seq)
        if self.window is not None:
            partial = None if hit.partial is None else self.blocks[hit.partial].block_hash
            self.window.serve(hit, [self.blocks[b].block_hash for b in hit.blocks], partial)
        return hit

    def _match(self, seq: Sequence) -> PrefixHit:
        hit = PrefixHit()
        if not self.enable_prefix_caching:
            return hit
        bs = self.block_size
        parent = None
        for start in range(0, seq.num_tokens - 1 - bs + 1, bs):
            tokens = tuple(seq.token_ids[start:start + bs])
            parent = chain_hash(parent, tokens, seq.cache_salt,
                                holds_generated(seq, start // bs, bs))
            block_id = self.cached.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hit.blocks.append(block_id)
        hit.tokens = start = len(hit.blocks) * bs
        limit = min(seq.num_tokens - 1, seq.num_prompt_tokens, start + bs - 1) - start
        if self.copy_slots is None or limit <= 0:
            return hit
        key = self.blocks[hit.blocks[-1]].block_hash if hit.blocks else root_key(seq.cache_salt)
        candidates = self.children.get(key)
        if candidates:
            want = seq.token_ids[start:start + limit]
            for block_id in islice(reversed(candidates), PARTIAL_CANDIDATES):
                have = self.blocks[block_id].token_ids
                n = 0
                while n < limit and have[n] == want[n]:
                    n += 1
                if n > hit.tokens - start:
                    hit.tokens, hit.partial = start + n, block_id
        return hit

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit) -> bool:
        """Whether admitting seq with this prefix hit and a first chunk of num_new_tokens fits.
        Hit blocks sitting in the free queue stop being free once taken."""
        total = -(-(hit.tokens + num_new_tokens) // self.block_size)
        return total - len(hit.blocks) <= self.num_free_blocks - self.num_reused_free(
            hit.blocks) and (self.window is None or self.window.can_allocate(
                hit, hit.tokens + num_new_tokens))

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit) -> None:
        """Admit seq: take its prefix hit's blocks, then blocks for its first chunk, the first
        of them starting as a copy of the partial hit's. Should the pool be so short that the
        partial hit's block (free, cached) is taken for the chunk, seq computes those tokens
        too: the chunk then ends short of the prompt's end and the rest follows next step."""
        assert not seq.block_table
        for block_id in hit.blocks:
            self._take(block_id)
        src = hit.partial
        w = self.window
        if src is not None:  # the last cached blocks evicted for the chunk
            for pool, block_id in ((self, src), (w, hit.window_partial)):
                if pool is not None and block_id in pool.free_cached:
                    pool.free_cached.move_to_end(block_id)
        seq.block_table = list(hit.blocks)
        seq.num_hashed_blocks = len(hit.blocks)
        seq.last_block_hash = self.blocks[hit.blocks[-1]].block_hash if hit.blocks else None
        seq.num_computed_tokens = hit.tokens
        if w is not None:
            w.allocate(seq, hit)
        self.append_slots(seq, num_new_tokens)
        whole = len(hit.blocks) * self.block_size
        if src is not None:
            if self.blocks[src].block_hash is None or (w is not None
                                                       and not w.copy_partial(seq, hit)):
                seq.num_computed_tokens = whole  # evicted for the chunk after all
            else:
                self.copy_slots(src, seq.block_table[len(hit.blocks)], hit.tokens - whole)
        seq.num_cached_tokens = seq.num_computed_tokens
        if not seq.internal:
            self.num_cache_queries += seq.num_tokens
            self.num_cache_hits += seq.num_cached_tokens

    # -- growth --------------------------------------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        total = seq.num_computed_tokens + num_new_tokens
        return self.blocks_needed(seq, total) <= self.num_free_blocks and (
            self.window is None
            or self.window.blocks_needed(seq, total) <= self.window.num_free_blocks)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give seq the blocks to compute num_new_tokens more tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        for _ in range(self.blocks_needed(seq, total)):
            seq.block_table.append(self.take_new())
        if self.window is not None:
            self.window.append_slots(seq, total)

    def _evict(self, block: Block) -> None:
        if block.parent is not None:
            siblings = self.children[block.parent]
            del siblings[block.block_id]
            if not siblings:
                del self.children[block.parent]
            block.parent = None
        super()._evict(block)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that are full of computed tokens, and drop its window
        blocks that no query reads any more (call after each step)."""
        if self.enable_prefix_caching:
            self._register(seq)
        if self.window is not None:
            self.window.trim(seq)

    def _register(self, seq: Sequence) -> None:
        bs, w = self.block_size, self.window
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            generated = holds_generated(seq, i, bs)
            block_hash = chain_hash(seq.last_block_hash, tokens, seq.cache_salt, generated)
            # an identical block computed elsewhere stays
            if self.register(seq.block_table[i], block_hash, tokens) and not generated:
                block = self.blocks[seq.block_table[i]]
                block.parent = seq.last_block_hash or root_key(seq.cache_salt)
                self.children.setdefault(block.parent, {})[block.block_id] = None
            if w is not None and seq.window_table[i] != NO_BLOCK:
                w.register(seq.window_table[i], block_hash, ())
            seq.last_block_hash = block_hash
            seq.num_hashed_blocks = i + 1

    # -- release -------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, tail block first (so tails are evicted before heads)."""
        for block_id in reversed(seq.block_table):
            self._drop(block_id)
        seq.block_table = []
        seq.num_hashed_blocks, seq.last_block_hash = 0, None
        if self.window is not None:
            self.window.free(seq)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.children.clear()
        if self.window is not None:
            self.window.reset_prefix_cache()
