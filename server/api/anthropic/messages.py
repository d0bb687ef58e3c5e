"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the same turn
as chat (turn.py). Errors on these routes are in Anthropic's envelope (errors.py).

Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens computed for this
request, `cache_read_input_tokens` those served from the prefix cache (their sum is the prompt).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.admission import Admission, admit, read_request
from server.api.anthropic.protocol import parse_messages_request
from server.api.auth import tenant
from server.api.generation.protocol import ChatRequest
from server.api.generation.tools import parsed_arguments
from server.api.generation.turn import Piece, Turn, count_prompt_tokens, pieces, start_turn
from server.api.state import ServerState
from server.api.usage import TokenCount


async def create_message(request: Request) -> Response:
    state, req = await read_request(request, parse_messages_request)
    async with admit(state, req, tenant(request)) as place:
        run = await start_message(state, req, place)
        return await place.reply(request, run, req.stream, "anthropic")


async def count_tokens(request: Request) -> Response:
    state, req = await read_request(request, partial(parse_messages_request, count_only=True))
    state.check_model(req.model)
    return JSONResponse({"input_tokens": await count_prompt_tokens(state, req, "messages")})


async def start_message(state: ServerState, req: ChatRequest, place: Admission) -> MessageRun:
    turn = await start_turn(state, req, place.owner, place.priority, f"msg_{uuid.uuid4().hex}",
                            "messages", "output_config")
    return MessageRun(state, turn)


def _stop_reason(piece: Piece) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of the turn's last piece."""
    stop_string = piece.chunk.stop_reason
    if piece.finish_reason == "stop" and stop_string is not None:
        return "stop_sequence", stop_string
    return {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}.get(
        piece.finish_reason or "", "end_turn"), None


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _tool_input(arguments: str) -> dict[str, Any]:
    value = parsed_arguments(arguments)
    return value if isinstance(value, dict) else {}


class MessageRun:
    """One Messages request: engine chunks as a `message` or its stream events."""

    def __init__(self, state: ServerState, turn: Turn) -> None:
        self.state, self.turn = state, turn
        self.count = TokenCount(turn.num_prompt_tokens)

    def _usage(self) -> dict[str, Any]:
        c = self.count
        return {"input_tokens": c.num_prompt - c.num_cached, "output_tokens": c.num_output,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": c.num_cached}

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]
                 ) -> dict[str, Any]:
        return {"id": self.turn.request_id, "type": "message", "role": "assistant",
                "model": self.state.served_name, "content": content, "stop_reason": stop[0],
                "stop_sequence": stop[1], "usage": self._usage()}

    async def collect(self) -> dict[str, Any]:
        text, calls = [], []
        stop: tuple[str | None, str | None] = (None, None)
        async for piece in pieces(self.turn):
            self.count.add(piece.chunk)
            text.append(piece.content)
            calls += piece.calls
            if piece.finish_reason is not None:
                stop = _stop_reason(piece)
        content = [{"type": "text", "text": "".join(text)}] if "".join(text) or not calls \
            else []
        merged: dict[int, dict[str, Any]] = {}
        for delta in calls:
            call = merged.setdefault(delta.index, {"id": delta.id, "name": delta.name,
                                                   "arguments": ""})
            call["arguments"] += delta.arguments
        content += [{"type": "tool_use", "id": _tool_id(c["id"]), "name": c["name"],
                     "input": _tool_input(c["arguments"])} for c in merged.values()]
        return self._message(content, stop)

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        start = self._message([], (None, None))
        yield {"type": "message_start", "message": start}
        index = -1  # the open content block (-1: none yet)
        open_kind: str | None = None
        call_index: int | None = None  # the parser's index of the open tool_use block
        last: Piece | None = None
        async for piece in pieces(self.turn):
            self.count.add(piece.chunk)
            last = piece
            if piece.content:
                if open_kind != "text":
                    if open_kind is not None:
                        yield {"type": "content_block_stop", "index": index}
                    index, open_kind = index + 1, "text"
                    yield {"type": "content_block_start", "index": index,
                           "content_block": {"type": "text", "text": ""}}
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "text_delta", "text": piece.content}}
            for delta in piece.calls:
                if delta.id is not None or call_index != delta.index:
                    if open_kind is not None:
                        yield {"type": "content_block_stop", "index": index}
                    index, open_kind, call_index = index + 1, "tool_use", delta.index
                    yield {"type": "content_block_start", "index": index, "content_block": {
                        "type": "tool_use", "id": _tool_id(delta.id or ""), "name": delta.name,
                        "input": {}}}
                if delta.arguments:
                    yield {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": delta.arguments}}
        if open_kind is None:  # an empty answer still has its (empty) text block
            index = 0
            yield {"type": "content_block_start", "index": 0,
                   "content_block": {"type": "text", "text": ""}}
        yield {"type": "content_block_stop", "index": index}
        stop_reason, stop_sequence = _stop_reason(last) if last else ("end_turn", None)
        yield {"type": "message_delta",
               "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
               "usage": self._usage()}
        yield {"type": "message_stop"}
