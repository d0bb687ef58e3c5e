"""POST /v1/embeddings: one vector per input, from the same engine as generation.

Each input is a prefill-only request through the scheduler (it batches with chats and never
stalls them); its final hidden states (after the model's last norm) are pooled. An embedding
model pools as its sentence-transformers files say (for example last-token and normalized, as
Qwen3-Embedding); a chat model pools by the mean over the input's tokens, normalized to unit
length. `dimensions` shortens the vector (then renormalized) only for Matryoshka models; for
others it must equal the model's size. `encoding_format` "base64" sends the little-endian
float32 bytes, as OpenAI does (the openai client asks for it by default).
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.api.admission import Admission, admit, read_request
from server.api.auth import tenant
from server.api.errors import invalid
from server.api.fields import Fields
from server.api.generation.pipeline import off_loop
from server.api.state import ServerState
from server.api.wire import new_id
from server.engine.scheduler import RequestTooLargeError
from server.engine.sequence import PRIORITY_INTERACTIVE, Pooling, SamplingParams

MAX_INPUTS = 2048  # OpenAI's limit per request


@dataclass(slots=True)
class EmbeddingRequest:
    model: str
    inputs: list[str | list[int]]
    encoding_format: str  # "float" or "base64"
    dimensions: int | None
    user: str | None
    stream: bool = False  # never: for the batch queue's shared check


def parse_embeddings(body: dict[str, Any], vocab_size: int) -> EmbeddingRequest:
    f = Fields(body)
    model = f.str("model", required=True)
    inputs = _inputs(f.raw("input"), vocab_size)
    encoding = f.str("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise invalid("encoding_format", f"Invalid value for 'encoding_format': {encoding!r}. "
                      "Supported values are: 'float' and 'base64'.")
    dimensions = f.int("dimensions", lo=1)
    user = f.str("user")
    f.check_unknown()
    return EmbeddingRequest(model, inputs, encoding, dimensions, user)


def _inputs(v: Any, vocab_size: int) -> list[str | list[int]]:
    """`input`: a string, strings, token ids, or lists of token ids; none empty."""
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(v, str) and v:
        inputs: list[str | list[int]] = [v]
    elif is_ids(v):
        inputs = [v]
    elif isinstance(v, list) and v and all((isinstance(x, str) and x) or is_ids(x) for x in v):
        inputs = list(v)
    else:
        raise invalid("input", "Invalid value for 'input': expected a non-empty string, array "
                      "of non-empty strings, array of token ids or array of token id arrays.")
    if len(inputs) > MAX_INPUTS:
        raise invalid("input", f"'input' holds at most {MAX_INPUTS} items, got {len(inputs)}.")
    for i, x in enumerate(inputs):
        bad = [t for t in x if not 0 <= t < vocab_size] if isinstance(x, list) else []
        if bad:
            raise invalid("input", f"Token id {bad[0]} in input[{i}] is outside the vocabulary "
                          f"(0..{vocab_size - 1}).")
    return inputs


def model_pooling(state: ServerState) -> tuple[Pooling, bool]:
    """(how this model pools, whether it may shorten vectors)."""
    p = state.pooling
    if p is None:
        return Pooling("mean", normalize=True), False
    return Pooling(p["mode"], p["normalize"]), bool(p.get("matryoshka"))


async def create_embeddings(request: Request) -> Response:
    state, req = await read_request(request, parse_embeddings)
    async with admit(state, req, tenant(request), generates=False) as place:
        run = await start_embeddings(state, req, place)
        return await place.answer(request, run.collect())


async def start_embeddings(state: ServerState, req: EmbeddingRequest, place: Admission
                           ) -> EmbeddingRun:
    """The inputs checked (dimensions, context) and tokenized; the run embeds them."""
    engine = state.ready_engine()
    pooling, matryoshka = model_pooling(state)
    size = engine.hidden_size
    if req.dimensions is not None and req.dimensions != size and not (
            matryoshka and req.dimensions < size):
        what = f"at most {size}" if matryoshka else f"only {size} (the model's size: it is not "\
            "a Matryoshka model)"
        raise invalid("dimensions", f"This model's embeddings have {what} dimensions; got "
                      f"{req.dimensions}.")
    ids = await off_loop(_tokenize, state.tokenizer, req.inputs)
    for i, x in enumerate(ids):
        try:
            engine.check(len(x), SamplingParams(max_tokens=0))
        except RequestTooLargeError as e:
            raise invalid("input", f"input[{i}]: {e}", code="context_length_exceeded") from None
    return EmbeddingRun(state, req, place, pooling, ids)


class EmbeddingRun:
    """One embeddings request: each input a prefill-only engine request, pooled."""

    def __init__(self, state: ServerState, req: EmbeddingRequest, place: Admission,
                 pooling: Pooling, ids: list[list[int]]) -> None:
        self.state, self.req, self.place, self.pooling, self.ids = state, req, place, pooling, ids

    async def collect(self) -> dict[str, Any]:
        state, req, ids, pooling = self.state, self.req, self.ids, self.pooling
        owner, priority = self.place.owner, self.place.priority
        rid = new_id("emb")
        vectors = await asyncio.gather(*(
            state.ready_engine().embed(x, pooling, priority, owner, f"{rid}-{i}")
            for i, x in enumerate(ids)))
        num_tokens = sum(map(len, ids))
        if priority == PRIORITY_INTERACTIVE:  # batch lines count when their result is stored
            state.usage.add(owner, "interactive", state.served_name, num_tokens, 0, 0)
            state.usage_added()
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode(_shorten(v, req.dimensions, pooling.normalize),
                                      req.encoding_format)} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data, "model": state.served_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


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


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
