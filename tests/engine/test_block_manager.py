"""Block manager: exact block ids, reference counts and prefix hits (block size 4)."""

from __future__ import annotations

from server.engine.block_manager import BlockManager, chain_hash
from server.engine.sequence import SamplingParams, Sequence


def seq(tokens, salt=""):
    return Sequence(list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def admit(bm, s):
    hits = bm.match_prefix(s)
    n = s.num_tokens - len(hits) * bm.block_size
    assert bm.can_allocate(s, n, hits)
    bm.allocate(s, n, hits)
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)
    return hits


def test_allocate_takes_blocks_in_order_and_frees_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))  # 10 tokens -> ceil(10/4) = 3 blocks
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.free(a)
    # Free queue was [3..7]; a's blocks go to the tail, last block first.
    assert list(bm.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_full_blocks_are_cached_and_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))
    admit(bm, a)
    # Blocks 0 and 1 are full (tokens 0-7); block 2 holds 8, 9 and is not cached.
    assert bm.blocks[0].token_ids == (0, 1, 2, 3) and bm.blocks[2].block_hash is None
    assert len(bm.cached) == 2
    b = seq([0, 1, 2, 3, 4, 5, 6, 7, 100])
    hits = admit(bm, b)
    assert hits == [0, 1] and b.num_cached_tokens == 8
    assert bm.blocks[0].ref_count == 2 and b.block_table == [0, 1, 3]


def test_last_token_is_never_a_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, seq(range(8)))
    # Same 8 tokens: only the first block may hit, since token 7's logits are needed.
    assert bm.match_prefix(seq(range(8))) == [0]
    assert bm.match_prefix(seq(range(9))) == [0, 1]


def test_tenants_never_share():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, seq(range(9), salt="key-a"))
    assert bm.match_prefix(seq(range(9), salt="key-b")) == []
    assert bm.match_prefix(seq(range(9), salt="key-a")) == [0, 1]
    assert chain_hash(None, (1, 2), "a") != chain_hash(None, (1, 2), "b")


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(9))  # blocks 0, 1 (cached), 2 (partial)
    admit(bm, a)
    bm.free(a)  # free queue: [3, 2, 1, 0]
    b = seq(range(9))
    assert admit(bm, b) == [0, 1]  # revived from the free queue
    assert b.block_table == [0, 1, 3] and list(bm.free_queue) == [2]
    bm.free(b)  # [2] + b's blocks tail first: [2, 3, 1, 0]
    c = seq([50, 51, 52, 53, 54, 55, 56, 57, 58])  # needs 3 new blocks: takes 2, 3, 1
    admit(bm, c)
    assert c.block_table == [2, 3, 1]
    # Block 1 (the chain's tail) was evicted, block 0 (its head) survives.
    assert bm.match_prefix(seq(range(9))) == [0]
    assert len(bm.cached) == 3  # block 0, plus c's two full blocks


def test_can_allocate_counts_revived_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq(range(9))
    admit(bm, a)
    bm.free(a)
    b = seq(range(9))
    hits = bm.match_prefix(b)
    # Hits 0 and 1 come out of the free queue, leaving 1 block for the partial third block.
    assert hits == [0, 1] and bm.can_allocate(b, 1, hits)
    assert not bm.can_allocate(b, 5, hits)


def test_identical_blocks_computed_twice_keep_one_cache_entry():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(range(5)), seq(range(5))
    for s in (a, b):  # both admitted before either computed: no hits
        bm.allocate(s, 5, [])
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.cache_full_blocks(s)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    assert list(bm.cached.values()) == [0] and bm.blocks[2].block_hash is None


def test_prefix_cache_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(bm, seq(range(9)))
    assert bm.match_prefix(seq(range(9))) == [] and bm.cached == {}
