"""POST /v1/chat/completions: `chat.completion`, or `chat.completion.chunk` events.

With a response format or tools in force the request decodes under a grammar; with tools
offered the text is split into content and `tool_calls` (tool_calls.py), whole or streamed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.api.errors import invalid
from server.api.protocol import ChatRequest, parse_chat
from server.api.serving import (
    Generation,
    TokenText,
    answer_for_batch,
    new_id,
    off_loop,
    respond,
    stream_engine,
    with_max_tokens,
)
from server.api.state import ServerState
from server.api.structured import compile_grammar, schema_grammar
from server.api.tool_calls import Parsed, ToolCallParser, openai_calls, openai_deltas
from server.api.tools import tool_grammar, tool_messages
from server.api.usage import TokenCount
from server.engine.async_engine import CompletionChunk
from server.engine.grammar import lark_grammar
from server.models.tokenizer import chat_prompt_ids

SYSTEM_FINGERPRINT = "localserve"


async def create_chat_completion(request: Request) -> Response:
    return await respond(request, parse_chat, _start)


async def chat_answer(state: ServerState, body: dict[str, Any], salt: str, priority: int
                      ) -> dict[str, Any]:
    """The `chat.completion` a plain request with this body gets (for the batch queue)."""
    return await answer_for_batch(state, body, salt, priority, parse_chat, _start)


async def _start(state: ServerState, req: ChatRequest, salt: str, priority: int) -> Generation:
    template = getattr(state.tokenizer, "chat_template", None) or ""
    messages, tools = tool_messages(req.messages, req.tool_use, template)
    prompt_ids = await off_loop(_prompt_ids, state.tokenizer, messages, tools)
    params = with_max_tokens(state, req.params, req.max_tokens, len(prompt_ids), "messages")
    grammar, param = _grammar_text(req)
    if grammar is not None:
        params = replace(params, grammar=await compile_grammar(state, grammar, param))
    rid = new_id("chatcmpl")
    run = _Run(state, req, rid, len(prompt_ids))
    chunks = stream_engine(state, prompt_ids, params, rid, salt, priority)
    return Generation(lambda: run.collect(chunks), lambda: run.stream(chunks))


def _grammar_text(req: ChatRequest) -> tuple[str | None, str]:
    """The grammar the answer follows (llguidance's text) and the field it comes from."""
    if req.tool_use is not None and req.tool_use.is_active:
        return lark_grammar(tool_grammar(req.tool_use, req.output_schema)), "tools"
    if req.output_schema is not None:
        return schema_grammar(req.output_schema, "response_format"), "response_format"
    return None, ""


def _prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools) -> list[int]:
    try:
        return chat_prompt_ids(tokenizer, messages, tools)
    except Exception as e:  # noqa: BLE001 - a template that refuses these messages
        from jinja2 import TemplateError

        if isinstance(e, TemplateError):
            raise invalid("messages", f"The chat template refused these messages: {e}") from None
        raise


def _logprobs(token_text: TokenText, chunk: CompletionChunk) -> dict[str, Any] | None:
    if chunk.logprobs is None:
        return None
    content = []
    for token_id, lp, tops in chunk.logprobs:
        text, raw = token_text(token_id)
        content.append({
            "token": text, "logprob": lp, "bytes": raw,
            "top_logprobs": [{"token": token_text(t)[0], "logprob": v,
                              "bytes": token_text(t)[1]} for t, v in tops],
        })
    return {"content": content, "refusal": None}


class _Run:
    """One chat request: turns engine chunks into a `chat.completion` or its chunk events."""

    def __init__(self, state: ServerState, req: ChatRequest, rid: str, num_prompt: int) -> None:
        self.state, self.req, self.rid = state, req, rid
        self.count = TokenCount(num_prompt)
        self.token_text = TokenText(state.tokenizer)
        self.created = int(time.time())
        self.calls_tools = req.tool_use is not None and req.tool_use.is_active

    def _object(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": kind, "created": self.created,
                "model": self.state.served_name, "choices": choices,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    async def collect(self, chunks: AsyncIterator[CompletionChunk]) -> dict[str, Any]:
        n = self.req.params.n
        texts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[dict]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        async for chunk in chunks:
            i = chunk.index
            texts[i].append(chunk.text)
            self.count.add(chunk)
            lp = _logprobs(self.token_text, chunk)
            if lp is not None:
                logprobs[i] += lp["content"]
            if chunk.finish_reason is not None:
                finish[i] = chunk.finish_reason
        with_logprobs = self.req.params.logprobs
        choices = []
        for i in range(n):
            message = {"role": "assistant", "content": "".join(texts[i]), "refusal": None}
            if self.calls_tools:
                parser = ToolCallParser()
                content = parser.feed(message["content"]).content + parser.finish().content
                message["content"] = content or (None if parser.calls else "")
                if parser.calls:
                    message["tool_calls"] = openai_calls(parser.calls)
                    finish[i] = _finish(finish[i], parser)
            choices.append({
                "index": i, "message": message,
                "logprobs": {"content": logprobs[i], "refusal": None} if with_logprobs else None,
                "finish_reason": finish[i]})
        return self._object("chat.completion", choices) | {"usage": self.count.usage()}

    async def stream(self, chunks: AsyncIterator[CompletionChunk]
                     ) -> AsyncIterator[dict[str, Any]]:
        extra = {"usage": None} if self.req.include_usage else {}

        def event(index: int, delta: dict, finish: str | None = None, logprobs=None) -> dict:
            return self._object("chat.completion.chunk", [{
                "index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish}]) | extra

        n = self.req.params.n
        parsers = [ToolCallParser() for _ in range(n)] if self.calls_tools else None
        for i in range(n):
            yield event(i, {"role": "assistant", "content": ""})
        async for chunk in chunks:
            self.count.add(chunk)
            lp = _logprobs(self.token_text, chunk)
            finish = chunk.finish_reason
            if parsers is None:
                delta = {"content": chunk.text} if chunk.text or lp is not None else None
            else:
                parser = parsers[chunk.index]
                parsed = parser.feed(chunk.text)
                if finish is not None:
                    rest = parser.finish()
                    parsed = Parsed(parsed.content + rest.content, parsed.calls + rest.calls)
                    finish = _finish(finish, parser)
                delta = _delta(parsed, lp is not None)
            if delta is not None:
                yield event(chunk.index, delta, logprobs=lp)
            if finish is not None:
                yield event(chunk.index, {}, finish)
        if self.req.include_usage:
            yield self._object("chat.completion.chunk", []) | {"usage": self.count.usage()}


def _finish(reason: str | None, parser: ToolCallParser) -> str | None:
    """A choice that ended by itself after calling tools finished with "tool_calls"."""
    return "tool_calls" if reason == "stop" and parser.calls else reason


def _delta(parsed: Parsed, has_logprobs: bool) -> dict[str, Any] | None:
    """A stream event's delta: content and call pieces (None: nothing to send)."""
    delta: dict[str, Any] = {}
    if parsed.content or (has_logprobs and not parsed.calls):
        delta["content"] = parsed.content
    if parsed.calls:
        delta["tool_calls"] = openai_deltas(parsed.calls)
    return delta or None
