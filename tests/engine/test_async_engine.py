"""AsyncEngine: the engine thread behind an asyncio API (tiny model, byte-level tokenizer)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from server.engine.async_engine import AsyncEngine
from server.engine.engine import Engine, EngineConfig
from server.engine.scheduler import RequestTooLargeError
from server.engine.sequence import PRIORITY_BATCH, PRIORITY_INTERACTIVE, SamplingParams, Sequence
from server.engine.turns import StepTurns
from server.models.loader import build_model
from tests.helpers import hf_model, make_tokenizer, our_config

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model():
    hf = hf_model("qwen2", seed=9)
    return build_model(our_config(hf), dict(hf.state_dict()), {}, CPU, torch.float32)


@pytest.fixture
def engine(model):
    e = AsyncEngine(Engine(model, EngineConfig(num_blocks=32), CPU, torch.float32),
                    make_tokenizer(), eos_token_ids=(2,))
    yield e
    e.shutdown()


async def collect(engine, ids, params, **kw):
    chunks = [c async for c in engine.generate(ids, params, **kw)]
    return chunks


def sync_greedy(model, ids, max_tokens):
    e = Engine(model, EngineConfig(num_blocks=32), CPU, torch.float32)
    s = Sequence(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    e.add(s)
    while e.has_unfinished:
        e.step()
    return s.output_token_ids


@pytest.mark.asyncio
async def test_stream_matches_sync_engine_and_text_joins(engine, model):
    ids = list(range(10, 30))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    chunks = await collect(engine, ids, params)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == sync_greedy(model, ids, 12)
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None
                                                        for c in chunks[:-1])
    tok = make_tokenizer()
    # A character cut off by max_tokens is dropped rather than sent as U+FFFD.
    assert "".join(c.text for c in chunks) == tok.decode(tokens, skip_special_tokens=True
                                                         ).rstrip("\ufffd")
    assert chunks[-1].num_prompt_tokens == 20 and chunks[-1].num_output_tokens == 12


@pytest.mark.asyncio
async def test_concurrent_requests_and_n(engine):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=3)
    results = await asyncio.gather(*[collect(engine, list(range(i, i + 40)), params)
                                     for i in range(4)])
    for chunks in results:
        by_index = {}
        for c in chunks:
            by_index.setdefault(c.index, []).extend(c.token_ids)
        assert sorted(by_index) == [0, 1, 2]
        assert all(len(v) <= 6 for v in by_index.values())
    # n children shared the prompt's full blocks: two of three hit 32 of 40 tokens.
    cached = sorted(c.num_cached_tokens for c in results[0] if c.finish_reason)
    assert cached == [0, 32, 32]


@pytest.mark.asyncio
async def test_too_large_raises_before_any_chunk(engine):
    with pytest.raises(RequestTooLargeError):
        await collect(engine, list(range(100)), SamplingParams(max_tokens=1000))


@pytest.mark.asyncio
async def test_abandoned_stream_frees_its_blocks(engine):
    gen = engine.generate(list(range(50)), SamplingParams(max_tokens=400, temperature=0.0,
                                                          ignore_eos=True))
    first = await gen.__anext__()
    assert first.token_ids
    await gen.aclose()  # the client went away
    bm = engine.engine.block_manager
    for _ in range(100):
        if bm.num_free_blocks == len(bm.blocks) and not engine.engine.has_unfinished:
            break
        await asyncio.sleep(0.02)
    assert bm.num_free_blocks == len(bm.blocks)


@pytest.mark.asyncio
async def test_stop_string_ends_the_request(engine):
    ids = list(range(10, 30))
    free = await collect(engine, ids, SamplingParams(max_tokens=12, temperature=0.0,
                                                     ignore_eos=True))
    text = "".join(c.text for c in free)
    stop = text[5:7]
    chunks = await collect(engine, ids, SamplingParams(max_tokens=12, temperature=0.0,
                                                       ignore_eos=True, stop=(stop,)))
    assert "".join(c.text for c in chunks) == text[: text.find(stop)]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop


@pytest.mark.asyncio
async def test_logprobs_stream_one_entry_per_token(engine):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True,
                            top_logprobs=2)
    chunks = await collect(engine, list(range(10, 30)), params)
    for c in chunks:
        [(token, lp, tops)] = c.logprobs
        assert token == c.token_ids[0] and len(tops) == 2
        assert tops[0][0] == token and lp == pytest.approx(tops[0][1])  # greedy took the top


@pytest.mark.asyncio
async def test_a_failing_step_drops_the_idle_reply_recompute_too(model):
    """The idle engine's own work (recache.py) fails with the step like requests do, instead
    of failing again at every step; the engine then serves the next request."""
    e = AsyncEngine(Engine(model, EngineConfig(num_blocks=32, recache_replies_after=0.0), CPU,
                           torch.float32), make_tokenizer(), eos_token_ids=(2,))
    try:
        run = e.engine.runner.run

        def failing(out):
            raise RuntimeError("a kernel failed")

        e.engine.runner.run = failing
        with pytest.raises(RuntimeError):
            await collect(e, list(range(20)), SamplingParams(max_tokens=30, ignore_eos=True))
        def failing_alone(out):  # the reply's recompute fails, the request does not
            return failing(out) if all(s.internal for s in out.seqs) else run(out)

        e.engine.runner.run = failing_alone
        await collect(e, list(range(20)), SamplingParams(max_tokens=30, temperature=0.0,
                                                         ignore_eos=True))
        for _ in range(200):
            if not e.engine.has_unfinished:
                break
            await asyncio.sleep(0.02)
        assert not e.engine.has_unfinished and e.engine.recache.num_done == 0
        e.engine.runner.run = run
        chunks = await collect(e, list(range(9)), SamplingParams(max_tokens=3, temperature=0.0,
                                                                 ignore_eos=True))
        assert chunks[-1].finish_reason == "length"
    finally:
        e.shutdown()


@pytest.mark.asyncio
async def test_priorities_hold_across_the_engines_that_take_turns(model):
    """Engines sharing StepTurns (the models a server holds): one whose most urgent work is
    less urgent than another's takes no step until that is done (batch lines while another
    model streams to a user; a reply recomputed while another runs batch lines), then does."""
    turns = StepTurns()
    e = AsyncEngine(Engine(model, EngineConfig(num_blocks=32, recache_replies_after=0.0), CPU,
                           torch.float32), make_tokenizer(), eos_token_ids=(2,), turns=turns)
    other = object()  # another model's engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    try:
        turns.mark(other, PRIORITY_INTERACTIVE)  # it streams to a user
        line = asyncio.ensure_future(collect(e, list(range(20)), params,
                                             priority=PRIORITY_BATCH))
        await asyncio.sleep(1.0)  # two rounds of its idle wait
        assert not line.done() and e.engine.metrics.num_steps == 0
        turns.mark(other, PRIORITY_BATCH)  # now only batch lines there: they take turns
        assert len(await asyncio.wait_for(line, 60)) == 30
        mine = await collect(e, list(range(20)), params)  # interactive never waits
        assert len(mine) == 30
        await asyncio.sleep(1.0)
        assert e.engine.recache.num_pending == 1 and e.engine.recache.num_done == 0
        turns.mark(other, None)  # the other is idle: the reply is recomputed
        for _ in range(200):
            if e.engine.recache.num_done:
                break
            await asyncio.sleep(0.02)
        assert e.engine.recache.num_done == 1
    finally:
        e.shutdown()
