"""Scheduler with a fake runner (no torch): budgets, chunks, priorities, preemption, accounting."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from server.engine.block_manager import BlockManager
from server.engine.pacing import FixedCap
from server.engine.scheduler import RequestTooLargeError, Scheduler
from server.engine.sequence import (
    PRIORITY_BATCH,
    PRIORITY_INTERACTIVE,
    SamplingParams,
    Sequence,
    SequenceStatus,
)


def make(num_blocks=32, block_size=4, max_num_seqs=8, budget=16, max_model_len=256,
         prefix=True):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(bm, max_num_seqs, budget, max_model_len)


def seq(n_prompt, max_tokens=4, priority=PRIORITY_INTERACTIVE, start=0):
    return Sequence(list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens),
                    priority=priority)


def step(s, token=7):
    out = s.schedule()
    finished = s.update(out, [token] * sum(out.is_sampling))
    return out, finished


def test_chunked_prefill_splits_the_budget_and_decode_goes_first():
    s = make(budget=16)
    long, short = seq(40, start=100), seq(3, start=500)
    s.add(long)
    out, _ = step(s)
    assert out.num_new_tokens == [16] and out.is_sampling == [False]
    s.add(short)
    out, _ = step(s)
    # long (running) gets its next chunk first; short fills nothing (budget spent).
    assert [x is long for x in out.seqs] == [True] and out.num_new_tokens == [16]
    out, _ = step(s)
    # long's last 8 prompt tokens sample; short takes the remaining 8 of the budget (needs 3).
    assert out.num_new_tokens == [8, 3] and out.is_sampling == [True, True]
    out, _ = step(s)
    assert out.num_new_tokens == [1, 1]  # both decoding
    assert long.num_computed_tokens == 41 and long.num_output_tokens == 2


def test_long_prompt_chunks_are_capped_in_steps_that_decode():
    s = make(budget=64)
    s.pacer, s.long_prompt_tokens = FixedCap(6), 20
    a, b = seq(3, max_tokens=20, start=100), seq(3, max_tokens=20, start=200)
    s.add(a)
    s.add(b)
    out, _ = step(s)
    assert out.num_new_tokens == [3, 3]  # no decodes yet: no cap
    long, short = seq(40, start=300), seq(10, start=400)
    s.add(long)
    s.add(short)
    out, _ = step(s)
    # Both decode: the long prompt gets 6 tokens, the short one is not held back.
    assert out.seqs == [a, b, long, short] and out.num_new_tokens == [1, 1, 6, 10]
    out, _ = step(s)
    assert out.seqs == [a, b, long, short] and out.num_new_tokens == [1, 1, 6, 1]
    s.pacer = FixedCap(None)
    out, _ = step(s)  # no cap: the rest of the prompt in one chunk
    assert out.seqs == [a, b, long, short] and out.num_new_tokens == [1, 1, 28, 1]


def test_capped_long_prompt_lets_short_ones_behind_it_in():
    s = make(budget=64)
    s.pacer, s.long_prompt_tokens = FixedCap(4), 20
    a = seq(3, max_tokens=20, start=100)
    s.add(a)
    step(s)
    first, second, short = seq(30, start=200), seq(30, start=300), seq(5, start=400)
    for x in (first, second, short):
        s.add(x)
    out, _ = step(s)
    # The cap is spent on the first long prompt; the second waits, the short one goes.
    assert out.seqs == [a, first, short] and out.num_new_tokens == [1, 4, 5]
    assert s.waiting == [second]


def test_max_tokens_finishes_and_frees():
    s = make()
    a = seq(5, max_tokens=2)
    s.add(a)
    step(s)
    _, finished = step(s)
    assert finished == [a] and a.status == SequenceStatus.FINISHED_LENGTH
    assert a.finish_reason == "length" and a.block_table == []
    assert s.block_manager.num_free_blocks == 32 and not s.has_unfinished


def test_eos_and_stop_token_ids_finish_with_stop():
    s = make()
    a = seq(5)
    a.eos_token_ids = (2,)
    b = Sequence([1, 2, 3], SamplingParams(max_tokens=9, stop_token_ids=(9,)))
    s.add(a)
    s.add(b)
    out = s.schedule()
    finished = s.update(out, [2, 9])
    assert finished == [a, b] and a.finish_reason == b.finish_reason == "stop"


def test_max_num_seqs_caps_the_batch():
    s = make(max_num_seqs=2, budget=100)
    seqs = [seq(3, start=10 * i) for i in range(3)]
    for x in seqs:
        s.add(x)
    out, _ = step(s)
    assert out.seqs == seqs[:2] and s.waiting == [seqs[2]]


def test_too_large_is_refused_at_admission():
    s = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestTooLargeError, match="maximum context length is 64 tokens"):
        s.add(seq(60, max_tokens=10))
    with pytest.raises(RequestTooLargeError, match="whole pool holds 16"):
        s.add(seq(10, max_tokens=10))
    s.add(seq(10, max_tokens=6))  # 16 tokens: fits exactly
    assert len(s.waiting) == 1


def test_preemption_takes_lowest_priority_newest_and_resumes():
    # 6 blocks of 4. Three sequences of 7 prompt tokens need 2 blocks each; growing past 8
    # tokens needs a third, so someone must give way.
    s = make(num_blocks=6, block_size=4, budget=64, max_model_len=64)
    a = seq(7, max_tokens=8, start=0)
    b = seq(7, max_tokens=8, priority=PRIORITY_BATCH, start=100)
    c = seq(7, max_tokens=8, start=200)
    for x in (a, b, c):
        s.add(x)
    out, _ = step(s)  # all prefill; each samples token 8 -> 8 tokens, 2 blocks each
    assert [x.num_tokens for x in (a, b, c)] == [8, 8, 8] and s.block_manager.num_free_blocks == 0
    assert s.running == [a, c, b]  # interactive first, batch last
    out, _ = step(s)  # computes token 8 (index 7, still in block 2): no new block
    assert out.preempted == [] and [x.num_tokens for x in (a, b, c)] == [9, 9, 9]
    out, _ = step(s)
    # Token index 8 needs a third block each. a goes first and preempts b (batch, lowest);
    # b's two blocks then serve a and c.
    assert out.preempted == [b] and out.seqs == [a, c]
    assert b.status == SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert s.waiting == [b] and s.num_preemptions == 1
    for _ in range(40):
        step(s)
    assert all(x.status == SequenceStatus.FINISHED_LENGTH for x in (a, b, c))
    assert all(x.num_output_tokens == 8 for x in (a, b, c))
    assert s.block_manager.num_free_blocks == 6


def test_interactive_arrival_preempts_batch_when_full():
    s = make(num_blocks=8, block_size=4, max_num_seqs=2, budget=64)
    batch = [seq(3, max_tokens=20, priority=PRIORITY_BATCH, start=10 * i) for i in range(2)]
    for x in batch:
        s.add(x)
    step(s)
    chat = seq(3, max_tokens=2, start=500)
    s.add(chat)
    out, _ = step(s)
    assert chat in out.seqs and out.preempted == [batch[1]]
    assert batch[1] not in out.seqs  # taken out of this step before it ran


def test_interactive_arrival_gets_a_step_without_batch_work():
    s = make(num_blocks=32, block_size=4, max_num_seqs=8, budget=64)
    batch = [seq(3, max_tokens=20, priority=PRIORITY_BATCH, start=10 * i) for i in range(3)]
    for x in batch:
        s.add(x)
    step(s)
    step(s)
    assert all(x.num_output_tokens == 2 for x in batch)
    chat = seq(5, max_tokens=3, start=500)
    s.add(chat)
    out, _ = step(s)
    # Only the arrival's prefill: the batch sequences keep their blocks and wait one step.
    assert out.seqs == [chat] and out.preempted == [] and chat.num_output_tokens == 1
    assert all(x.status == SequenceStatus.RUNNING and x.num_output_tokens == 2 for x in batch)
    out, _ = step(s)
    assert out.seqs == [chat, *batch]  # then everyone decodes together again
    assert all(x.num_output_tokens == 3 for x in batch)


def test_batch_shares_steps_with_interactive_streams():
    bm = BlockManager(64, 4, True)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                  max_num_shared_seqs=2)
    batch = [seq(3, max_tokens=30, priority=PRIORITY_BATCH, start=10 * i) for i in range(5)]
    for x in batch:
        s.add(x)
    out, _ = step(s)
    assert out.seqs == batch  # batch work alone: all of it
    chat = seq(3, max_tokens=4, start=500)
    s.add(chat)
    out, _ = step(s)
    assert out.seqs == [chat]  # the arrival's own step
    out, _ = step(s)
    assert out.seqs == [chat, batch[0], batch[1]]  # then the two oldest batch sequences
    while chat.status == SequenceStatus.RUNNING:
        step(s)
    out, _ = step(s)
    assert out.seqs == batch and all(x.status == SequenceStatus.RUNNING for x in batch)


def test_abort_frees_at_once():
    s = make()
    a, b = seq(9), seq(9, start=50)
    s.add(a)
    s.add(b)
    step(s)
    s.abort(a)
    s.abort(b)
    assert a.status == SequenceStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert s.block_manager.num_free_blocks == 32 and not s.has_unfinished


def check_accounting(s: Scheduler):
    bm = s.block_manager
    owners = Counter(b for x in s.running for b in x.block_table)
    for block in bm.blocks:
        assert block.ref_count >= 0
        assert block.ref_count == owners[block.block_id], block
        free = {*bm.free_cached, *bm.free_resident, *bm.free_fresh}
        assert (block.ref_count == 0) == (block.block_id in free)
    for x in s.waiting:
        assert x.block_table == [] and x.num_computed_tokens == 0
    for block_hash, block_id in bm.cached.items():
        assert bm.blocks[block_id].block_hash == block_hash


@pytest.mark.parametrize(("seed", "prefill_cap"), [(0, None), (1, None), (2, 5), (3, 5)])
def test_randomized_schedule_keeps_block_accounting(seed, prefill_cap):
    rng = random.Random(seed)
    s = make(num_blocks=24, block_size=4, max_num_seqs=6, budget=20, max_model_len=96)
    s.pacer, s.long_prompt_tokens = FixedCap(prefill_cap), 12
    live = []
    shared = list(range(1000, 1012))  # common prefix for cache hits
    for _ in range(300):
        r = rng.random()
        if r < 0.3:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(50) for _ in
                                                                range(rng.randrange(1, 30))]
            x = Sequence(prompt, SamplingParams(max_tokens=rng.randrange(1, 30)),
                         priority=rng.choice([PRIORITY_INTERACTIVE, PRIORITY_BATCH]))
            s.add(x)
            live.append(x)
        elif r < 0.35 and live:
            s.abort(rng.choice(live))
        out = s.schedule()
        s.update(out, [rng.randrange(50) for _ in range(sum(out.is_sampling))])
        check_accounting(s)
    while s.has_unfinished:
        out = s.schedule()
        s.update(out, [rng.randrange(50) for _ in range(sum(out.is_sampling))])
        check_accounting(s)
    assert s.block_manager.num_free_blocks == 24
    assert s.num_preemptions > 0  # the schedule really exercised preemption
    assert s.block_manager.num_cache_hits > 0
    for x in live:
        assert x.status.is_finished
        if x.status == SequenceStatus.FINISHED_LENGTH:
            assert x.num_output_tokens == x.params.max_tokens
