"""Sampler: exact outcomes on hand-made logits."""

from __future__ import annotations

import torch

from server.engine.sampler import TOP_P_WIDTH, Sampler
from server.engine.sequence import SamplingParams, Sequence


def seqs(*params, tokens=(1, 2, 3)):
    return [Sequence(list(tokens), p) for p in params]


LOGITS = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]])


def sample(params, logits=LOGITS, tokens=(0,)):
    return Sampler(5)(logits.clone(), seqs(params, tokens=tokens)).token_ids.tolist()[0]


def test_greedy_top_k_1_and_tiny_top_p_pick_the_argmax():
    assert sample(SamplingParams(temperature=0.0)) == 1
    for seed in range(5):
        assert sample(SamplingParams(temperature=5.0, top_k=1, seed=seed)) == 1
        assert sample(SamplingParams(temperature=5.0, top_p=0.01, seed=seed)) == 1
        # min_p 0.9: only tokens within 90% of the top probability survive -> token 1 alone.
        assert sample(SamplingParams(temperature=1.0, min_p=0.9, seed=seed)) == 1


def test_logit_bias_forces_a_token():
    assert sample(SamplingParams(temperature=0.0, logit_bias={4: 100.0})) == 4


def test_frequency_presence_and_repetition_penalties():
    # Output so far (after the 1-token prompt): token 1 twice. frequency 1.0 -> 3 - 2 = 1 < 2.
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    s = Sequence([0, 1, 1], params, num_prompt_tokens=1)
    assert Sampler(5)(LOGITS.clone(), [s]).token_ids.tolist() == [2]
    s = Sequence([0, 1], SamplingParams(temperature=0.0, presence_penalty=1.5),
                 num_prompt_tokens=1)
    assert Sampler(5)(LOGITS.clone(), [s]).token_ids.tolist() == [2]  # 3 - 1.5 < 2
    # Repetition 2.0 over every seen token (prompt too): 3 / 2 = 1.5 < 2.
    s = Sequence([1], SamplingParams(temperature=0.0, repetition_penalty=2.0))
    assert Sampler(5)(LOGITS.clone(), [s]).token_ids.tolist() == [2]


def test_seeded_rows_repeat_and_follow_the_distribution():
    params = SamplingParams(temperature=1.0, seed=7)
    a = Sampler(5)
    b = Sampler(5)
    s1, s2 = seqs(params, params)
    draws_a = [a(LOGITS.clone(), [s1]).token_ids.item() for _ in range(20)]
    draws_b = [b(LOGITS.clone(), [s2]).token_ids.item() for _ in range(20)]
    assert draws_a == draws_b
    # Frequencies follow softmax: token 1 has p = e^3 / sum = 0.6364, token 4 0.0117. Each row
    # seeded (its own seed), so the count is the same every run: no test of luck.
    params = [SamplingParams(seed=i) for i in range(4000)]
    many = Sampler(5)(LOGITS.repeat(4000, 1), seqs(*params)).token_ids
    expected = torch.softmax(LOGITS[0], dim=-1)
    for token in range(5):
        assert abs((many == token).float().mean().item() - expected[token].item()) < 0.02


def test_logprobs_are_the_models():
    result = Sampler(5)(LOGITS.clone(), seqs(SamplingParams(temperature=0.0, logprobs=True,
                                                           top_logprobs=2)))
    expected = torch.log_softmax(LOGITS, -1)
    assert result.top_ids.tolist() == [[1, 2]]
    torch.testing.assert_close(result.logprobs, expected[:, 1])


def test_top_logprobs_list_the_chosen_token_first_among_equals():
    from server.engine.sampler import chosen_first

    assert chosen_first([7, 3, 9], [-1.0, -2.0, -2.0], 9) == [(7, -1.0), (9, -2.0), (3, -2.0)]
    assert chosen_first([7, 3], [-2.0, -2.0], 3) == [(3, -2.0), (7, -2.0)]
    assert chosen_first([7, 3], [-1.0, -2.0], 3) == [(7, -1.0), (3, -2.0)]  # not tied: kept


