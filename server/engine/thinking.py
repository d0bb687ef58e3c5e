"""A thinking budget: when a sequence's reasoning block has taken its tokens, the engine writes
the block's closing tag for it (the sampled token replaced by the tag's next one), and the
answer follows, as llama-server's and vLLM's budgets do.

The block opens with the output's first tokens (the opening tag) or was opened by the prompt.
Like a grammar's state, a sequence's `ThinkingState` advances only on its sampled tokens, so
preemption and recompute never change it; a grammar that allows the block (the reasoning
prefix of api/generation/reasoning.py) accepts the forced tag as it would the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass

BEFORE, INSIDE, DONE = range(3)


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    """At most `budget` tokens inside the block; its tags as token ids; `opened`: the prompt
    opened it (the output starts inside)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    budget: int
    opened: bool = False

    def __post_init__(self) -> None:
        if not self.end or (not self.opened and not self.start) or self.budget < 0:
            raise ValueError("a thinking budget needs its tags' tokens and a budget >= 0")

    def begin(self) -> ThinkingState:
        return ThinkingState(self)


class ThinkingState:
    """One sequence's place: before the block, inside it (`count` tokens so far, `matched`
    tokens of the closing tag just written), or past it."""

    __slots__ = ("spec", "phase", "matched", "count")

    def __init__(self, spec: ThinkingBudget) -> None:
        self.spec = spec
        self.phase = INSIDE if spec.opened else BEFORE
        self.matched = 0  # of the opening tag before the block, of the closing one inside
        self.count = 0

    def forced(self) -> int | None:
        """The token the next step must write, if the budget is spent: the closing tag's next."""
        if self.phase == INSIDE and self.count >= self.spec.budget:
            return self.spec.end[self.matched]
        return None

    def accept(self, token: int) -> None:
        start, end = self.spec.start, self.spec.end
        if self.phase == BEFORE:
            if token != start[self.matched]:  # the output did not open a block
                self.phase = DONE
                return
            self.matched += 1
            if self.matched == len(start):
                self.phase, self.matched = INSIDE, 0
            return
        if self.phase != INSIDE:
            return
        if token == end[self.matched]:
            self.matched += 1
            if self.matched == len(end):
                self.phase = DONE
                return
        else:
            self.matched = 1 if token == end[0] else 0
        self.count += 1
