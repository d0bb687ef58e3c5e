"""Block manager: exact block ids, reference counts and prefix hits (block size 4)."""

from __future__ import annotations

from server.engine.block_manager import BlockManager, PrefixHit, chain_hash
from server.engine.sequence import SamplingParams, Sequence


def seq(tokens, salt=""):
    return Sequence(list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def admit(bm, s):
    hit = bm.match_prefix(s)
    n = s.num_tokens - hit.tokens
    assert bm.can_allocate(s, n, hit)
    bm.allocate(s, n, hit)
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)
    return hit.blocks


def generate(bm, s, tokens):
    """s samples these tokens one step at a time."""
    for t in tokens:
        s.token_ids.append(t)
        bm.append_slots(s, 1)
        s.num_computed_tokens += 1
        bm.cache_full_blocks(s)


def test_allocate_takes_blocks_in_order_and_frees_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))  # 10 tokens -> ceil(10/4) = 3 blocks
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 5
    bm.free(a)
    # Tail first: block 2 (partial, caches nothing) is resident and free; 1 then 0 (full,
    # cached) join the cached blocks in that order; 3-7 were never touched.
    assert (bm.free_resident, list(bm.free_cached), sorted(bm.free_fresh)) == \
        ([2], [1, 0], [3, 4, 5, 6, 7])
    assert all(b.ref_count == 0 for b in bm.blocks) and bm.num_resident_blocks == 3


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
    assert bm.match_prefix(seq(range(8))).blocks == [0]
    assert bm.match_prefix(seq(range(9))).blocks == [0, 1]


def test_tenants_never_share():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, seq(range(9), salt="key-a"))
    assert bm.match_prefix(seq(range(9), salt="key-b")).blocks == []
    assert bm.match_prefix(seq(range(9), salt="key-a")).blocks == [0, 1]
    assert chain_hash(None, (1, 2), "a") != chain_hash(None, (1, 2), "b")


def test_generated_blocks_serve_their_own_sequence_not_a_prompt_repeating_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(6))  # prompt 0-5; then it generates 6-10
    admit(bm, a)
    generate(bm, a, range(6, 11))
    # Block 0 is prompt; block 1 (4, 5, 6, 7) holds generated tokens: another hash domain.
    assert len(bm.cached) == 2
    assert bm.blocks[1].block_hash != chain_hash(bm.blocks[0].block_hash, (4, 5, 6, 7), "")
    # A follow-up whose prompt repeats the reply reuses only the prompt block...
    assert bm.match_prefix(seq(range(11))).blocks == [0]
    # ...while the sequence itself, preempted and resumed, finds both.
    bm.free(a)
    a.num_computed_tokens, a.block_table, a.num_hashed_blocks = 0, [], 0
    assert bm.match_prefix(a).blocks == [0, 1]


def copying(**kw):
    """A block manager whose copies of partial hits are recorded as (src, dst, n)."""
    copies = []
    bm = BlockManager(block_size=4, copy_slots=lambda *c: copies.append(c), **kw)
    return bm, copies


def test_partial_block_hits_copy_the_shared_tokens():
    bm, copies = copying(num_blocks=8)
    admit(bm, seq(range(10)))  # blocks 0 (0-3) and 1 (4-7) cached, 2 holds 8, 9
    b = seq([0, 1, 2, 3, 4, 5, 60, 61, 62])  # shares block 0 and two tokens of block 1
    hit = bm.match_prefix(b)
    assert (hit.blocks, hit.partial, hit.tokens) == ([0], 1, 6)
    admit(bm, b)
    # A new block (3) gets block 1's first two slots; only tokens 6-8 are computed.
    assert b.block_table == [0, 3, 4] and copies == [(1, 3, 2)]
    assert b.num_cached_tokens == 6 and bm.num_cache_hits == 6
    assert bm.blocks[1].ref_count == 1  # a's: b only read it
    # Once computed, b's second block is cached too: a third prompt picks the longer match.
    hit = bm.match_prefix(seq([0, 1, 2, 3, 4, 5, 60, 61, 70]))
    assert (hit.blocks, hit.partial, hit.tokens) == ([0, 3], None, 8)
    hit = bm.match_prefix(seq([0, 1, 2, 3, 4, 5, 60, 99, 70]))
    assert (hit.blocks, hit.partial, hit.tokens) == ([0], 3, 7)


