"""The pacing policy of chunked prefill: how many prompt tokens a step that decodes may take.

An object the scheduler is given (`Scheduler(pacer=...)`): it reads `cap()` when it plans a
step; the engine feeds `observe()` the measured time of each step. No torch.
"""

from __future__ import annotations

# The smallest prompt chunk in a step that decodes, so a new prompt always advances. Measured
# (16 int4 streams, a 2,000-token prompt, stretch 1.75): with a floor of 4 the chunks sank to it
# and the prompt took 69-113 s for no better ITL: a chunk's cost is not only per token, its
# attention gathers the whole context so far (+22 ms at 16 tokens of context, +130 ms at 3,400).
# 32, not 16, since int4 prompt rows run a bf16 GEMM, memory-bound at a few rows (AVX-512 BF16
# machine, stretch 1.5): the same ITL (2.09-2.13x against 2.11x), the prompt in 5.0 s, not 9.2.
MIN_PREFILL_CHUNK = 32


class PrefillPacer:
    """Sizes prompt chunks in steps that decode, from measured step times.

    It keeps two running averages: the time of a decode-only step and the time per prompt
    token (a step's time beyond its decodes, over its prompt tokens). A step that decodes may
    then add (stretch - 1) decode steps' worth of prompt tokens, at least min_tokens so a new
    prompt always advances. Until both are measured, no cap.
    """

    ALPHA = 0.3  # weight of the newest step in the averages

    def __init__(self, stretch: float | None, min_tokens: int) -> None:
        self.stretch, self.min_tokens = stretch, min_tokens
        self.decode_seconds: float | None = None
        self.token_seconds: float | None = None

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        if num_prompt_tokens == 0 and num_decodes:
            self.decode_seconds = self._mix(self.decode_seconds, seconds)
        elif num_prompt_tokens >= self.min_tokens:
            base = self.decode_seconds if num_decodes and self.decode_seconds else 0.0
            per_token = max(seconds - base, 0.0) / num_prompt_tokens
            self.token_seconds = self._mix(self.token_seconds, per_token)

    def forget(self) -> None:
        """Drop the measurements (after the engine's warm-up, whose first calls are slow)."""
        self.decode_seconds = self.token_seconds = None

    def cap(self) -> int | None:
        """Prompt tokens allowed in a step that decodes, or None for no cap."""
        if self.stretch is None or not self.decode_seconds or not self.token_seconds:
            return None
        extra = (self.stretch - 1.0) * self.decode_seconds
        return max(self.min_tokens, int(extra / self.token_seconds))

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ALPHA) * old + self.ALPHA * new


class FixedCap:
    """A pacer with a constant cap (or None: no cap), for callers that size chunks themselves."""

    def __init__(self, tokens: int | None) -> None:
        self.tokens = tokens

    def cap(self) -> int | None:
        return self.tokens
