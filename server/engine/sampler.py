"""Batched sampling: penalties, logit bias, greedy, temperature / top-k / top-p / min-p, seeds.

Rows with a seed draw their noise from their own generator, so a seeded request gives the same
text whatever else shares the batch. Sampling is the exponential race: argmax(p / E) with
E ~ Exp(1) picks index i with probability p_i, and needs one noise vector per row.
Rows of sequences with a grammar are masked to the tokens it allows (after bias and penalties,
so nothing lifts a disallowed token back); reported logprobs stay the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.grammar import GrammarMasks
from server.engine.sequence import Sequence


@dataclass(slots=True)
class SampleResult:
    token_ids: torch.Tensor  # [N] sampled ids
    logprobs: torch.Tensor | None  # [N] logprob of each sampled id, when any row asked
    top_ids: torch.Tensor | None  # [N, K] ids of the K most likely tokens
    top_logprobs: torch.Tensor | None  # [N, K] their logprobs


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> seeded generator
        self.grammar_masks = GrammarMasks(vocab_size)

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        """logits: [N, vocab] fp32, one row per sampling sequence (modified in place)."""
        raw_logprobs = None
        max_top = max(s.params.top_logprobs if s.params.logprobs else 0 for s in seqs)
        if any(s.params.logprobs for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # OpenAI reports the model's own
        self._apply_bias_and_penalties(logits, seqs)
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if constrained:
            allowed = self.grammar_masks.masks([seqs[i].grammar for i in constrained])
            rows = torch.tensor(constrained, device=logits.device)
            logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))

        temps = [s.params.temperature for s in seqs]
        token_ids = logits.argmax(dim=-1)  # [N]
        random_rows = [i for i, t in enumerate(temps) if t > 0]
        if random_rows:
            rows = torch.tensor(random_rows)
            sub = logits[rows] / torch.tensor([temps[i] for i in random_rows])[:, None]
            sub = self._truncate(sub, [seqs[i] for i in random_rows])
            probs = torch.softmax(sub, dim=-1)
            noise = torch.stack([self._exponential(seqs[i], probs.shape[1], probs.device)
                                 for i in random_rows])
            token_ids[rows] = (probs / noise).argmax(dim=-1)

        if raw_logprobs is None:
            return SampleResult(token_ids, None, None, None)
        chosen = raw_logprobs.gather(1, token_ids[:, None])[:, 0]
        top_lp, top_ids = (raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None))
        return SampleResult(token_ids, chosen, top_ids, top_lp)

    def advance(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """The step's tokens are known: grammars consume them, and the next step's masks are
        computed while its forward runs."""
        states = []
        self.grammar_masks.wait()
        for seq, token in zip(seqs, token_ids, strict=True):
            if seq.grammar is not None:
                seq.grammar.accept(token)
                if not seq.grammar.is_finished:
                    states.append(seq.grammar)
        self.grammar_masks.prefetch(states)

    def _exponential(self, seq: Sequence, vocab: int, device) -> torch.Tensor:
        seed = seq.params.seed
        if seed is None:
            return torch.empty(vocab, device=device).exponential_()
        gen = self.generators.get(seq.seq_id)
        if gen is None:
            gen = self.generators[seq.seq_id] = torch.Generator(device=device)
            gen.manual_seed(seed)
        return torch.empty(vocab, device=device).exponential_(generator=gen)

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
    def _truncate(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Mask tokens outside top-k, top-p and min-p (per row; no-ops skipped)."""
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        min_p = [s.params.min_p for s in seqs]
        vocab = logits.shape[1]
        if any(0 < k < vocab for k in top_k):
            k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
            kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the mass before it already reaches top_p (keeps at least one).
            before = probs.cumsum(dim=-1) - probs
            drop = before >= torch.tensor(top_p)[:, None]
            logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
        if any(p > 0.0 for p in min_p):
            probs = logits.softmax(dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p)[:, None]
            logits = logits.masked_fill(probs < floor, float("-inf"))
        return logits


def chosen_first(ids: list[int], logprobs: list[float], chosen: int) -> list[tuple[int, float]]:
    """Top (id, logprob) pairs, most likely first; topk orders equal logprobs arbitrarily, so
    among equals the chosen token comes first (a greedy token is then always the first entry)."""
    return sorted(zip(ids, logprobs, strict=True), key=lambda e: (-e[1], e[0] != chosen))
