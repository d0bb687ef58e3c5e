"""Batched sampling: penalties, logit bias, greedy, temperature / top-k / top-p / min-p, seeds.

Rows with a seed draw from a generator seeded with the seed and the token's place in the output,
so a seeded request gives the same text whatever else shares the batch, after a preemption, and
whether its tokens come one a step or several (predicted outputs: speculation.py).
Sampling inverts the row's cumulative distribution (in fp64) at one uniform draw per row: the
exponential race (argmax(p / E), E ~ Exp(1)) needed a noise vector the size of the vocabulary per
row, 31 ms a step at 32 rows of a 49,152-token vocabulary (two CPU
cores) against a forward of ~20 ms; one draw a row takes 8-9 ms there, all told. Top-k and top-p
read the top of each row with `topk` instead of sorting the vocabulary (top-p sorts a row whose
top does not hold its mass): 32 rows with top-p 9-16 ms a step, 73-78 before.
Rows of sequences with a grammar are masked to the tokens it allows (after bias and penalties,
so nothing lifts a disallowed token back); reported logprobs stay the model's own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

import server.kernels.layer_ops as layer_ops
from server.engine.grammar import GrammarMasks
from server.engine.sequence import Sequence

# Tokens top-p reads first (a row they do not cover reads all of its tokens): a nucleus of
# 0.9-0.95 at temperature 0.7-1 is tens to hundreds of tokens.
TOP_P_WIDTH = 512


@dataclass(slots=True)
class SampleResult:
    token_ids: torch.Tensor  # [N] sampled ids
    logprobs: torch.Tensor | None  # [N] logprob of each sampled id, when any row asked
    top_ids: torch.Tensor | None  # [N, K] ids of the K most likely tokens
    top_logprobs: torch.Tensor | None  # [N, K] their logprobs


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self._cdf_buffer: torch.Tensor | None = None
        self.grammar_masks = GrammarMasks(vocab_size)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: [N, vocab] fp32, one row per sampling sequence (modified in place); a
        sequence with drafts has a row for each, in a run (its next tokens in order)."""
        raw_logprobs = None
        max_top = max(s.params.top_logprobs if s.params.logprobs else 0 for s in seqs)
        if any(s.params.logprobs for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # OpenAI reports the model's own
        self._apply_bias_and_penalties(logits, seqs)
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        allowed = None
        if constrained:
            allowed = self.grammar_masks.masks([seqs[i].grammar for i in constrained])
            rows = torch.tensor(constrained, device=logits.device)
            logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))

        temps = [s.params.temperature for s in seqs]
        # max's indices are argmax's (the first maximum; a NaN wins), in 0.80 ms instead of
        # 1.47 at 32 rows x 49,152 [Intel(R) Xeon(R) Processor, AVX-512 BF16 no, AMX no];
        # layer_ops.argmax the same on CPU rows: 188 against 362 us (Zen 5)
        token_ids = layer_ops.argmax(logits) if logits.device.type == "cpu" else None
        if token_ids is None:
            token_ids = logits.max(dim=-1).indices  # [N]
        random_rows = [i for i, t in enumerate(temps) if t > 0]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sub = logits[rows] / torch.tensor([temps[i] for i in random_rows],
                                              device=logits.device)[:, None]
            sub = self._truncate(sub, [seqs[i] for i in random_rows])
            probs = torch.softmax(sub, dim=-1)
            cdf = self._cdf(probs)
            places = _output_places(seqs)
            draws = torch.cat([self._uniform(seqs[i], places[i]) for i in random_rows]
                              ).to(cdf.device)
            picked = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)[:, 0]
            picked.clamp_(max=cdf.shape[1] - 1)
            # A draw that rounds to the very top can land past the last token with any mass:
            # never hand out a token of probability 0 (masked by a grammar, top-k or top-p), but
            # the row's most likely one, its greedy token (no host sync, no second argmax).
            empty = probs.gather(1, picked[:, None])[:, 0] == 0
            greedy = token_ids[rows]
            token_ids[rows] = torch.where(empty, greedy, picked.to(greedy.device))

        _force_closing_tags(token_ids, seqs, constrained, allowed)
        if raw_logprobs is None:
            return SampleResult(token_ids, None, None, None)
        return SampleResult(token_ids, *token_logprobs(raw_logprobs, token_ids, max_top))

    def advance(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """The step's tokens are known: grammars consume them, and the next step's masks are
        computed while its forward runs."""
        states = []
        self.grammar_masks.wait()
        for seq, token in zip(seqs, token_ids, strict=True):
            if seq.thinking is not None:
                seq.thinking.accept(token)
            if seq.grammar is not None:
                seq.grammar.accept(token)
                if not seq.grammar.is_finished:
                    states.append(seq.grammar)
        self.grammar_masks.prefetch(states)

    def _cdf(self, probs: torch.Tensor) -> torch.Tensor:
        """The rows' cumulative sums in fp64, in a buffer kept between steps (a fresh one costs
        as much again in page faults: 2.1 against 1.0 ms at 32 rows x 49,152)."""
        n, vocab = probs.shape
        buf = self._cdf_buffer
        if buf is None or buf.shape[0] < n or buf.shape[1] != vocab or buf.device != probs.device:
            buf = self._cdf_buffer = torch.empty(n, vocab, dtype=torch.float64,
                                                 device=probs.device)
        return torch.cumsum(probs, dim=-1, dtype=torch.float64, out=buf[:n])

    @staticmethod
    def _uniform(seq: Sequence, place: int) -> torch.Tensor:
        """One draw in [0, 1) (fp64, [1]); with a seed, from a generator keyed by the seed and
        the token's place in the output, so a token's draw is its own. Drawn on the CPU whatever
        the device: a seed gives the same draws on a GPU (one copy a step, not a launch a row)."""
        seed = seq.params.seed
        if seed is None:
            return torch.rand(1, dtype=torch.float64)
        key = hashlib.blake2b(f"{seed}:{place}".encode(), digest_size=8).digest()
        gen = torch.Generator()
        gen.manual_seed(int.from_bytes(key, "little"))
        return torch.rand(1, dtype=torch.float64, generator=gen)

    @staticmethod
    def _apply_bias_and_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias.keys()), device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
            if p.presence_penalty or p.frequency_penalty:
                out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.bincount(out, minlength=logits.shape[1])[: logits.shape[1]]
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                              vals * p.repetition_penalty)

    @staticmethod
    def _top_p_drop(probs: torch.Tensor, p: torch.Tensor,
                    width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which tokens top-p drops, judged on each row's `width` most likely (a row's own
        width, never another row's: ties keep their order), and the rows whose `width` tokens
        hold less than their top_p (to judge on every token)."""
        top, order = probs.topk(width, dim=-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        before = top.cumsum(dim=-1) - top
        drop = torch.ones_like(probs, dtype=torch.bool).scatter(1, order, before >= p)
        short = (before[:, -1:] + top[:, -1:] < p)[:, 0].nonzero()[:, 0]
        return drop, short

    @staticmethod
    def _truncate(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Mask tokens outside top-k, top-p and min-p (per row; no-ops skipped)."""
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        vocab = logits.shape[1]
        if any(0 < k < vocab for k in top_k):
            k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
            top = logits.topk(int(k.max()), dim=-1).values
            kth = top.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p < 1.0 for p in top_p):
            p = torch.tensor(top_p, device=logits.device)[:, None]
            probs = logits.softmax(dim=-1)
            drop, short = Sampler._top_p_drop(probs, p, min(vocab, TOP_P_WIDTH))
            if len(short):  # rows whose most likely tokens hold less than top_p: all of them
                drop[short] = Sampler._top_p_drop(probs[short], p[short], vocab)[0]
            logits = logits.masked_fill(drop, float("-inf"))
        if any(p > 0.0 for p in min_p):
            probs = logits.softmax(dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p,
                                                                    device=logits.device)[:, None]
            logits = logits.masked_fill(probs < floor, float("-inf"))
        return logits


