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

The pool is reserved, not resident: a block's memory becomes resident the first time it is
written. So a free block is taken in this order: one already resident that caches nothing
(lowest id first); a cached one, least recently freed, once more than `cache_budget` blocks
sit cached; a block never touched (lowest id first, so the resident part stays packed at the
low ids); and only when none is left, a cached one anyway. Resident memory then follows the
peak of running sequences plus the cache budget, not the pool's size. `release_idle` hands back
what an idle server does not need: the blocks that cache nothing and the cached ones beyond a
budget; the runner returns their pages to the OS and they count as never touched again.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from server.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered
    token_ids: tuple[int, ...] = ()  # the tokens behind block_hash, to verify hits
    is_resident: bool = False  # written since the pool was made or its memory handed back
    parent: bytes | None = None  # cached and of prompt tokens only: the key of what it follows


@dataclass(slots=True)
class PrefixHit:
    """What the prefix cache holds of a prompt: whole blocks, then maybe the start of one more."""

    blocks: list[int] = field(default_factory=list)  # cached blocks, reused as they are
    tokens: int = 0  # prompt tokens found: the blocks' and the partial block's
    partial: int | None = None  # a cached block whose first tokens continue the prompt


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


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_budget: int | None = None,
                 copy_slots: Callable[[int, int, int], None] | None = None):
        """copy_slots(src, dst, n): copy the keys and values of block src's first n slots into
        block dst's (None: no partial hits)."""
        self.block_size = block_size
        self.copy_slots = copy_slots
        self.enable_prefix_caching = enable_prefix_caching
        # Free blocks holding cached content kept before fresh memory is preferred to them.
        self.cache_budget = num_blocks if cache_budget is None else cache_budget
        self.blocks = [Block(i) for i in range(num_blocks)]
        # The free blocks, in three groups (see the module docstring for the order they go):
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.free_resident: list[int] = []  # a heap: resident, caching nothing
        self.free_fresh: list[int] = list(range(num_blocks))  # a heap: never touched
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        # Cached blocks of prompt tokens by the key of what they follow (the previous block's
        # hash, or root_key), oldest first: where partial hits are looked up.
        self.children: dict[bytes, dict[int, None]] = {}
        self.num_cache_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_cache_hits = 0  # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_cached) + len(self.free_resident) + len(self.free_fresh)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - self.num_free_blocks

    @property
    def num_resident_blocks(self) -> int:
        """Blocks whose memory has been written and not handed back."""
        return len(self.blocks) - len(self.free_fresh)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks still holding cached content (evictable)."""
        return len(self.free_cached)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs to hold its first `num_tokens` tokens."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(seq.block_table))

    # -- admission: prefix-cache lookup -------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> PrefixHit:
        """Cached blocks holding a prefix of seq's tokens, then a cached block that continues it
        for part of a block; never seq's last token (whose logits are needed, so it is always
        computed), and a partial hit only over prompt tokens (a generated token's keys and
        values come from other kernels)."""
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
        reused_free = sum(1 for b in hit.blocks if self.blocks[b].ref_count == 0)
        total = -(-(hit.tokens + num_new_tokens) // self.block_size)
        return total - len(hit.blocks) <= self.num_free_blocks - reused_free

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit) -> None:
        """Admit seq: take its prefix hit's blocks, then blocks for its first chunk, the first
        of them starting as a copy of the partial hit's. Should the pool be so short that the
        partial hit's block (free, cached) is taken for the chunk, seq computes those tokens
        too: the chunk then ends short of the prompt's end and the rest follows next step."""
        assert not seq.block_table
        for block_id in hit.blocks:
            self._take(block_id)
        src = hit.partial
        if src is not None and src in self.free_cached:
            self.free_cached.move_to_end(src)  # the last cached block evicted for the chunk
        seq.block_table = list(hit.blocks)
        seq.num_hashed_blocks = len(hit.blocks)
        seq.last_block_hash = self.blocks[hit.blocks[-1]].block_hash if hit.blocks else None
        seq.num_computed_tokens = hit.tokens
        self.append_slots(seq, num_new_tokens)
        whole = len(hit.blocks) * self.block_size
        if src is not None:
            if self.blocks[src].block_hash is None:  # evicted for the chunk after all
                seq.num_computed_tokens = whole
            else:
                self.copy_slots(src, seq.block_table[len(hit.blocks)], hit.tokens - whole)
        seq.num_cached_tokens = seq.num_computed_tokens
        if not seq.internal:
            self.num_cache_queries += seq.num_tokens
            self.num_cache_hits += seq.num_cached_tokens

    # -- growth --------------------------------------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq, seq.num_computed_tokens + num_new_tokens)
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give seq the blocks to compute num_new_tokens more tokens."""
        for _ in range(self.blocks_needed(seq, seq.num_computed_tokens + num_new_tokens)):
            block = self.blocks[self._pop_free()]
            block.ref_count, block.is_resident = 1, True
            seq.block_table.append(block.block_id)

    def _pop_free(self) -> int:
        """The free block to write next (the order is the module docstring's)."""
        if self.free_resident:
            return heapq.heappop(self.free_resident)
        if self.free_cached and (len(self.free_cached) > self.cache_budget
                                 or not self.free_fresh):
            block_id, _ = self.free_cached.popitem(last=False)
            self._evict(self.blocks[block_id])
            return block_id
        return heapq.heappop(self.free_fresh)

    def _evict(self, block: Block) -> None:
        if self.cached.get(block.block_hash) == block.block_id:
            del self.cached[block.block_hash]
        if block.parent is not None:
            siblings = self.children[block.parent]
            del siblings[block.block_id]
            if not siblings:
                del self.children[block.parent]
        block.block_hash, block.token_ids, block.parent = None, (), None

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that are full of computed tokens (call after each step)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(seq.num_hashed_blocks, seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            generated = holds_generated(seq, i, bs)
            block_hash = chain_hash(seq.last_block_hash, tokens, seq.cache_salt, generated)
            if block_hash not in self.cached:  # an identical block computed elsewhere stays
                block = self.blocks[seq.block_table[i]]
                block.block_hash, block.token_ids = block_hash, tokens
                self.cached[block_hash] = block.block_id
                if not generated:
                    block.parent = seq.last_block_hash or root_key(seq.cache_salt)
                    self.children.setdefault(block.parent, {})[block.block_id] = None
            seq.last_block_hash = block_hash
            seq.num_hashed_blocks = i + 1

    # -- release -------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop seq's references, tail block first (so tails are evicted before heads)."""
        for block_id in reversed(seq.block_table):
            self._drop(block_id)
        seq.block_table = []
        seq.num_hashed_blocks, seq.last_block_hash = 0, None

    def release_idle(self, keep_cached: int) -> list[int]:
        """The blocks whose memory an idle server can hand back: every free block that caches
        nothing and the least recently freed cached ones beyond `keep_cached` (evicted). They
        count as never touched from now on; the caller returns their pages to the OS."""
        released = list(self.free_resident)
        self.free_resident = []
        while len(self.free_cached) > keep_cached:
            block_id, _ = self.free_cached.popitem(last=False)
            self._evict(self.blocks[block_id])
            released.append(block_id)
        for block_id in released:
            self.blocks[block_id].is_resident = False
            heapq.heappush(self.free_fresh, block_id)
        return sorted(released)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_cached[block_id]  # a hit: only cached blocks are taken by id
        block.ref_count += 1

    def _drop(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count == 0:
            if block.block_hash is not None:
                self.free_cached[block_id] = None
            else:
                heapq.heappush(self.free_resident, block_id)

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_cached:
            heapq.heappush(self.free_resident, block_id)
        self.free_cached.clear()
        for block in self.blocks:
            block.block_hash, block.token_ids, block.parent = None, (), None
        self.cached.clear()
        self.children.clear()
