"""Output processing: a step's new tokens turned into what callers receive, in the engine's
thread right after the step. Each choice's tokens are detokenized incrementally; a stop string
ends the sequence (the tokens sampled after it are cut from it, and it finishes as stopped);
a finished choice flushes its held-back text; logprobs are paired with their tokens, and a
choice's first chunk carries its prompt's logprobs where asked. An embedding request's one
chunk carries its vector."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class CompletionChunk:
    """What generate() yields: new text and tokens of one of the request's n choices."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | None = None  # the stop string that ended it, if any
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    # The first chunk of a choice whose request asked for prompt logprobs: one entry for each
    # prompt token after the first (the first has none), as `logprobs`
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's vector (its one chunk)
    num_accepted_prediction: int = 0  # predicted outputs: drafts kept so far
    num_rejected_prediction: int = 0  # and drafts computed and dropped


@dataclass(slots=True)
class RequestOutput:
    """One request's output state: its n sequences and their detokenizers."""

    request_id: str
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]


class OutputProcessor:
    """The requests in flight (by id) and the chunks each step gives them."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}  # request id -> its RequestOutput
        self.engine: Any = None  # the Engine, to finish a sequence a stop string ended

    def process(self, step: Any) -> list[tuple[Any, CompletionChunk]]:
        """(request, chunk) for each sequence that gained tokens this step (one, or several
        with a prediction: speculation.py) and each embedding request that finished."""
        out = []
        scheduled = step.scheduled
        for seq, num_kept in zip(scheduled.seqs, scheduled.num_kept, strict=True):
            req = self.requests.get(seq.request_id) if num_kept else None
            if req is not None:
                out.append((req, self._chunk(req, seq, num_kept)))
        for seq in step.finished:  # embedding requests: their vector, once
            req = self.requests.pop(seq.request_id, None) if seq.pooling else None
            if req is not None:
                out.append((req, CompletionChunk(
                    0, "", [], seq.finish_reason, embedding=seq.embedding,
                    num_prompt_tokens=seq.num_prompt_tokens)))
        return out

    def forget_finished(self, step: Any) -> None:
        """Drop requests whose every choice has finished. Only after the whole step: several
        of a request's n choices can finish in the same one."""
        scheduled = step.scheduled
        for seq, num_kept in zip(scheduled.seqs, scheduled.num_kept, strict=True):
            req = self.requests.get(seq.request_id) if num_kept else None
            if req is not None and all(s.status.is_finished for s in req.seqs):
                del self.requests[seq.request_id]

    def _chunk(self, req: RequestOutput, seq: Sequence, num_kept: int) -> CompletionChunk:
        index = req.seqs.index(seq)
        detok = req.detokenizers[index]
        # the choice's first chunk carries its prompt's logprobs, where asked
        with_prompt = (seq.params.prompt_logprobs is not None
                       and seq.num_output_tokens == num_kept)
        tokens = seq.token_ids[-num_kept:]
        text = ""
        for i, token in enumerate(tokens):
            text += detok.add(token)
            if detok.stopped_by is not None:  # a stop string: the tokens after it go
                if i + 1 < num_kept:
                    del seq.token_ids[i + 1 - num_kept:], seq.logprobs[i + 1 - num_kept:]
                    tokens = tokens[:i + 1]
                break
        if detok.stopped_by is not None and not seq.status.is_finished:
            self.engine.abort(seq, SequenceStatus.FINISHED_STOPPED)
        if seq.status.is_finished:
            text += detok.flush() if detok.stopped_by is None else ""
        logprobs = None
        if seq.params.logprobs:  # one entry per sampled token, this step's are the last
            logprobs = [(token, lp, tops) for token, (lp, tops) in zip(
                tokens, seq.logprobs[-len(tokens):], strict=True)]
        prompt_logprobs = None
        if with_prompt:
            prompt_logprobs = [(token, lp, tops) for token, (lp, tops) in zip(
                seq.token_ids[1:seq.num_prompt_tokens], seq.prompt_logprobs, strict=True)]
        return CompletionChunk(
            index, text, tokens, seq.finish_reason, detok.stopped_by, logprobs,
            prompt_logprobs, seq.num_prompt_tokens, seq.num_cached_tokens,
            seq.num_output_tokens,
            num_accepted_prediction=seq.num_accepted_prediction,
            num_rejected_prediction=seq.num_rejected_prediction)