def _force_closing_tags(token_ids: torch.Tensor, seqs: list[Sequence], constrained: list[int],
                        allowed: torch.Tensor | None) -> None:
    """Sequences whose thinking budget is spent write their block's closing tag instead
    (thinking.py; such a sequence never drafts: scheduler._draft_all), once their grammar
    allows it: not inside a character whose bytes span tokens, which the tag cannot follow."""
    for i, seq in enumerate(seqs):
        if seq.thinking is not None:
            token = seq.thinking.forced()
            if token is None:
                continue
            if allowed is not None and i in constrained and not allowed[
                    constrained.index(i), token]:
                continue  # the model finishes the character first
            token_ids[i] = token


def _output_places(seqs: list[Sequence]) -> list[int]:
    """Each row's place in its sequence's output: the next token's, plus the row's place in
    the sequence's run of rows (its drafts)."""
    places, prev = [], None
    for seq in seqs:
        places.append(places[-1] + 1 if seq is prev else seq.num_output_tokens)
        prev = seq
    return places


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each row's logprob of its token, and the ids and logprobs of its k most likely (None
    when k is 0): what sampled tokens report, and prompt tokens (model_runner.py)."""
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    return chosen, top_ids, top_lp


def chosen_first(ids: list[int], logprobs: list[float], chosen: int) -> list[tuple[int, float]]:
    """Top (id, logprob) pairs, most likely first; topk orders equal logprobs arbitrarily, so
    among equals the chosen token comes first (a greedy token is then always the first entry)."""
    return sorted(zip(ids, logprobs, strict=True), key=lambda e: (-e[1], e[0] != chosen))
