"""Predicted outputs (speculation.py): a prediction changes how many steps a reply takes, never
the reply: its tokens, logprobs, seeded draws and where it stops are those of plain decoding."""

from __future__ import annotations

from dataclasses import replace

import torch

from server.engine import speculation
from server.engine.engine import Engine, EngineConfig
from server.engine.sequence import SamplingParams, Sequence
from tests.engine.test_engine import CPU, greedy, prompt, run


def reply(model, p, params, **config):
    """(output tokens, logprobs, steps, drafts kept, drafts dropped) of p alone."""
    s = Sequence(p, params)
    engine = run(model, [s], **config)
    return (s.output_token_ids, s.logprobs, engine.metrics.num_steps, s.num_accepted_prediction,
            s.num_rejected_prediction)


def with_prediction(params: SamplingParams, tokens: list[int]) -> SamplingParams:
    return replace(params, prediction=tuple(tokens))


def test_a_right_prediction_takes_fewer_steps_for_the_same_reply(llama):
    p = prompt(20, 1)
    params = greedy(40, logprobs=True, top_logprobs=2)
    out, lps, steps, _, _ = reply(llama, p, params)
    got, got_lps, fewer, kept, dropped = reply(llama, p, with_prediction(params, out))
    assert (got, got_lps) == (out, lps)  # logprobs too, bit for bit
    assert dropped == 0 and kept >= 30
    assert fewer <= steps // 4  # up to 9 tokens a step


def test_an_edited_prediction_is_picked_up_again_after_the_change(llama):
    """The prediction differs in the middle (a changed line): drafts are dropped there, then
    the output's last tokens are found further on and drafting resumes."""
    p = prompt(20, 2)
    params = greedy(48)
    out, _, steps, _, _ = reply(llama, p, params)
    edited = out[:12] + [250, 251, 252, 253, 254] + out[16:]
    got, _, fewer, kept, dropped = reply(llama, p, with_prediction(params, edited))
    assert got == out
    assert dropped > 0 and kept >= 30 and fewer < steps // 2
    # a prediction with nothing of the reply in it drafts and loses, and changes nothing
    wrong = [7] * 60
    got, _, _, kept, _ = reply(llama, p, with_prediction(params, wrong))
    assert got == out and kept <= 2


def test_seeded_sampling_keeps_its_draws_with_a_prediction(llama):
    """A seeded row's draw belongs to its place in the output: drafted several a step, the
    reply is the one decoded a token a step, right prediction or wrong."""
    p = prompt(16, 3)
    params = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=77)
    out, _, _, _, _ = reply(llama, p, params)
    assert len(set(out)) > 5  # a real sample, not a greedy run
    right, _, _, kept, _ = reply(llama, p, with_prediction(params, out))
    assert right == out and kept >= 30
    half = out[:20] + [5] * 20
    assert reply(llama, p, with_prediction(params, half))[0] == out


def test_drafts_in_busy_steps_and_under_preemption_change_nothing(llama):
    """Drafting beside other sequences' prompts and decodes, in small steps (the budget caps
    the drafts), and in a pool so small that sequences are preempted mid-reply."""
    prompts = [prompt(20, 10 + i) for i in range(4)]
    alone = [reply(llama, p, greedy(30))[0] for p in prompts]
    seqs = [Sequence(p, with_prediction(greedy(30), a if i % 2 else a[:10] + a[14:]))
            for i, (p, a) in enumerate(zip(prompts, alone, strict=True))]
    others = [Sequence(prompt(5 + 3 * i, 60 + i), greedy(4 + i)) for i in range(6)]
    run(llama, seqs[:2] + others + seqs[2:], max_num_batched_tokens=24)
    assert [s.output_token_ids for s in seqs] == alone
    assert all(s.num_accepted_prediction for s in seqs)
    seqs = [Sequence(p, with_prediction(greedy(30), a)) for p, a in zip(prompts, alone,
                                                                           strict=True)]
    engine = run(llama, seqs, num_blocks=9)  # 4 sequences of up to 50 tokens, 16 a block
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == alone  # and run() found every block free


def test_a_reply_stops_where_it_would_inside_a_run_of_drafts(llama):
    p = prompt(20, 4)
    out = reply(llama, p, greedy(40))[0]
    stop = out[9]
    first = out.index(stop)
    got = reply(llama, p, with_prediction(greedy(40, stop_token_ids=(stop,)), out))[0]
    assert got == out[:first + 1]
    short = reply(llama, p, with_prediction(greedy(13), out))[0]  # max_tokens inside a run
    assert short == out[:13]


def test_drafts_take_only_the_budget_a_step_leaves(llama):
    """In small steps, with predictions or without, every prompt gets its first token at the
    same step and every decoding sequence its token each step: drafts take only what is left
    (and the replies are the plain ones)."""
    prompts = [prompt(12, 20 + i) for i in range(4)]
    alone = [reply(llama, p, greedy(30))[0] for p in prompts]

    def steps_to_first_token(predicted: bool) -> tuple[list[int], list[Sequence], int]:
        seqs = [Sequence(p, with_prediction(greedy(30), a) if predicted else greedy(30))
                for p, a in zip(prompts, alone, strict=True)]
        engine = Engine(llama, EngineConfig(num_blocks=128, kv_cache_dtype=torch.float32,
                                            max_num_batched_tokens=10), CPU, torch.float32)
        for s in seqs:
            engine.add(s)
        first, step, drafted = [0] * 4, 0, 0
        while engine.has_unfinished:
            decoding = [s for s in engine.scheduler.running
                        if s.num_computed_tokens + 1 == s.num_tokens]
            out = engine.step().scheduled
            step += 1
            assert all(s in out.seqs for s in decoding)  # every decode got its step
            drafted += sum(out.num_drafts)
            for i, s in enumerate(seqs):
                first[i] = first[i] or (step if s.num_output_tokens else 0)
        return first, seqs, drafted

    plain, _, _ = steps_to_first_token(False)
    first, seqs, drafted = steps_to_first_token(True)
    assert first == plain and drafted > 0
    assert [s.output_token_ids for s in seqs] == alone


def test_propose_follows_the_output_through_the_prediction():
    s = Sequence([1, 2], SamplingParams(prediction=(10, 11, 12, 13, 14, 15, 16, 17, 18)))
    assert speculation.propose(s, 3) == [10, 11, 12]
    s.token_ids += [10, 11]
    assert speculation.propose(s, 3) == [12, 13, 14]
    s.token_ids += [12, 99]  # departs: no three tokens of the output's end are in it
    assert speculation.propose(s, 3) == []
    s.token_ids += [15, 16, 17]  # ...until its last three are found again
    assert speculation.propose(s, 3) == [18]
    assert speculation.propose(s, 0) == []
    assert speculation.kept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert speculation.kept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert speculation.kept([], [3]) == [3]
