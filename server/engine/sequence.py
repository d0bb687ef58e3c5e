"""A request's state: counters, not phases.

Prefill, chunked prefill, prefix-cache hits, decoding and preemption are all the same thing:
`num_computed_tokens` catching up with `len(token_ids)`.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.engine.grammar import Grammar, GrammarState
    from server.engine.thinking import ThinkingBudget, ThinkingState


class SequenceStatus(enum.IntEnum):
    """Ordered: everything from FINISHED_STOPPED on is final."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2  # an end-of-turn token, a stop token id or a stop string
    FINISHED_LENGTH = 3  # max_tokens or the model's context
    FINISHED_ABORTED = 4  # the client went away or cancelled

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}

# Lower value runs first.
PRIORITY_INTERACTIVE = 0
PRIORITY_BATCH = 10


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI's names where OpenAI has them)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()  # besides the model's end-of-turn ids
    stop: tuple[str, ...] = ()  # stop strings, handled by the detokenizer
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Each prompt token's logprob after the ones before it, with this many alternatives
    # (completions' echo with logprobs); None: not asked. Such a prompt takes no prefix hits.
    prompt_logprobs: int | None = None
    n: int = 1
    grammar: Grammar | None = None  # constrained decoding: every choice follows it
    # Predicted outputs: the reply's expected tokens, checked several a step (speculation.py)
    prediction: tuple[int, ...] = ()
    # A reasoning block's budget: its closing tag is written when it is spent (thinking.py)
    thinking: ThinkingBudget | None = None
    # Special tokens the output's text shows all the same (a tool format's markup)
    shown_special: tuple[int, ...] = ()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True, frozen=True)
class Pooling:
    """An embedding request: its prompt's final hidden states pooled into one vector, nothing
    sampled. `mode`: "mean" over every prompt token, or "last" (the last token's)."""

    mode: str
    normalize: bool = True  # to unit length
    # A score instead of a vector: the LM head's logits of these tokens at the last position
    # (a reranker's "no" and "yes"), mode "last" only
    token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in ("mean", "last"):
            raise ValueError(f"unknown pooling mode {self.mode!r}")
        if self.token_ids and (self.mode != "last" or self.normalize):
            raise ValueError("token logits are the last position's, not normalized")


_seq_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """One generated continuation. `token_ids` holds the prompt followed by the output."""

    token_ids: list[int]
    params: SamplingParams
    priority: int = PRIORITY_INTERACTIVE
    cache_salt: str = ""  # tenant: blocks are only shared between equal salts
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    last_block_hash: bytes | None = None  # hash of block num_hashed_blocks - 1 (chain parent)
    # Its blocks in the sliding-window layers' pool (window_blocks.py), NO_BLOCK where no
    # query reads them any more: the first window_dropped ones.
    window_table: list[int] = field(default_factory=list)
    window_dropped: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    arrival: int = 0  # admission order, set by the scheduler; the newest is preempted first
    num_preemptions: int = 0
    eos_token_ids: tuple[int, ...] = ()
    leader: Sequence | None = None  # n > 1: wait until the leader's prompt is cached
    logprobs: list = field(default_factory=list)  # per output token, when asked
    # (logprob, tops) of prompt tokens 1.. in order, when params.prompt_logprobs asks
    prompt_logprobs: list = field(default_factory=list)
    # Its place in params.grammar: advanced once per sampled token, so it survives preemption.
    grammar: GrammarState | None = None
    thinking: ThinkingState | None = None  # its place in params.thinking, advanced alike
    pooling: Pooling | None = None  # an embedding request: prefill only, then pooled
    embedding: list[float] | None = None  # its vector, once the prompt is computed
    internal: bool = False  # the engine's own work (recache.py): no request, not counted
    # Predicted outputs (speculation.py): drafted tokens at the end of token_ids during a
    # step (0 between steps), where the output last agreed with the prediction (output index
    # prediction_base is prediction index prediction_at), and the drafts kept and dropped.
    num_draft: int = 0
    prediction_at: int = 0
    prediction_base: int = 0
    draft_limit: int = 8  # drafts a step: doubles while they all hold, halves when one fails
    num_accepted_prediction: int = 0
    num_rejected_prediction: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)  # owned: outputs are appended to it
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        if self.params.grammar is not None and self.grammar is None:
            self.grammar = self.params.grammar.start()
        if self.params.thinking is not None and self.thinking is None:
            self.thinking = self.params.thinking.begin()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens - self.num_draft

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
