"""Token accounting and cost: interactive vs batch, by day and API key (GET /v1/usage reads it:
ops/usage.py).

Batch lines are counted in the transaction that stores their result (exact across crashes).
Interactive requests are counted in memory and flushed to SQLite every few seconds and at
shutdown (a kill -9 loses at most the last few seconds of interactive counts).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass
from typing import Any

from server.engine.engine import ConfigError, at_least


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    """OpenAI's usage object."""
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


class TokenCount:
    """A request's tokens as its chunks arrive: every choice's output so far and the cached
    prompt tokens of each prompt (reported on its first choice); the one place that counts."""

    def __init__(self, num_prompt: int, predicted: bool = False, thinks: bool = False) -> None:
        self.num_prompt = num_prompt
        self.output: dict[int, int] = {}  # choice -> output tokens so far
        self.cached: dict[int, int] = {}  # prompt -> cached prompt tokens
        self.predicted = predicted  # predicted outputs: report the drafts kept and dropped
        self.prediction: dict[int, tuple[int, int]] = {}  # choice -> (accepted, rejected)
        self.thinks = thinks  # the model has a thinking block: report its tokens
        self.num_reasoning = 0

    def add(self, chunk, choice: int | None = None, prompt: int = 0,
            num_reasoning: int = 0) -> None:
        """`chunk` of `choice` (default: its own index) of prompt number `prompt`, of whose
        tokens `num_reasoning` were the thinking block's."""
        choice = chunk.index if choice is None else choice
        self.num_reasoning += num_reasoning
        self.output[choice] = chunk.num_output_tokens
        self.prediction[choice] = (chunk.num_accepted_prediction, chunk.num_rejected_prediction)
        if chunk.index == 0:
            self.cached[prompt] = chunk.num_cached_tokens

    @property
    def num_output(self) -> int:
        return sum(self.output.values())

    @property
    def num_cached(self) -> int:
        return sum(self.cached.values())

    def usage(self) -> dict[str, Any]:
        out = usage(self.num_prompt, self.num_output, self.num_cached)
        if self.predicted or self.thinks:
            out["completion_tokens_details"] = {
                "reasoning_tokens": self.num_reasoning, "audio_tokens": 0,
                "accepted_prediction_tokens": sum(a for a, _ in self.prediction.values()),
                "rejected_prediction_tokens": sum(r for _, r in self.prediction.values())}
        return out


@dataclass(slots=True)
class Prices:
    """US dollars per million tokens; batch tokens cost (1 - batch_discount) of that."""

    input_per_million: float = 0.10
    output_per_million: float = 0.40
    batch_discount: float = 0.5

    def __post_init__(self) -> None:
        at_least(self, 0, "input_per_million", "output_per_million", "batch_discount")
        if not self.batch_discount <= 1:
            raise ConfigError("batch_discount", f"must be within 0..1, got {self.batch_discount}")

    def cost(self, kind: str, prompt_tokens: int, completion_tokens: int) -> float:
        factor = 1.0 - self.batch_discount if kind == "batch" else 1.0
        return factor * (prompt_tokens * self.input_per_million
                         + completion_tokens * self.output_per_million) / 1e6

    def as_dict(self) -> dict[str, float]:
        return {"input_per_million": self.input_per_million,
                "output_per_million": self.output_per_million,
                "batch_discount": self.batch_discount}


def today() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")


class UsageMeter:
    """Interactive usage waiting to be written: (day, tenant, kind, model) -> counters."""

    def __init__(self) -> None:
        self.pending: dict[tuple[str, str, str, str], Counter[str]] = {}

    def add(self, tenant: str, kind: str, model: str, prompt_tokens: int,
            completion_tokens: int, cached_tokens: int) -> None:
        c = self.pending.setdefault((today(), tenant, kind, model), Counter())
        c.update(requests=1, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 cached_tokens=cached_tokens)

    def restore(self, rows: list[dict[str, Any]]) -> None:
        """Put back rows that `take` returned and could not be written."""
        for r in rows:
            c = self.pending.setdefault((r["day"], r["tenant"], r["kind"], r["model"]), Counter())
            c.update({k: r[k] for k in ("requests", "prompt_tokens", "completion_tokens",
                                        "cached_tokens")})

    def take(self) -> list[dict[str, Any]]:
        """The pending rows, leaving nothing pending."""
        rows = [{"day": day, "tenant": tenant, "kind": kind, "model": model,
                 "requests": c["requests"], "prompt_tokens": c["prompt_tokens"],
                 "completion_tokens": c["completion_tokens"],
                 "cached_tokens": c["cached_tokens"]}
                for (day, tenant, kind, model), c in self.pending.items()]
        self.pending = {}
        return rows