def test_top_p_drops_what_a_full_sort_would():
    """Top-p judges each row on its TOP_P_WIDTH most likely tokens, or on all of them where those
    hold less than its top_p: the same tokens dropped as sorting the whole row (peaky rows and
    flat ones whose nucleus is thousands of tokens, in one batch)."""
    g = torch.Generator().manual_seed(3)
    spread = torch.tensor([[8.0], [4.0], [2.0], [0.5], [0.1], [3.0]])
    logits = torch.randn(6, 3000, generator=g) * spread
    top_p = [0.9, 0.5, 0.95, 0.9, 0.99, 0.2]
    got = Sampler._truncate(logits.clone(), seqs(*[SamplingParams(top_p=p) for p in top_p]))
    probs = logits.softmax(dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered
    drop = torch.zeros_like(probs, dtype=torch.bool).scatter(
        1, order, before >= torch.tensor(top_p)[:, None])
    assert torch.equal(got == float("-inf"), drop)
    kept = (~drop).sum(dim=-1)
    assert kept.max() > TOP_P_WIDTH and kept.min() < 20  # both paths taken


def test_a_seeded_row_draws_the_same_alone_and_batched():
    """A seeded row's draws depend on its own logits and seed only: alone, or beside unseeded
    rows with other settings (one of them flat enough to take top-p's whole-row path); and a
    token outside its top-k is never drawn."""
    g = torch.Generator().manual_seed(4)
    row = torch.randn(1, 3000, generator=g) * 3
    flat = torch.randn(1, 3000, generator=g) * 0.1
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=11)
    alone, batched = Sampler(3000), Sampler(3000)
    mine = seqs(params)[0]
    others = seqs(SamplingParams(temperature=1.3, top_p=0.9), SamplingParams(temperature=0.0))
    draws_alone, draws_batched = [], []
    for _ in range(30):
        draws_alone.append(alone(row.clone(), [mine]).token_ids.item())
        batch = torch.cat([flat, row, row])
        draws_batched.append(batched(batch, [others[0], mine, others[1]]).token_ids[1].item())
        mine.token_ids.append(0)  # the next step draws for the output's next place
    assert draws_alone == draws_batched
    allowed = set(row[0].topk(50).indices.tolist())
    assert set(draws_alone) <= allowed and len(set(draws_alone)) > 1


def test_a_draw_at_the_very_top_never_hands_out_a_masked_token(monkeypatch):
    """A draw that rounds up to the row's whole mass lands past the last token with any mass;
    the sampler then keeps to tokens of nonzero probability (here top-k masks the last ones)."""
    sampler = Sampler(5)
    monkeypatch.setattr(sampler, "_uniform",
                        lambda seq, place: torch.ones(1, dtype=torch.float64))
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]])
    for k in (2, 3, 4):
        got = sampler(logits.clone(), seqs(SamplingParams(temperature=1.0, top_k=k)))
        assert got.token_ids.item() in logits[0].topk(k).indices.tolist()


def test_a_spent_thinking_budget_writes_the_closing_tag_once_the_grammar_allows_it():
    """Budget 1: after the opening tag (token 3) and one token the sampler writes the closing
    tag (token 4) in place of the argmax (1) -- unless the sequence's grammar forbids it there
    (inside a character whose bytes span tokens), then the model's token stands, and the tag
    comes at the next step the grammar allows it."""
    from server.engine.thinking import ThinkingBudget

    params = SamplingParams(temperature=0.0, thinking=ThinkingBudget((3,), (4,), budget=1))
    sampler = Sampler(5)
    s = seqs(params, tokens=(0,))[0]
    s.thinking.accept(3)  # the block opened
    assert sampler(LOGITS.clone(), [s]).token_ids.tolist() == [1]  # within the budget
    s.thinking.accept(1)
    assert sampler(LOGITS.clone(), [s]).token_ids.tolist() == [4]  # spent: the tag

    class Refusing:  # a grammar state whose mask allows only token 2 this step
        is_finished = False
        num_consumed = 0

    s.grammar = Refusing()
    only_2 = torch.zeros(1, 5, dtype=torch.bool)
    only_2[0, 2] = True
    sampler.grammar_masks.masks = lambda states: only_2
    assert sampler(LOGITS.clone(), [s]).token_ids.tolist() == [2]  # not yet: the mask's token
    only_4 = torch.zeros(1, 5, dtype=torch.bool)
    only_4[0, 4] = True
    sampler.grammar_masks.masks = lambda states: only_4 | only_2
    assert sampler(LOGITS.clone(), [s]).token_ids.tolist() == [4]
