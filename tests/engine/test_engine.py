"""The engine's tokens against transformers' and against itself under every scheduling path."""

from __future__ import annotations

import pytest
import torch

from server.engine.engine import Engine, EngineConfig
from server.engine.scheduler import RequestTooLargeError
from server.engine.sequence import PRIORITY_BATCH, SamplingParams, Sequence, SequenceStatus
from server.models.loader import build_model
from tests.helpers import hf_model, our_config

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def models(request):
    hf = hf_model(request.param, seed=7)
    ours = build_model(our_config(hf), dict(hf.state_dict()), {}, CPU, torch.float32)
    return hf, ours


@pytest.fixture(scope="module")
def llama():
    hf = hf_model("llama", seed=8)
    return build_model(our_config(hf), dict(hf.state_dict()), {}, CPU, torch.float32)


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 260, (n,), generator=g).tolist()


def greedy(max_tokens=10, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run(model, seqs, **config):
    engine = Engine(model, EngineConfig(**({"num_blocks": 128} | config)), CPU, torch.float32)
    for s in seqs:
        engine.add(s)
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        assert steps < 2000
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    return engine


def solo(model, p, max_tokens=10):
    s = Sequence(p, greedy(max_tokens))
    run(model, [s])
    return s.output_token_ids


def test_greedy_equals_transformers(models):
    hf, ours = models
    prompts = [prompt(n, i) for i, n in enumerate((5, 33, 17))]
    seqs = [Sequence(p, greedy(12)) for p in prompts]
    run(ours, seqs)
    for s, p in zip(seqs, prompts, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert s.output_token_ids == ref


def test_chunked_prefill_gives_the_same_tokens(llama):
    p = prompt(70, 1)
    whole = Sequence(p, greedy())
    run(llama, [whole], max_num_batched_tokens=512)
    chunked = Sequence(p, greedy())
    engine = run(llama, [chunked], max_num_batched_tokens=16)
    assert chunked.output_token_ids == whole.output_token_ids
    assert engine.metrics.num_steps >= 70 // 16 + 10


@pytest.mark.parametrize("kind, second", [
    ("full blocks", lambda p: p[:32] + prompt(9, 99)),  # shares two full blocks of 16
    ("partial block", lambda p: p[:40] + prompt(5, 98)),  # shares 2 blocks + half of a third
    ("whole prompt", lambda p: list(p)),  # everything but the last token hits
])
def test_prefix_hit_gives_the_same_tokens(llama, kind, second):
    p = prompt(48, 2)
    q = second(p)
    cold = solo(llama, q)
    engine = Engine(llama, EngineConfig(num_blocks=64), CPU, torch.float32)
    first = Sequence(p, greedy())
    engine.add(first)
    while engine.has_unfinished:
        engine.step()
    hit = Sequence(q, greedy())
    engine.add(hit)
    while engine.has_unfinished:
        engine.step()
    expected_hit = {"full blocks": 32, "partial block": 32, "whole prompt": 32}[kind]
    assert hit.num_cached_tokens == expected_hit
    assert hit.output_token_ids == cold


def test_preempted_and_resumed_equals_solo(llama):
    prompts = [prompt(20, 10 + i) for i in range(4)]
    alone = [solo(llama, p, 24) for p in prompts]
    seqs = [Sequence(p, greedy(24), priority=PRIORITY_BATCH if i % 2 else 0)
            for i, p in enumerate(prompts)]
    # 10 blocks of 16 for 4 sequences growing to 44 tokens (3 blocks each): preemption needed.
    engine = run(llama, seqs, num_blocks=10)
    assert engine.scheduler.num_preemptions > 0
    assert any(s.num_preemptions for s in seqs)
    assert [s.output_token_ids for s in seqs] == alone


def test_batched_with_fifteen_others_equals_alone(llama):
    target = prompt(25, 50)
    alone = solo(llama, target, 16)
    others = [Sequence(prompt(5 + 3 * i, 60 + i), greedy(4 + i)) for i in range(15)]
    mine = Sequence(target, greedy(16))
    run(llama, others[:7] + [mine] + others[7:], max_num_batched_tokens=64)
    assert mine.output_token_ids == alone


def test_too_big_is_refused_and_the_rest_complete(llama):
    engine = Engine(llama, EngineConfig(num_blocks=4, block_size=16), CPU, torch.float32)
    small = [Sequence(prompt(10, i), greedy(8)) for i in range(3)]
    engine.add(small[0])
    with pytest.raises(RequestTooLargeError):
        engine.add(Sequence(prompt(60, 5), greedy(10)))  # 70 tokens > 64 in the whole pool
    for s in small[1:]:
        engine.add(s)
    while engine.has_unfinished:
        engine.step()
    assert all(s.status == SequenceStatus.FINISHED_LENGTH for s in small)


def test_seed_reproducible_and_independent_of_batch(llama):
    p = prompt(12, 3)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    a, b = Sequence(p, params), Sequence(p, params)
    run(llama, [a])
    run(llama, [Sequence(prompt(7, 4), SamplingParams(max_tokens=5)), b])
    assert a.output_token_ids == b.output_token_ids
    c = Sequence(p, SamplingParams(max_tokens=12, temperature=1.0, seed=4321))
    run(llama, [c])
    assert c.output_token_ids != a.output_token_ids


def test_logprobs_recorded(llama):
    s = Sequence(prompt(6, 5), greedy(4, logprobs=True, top_logprobs=3))
    run(llama, [s])
    assert len(s.logprobs) == 4
    for token, (lp, tops) in zip(s.output_token_ids, s.logprobs, strict=True):
        assert len(tops) == 3 and tops[0][0] == token  # greedy: the top token was chosen
        assert lp == pytest.approx(tops[0][1]) and lp <= 0


def test_stats_and_pool_sizing(llama):
    engine = Engine(llama, EngineConfig(kv_cache_bytes=1 << 20), CPU, torch.float32)
    # Tiny llama: 2 layers x 16 tokens x 2 kv heads x 32 dims x 4 bytes x (k, v) = 16 KiB/block.
    assert len(engine.block_manager.blocks) == (1 << 20) // (2 * 2 * 16 * 2 * 32 * 4) == 64
    s = Sequence(prompt(40, 1), greedy(3))
    engine.add(s)
    engine.step()
    stats = engine.stats()
    assert stats["num_running"] == 1 and stats["kv_blocks_used"] == 3  # ceil(40 / 16)
    assert stats["prefix_cache_queries"] == 40 and stats["prefix_cache_hits"] == 0
    assert stats["prompt_tokens"] == {0: 40} and stats["generation_tokens"] == {0: 1}
