"""POST /v1/embeddings: one vector per input, from the same engine as generation (how inputs
are embedded and pooled: generation/embedding.py). `encoding_format` "base64" sends the
little-endian float32 bytes, as OpenAI does (the openai client asks for it by default).
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.api.admission import Admission, admit, read_request
from server.api.auth import tenant
from server.api.errors import invalid
from server.api.fields import Fields
from server.api.generation.embedding import embed
from server.api.state import ServerState

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


async def create_embeddings(request: Request) -> Response:
    state, req = await read_request(request, parse_embeddings)
    async with admit(state, req, tenant(request), generates=False) as place:
        run = await start_embeddings(state, req, place)
        return await place.answer(request, run.collect())


async def start_embeddings(state: ServerState, req: EmbeddingRequest, place: Admission
                           ) -> EmbeddingRun:
    return EmbeddingRun(state, req, place)


class EmbeddingRun:
    """One embeddings request (generation/embedding.py) in OpenAI's shape."""

    def __init__(self, state: ServerState, req: EmbeddingRequest, place: Admission) -> None:
        self.state, self.req, self.place = state, req, place

    async def collect(self) -> dict[str, Any]:
        req = self.req
        got = await embed(self.state, req.inputs, req.dimensions, self.place.owner,
                          self.place.priority)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode(v, req.encoding_format)}
                for i, v in enumerate(got.vectors)]
        return {"object": "list", "data": data, "model": self.state.served_name,
                "usage": {"prompt_tokens": got.num_tokens, "total_tokens": got.num_tokens}}


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
