"""Replies recomputed as prompt while the engine is idle, for the chat's next turn. No torch.

A chat's next turn repeats the last reply in its prompt. The reply's blocks were computed as
generated tokens, with other kernels than prompt tokens get, so the prefix cache keeps them
apart (block_manager.py) and the next turn would compute the reply again before its first
token. While no request runs or waits, the engine computes each finished interactive reply as
prompt (prompt + reply, a few tokens per step) and caches those blocks like any prompt's: the
next turn finds them, with the numbers a cold server would compute, and its first token comes
as fast as if the reply had been reused. It keeps out of the way of requests: it starts only
once the engine has been idle for `delay` seconds (a client sending requests back to back
never meets it; a person reading the reply takes longer), its steps are small, and it is
dropped (its finished blocks kept) as soon as anything else arrives. It is the engine's own
work: no request, not in the counters.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from server.engine.scheduler import RequestTooLargeError, Scheduler
from server.engine.sequence import PRIORITY_INTERACTIVE, SamplingParams, Sequence, SequenceStatus

PRIORITY_RECACHE = 20  # below batch work (10)
# Prompt tokens per step: an arrival waits at most one such step (smollm2-135m:int4 on two
# Zen 4 cores: a 300-token reply in 0.58-0.66 s, ~60 ms a step).
CHUNK_TOKENS = 32
MAX_PENDING = 8  # the newest replies; older ones are dropped


class ReplyRecache:
    def __init__(self, block_size: int, delay: float | None) -> None:
        """delay: idle seconds before a recompute starts (None: never)."""
        self.block_size, self.delay = block_size, delay
        self.pending: deque[Sequence] = deque(maxlen=MAX_PENDING)
        self.running: Sequence | None = None
        self.idle_since: float | None = None  # when the last step left the scheduler empty
        self.num_done = 0  # replies computed to their end (for /metrics)

    def offer(self, seq: Sequence) -> None:
        """A sequence the scheduler finished: queue its reply if it fills a block."""
        if seq is self.running:
            self.num_done += 1
            self.running = None
            return
        bs = self.block_size
        full = seq.num_tokens // bs * bs
        if (self.delay is None or seq.internal or seq.pooling is not None
                or seq.priority != PRIORITY_INTERACTIVE or full <= seq.num_prompt_tokens
                or seq.status not in (SequenceStatus.FINISHED_STOPPED,
                                      SequenceStatus.FINISHED_LENGTH)):
            return
        # Full blocks only: the last of them is the last token, always computed, so every
        # block is registered once the step reaches it.
        params = SamplingParams(max_tokens=1, temperature=0.0)
        self.pending.append(Sequence(seq.token_ids[:full], params, PRIORITY_RECACHE,
                                     seq.cache_salt, internal=True))

    def after_step(self, scheduler: Scheduler) -> None:
        """The engine finished a step: idle from now on if the scheduler is empty."""
        self.idle_since = time.monotonic() if not scheduler.has_unfinished else None

    def before_step(self, scheduler: Scheduler,
                    abort: Callable[[Sequence], None]) -> int | None:
        """Start one when the scheduler is idle, drop the running one once anything else
        arrives. Returns the step's token budget while only a recompute runs (None: the
        scheduler's own)."""
        if self.running is not None and len(scheduler.running) + len(scheduler.waiting) > 1:
            self.drop_running(abort)
        if self.running is None and self.ready(scheduler):
            seq = self.pending.pop()  # the newest reply first: the likeliest next turn
            try:
                scheduler.add(seq)
            except RequestTooLargeError:
                return None
            self.running = seq
        return CHUNK_TOKENS if self.running is not None else None

    def ready(self, scheduler: Scheduler) -> bool:
        """Whether a recompute is running or may start now (reads only)."""
        if self.running is not None:
            return True
        return (bool(self.pending) and not scheduler.has_unfinished
                and self.idle_since is not None
                and time.monotonic() - self.idle_since >= self.delay)

    def drop_running(self, abort: Callable[[Sequence], None]) -> None:
        """Abort the running recompute (its finished blocks stay cached)."""
        if self.running is not None:
            abort(self.running)
            self.running = None

    @property
    def num_pending(self) -> int:
        """Replies queued or being computed."""
        return len(self.pending) + (self.running is not None)
