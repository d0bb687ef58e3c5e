"""The sliding-window layers' KV blocks: a pool of their own, in which each sequence holds only
the blocks its next queries still read. No torch.

A windowed layer's query at position p reads positions p - window + 1 .. p. Once a sequence
has computed c tokens its next query is at c or later, so its blocks that end before
c - window + 1 are never read again: after each step they are dropped (kept as cached blocks
where the prefix cache registered them, so a later prompt may still start from them) and the
sequence's `window_table` holds NO_BLOCK in their place. Windowed layers then keep about
window / block_size + 2 blocks a sequence, however long its context; the layers that attend
over everything keep it all in the main pool (block_manager.py).

The main pool is the prefix cache's index. A hit found there serves the windowed layers only
as far as this pool still holds what the hit's end reads: the blocks of its last `window`
positions, under the same hashes. Where one is missing the hit is cut back to the longest
block boundary this pool serves whole (none at all: the prompt is computed cold); a partial
hit needs its block's counterpart here too.
"""

from __future__ import annotations

from collections.abc import Callable

from server.engine.block_pool import BlockPool
from server.engine.sequence import Sequence

NO_BLOCK = -1  # a window_table entry no query reads any more (dropped, or never taken)


class WindowBlocks(BlockPool):
    def __init__(self, num_blocks: int, block_size: int, window: int,
                 cache_budget: int | None = None,
                 copy_slots: Callable[[int, int, int], None] | None = None):
        super().__init__(num_blocks, cache_budget)
        self.block_size, self.window = block_size, window
        self.copy_slots = copy_slots

    def first_read(self, num_tokens: int) -> int:
        """The first block a query at position num_tokens, or later, reads."""
        return max(0, num_tokens + 1 - self.window) // self.block_size

    def most_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a sequence of num_tokens holds here at once, computing at most
        `chunk` tokens a step: its window before the chunk and the chunk's own blocks."""
        return min(-(-num_tokens // self.block_size),
                   -(-(self.window + chunk) // self.block_size) + 1)

    # -- admission -----------------------------------------------------------------------------

    def serve(self, hit, hashes: list[bytes], partial_hash: bytes | None) -> None:
        """Cut the main pool's prefix hit to what this pool serves and note its blocks here
        (hit.window_blocks: the held blocks of the hit's last window, hit.window_partial)."""
        bs = self.block_size
        if hit.partial is not None:  # the blocks of the whole-block hit's window, and the
            held = self._held(hashes, len(hit.blocks))  # partial block's counterpart: should
            partial = self.cached.get(partial_hash)  # the copy fail, the whole blocks serve
            if held is not None and partial is not None:
                hit.window_blocks, hit.window_partial = held, partial
                return
            hit.partial, hit.tokens = None, len(hit.blocks) * bs
        for k in range(len(hit.blocks), -1, -1):
            held = self._held(hashes, k)
            if held is not None:
                del hit.blocks[k:]
                hit.tokens, hit.window_blocks = k * bs, held
                return

    def _held(self, hashes: list[bytes], k: int) -> list[int] | None:
        """The cached blocks a hit of k whole blocks reads here, None if one is missing."""
        held = []
        for block_hash in hashes[self.first_read(k * self.block_size):k]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                return None
            held.append(block_id)
        return held

    def can_allocate(self, hit, num_tokens: int) -> bool:
        """Whether the hit's blocks here and new ones up to num_tokens fit."""
        new = -(-num_tokens // self.block_size) - len(hit.blocks)
        return new <= self.num_free_blocks - self.num_reused_free(hit.window_blocks)

    def allocate(self, seq: Sequence, hit) -> None:
        """Give seq the hit's blocks (earlier ones are not read: NO_BLOCK)."""
        for block_id in hit.window_blocks:
            self._take(block_id)
        seq.window_table = [NO_BLOCK] * (len(hit.blocks) - len(hit.window_blocks))
        seq.window_table += hit.window_blocks
        seq.window_dropped = len(hit.blocks) - len(hit.window_blocks)

    def copy_partial(self, seq: Sequence, hit) -> bool:
        """Start seq's first new block as a copy of the partial hit's counterpart; False if
        that block was taken for seq's own chunk meanwhile."""
        src = hit.window_partial
        if self.blocks[src].block_hash is None:
            return False
        whole = len(hit.blocks) * self.block_size
        self.copy_slots(src, seq.window_table[len(hit.blocks)], hit.tokens - whole)
        return True

    # -- growth and release --------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.window_table))

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks here for seq's first num_tokens tokens."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.window_table.append(self.take_new())

    def trim(self, seq: Sequence) -> None:
        """Drop seq's blocks that its next queries no longer read."""
        for i in range(seq.window_dropped, self.first_read(seq.num_computed_tokens)):
            self._drop(seq.window_table[i])
            seq.window_table[i] = NO_BLOCK
            seq.window_dropped = i + 1

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.window_table):
            if block_id != NO_BLOCK:
                self._drop(block_id)
        seq.window_table, seq.window_dropped = [], 0
