"""Embedding inputs, for every protocol that asks for vectors (OpenAI's /v1/embeddings,
Ollama's /api/embed): each input a prefill-only request through the scheduler (it batches with
chats and never stalls them), its final hidden states (after the model's last norm) pooled. An
embedding model pools as its sentence-transformers files say (for example last-token and
normalized, as Qwen3-Embedding); a chat model pools by the mean over the input's tokens,
normalized to unit length. `dimensions` shortens a vector (then renormalized) only for
Matryoshka models; for others it must equal the model's size."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from server.api.errors import invalid
from server.api.generation.pipeline import off_loop
from server.api.state import ServerState
from server.api.wire import new_id
from server.engine.scheduler import RequestTooLargeError
from server.engine.sequence import PRIORITY_INTERACTIVE, Pooling, SamplingParams


@dataclass(slots=True)
class Embedded:
    """The vectors of a request's inputs, in order, and the tokens they took."""

    vectors: list[list[float]]
    num_tokens: int


def model_pooling(state: ServerState) -> tuple[Pooling, bool]:
    """(how this model pools, whether it may shorten vectors)."""
    p = state.pooling
    if p is None:
        return Pooling("mean", normalize=True), False
    return Pooling(p["mode"], p["normalize"]), bool(p.get("matryoshka"))


async def embed(state: ServerState, inputs: list[str | list[int]], dimensions: int | None,
                owner: str, priority: int, param: str = "input") -> Embedded:
    """The inputs checked (dimensions, context), tokenized and embedded; 400s name `param`."""
    engine = state.ready_engine()
    pooling, matryoshka = model_pooling(state)
    size = engine.hidden_size
    if dimensions is not None and dimensions != size and not (matryoshka and dimensions < size):
        what = f"at most {size}" if matryoshka else f"only {size} (the model's size: it is not "\
            "a Matryoshka model)"
        raise invalid("dimensions", f"This model's embeddings have {what} dimensions; got "
                      f"{dimensions}.")
    ids = await off_loop(_tokenize, state.tokenizer, inputs)
    for i, x in enumerate(ids):
        try:
            engine.check(len(x), SamplingParams(max_tokens=0))
        except RequestTooLargeError as e:
            raise invalid(param, f"{param}[{i}]: {e}", code="context_length_exceeded") from None
    rid = new_id("emb")
    vectors = await asyncio.gather(*(engine.embed(x, pooling, priority, owner, f"{rid}-{i}")
                                     for i, x in enumerate(ids)))
    num_tokens = sum(map(len, ids))
    if priority == PRIORITY_INTERACTIVE:  # batch lines count when their result is stored
        state.usage.add(owner, "interactive", state.served_name, num_tokens, 0, 0)
        state.usage_added()
    return Embedded([_shorten(v, dimensions, pooling.normalize) for v in vectors], num_tokens)


def _tokenize(tokenizer: Any, inputs: list[str | list[int]]) -> list[list[int]]:
    """Text as the model's tokenizer writes it, special tokens included (an embedding model's
    end-of-text token is part of what it pools)."""
    return [x if isinstance(x, list) else tokenizer.encode(x, add_special_tokens=True)
            for x in inputs]


def _shorten(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    if not normalize:
        return head
    norm = math.sqrt(sum(x * x for x in head)) or 1.0
    return [x / norm for x in head]
