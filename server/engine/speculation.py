"""Predicted outputs: a request's expected reply (OpenAI's `prediction`, e.g. the file being
edited) proposes the next tokens, and one step checks several at once.

A decoding sequence with a prediction computes its last token and the tokens drafted after it
in one step, every one a generated row (the decode kernels; attention.py), and samples at each.
It drafts 8 at first, then twice as many after a step whose drafts all held and half as many
after one that failed (2 to 16): a prediction the reply keeps to costs a few steps, one it
departs from little compute. Drafts take only the token budget a step leaves over (never a
prompt's or another sequence's) and only free blocks (they never preempt).

Row i's token is kept while every row before it sampled its draft: the kept tokens are exactly
what decoding one token a step would have produced, since a row's numbers do not depend on
what shares its step (batch invariance, on CPUs) and a seeded row's draw depends on the seed
and the token's place in the output only (sampler.py). So a prediction
changes how many steps a reply takes, never the reply.

Drafts come from where the output stands in the prediction: while the output keeps to it, its
next tokens; after a departure (a changed line), what follows the place where the output's last
SYNC_TOKENS tokens occur in it, the one nearest where the output would be had it kept to it.
"""

from __future__ import annotations

from server.engine.sequence import Sequence

MAX_DRAFT_TOKENS = 16  # drafted rows per sequence and step, at most
MIN_DRAFT_TOKENS = 2  # and at least, where any are
SYNC_TOKENS = 3  # output tokens that must match to pick the prediction up again


def propose(seq: Sequence, limit: int) -> list[int]:
    """Up to `limit` tokens the prediction says follow seq's output (none if it says nothing)."""
    prediction = seq.params.prediction
    if limit <= 0 or not prediction:
        return []
    out = seq.output_token_ids
    since = out[seq.prediction_base:]
    at = seq.prediction_at + len(since)  # where the output would be, had it kept to it
    if list(prediction[seq.prediction_at:at]) != since:
        at = _resync(prediction, out, at)
        if at is None:
            return []
    seq.prediction_at, seq.prediction_base = at, len(out)
    return list(prediction[at:at + limit])


def _resync(prediction: tuple[int, ...], out: list[int], expected: int) -> int | None:
    """The prediction index just past the occurrence of the output's last SYNC_TOKENS tokens
    nearest `expected` (None: none, or the output is shorter): an edit that keeps the text's
    length keeps its place even where the text repeats."""
    if len(out) < SYNC_TOKENS:
        return None
    tail = tuple(out[-SYNC_TOKENS:])
    best, i = None, 0
    while True:
        try:
            i = prediction.index(tail[0], i, len(prediction) - SYNC_TOKENS + 1)
        except ValueError:
            return best
        if prediction[i:i + SYNC_TOKENS] == tail and (
                best is None or abs(i + SYNC_TOKENS - expected) < abs(best - expected)):
            best = i + SYNC_TOKENS
        i += 1


def kept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a step keeps: sampled[i] for every row up to and including the first whose
    sample is not its draft (all of them, the last row's included, when every draft holds)."""
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return sampled[:i + 1]
    return sampled[:len(drafts) + 1]


def adapt(seq: Sequence, num_draft: int, num_kept: int) -> None:
    """Count a step's drafts, and draft twice as many next time if they all held, half as
    many if one failed (within MIN_DRAFT_TOKENS..MAX_DRAFT_TOKENS)."""
    seq.num_accepted_prediction += num_kept
    seq.num_rejected_prediction += num_draft - num_kept
    if num_kept == num_draft:
        seq.draft_limit = min(MAX_DRAFT_TOKENS, 2 * seq.draft_limit)
    else:
        seq.draft_limit = max(MIN_DRAFT_TOKENS, seq.draft_limit // 2)
