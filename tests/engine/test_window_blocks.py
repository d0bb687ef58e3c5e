"""The sliding-window layers' own pool (window_blocks.py) beside the main one: exact block ids,
what a sequence holds step by step, prefix hits cut to what the window pool still serves, and
the pools' sizes (block size 4, a 6-token window unless said)."""

from __future__ import annotations

import pytest
import torch

from server.engine.block_manager import BlockManager
from server.engine.engine import EngineConfig, PoolSizes
from server.engine.sequence import SamplingParams, Sequence
from server.engine.window_blocks import NO_BLOCK, WindowBlocks
from server.models.config import ModelConfig
from tests.engine.test_block_manager import admit, generate


def seq(tokens):
    return Sequence(list(tokens), SamplingParams(max_tokens=8))


def manager(num_blocks=64, window_blocks=16, window=6, copies=None, **kw):
    def copy(pool):
        return None if copies is None else (lambda *c: copies.append((pool, *c)))
    w = WindowBlocks(window_blocks, 4, window, copy_slots=copy("window"), **kw)
    return BlockManager(num_blocks, 4, copy_slots=copy("main"), window=w)


def held(s):
    return [b for b in s.window_table if b != NO_BLOCK]


def test_a_sequence_holds_only_the_blocks_its_next_queries_read():
    bm = manager()
    a = seq(range(10))
    admit(bm, a)  # 10 tokens: the next query (position 10) reads 5..10, blocks 1 and 2
    assert a.block_table == [0, 1, 2] and a.window_table == [NO_BLOCK, 1, 2]
    assert list(bm.window.free_cached) == [0]  # dropped, still cached (full: tokens 0-3)
    for n in range(11, 81):  # tokens after each step, all computed
        generate(bm, a, [n])
        first = max(0, n + 1 - 6) // 4  # the first block the next query (position n) reads
        assert a.window_dropped == first and len(a.window_table) == -(-n // 4)
        assert all(b != NO_BLOCK for b in a.window_table[first:])
        assert len(held(a)) <= 3 == -(-(6 - 1) // 4) + 1  # the window and the block it fills
        assert bm.window.num_used_blocks == len(held(a))
    assert len(a.block_table) == 20 and bm.num_used_blocks == 20  # the main pool holds all
    bm.free(a)
    assert bm.window.num_used_blocks == bm.num_used_blocks == 0
    assert a.window_table == [] and a.window_dropped == 0


def test_a_prompt_chunk_holds_its_own_blocks_until_its_step_is_done():
    bm = manager(window_blocks=12)
    a = seq(range(40))
    hit = bm.match_prefix(a)
    assert bm.can_allocate(a, 32, hit)
    bm.allocate(a, 32, hit)
    assert len(held(a)) == 8  # every position of the chunk is written and read this step
    a.num_computed_tokens = 32
    bm.cache_full_blocks(a)
    assert held(a) == a.window_table[6:] and len(held(a)) == 2  # 27.. read next
    assert not bm.can_append(a, 48 - 32 + 4 * 8)  # 11 more blocks: 10 are free
    assert bm.window.most_held(200, 32) == 11 and bm.fits(200, 32)
    assert not bm.fits(200, 48) and not bm.fits(4 * 65, 32)  # the main pool: 64 blocks


def test_a_prefix_hit_is_cut_to_what_the_window_pool_still_holds():
    bm = manager(window_blocks=16)
    a = seq(range(40))
    admit(bm, a)  # blocks 0-9 registered; the window pool keeps 8 and 9, drops 0-7
    bm.free(a)
    d = seq(list(range(20)) + [500])
    admit(bm, d)  # a hit of 20 tokens: reads blocks 3 and 4 of the window pool
    assert d.num_cached_tokens == 20 and d.window_table == [NO_BLOCK] * 4 + [4, 10]
    bm.free(d)
    # least recently freed first: 0-2, 5-7 (dropped by a), 9, 8 (a's end), then 3, 4 (d's)
    assert list(bm.window.free_cached) == [0, 1, 2, 5, 6, 7, 9, 8, 3, 4]
    assert bm.window.release_idle(2) == [0, 1, 2, 5, 6, 7, 8, 9, 10]  # 10: cached nothing
    b = seq(list(range(40)) + [600])  # the main pool holds all 10 blocks; the window pool
    hit = bm.match_prefix(b)  # serves only a hit ending at 20 (the last window: 3, 4)
    assert (hit.tokens, hit.blocks, hit.window_blocks) == (20, [0, 1, 2, 3, 4], [3, 4])
    bm.allocate(b, b.num_tokens - 20, hit)
    assert b.window_table[:5] == [NO_BLOCK] * 3 + [3, 4] and b.num_cached_tokens == 20
    assert bm.blocks[5].ref_count == 0  # the main pool's later blocks were not taken
    bm.free(b)
    bm.window.release_idle(0)
    assert bm.match_prefix(seq(range(41))).tokens == 0  # nothing left to serve the window


def test_a_partial_hit_copies_in_both_pools_or_in_neither():
    copies = []
    bm = manager(copies=copies)
    a = seq(range(12))
    admit(bm, a)
    bm.free(a)
    b = seq(list(range(9)) + [77, 78])  # shares 9 tokens: 2 blocks and the first of block 2
    hit = bm.match_prefix(b)
    assert (hit.tokens, hit.partial, hit.window_partial) == (9, 2, 2)
    bm.allocate(b, 2, hit)
    assert copies == [("window", 2, b.window_table[2], 1), ("main", 2, b.block_table[2], 1)]
    assert b.num_computed_tokens == 9
    bm.free(b)
    # The window pool lost its counterpart of block 2: the partial hit goes, whole blocks stay
    bm.window._evict(bm.window.blocks[2])
    copies.clear()
    c = seq(list(range(9)) + [79, 80])
    hit = bm.match_prefix(c)
    assert (hit.tokens, hit.partial, len(hit.blocks)) == (8, None, 2)


def test_preemption_and_reset_give_every_window_block_back():
    bm = manager()
    a, b = seq(range(30)), seq(range(100, 123))
    for s in (a, b):
        admit(bm, s)
    bm.free(a)
    assert bm.window.num_used_blocks == len(held(b))
    bm.free(b)
    bm.reset_prefix_cache()
    assert bm.window.num_used_blocks == 0 and not bm.window.cached and not bm.window.free_cached


def gemma3_1b(**change) -> ModelConfig:
    """Gemma 3 1B's attention layout: 26 layers, every sixth global, a 512-token window."""
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)]
    return ModelConfig.from_hf({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "max_position_embeddings": 32768, "sliding_window": 512, "layer_types": types,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-6} | change)