def test_partial_hits_stop_before_the_last_token_and_the_generated_ones():
    bm, _ = copying(num_blocks=8)
    admit(bm, seq(range(10)))
    hit = bm.match_prefix(seq(range(6)))  # token 5 is the last: its logits are needed
    assert (hit.blocks, hit.partial, hit.tokens) == ([0], 1, 5)
    assert bm.match_prefix(seq(range(5))).tokens == 4  # token 4 is the last one
    # A sequence whose prompt ends at 5 and that generated 6, 7, resumed after preemption:
    # its generated tokens come from the decode kernels, never from another prompt's block.
    resumed = seq(range(6))
    resumed.token_ids += [6, 7]
    assert bm.match_prefix(resumed).tokens == 6
    # A block holding generated tokens serves no partial hit (its keys are a decode's).
    bm2, _ = copying(num_blocks=8)
    a = seq(range(2))
    admit(bm2, a)
    generate(bm2, a, range(2, 8))
    assert len(bm2.cached) == 2 and bm2.children == {}
    assert bm2.match_prefix(seq([0, 1, 2, 50])).tokens == 0


def test_partial_hits_keep_to_their_tenant_and_leave_with_their_block():
    bm, _ = copying(num_blocks=8, cache_budget=0)
    a = seq(range(5), salt="key-a")
    admit(bm, a)
    assert bm.match_prefix(seq([0, 1, 9], salt="key-b")).tokens == 0
    assert bm.match_prefix(seq([0, 1, 9], salt="key-a")).tokens == 2
    bm.free(a)
    admit(bm, seq(range(100, 120)))  # over budget: block 0 evicted and reused
    assert bm.blocks[0].block_hash != chain_hash(None, (0, 1, 2, 3), "key-a")
    assert bm.match_prefix(seq([0, 1, 9], salt="key-a")).tokens == 0
    assert all(bm.blocks[b].parent == key for key, kids in bm.children.items() for b in kids)
    assert sum(map(len, bm.children.values())) == len(bm.cached) == 5
    bm.reset_prefix_cache()
    assert bm.children == {} and all(b.parent is None for b in bm.blocks)


def test_a_pool_too_short_for_the_copy_computes_the_shared_tokens():
    bm, copies = copying(num_blocks=3)
    a = seq(range(8))
    admit(bm, a)  # blocks 0 and 1, both cached
    bm.free(a)
    b = seq([0, 1, 2, 3, 4, 5, 50, 51, 52])  # block 0, then 2 tokens of block 1, then 3 more
    hit = bm.match_prefix(b)
    assert (hit.blocks, hit.partial, hit.tokens) == ([0], 1, 6)
    assert bm.can_allocate(b, 3, hit)
    bm.allocate(b, 3, hit)  # 2 new blocks: fresh 2, then block 1 itself, evicted
    assert b.block_table == [0, 2, 1] and copies == []
    # b computes from token 4: this step's 3 tokens (4-6), the rest next step.
    assert b.num_computed_tokens == b.num_cached_tokens == 4


def test_freed_blocks_stay_cached_until_reused_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(9))  # blocks 0, 1 (cached), 2 (partial)
    admit(bm, a)
    bm.free(a)  # resident [2], cached [1, 0], fresh [3]
    b = seq(range(9))
    assert admit(bm, b) == [0, 1]  # revived from the cached free blocks
    assert b.block_table == [0, 1, 2]  # its third block: the resident one before fresh 3
    bm.free(b)  # resident [2], cached [1, 0], fresh [3]
    c = seq([50, 51, 52, 53, 54, 55, 56, 57, 58])  # 3 new blocks: resident 2, fresh 3, then
    admit(bm, c)                                    # the least recently freed cached one, 1
    assert c.block_table == [2, 3, 1]
    # Block 1 (the chain's tail) was evicted, block 0 (its head) survives.
    assert bm.match_prefix(seq(range(9))).blocks == [0]
    assert len(bm.cached) == 3  # block 0, plus c's two full blocks


