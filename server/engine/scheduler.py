"""Continuous batching with chunked prefill, prefix caching and preemption. No torch.

Each step has a token budget (max_num_batched_tokens) and a cap on sequences (max_num_seqs).
Running sequences are served first, most important first: a decoding sequence needs one
token, a sequence still prefilling takes the next chunk of its prompt. Waiting requests then
fill what is left of the budget, in priority order. A request joins at the next step; a
finished one leaves at once and its blocks serve the next step. In a step with decodes, chunks
of long prompts (over `long_prompt_tokens`) are also capped by the pacer the scheduler is given
(pacing.py: sized from measured step times), so a long prompt arriving cannot stall running
streams for one giant step; short prompts are not held back (that would only trade their TTFT
and the server's throughput for a little inter-token latency).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import Protocol

from server.engine import speculation
from server.engine.block_manager import BlockManager, PrefixHit
from server.engine.sequence import Sequence, SequenceStatus


class Pacer(Protocol):
    def cap(self) -> int | None:
        """Tokens of long prompts a step may compute when it also decodes (None: the budget)."""


class RequestTooLargeError(ValueError):
    """The request can never fit: beyond the model's context or the whole KV pool."""


@dataclass(slots=True)
class _StepRoom:
    """What is left of one step while it is scheduled."""

    budget: int  # tokens the step may still compute
    prefill_left: int = 0  # tokens of long prompts it may still compute (the pacer's cap)
    num_shared: int = 0  # lower-priority sequences scheduled beside the top priority's
    top: int = 0  # the highest priority with work (lowest number)
    urgent: int | None = None  # the first waiting request's priority: outranked running wait


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes."""

    seqs: list[Sequence] = field(default_factory=list)  # scheduled sequences, in batch order
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each computes this step
    is_sampling: list[bool] = field(default_factory=list)  # reaches its last known token
    # An embedding request reaching the end of its prompt: pooled, not sampled, then done.
    is_pooling: list[bool] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # lost their blocks this step
    # Predicted outputs (speculation.py): tokens drafted after each one's last token, each a
    # row that samples too; and, once the step is done, how many tokens each one gained.
    num_drafts: list[int] = field(default_factory=list)
    num_kept: list[int] = field(default_factory=list)

    @property
    def num_sampled_rows(self) -> list[int]:
        """Rows each sequence samples at: its last token's and one per draft, or none."""
        return [1 + d if f else 0 for f, d in zip(self.is_sampling, self.num_drafts, strict=True)]

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        max_model_len: int = 2048,
        max_num_shared_seqs: int | None = None,
        long_prompt_tokens: int = 256,
        pacer: Pacer | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        # While sequences of the top priority run or wait, those of lower priority (batch
        # work) compute at most this many per step, so steps stay short for the top ones.
        self.max_num_shared_seqs = max_num_shared_seqs or max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pacer = pacer  # caps long prompts' chunks in steps that decode (None: no cap)
        self.long_prompt_tokens = long_prompt_tokens
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by (priority, order of arrival)
        self.running: list[Sequence] = []  # sorted by (priority, admission): the tail goes first
        self._order = itertools.count()
        self._waiting_keys: list[tuple[int, int]] = []
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # predicted outputs: tokens drafted, and of those kept
        self.num_accepted_draft_tokens = 0

    # -- requests ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a sequence, or refuse it now if it could never run."""
        self.check(seq)
        self._enqueue(seq)

    def check(self, seq: Sequence) -> None:
        """Raise RequestTooLargeError if seq could never run (reads only constants)."""
        self.check_size(seq.num_prompt_tokens, seq.params.max_tokens)

    def check_size(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestTooLargeError if such a sequence could never run."""
        need = num_prompt_tokens + max_tokens
        if need > self.max_model_len:
            raise RequestTooLargeError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {need} tokens ({num_prompt_tokens} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages "
                "or completion."
            )
        bm = self.block_manager
        if not bm.fits(need, self.max_num_batched_tokens):
            raise RequestTooLargeError(
                f"The request needs {need} tokens of KV cache but the whole pool holds "
                f"{len(bm.blocks) * bm.block_size}."
            )

    def abort(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED_ABORTED):
        """Finish seq now (client gone, stop string seen); its blocks are free for the next step."""
        if seq.status.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.waiting:
            i = self.waiting.index(seq)
            del self.waiting[i], self._waiting_keys[i]
        seq.status = status

    @property
    def prefill_tokens_with_decodes(self) -> int | None:
        """The pacer's cap for this step (None: no pacer, or no cap yet)."""
        return self.pacer.cap() if self.pacer is not None else None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ------------------------------------------------------------------------------

    def schedule(self, budget: int | None = None) -> SchedulerOutput:
        """The next step (`budget`: its token budget, default max_num_batched_tokens)."""
        # Every sequence is "computed tokens catch up with known tokens": a new prompt starts
        # at 0 (or at its prefix-cache hit), a chunk of a long prompt advances it by the chunk,
        # a decode computes the one token sampled last step, and a preempted sequence falls back
        # to 0 and catches up again (mostly from the prefix cache). Sampling happens when a
        # sequence's computed tokens reach its known tokens.
        #
        # Priorities: a waiting request that outranks running ones gets a step without them
        # (batch work sits that one step out, keeping its blocks), so an interactive request's
        # first token is never stuck behind a step full of batch decodes. And while the top
        # priority has work, lower-priority sequences compute at most max_num_shared_seqs per
        # step (the oldest), so steps stay short for interactive streams.
        out = SchedulerOutput()
        room = _StepRoom(budget or self.max_num_batched_tokens)
        room.urgent = self.waiting[0].priority if self.waiting else None
        room.top = min((x.priority for x in (*self.running[:1], *self.waiting[:1])), default=0)
        room.prefill_left = room.budget
        cap = self.prefill_tokens_with_decodes
        if cap is not None and any(
                s.num_tokens - s.num_computed_tokens == 1 for s in self.running):
            room.prefill_left = cap
        self._schedule_running(out, room)
        if not out.preempted:  # no admissions while running sequences lack memory
            self._admit_waiting(out, room)
        if room.budget > 0:
            self._draft_all(out, room.budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, room: _StepRoom) -> None:
        """Running sequences in priority order: each its next chunk or its decode token,
        preempting the lowest-priority ones where blocks run short."""
        bm = self.block_manager
        i = 0
        while i < len(self.running) and room.budget > 0:
            seq = self.running[i]
            if room.urgent is not None and seq.priority > room.urgent:
                break  # running is sorted by priority: everything from here is outranked
            if seq.priority > room.top:
                if room.num_shared >= self.max_num_shared_seqs:
                    break
                room.num_shared += 1
            n = self._paced(seq, min(seq.num_tokens - seq.num_computed_tokens, room.budget),
                            room.prefill_left)
            if n == 0:
                i += 1  # a long prompt past the cap: decodes behind it still go
                continue
            room.prefill_left -= self._paced_tokens(seq, n)
            while not bm.can_append(seq, n):
                victim = self.running[-1]  # lowest priority, most recently admitted
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # it preempted itself: everything behind it is gone too
            bm.append_slots(seq, n)
            self._schedule(out, seq, n)
            room.budget -= n
            i += 1

    def _admit_waiting(self, out: SchedulerOutput, room: _StepRoom) -> None:
        """Waiting requests in priority order into what the step has left, from their prefix
        hit, preempting lower-priority running ones where they must."""
        bm = self.block_manager
        j = 0
        while j < len(self.waiting) and room.budget > 0:
            seq = self.waiting[j]
            if seq.priority > room.top and room.num_shared >= self.max_num_shared_seqs:
                break  # waiting is sorted by priority: the rest are shared too
            if seq.leader is not None and not _prompt_cached(seq.leader):
                j += 1  # n > 1: siblings wait to share the leader's cached prompt blocks
                continue
            # Pooling reads every prompt token's hidden state, prompt logprobs every prompt
            # token's logits: no prefix hits for either.
            every_row = seq.pooling is not None or seq.params.prompt_logprobs is not None
            hit = PrefixHit() if every_row else bm.match_prefix(seq)
            n = self._paced(seq, min(seq.num_tokens - hit.tokens, room.budget),
                            room.prefill_left)
            if n == 0:
                j += 1  # a long prompt past the cap: a shorter one behind it may still go
                continue
            if len(self.running) >= self.max_num_seqs or not bm.can_allocate(seq, n, hit):
                refund = self._preempt_lower(seq, out)
                if refund is None:
                    break
                room.budget += refund
                continue
            del self.waiting[j], self._waiting_keys[j]
            room.num_shared += seq.priority > room.top
            bm.allocate(seq, n, hit)
            seq.status = SequenceStatus.RUNNING
            seq.arrival = next(self._order)
            # Newest of its priority: after every running sequence of equal or higher priority.
            bisect.insort(self.running, seq, key=lambda s: (s.priority, s.arrival))
            self._schedule(out, seq, n)
            room.budget -= n
            room.prefill_left -= self._paced_tokens(seq, n)

    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """Advance counters with the step's results (`sampled`: a token per sampling row, a
        sequence's drafted rows after its last one); returns the sequences that finished."""
        finished = []
        tokens = iter(sampled)
        out.num_kept = [0] * len(out.seqs)
        for k, (seq, n, samples, num_draft, num_rows) in enumerate(zip(
                out.seqs, out.num_new_tokens, out.is_sampling, out.num_drafts,
                out.num_sampled_rows, strict=True)):
            rows = [next(tokens) for _ in range(num_rows)]
            drafts = self._undraft(seq)
            if seq.status != SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            new = speculation.kept(drafts, rows)
            # the last token and the drafts kept are computed; the rest are not tokens at all
            seq.num_computed_tokens += n - num_draft + max(0, len(new) - 1)
            if num_draft:
                speculation.adapt(seq, num_draft, len(new) - 1)
                self.num_draft_tokens += num_draft
                self.num_accepted_draft_tokens += len(new) - 1
            self.block_manager.cache_full_blocks(seq)
            if not samples:
                if seq.pooling is not None and seq.num_computed_tokens == seq.num_tokens:
                    self._finish(seq, SequenceStatus.FINISHED_STOPPED, finished)
                continue
            for token in new:
                seq.token_ids.append(token)
                out.num_kept[k] += 1
                status = self._stop_status(seq, token)
                if status is not None:
                    self._finish(seq, status, finished)
                    break
        return finished

    def _draft_all(self, out: SchedulerOutput, budget: int) -> None:
        """Predicted outputs (speculation.py): the budget the step leaves goes to drafts of its
        decoding sequences with a prediction, in order, so drafts never hold back a prompt or
        another sequence's token (nor preempt anything: only free blocks take them)."""
        for k, (seq, n, samples) in enumerate(zip(out.seqs, out.num_new_tokens, out.is_sampling,
                                                  strict=True)):
            p = seq.params
            if (budget <= 0 or n != 1 or not samples or not p.prediction or seq.grammar is not None
                    or seq.thinking is not None or p.presence_penalty or p.frequency_penalty
                    or p.repetition_penalty != 1.0):
                continue  # a grammar, a budget or penalties would need each draft's history
            limit = min(seq.draft_limit, budget, p.max_tokens - seq.num_output_tokens - 1,
                        self.max_model_len - seq.num_tokens - 1)
            drafts = speculation.propose(seq, limit)
            if not drafts or not self.block_manager.can_append(seq, 1 + len(drafts)):
                continue
            self.block_manager.append_slots(seq, 1 + len(drafts))
            seq.token_ids += drafts
            seq.num_draft = out.num_drafts[k] = len(drafts)
            out.num_new_tokens[k] += len(drafts)
            budget -= len(drafts)

    @staticmethod
    def _undraft(seq: Sequence) -> list[int]:
        """Take seq's drafted tokens off its tokens (they were never its output); returns them."""
        k = seq.num_draft
        if not k:
            return []
        drafts = seq.token_ids[-k:]
        del seq.token_ids[-k:]
        seq.num_draft = 0
        return drafts

    def _finish(self, seq: Sequence, status: SequenceStatus, finished: list[Sequence]) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        finished.append(seq)

    # -- helpers -------------------------------------------------------------------------------

    def _paced_tokens(self, seq: Sequence, n: int) -> int:
        """The tokens of an n-token computation that count against the pacing cap: a chunk of
        a long prompt counts, a decode or a short prompt does not."""
        return n if n > 1 and seq.num_prompt_tokens > self.long_prompt_tokens else 0

    def _paced(self, seq: Sequence, n: int, prefill_left: int) -> int:
        """n, or as much of it as the pacing cap leaves (0: not this step)."""
        return min(n, prefill_left) if self._paced_tokens(seq, n) else n

    def _schedule(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        reaches_end = seq.num_computed_tokens + n == seq.num_tokens
        out.is_sampling.append(reaches_end and seq.pooling is None)
        out.is_pooling.append(reaches_end and seq.pooling is not None)
        out.num_drafts.append(seq.num_draft)

    def _stop_status(self, seq: Sequence, token: int) -> SequenceStatus | None:
        p = seq.params
        if (not p.ignore_eos and token in seq.eos_token_ids) or token in p.stop_token_ids:
            return SequenceStatus.FINISHED_STOPPED
        if seq.grammar is not None and seq.grammar.is_finished:
            return SequenceStatus.FINISHED_STOPPED  # nothing but EOS could follow
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        key = (seq.priority, next(self._order))
        i = bisect.bisect(self._waiting_keys, key)
        self._waiting_keys.insert(i, key)
        self.waiting.insert(i, seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free seq's blocks and send it back to wait; it recomputes from its prefix later."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        # Back in line by priority, ahead of every new arrival of its priority.
        seq.status = SequenceStatus.WAITING
        key = (seq.priority, seq.arrival - (1 << 62))
        i = bisect.bisect(self._waiting_keys, key)
        self._waiting_keys.insert(i, key)
        self.waiting.insert(i, seq)

    def _preempt_lower(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """Make room for a waiting seq by preempting a running one of lower priority (taking it
        out of this step if it was scheduled). Returns the tokens refunded to the budget, or
        None when nothing of lower priority runs."""
        if not self.running or self.running[-1].priority <= seq.priority:
            return None
        victim = self.running[-1]
        refund = 0
        if victim in out.seqs:
            k = out.seqs.index(victim)
            refund = out.num_new_tokens[k]
            del out.seqs[k], out.num_new_tokens[k], out.is_sampling[k], out.is_pooling[k]
            del out.num_drafts[k]
        self._preempt(victim, out)
        return refund


def _prompt_cached(seq: Sequence) -> bool:
    return seq.status.is_finished or seq.num_computed_tokens >= seq.num_prompt_tokens
