"""KV memory: an idle engine hands back what its cache does not keep, and answers the same."""

from __future__ import annotations

import torch

from server.engine.engine import Engine, EngineConfig
from server.engine.sequence import SamplingParams, Sequence
from tests.engine.test_engine import CPU, prompt


def generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    seqs = [Sequence(p, SamplingParams(max_tokens=8, temperature=0.0)) for p in prompts]
    for s in seqs:
        engine.add(s)
    while engine.has_unfinished:
        engine.step()
    return [s.output_token_ids for s in seqs]


def test_idle_release_hands_back_pages_and_answers_stay_the_same(llama):
    # 256 blocks of 16 slots; head_dim 32 in fp32: 2 KB per block and head, so a 4 KB page
    # holds two blocks of one head and a run of released blocks frees whole pages.
    engine = Engine(llama, EngineConfig(num_blocks=256, idle_cache_bytes=0), CPU,
                    torch.float32)
    prompts = [prompt(100, 70 + i) for i in range(6)]
    before = generate(engine, prompts)
    stats = engine.stats()
    assert stats["kv_blocks_resident"] == 6 * 7  # 108 tokens each: 7 blocks, none shared
    released = engine.release_idle()
    # Everything went back but the partial pages at the run's ends, in every layer's K and V.
    resident_bytes = stats["kv_blocks_resident"] * stats["kv_block_bytes"]
    assert resident_bytes - 2 * 2 * 2 * 2 * 4096 <= released <= resident_bytes
    assert engine.stats()["kv_blocks_resident"] == 0
    assert engine.stats()["kv_blocks_cached_free"] == 0
    assert generate(engine, prompts) == before  # recomputed on handed-back pages
    null = [k[:, -1] for k, _ in engine.runner.kv_caches]
    assert all(not n.any() for n in null)  # the zero slot padded reads point to is intact


def test_idle_release_keeps_the_budgeted_cache_and_its_hits(llama):
    block_bytes = 2 * 2 * 16 * 2 * 32 * 4  # K and V, 2 layers, 16 slots, 2 heads, 32 dims
    engine = Engine(llama, EngineConfig(num_blocks=256, idle_cache_bytes=4 * block_bytes),
                    CPU, torch.float32)
    shared = prompt(64, 5)
    first = generate(engine, [shared + [7]])
    engine.release_idle()
    assert engine.stats()["kv_blocks_cached_free"] == 4  # the prompt's 4 full blocks
    s = Sequence(shared + [7], SamplingParams(max_tokens=8, temperature=0.0))
    engine.add(s)
    while engine.has_unfinished:
        engine.step()
    assert s.num_cached_tokens == 64 and [s.output_token_ids] == first