def test_can_allocate_counts_revived_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq(range(9))
    admit(bm, a)
    bm.free(a)
    b = seq(range(9))
    hit = bm.match_prefix(b)
    # Hits 0 and 1 come out of the free queue, leaving 1 block for the partial third block.
    assert hit.blocks == [0, 1] and bm.can_allocate(b, 1, hit)
    assert not bm.can_allocate(b, 5, hit)


def test_identical_blocks_computed_twice_keep_one_cache_entry():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(range(5)), seq(range(5))
    for s in (a, b):  # both admitted before either computed: no hits
        bm.allocate(s, 5, PrefixHit())
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.cache_full_blocks(s)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    assert list(bm.cached.values()) == [0] and bm.blocks[2].block_hash is None


def test_prefix_cache_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(bm, seq(range(9)))
    assert bm.match_prefix(seq(range(9))).blocks == [] and bm.cached == {}


def test_allocation_prefers_resident_memory_then_fresh_within_the_cache_budget():
    def pool(cache_budget):
        bm = BlockManager(num_blocks=8, block_size=4, cache_budget=cache_budget)
        a, b = seq(range(12)), seq(range(100, 106))
        admit(bm, a)  # blocks 0, 1, 2: all full, all cached
        admit(bm, b)  # blocks 3 (full, cached) and 4 (partial)
        bm.free(a)
        bm.free(b)  # cached, least recent first: [2, 1, 0, 3]; resident [4]; fresh [5, 6, 7]
        c = seq(range(200, 216))  # 16 new tokens: 4 blocks
        admit(bm, c)
        return bm, c

    # Within budget (8): the resident block 4, then fresh memory; the cache stays whole.
    bm, c = pool(8)
    assert c.block_table == [4, 5, 6, 7] and list(bm.free_cached) == [2, 1, 0, 3]
    assert bm.num_resident_blocks == 8
    # Budget 1: 4 cached blocks is 3 too many, so after block 4 the least recent cached ones
    # (2, 1, 0) are reused before any fresh memory is touched.
    bm, c = pool(1)
    assert c.block_table == [4, 2, 1, 0] and list(bm.free_cached) == [3]
    assert sorted(bm.free_fresh) == [5, 6, 7] and bm.num_resident_blocks == 5
    assert bm.match_prefix(seq(range(12))).blocks == []  # a's chain is gone: its head was evicted


def test_idle_release_frees_all_but_the_most_recent_cache():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(range(12)), seq(range(100, 106))
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.free(b)  # cached [2, 1, 0, 3]; resident [4]; fresh [5, 6, 7]
    c = seq(range(200, 217))  # 17 tokens: 5 blocks, 4 5 6 7 then the LRU cached 2
    admit(bm, c)
    assert c.block_table == [4, 5, 6, 7, 2]
    bm.free(c)  # 2 (partial: resident), then 7, 6, 5, 4 cached: [1, 0, 3, 7, 6, 5, 4]
    released = bm.release_idle(keep_cached=2)
    # Every block that caches nothing (2) and the cached ones beyond the 2 most recent.
    assert released == [0, 1, 2, 3, 6, 7]
    assert list(bm.free_cached) == [5, 4] and bm.num_resident_blocks == 2
    assert not any(bm.blocks[i].is_resident or bm.blocks[i].block_hash for i in released)
    assert bm.match_prefix(c).blocks == [4, 5]  # c's first two blocks survive
    d = seq(range(300, 306))
    admit(bm, d)
    assert d.block_table == [0, 1]  # handed-back memory counts as fresh, lowest ids first