def test_pools_are_sized_by_need_and_budget():
    config = gemma3_1b()
    engine = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, prefix_cache_bytes=0)
    sizes = PoolSizes.plan(config, engine, 32768, torch.bfloat16, 64 << 30)
    per_block = 2 * 16 * 256 * 2  # keys and values of one layer, one block
    assert (sizes.block_bytes, sizes.window_block_bytes) == (4 * per_block, 22 * per_block)
    assert sizes.window == 512 and sizes.num_blocks == 8 * 2048  # all of every context
    assert sizes.window_blocks == 8 * (32 + 2) + 32 + 1  # each window, and a chunk
    # A small budget: the window pool first (at most half), the main pool the rest
    small = PoolSizes.plan(config, engine, 32768, torch.bfloat16, 64 << 20)
    assert small.window_blocks == (32 << 20) // (22 * per_block) == 93
    assert small.num_blocks == ((64 << 20) - 93 * 22 * per_block) // (4 * per_block)
    # Every layer windowed (Mistral 7B v0.1): the main pool holds nothing but the index
    mistral = ModelConfig.from_hf({
        "architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "max_position_embeddings": 32768, "sliding_window": 4096})
    sizes = PoolSizes.plan(mistral, engine, 32768, torch.bfloat16, 4 << 30)
    assert sizes.block_bytes == 0 and sizes.num_blocks == 8 * 2048 and sizes.window_blocks > 0
    # A window as long as the context: one pool, as a model without windows
    whole = PoolSizes.plan(config, engine, 512, torch.bfloat16, 4 << 30)
    assert whole.window_blocks == 0 and whole.block_bytes == 26 * per_block


@pytest.mark.parametrize("num_tokens", [1, 6, 7, 100])
def test_first_read_is_the_block_of_the_window_start(num_tokens):
    w = WindowBlocks(4, 4, 6)
    start = max(0, num_tokens + 1 - 6)  # a query at num_tokens reads start..num_tokens
    assert w.first_read(num_tokens) == start // 4
