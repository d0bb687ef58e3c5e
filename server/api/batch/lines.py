"""What a batch line runs: the body a plain request to its endpoint would get, through the
same admission as interactive requests (at batch priority: no queue place, no streaming).
Raises APIError as the endpoint would answer. /v1/messages lines are Anthropic's Message
Batches (anthropic/message_batches.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from server.api.admission import admit
from server.api.anthropic.messages import start_message
from server.api.anthropic.protocol import parse_messages_request
from server.api.errors import unsupported
from server.api.generation.protocol import parse_chat, parse_completion
from server.api.openai.chat import start_chat
from server.api.openai.completions import start_completion
from server.api.openai.embeddings import parse_embeddings, start_embeddings
from server.api.openai.responses import parse_response_line, start_response
from server.api.state import ServerState
from server.engine.sequence import PRIORITY_BATCH
from storage.batches import MESSAGES


def parse_message_line(body: dict[str, Any], vocab_size: int) -> Any:
    """A Message Batch line: a Messages body, each line a whole conversation (no thread)."""
    req = parse_messages_request(body, vocab_size)
    if req.thread is not None:
        raise unsupported("thread", "threads in a Message Batch: each line sends its whole "
                          "conversation")
    return req


@dataclass(frozen=True, slots=True)
class LineEndpoint:
    """How one endpoint parses a line's body and starts it (a run with `collect()`)."""

    parse: Callable[[dict[str, Any], int], Any]
    start: Callable[..., Awaitable[Any]]  # (state, request, admission) -> its run
    generates: bool = True  # False: embedding models serve it too


ENDPOINTS = {
    "/v1/chat/completions": LineEndpoint(parse_chat, start_chat),
    "/v1/completions": LineEndpoint(parse_completion, start_completion),
    "/v1/embeddings": LineEndpoint(parse_embeddings, start_embeddings, generates=False),
    "/v1/responses": LineEndpoint(parse_response_line, start_response),
    MESSAGES: LineEndpoint(parse_message_line, start_message),
}


async def answer_line(state: ServerState, endpoint: str, body: dict[str, Any], owner: str
                      ) -> dict[str, Any]:
    """The answer to one line's body, at batch priority."""
    spec = ENDPOINTS[endpoint]
    state = await state.held.view_for(body.get("model"))  # loaded now if need be
    req = spec.parse(body, state.vocab_size)
    async with admit(state, req, owner, PRIORITY_BATCH, spec.generates) as place:
        run = await spec.start(state, req, place)
        return await run.collect()
