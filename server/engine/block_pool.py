"""One pool of KV blocks: reference counts, the free blocks in the order they are taken, and
the cached ones by hash. No torch. The sequences' tables over it are block_manager.py's (the
main pool: every layer that attends over the whole context, and the prefix cache's index)
and window_blocks.py's (the sliding-window layers' own pool).

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

import heapq
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered
    token_ids: tuple[int, ...] = ()  # the tokens behind block_hash, to verify hits
    is_resident: bool = False  # written since the pool was made or its memory handed back
    parent: bytes | None = None  # cached and of prompt tokens only: the key of what it follows


class BlockPool:
    def __init__(self, num_blocks: int, cache_budget: int | None = None):
        # Free blocks holding cached content kept before fresh memory is preferred to them.
        self.cache_budget = num_blocks if cache_budget is None else cache_budget
        self.blocks = [Block(i) for i in range(num_blocks)]
        # The free blocks, in three groups (see the module docstring for the order they go):
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.free_resident: list[int] = []  # a heap: resident, caching nothing
        self.free_fresh: list[int] = list(range(num_blocks))  # a heap: never touched
        self.cached: dict[bytes, int] = {}  # block hash -> block id

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

    def num_reused_free(self, block_ids: list[int]) -> int:
        """How many of these blocks (a prefix hit's) sit free: taking them uses free blocks."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def take_new(self) -> int:
        """A free block for new data, referenced once and resident from now on."""
        block = self.blocks[self._pop_free()]
        block.ref_count, block.is_resident = 1, True
        return block.block_id

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

    def register(self, block_id: int, block_hash: bytes, tokens: tuple[int, ...]) -> bool:
        """Cache a full block under its hash, unless an identical one is cached already."""
        if block_hash in self.cached:
            return False
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = block_hash, tokens
        self.cached[block_hash] = block_id
        return True

    def _evict(self, block: Block) -> None:
        if self.cached.get(block.block_hash) == block.block_id:
            del self.cached[block.block_hash]
        block.block_hash, block.token_ids = None, ()

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
