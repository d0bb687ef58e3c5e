"""POST /v1/chat/completions: `chat.completion`, or `chat.completion.chunk` events.

With a response format or tools in force the request decodes under a grammar; with tools
offered the text is split into content and `tool_calls` (tool_calls.py), whole or streamed.
With the deprecated `functions` the one call is the message's `function_call` instead, and
the choice finishes with "function_call" where tools' finish with "tool_calls".
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.api.admission import Admission, admit, read_request
from server.api.auth import tenant
from server.api.generation.protocol import ChatRequest, parse_chat
from server.api.generation.token_text import TokenText
from server.api.generation.tool_calls import CallDelta, openai_calls, openai_deltas, whole_calls
from server.api.generation.turn import Piece, Turn, pieces, start_turn
from server.api.state import ServerState
from server.api.usage import TokenCount
from server.engine.output import CompletionChunk

SYSTEM_FINGERPRINT = "localserve"


async def create_chat_completion(request: Request) -> Response:
    state, req = await read_request(request, parse_chat)
    async with admit(state, req, tenant(request)) as place:
        run = await start_chat(state, req, place)
        return await place.reply(request, run, req.stream, "chat")


async def start_chat(state: ServerState, req: ChatRequest, place: Admission) -> ChatRun:
    """The admitted request's turn started; its run answers whole or as a stream."""
    turn = await start_turn(state, req, place.owner, place.priority)
    return ChatRun(state, req, turn, place.owner)


def _logprobs(token_text: TokenText, chunk: CompletionChunk) -> dict[str, Any] | None:
    if chunk.logprobs is None:
        return None
    return {"content": token_text.entries(chunk.logprobs), "refusal": None}


class ChatRun:
    """One chat request: turns engine chunks into a `chat.completion` or its chunk events."""

    def __init__(self, state: ServerState, req: ChatRequest, turn: Turn, owner: str) -> None:
        self.state, self.req, self.turn, self.owner = state, req, turn, owner
        self.rid = turn.request_id
        self.count = TokenCount(turn.num_prompt_tokens, req.prediction is not None,
                                turn.reasoning is not None)
        self.token_text = TokenText(state.tokenizer)
        self.created = int(time.time())
        self.calls_tools = turn.calls_tools
        self.legacy = req.tool_use is not None and req.tool_use.legacy  # `functions`

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": kind, "created": self.created,
                "model": self.state.served_name, "choices": choices,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    async def collect(self) -> dict[str, Any]:
        written = _Written(self.req.params.n)
        async for piece in pieces(self.turn):
            self.count.add(piece.chunk, num_reasoning=piece.num_reasoning_tokens)
            written.add(piece, _logprobs(self.token_text, piece.chunk))
        return await self._answered(written)

    async def _answered(self, written: _Written) -> dict[str, Any]:
        """The `chat.completion` of what the choices wrote; stored where asked."""
        with_logprobs = self.req.params.logprobs
        choices = []
        for i in range(self.req.params.n):
            content = "".join(written.texts[i])
            message = {"role": "assistant", "content": content, "refusal": None}
            reasoning = "".join(written.reasoning[i])
            if reasoning:  # both names: clients read one or the other
                message |= {"reasoning_content": reasoning, "reasoning": reasoning}
            calls = whole_calls(written.calls[i])
            if self.calls_tools:
                message["content"] = content or (None if calls else "")
            if calls and self.legacy:
                message["function_call"] = openai_calls(calls)[0]["function"]
            elif calls:
                message["tool_calls"] = openai_calls(calls)
            choices.append({
                "index": i, "message": message,
                "logprobs": {"content": written.logprobs[i], "refusal": None}
                if with_logprobs else None,
                "finish_reason": self._finish(written.finish[i])})
        completion = self._object("chat.completion", choices) | {"usage": self.count.usage()}
        if self.req.store:
            await self.state.db.run(self.state.chat_completions.put, self.owner, completion,
                                    self.req.messages, self.req.metadata or {})
        return completion

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        extra = {"usage": None} if self.req.include_usage else {}

        def event(index: int, delta: dict, finish: str | None = None, logprobs=None) -> dict:
            return self._object("chat.completion.chunk", [{
                "index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish}]) | extra

        # A reply that can only be calls has null content, streamed as it is whole.
        only_calls = self.calls_tools and self.req.tool_use.forced
        for i in range(self.req.params.n):
            yield event(i, {"role": "assistant", "content": None if only_calls else ""})
        written = _Written(self.req.params.n) if self.req.store else None  # to be stored
        async for piece in pieces(self.turn):
            chunk = piece.chunk
            self.count.add(chunk, num_reasoning=piece.num_reasoning_tokens)
            lp = _logprobs(self.token_text, chunk)
            if written is not None:
                written.add(piece, lp)
            delta = _delta(piece, lp is not None, self.legacy)
            if delta is not None:
                yield event(chunk.index, delta, logprobs=lp)
            if piece.finish_reason is not None:
                yield event(chunk.index, {}, self._finish(piece.finish_reason))
        if written is not None:
            await self._answered(written)
        if self.req.include_usage:
            yield self._object("chat.completion.chunk", []) | {"usage": self.count.usage()}

    def _finish(self, reason: str | None) -> str | None:
        return "function_call" if self.legacy and reason == "tool_calls" else reason


class _Written:
    """What each of a request's choices wrote: content, reasoning, calls, logprobs, finish."""

    def __init__(self, n: int) -> None:
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.reasoning: list[list[str]] = [[] for _ in range(n)]
        self.calls: list[list[CallDelta]] = [[] for _ in range(n)]
        self.logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n

    def add(self, piece: Piece, logprobs: dict[str, Any] | None) -> None:
        i = piece.chunk.index
        self.texts[i].append(piece.content)
        self.reasoning[i].append(piece.reasoning)
        self.calls[i] += piece.calls
        if logprobs is not None:
            self.logprobs[i] += logprobs["content"]
        if piece.finish_reason is not None:
            self.finish[i] = piece.finish_reason


def _delta(piece: Piece, has_logprobs: bool, legacy: bool) -> dict[str, Any] | None:
    """A stream event's delta: reasoning, content and call pieces (None: nothing to send);
    `legacy`: the one call's pieces as `function_call` ({name, arguments} first, then
    arguments)."""
    delta: dict[str, Any] = {}
    if piece.reasoning:
        delta |= {"reasoning_content": piece.reasoning, "reasoning": piece.reasoning}
    if piece.content or (has_logprobs and not piece.calls and not piece.reasoning):
        delta["content"] = piece.content
    if piece.calls and legacy:
        delta["function_call"] = openai_deltas(piece.calls)[0]["function"]
    elif piece.calls:
        delta["tool_calls"] = openai_deltas(piece.calls)
    return delta or None
