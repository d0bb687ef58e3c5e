"""POST /api/chat and /api/generate: Ollama's native replies over the same turn as chat
(turn.py): one JSON object, or newline-delimited JSON objects as the text comes (`done` false),
then the last one with `done`, `done_reason` and the counts and durations (nanoseconds)
Ollama's clients read. The thinking block goes to `thinking`, calls to `message.tool_calls`
(their arguments as objects, each call whole in the chunk after it ends)."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.admission import admit, read_request
from server.api.auth import tenant
from server.api.generation.protocol import ChatRequest
from server.api.generation.tool_calls import whole_calls
from server.api.generation.tool_formats import parsed_arguments
from server.api.generation.turn import pieces, start_turn
from server.api.ollama.protocol import parse_ollama_chat, parse_ollama_generate
from server.api.state import ServerState
from server.api.usage import TokenCount


async def chat(request: Request) -> Response:
    return await _reply(request, parse_ollama_chat, "message")


async def generate(request: Request) -> Response:
    return await _reply(request, parse_ollama_generate, "response")


async def _reply(request: Request, parse, shape: str) -> Response:
    state, req = await read_request(request, parse)
    async with admit(state, req, tenant(request)) as place:
        if req.max_tokens == 0:  # /api/generate with no prompt: the model is loaded, done
            return JSONResponse(_done(state, shape, "load", TokenCount(0), time.monotonic()))
        turn = await start_turn(state, req, place.owner, place.priority,
                                f"ollama-{uuid.uuid4().hex}")
        run = OllamaRun(state, req, turn, shape)
        if req.stream:
            return place.stream(run.stream(), "ollama")
        return await place.answer(request, run.collect())


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def _done(state: ServerState, shape: str, reason: str, count: TokenCount, started: float,
          first: float | None = None, **fields: Any) -> dict[str, Any]:
    """The last object: the reply's end, its counts and durations (ns)."""
    end = time.monotonic()
    first = first or end
    body = {"role": "assistant", "content": ""} if shape == "message" else ""
    return {"model": state.served_name, "created_at": now(), shape: body, **fields,
            "done": True, "done_reason": reason,
            "total_duration": int((end - started) * 1e9), "load_duration": 0,
            "prompt_eval_count": count.num_prompt,
            "prompt_eval_duration": int((first - started) * 1e9),
            "eval_count": count.num_output, "eval_duration": int((end - first) * 1e9)}


class OllamaRun:
    def __init__(self, state: ServerState, req: ChatRequest, turn: Any, shape: str) -> None:
        self.state, self.req, self.turn, self.shape = state, req, turn, shape
        self.count = TokenCount(turn.num_prompt_tokens)
        self.started = time.monotonic()

    def _chunk(self, content: str, thinking: str = "", calls: list | None = None
               ) -> dict[str, Any]:
        if self.shape == "message":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [{"function": {
                    "name": c.name, "arguments": _object(c.arguments)}} for c in calls]
            return {"model": self.state.served_name, "created_at": now(), "message": message,
                    "done": False}
        out = {"model": self.state.served_name, "created_at": now(), "response": content,
               "done": False}
        return out | ({"thinking": thinking} if thinking else {})

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        first, reason, said = None, "stop", []
        async for piece in pieces(self.turn):
            self.count.add(piece.chunk, num_reasoning=piece.num_reasoning_tokens)
            first = first or time.monotonic()
            said += piece.calls
            if piece.content or piece.reasoning:
                yield self._chunk(piece.content, piece.reasoning)
            if piece.finish_reason is not None:
                reason = "length" if piece.finish_reason == "length" else "stop"
        calls = whole_calls(said)
        if calls:
            yield self._chunk("", calls=calls)
        yield _done(self.state, self.shape, reason, self.count, self.started, first)

    async def collect(self) -> dict[str, Any]:
        content, thinking, calls, last = "", "", [], None
        async for event in self.stream():
            if event["done"]:
                last = event
                break
            body = event.get("message") or {}
            content += body.get("content", "") if self.shape == "message" else event["response"]
            thinking += (body if self.shape == "message" else event).get("thinking", "")
            calls += body.get("tool_calls", [])
        whole = self._chunk(content, thinking)
        if calls:
            whole["message"]["tool_calls"] = calls
        return last | {self.shape: whole[self.shape]} | (
            {"thinking": thinking} if thinking and self.shape != "message" else {})


def _object(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Ollama's clients take (a cut-off call's: empty)."""
    value = parsed_arguments(arguments)
    return value if isinstance(value, dict) else {}
