"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the same turn
as chat (turn.py). Errors on these routes are in Anthropic's envelope (errors.py).

Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens computed for this
request, `cache_read_input_tokens` those served from the prefix cache (their sum is the prompt).
"""

from __future__ import annotations

import base64
import hmac
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.admission import Admission, admit, read_request
from server.api.anthropic.protocol import SIGNED, parse_messages_request
from server.api.anthropic.threads import Thread, open_thread, reply_message, thread_fields
from server.api.auth import tenant
from server.api.generation.protocol import ChatRequest
from server.api.generation.tool_calls import CallDelta, whole_calls
from server.api.generation.tool_formats import parsed_arguments
from server.api.generation.turn import Piece, Turn, count_prompt_tokens, pieces, start_turn
from server.api.state import ServerState
from server.api.usage import TokenCount


async def create_message(request: Request) -> Response:
    state, req = await read_request(request, parse_messages_request,
                                    partial(thread_fields, owner=tenant(request)))
    async with admit(state, req, tenant(request)) as place:
        run = await start_message(state, req, place)
        return await place.reply(request, run, req.stream, "anthropic")


async def count_tokens(request: Request) -> Response:
    state, req = await read_request(request, partial(parse_messages_request, count_only=True),
                                    partial(thread_fields, owner=tenant(request)))
    state.check_model(req.model)
    check_signatures(state, req)
    req, _ = await open_thread(state, req, tenant(request), "", claim=False)
    return JSONResponse({"input_tokens": await count_prompt_tokens(state, req, "messages")})


async def start_message(state: ServerState, req: ChatRequest, place: Admission) -> MessageRun:
    check_signatures(state, req)
    message_id = f"msg_{uuid.uuid4().hex}"
    req, thread = await open_thread(state, req, place.owner, message_id)
    try:
        turn = await start_turn(state, req, place.owner, place.priority, message_id,
                                "messages", "output_config")
    except BaseException:
        if thread is not None:
            await thread.failed()
        raise
    return MessageRun(state, turn, req.thinking.omitted, thread)


def check_signatures(state: ServerState, req: ChatRequest) -> None:
    """Thinking blocks sent back reach the template (as the turn's reasoning) only if they are
    ours, unchanged (their signature: signature()); others are dropped, as Anthropic drops an
    earlier turn's thinking (a conversation begun with another model still goes on)."""
    for m in req.messages:
        signed = m.pop(SIGNED, [])
        if signed:
            kept = [text for text, given, _ in signed
                    if hmac.compare_digest(given.encode(), signature(state, text).encode())]
            m.pop("reasoning_content", None)
            if kept:
                m["reasoning_content"] = "".join(kept)


def signature(state: ServerState, text: str) -> str:
    """A thinking block's signature: an HMAC of its text under this server's key."""
    return base64.b64encode(hmac.digest(state.signing_key(), text.encode(), "sha256")).decode()


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


def _uses(calls: list[CallDelta]) -> list[dict[str, Any]]:
    """Call pieces as the reply's tool_use blocks."""
    return [{"type": "tool_use", "id": _tool_id(c.id), "name": c.name,
             "input": _tool_input(c.arguments)} for c in whole_calls(calls)]


class MessageRun:
    """One Messages request: engine chunks as a `message` or its stream events."""

    def __init__(self, state: ServerState, turn: Turn, omitted: bool = False,
                 thread: Thread | None = None) -> None:
        self.state, self.turn, self.thread = state, turn, thread
        self.count = TokenCount(turn.num_prompt_tokens)
        self.omitted = omitted  # thinking blocks without their text (display "omitted")

    def _thinking_block(self, text: str) -> dict[str, Any]:
        shown = "" if self.omitted else text
        return {"type": "thinking", "thinking": shown, "signature": signature(self.state, shown)}

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
        text, calls, thought = [], [], []
        stop: tuple[str | None, str | None] = (None, None)
        try:
            async for piece in pieces(self.turn):
                self.count.add(piece.chunk)
                thought.append(piece.reasoning)
                text.append(piece.content)
                calls += piece.calls
                if piece.finish_reason is not None:
                    stop = _stop_reason(piece)
        except BaseException:
            await self._ended(None)
            raise
        said, uses = "".join(text), _uses(calls)
        content = [self._thinking_block("".join(thought))] if "".join(thought) else []
        if said or not calls:
            content.append({"type": "text", "text": said})
        await self._ended(reply_message("".join(thought), said, uses))
        return self._message(content + uses, stop)

    async def _ended(self, reply: dict[str, Any] | None) -> None:
        """The thread (if any) gets the whole reply, or its claim back (None: cut off)."""
        if self.thread is not None:
            await (self.thread.done(reply) if reply is not None else self.thread.failed())

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        said: dict[str, list] = {"thought": [], "text": [], "calls": []}
        whole = False
        try:
            async for event in self._events(said):
                whole |= event["type"] == "message_delta"  # the reply is whole
                yield event
        finally:
            await self._ended(reply_message("".join(said["thought"]), "".join(said["text"]),
                                            _uses(said["calls"])) if whole else None)

    async def _events(self, said: dict[str, list]) -> AsyncIterator[dict[str, Any]]:
        """The stream's events; `said` gathers the reply's thinking, text and call pieces."""
        yield {"type": "message_start", "message": self._message([], (None, None))}
        blocks = _Blocks()
        call_index: int | None = None  # the parser's index of the open tool_use block
        last: Piece | None = None
        thought = ""  # the open thinking block's text
        async for piece in pieces(self.turn):
            self.count.add(piece.chunk)
            last, events = piece, []
            said["thought"].append(piece.reasoning)
            said["text"].append(piece.content)
            said["calls"] += piece.calls
            if piece.reasoning:
                if blocks.kind != "thinking":
                    events += blocks.open({"type": "thinking", "thinking": "", "signature": ""})
                    thought = ""
                thought += piece.reasoning
                if not self.omitted:
                    events.append(blocks.delta({"type": "thinking_delta",
                                                "thinking": piece.reasoning}))
            if blocks.kind == "thinking" and (piece.content or piece.calls
                                              or piece.finish_reason is not None):
                signed = self._thinking_block(thought)["signature"]
                events.append(blocks.delta({"type": "signature_delta", "signature": signed}))
                events += blocks.close()
            if piece.content:
                if blocks.kind != "text":
                    events += blocks.open({"type": "text", "text": ""})
                events.append(blocks.delta({"type": "text_delta", "text": piece.content}))
            for delta in piece.calls:
                if delta.id is not None or call_index != delta.index:
                    call_index = delta.index
                    events += blocks.open({"type": "tool_use", "id": _tool_id(delta.id or ""),
                                           "name": delta.name, "input": {}})
                if delta.arguments:
                    events.append(blocks.delta({"type": "input_json_delta",
                                                "partial_json": delta.arguments}))
            for event in events:
                yield event
        if not blocks.answered:  # an empty answer still has its (empty) text block
            for event in blocks.open({"type": "text", "text": ""}):
                yield event
        for event in blocks.close():
            yield event
        stop_reason, stop_sequence = _stop_reason(last) if last else ("end_turn", None)
        yield {"type": "message_delta",
               "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
               "usage": self._usage()}
        yield {"type": "message_stop"}


class _Blocks:
    """The content blocks of a streamed message: one open at a time, numbered in order."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.answered = False  # a text or tool_use block was opened

    def open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index, self.kind = self.index + 1, block["type"]
        self.answered |= block["type"] != "thinking"
        return events + [{"type": "content_block_start", "index": self.index,
                          "content_block": block}]

    def delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        self.kind = None
        return [{"type": "content_block_stop", "index": self.index}]
