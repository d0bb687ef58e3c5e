"""Embedding requests in the engine: prefill only, pooled final hidden states, through the same
scheduler as generation (tiny random Qwen3, fp32, against transformers' hidden states)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch.nn import functional as F

from server.engine.async_engine import AsyncEngine
from server.engine.block_manager import BlockManager
from server.engine.engine import Engine, EngineConfig
from server.engine.scheduler import Scheduler
from server.engine.sequence import Pooling, SamplingParams, Sequence, SequenceStatus
from server.models.loader import build_model
from tests.helpers import hf_model, make_tokenizer, our_config

CPU = torch.device("cpu")
PROMPT = [5 + (7 * i) % 250 for i in range(45)]


@pytest.fixture(scope="module")
def hf():
    return hf_model("qwen3", seed=21)


@pytest.fixture(scope="module")
def model(hf):
    return build_model(our_config(hf), dict(hf.state_dict()), {}, CPU, torch.float32)


def reference(hf, ids: list[int], mode: str) -> torch.Tensor:
    """transformers' last hidden state (after the final norm), pooled and normalized."""
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]  # [T, hidden]
    return F.normalize(hidden.mean(0) if mode == "mean" else hidden[-1], dim=0)


def make_engine(model, **config) -> AsyncEngine:
    # an fp32 pool, as the reference computes (on CPUs without native bf16 the default is bf16)
    config = {"num_blocks": 64, "kv_cache_dtype": torch.float32} | config
    return AsyncEngine(Engine(model, EngineConfig(**config), CPU, torch.float32),
                       make_tokenizer(), eos_token_ids=(2,))


@pytest.mark.parametrize("mode", ["mean", "last"])
@pytest.mark.asyncio
async def test_pooled_vector_matches_transformers(model, hf, mode):
    engine = make_engine(model)
    try:
        vector = await engine.embed(PROMPT, Pooling(mode))
    finally:
        engine.shutdown()
    assert len(vector) == hf.config.hidden_size
    torch.testing.assert_close(torch.tensor(vector), reference(hf, PROMPT, mode),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.asyncio
async def test_a_prompt_in_chunks_pools_to_the_same_vector(model, hf):
    # 45 tokens with 16 per step: three chunks, the sums carried between steps.
    engine = make_engine(model, max_num_batched_tokens=16)
    try:
        vector = await engine.embed(PROMPT, Pooling("mean"))
        steps = engine.stats()["num_steps"]
    finally:
        engine.shutdown()
    assert steps >= 3
    torch.testing.assert_close(torch.tensor(vector), reference(hf, PROMPT, "mean"),
                               atol=2e-5, rtol=1e-4)


@pytest.mark.asyncio
async def test_embeddings_batch_with_generation_and_change_nothing(model):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = make_engine(model)
    try:
        alone = [c.token_ids[0] async for c in engine.generate(PROMPT[:20], greedy)]
        vector_alone = await engine.embed(PROMPT, Pooling("mean"))

        async def generate():
            return [c.token_ids[0] async for c in engine.generate(PROMPT[:20], greedy)]

        tokens, *vectors = await asyncio.gather(
            generate(), *(engine.embed(PROMPT[:k], Pooling("mean")) for k in (45, 30, 12)))
    finally:
        engine.shutdown()
    assert tokens == alone
    torch.testing.assert_close(torch.tensor(vectors[0]), torch.tensor(vector_alone),
                               atol=1e-5, rtol=1e-5)


def test_an_aborted_embedding_frees_its_blocks_and_sum(model):
    engine = Engine(model, EngineConfig(num_blocks=64, max_num_batched_tokens=16), CPU,
                    torch.float32)
    seq = Sequence(PROMPT, SamplingParams(max_tokens=0), pooling=Pooling("mean"))
    engine.add(seq)
    engine.step()  # 16 of 45 tokens: a partial sum is held
    assert seq.seq_id in engine.runner.pooled_sums
    engine.abort(seq)
    assert engine.block_manager.num_used_blocks == 0 and not engine.runner.pooled_sums
    assert seq.embedding is None and not engine.has_unfinished


def test_scheduler_pools_without_prefix_hits_or_sampling():
    # Block size 4, prompt of 10 tokens, budget 8: steps of 8 then 2 tokens. The same tokens
    # were cached by a chat sequence first, yet the embedding computes all 10 itself.
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_batched_tokens=8)
    tokens = list(range(10, 20))
    chat = Sequence(tokens, SamplingParams(max_tokens=1))
    sched.add(chat)
    while chat.status != SequenceStatus.FINISHED_LENGTH:
        out = sched.schedule()
        sched.update(out, [7] * sum(out.is_sampling))
    emb = Sequence(tokens, SamplingParams(max_tokens=0), pooling=Pooling("mean"))
    sched.add(emb)
    out = sched.schedule()
    assert (out.num_new_tokens, out.is_sampling, out.is_pooling) == ([8], [False], [False])
    assert emb.num_cached_tokens == 0
    assert sched.update(out, []) == []
    out = sched.schedule()
    assert (out.num_new_tokens, out.is_sampling, out.is_pooling) == ([2], [False], [True])
    assert sched.update(out, []) == [emb]
    assert emb.status == SequenceStatus.FINISHED_STOPPED and emb.num_output_tokens == 0
    assert not sched.has_unfinished and bm.num_used_blocks == 0
