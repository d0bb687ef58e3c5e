"""POST /v1/chat/completions: `chat.completion`, or `chat.completion.chunk` events."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
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
from server.api.usage import TokenCount
from server.engine.async_engine import CompletionChunk
from server.models.tokenizer import chat_prompt_ids

SYSTEM_FINGERPRINT = "localserve"


async def create_chat_completion(request: Request) -> Response:
    return await respond(request, parse_chat, _start)


async def chat_answer(state: ServerState, body: dict[str, Any], salt: str, priority: int
                      ) -> dict[str, Any]:
    """The `chat.completion` a plain request with this body gets (for the batch queue)."""
    return await answer_for_batch(state, body, salt, priority, parse_chat, _start)


async def _start(state: ServerState, req: ChatRequest, salt: str, priority: int) -> Generation:
    prompt_ids = await off_loop(_prompt_ids, state.tokenizer, req.messages)
    params = with_max_tokens(state, req.params, req.max_tokens, len(prompt_ids), "messages")
    rid = new_id("chatcmpl")
    run = _Run(state, req, rid, len(prompt_ids))
    chunks = stream_engine(state, prompt_ids, params, rid, salt, priority)
    return Generation(lambda: run.collect(chunks), lambda: run.stream(chunks))


def _prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    try:
        return chat_prompt_ids(tokenizer, messages)
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
        choices = [{
            "index": i,
            "message": {"role": "assistant", "content": "".join(texts[i]), "refusal": None},
            "logprobs": {"content": logprobs[i], "refusal": None} if with_logprobs else None,
            "finish_reason": finish[i],
        } for i in range(n)]
        return self._object("chat.completion", choices) | {"usage": self.count.usage()}

    async def stream(self, chunks: AsyncIterator[CompletionChunk]
                     ) -> AsyncIterator[dict[str, Any]]:
        extra = {"usage": None} if self.req.include_usage else {}

        def event(index: int, delta: dict, finish: str | None = None, logprobs=None) -> dict:
            return self._object("chat.completion.chunk", [{
                "index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish}]) | extra

        for i in range(self.req.params.n):
            yield event(i, {"role": "assistant", "content": ""})
        async for chunk in chunks:
            self.count.add(chunk)
            lp = _logprobs(self.token_text, chunk)
            if chunk.text or lp is not None:
                yield event(chunk.index, {"content": chunk.text}, logprobs=lp)
            if chunk.finish_reason is not None:
                yield event(chunk.index, {}, chunk.finish_reason)
        if self.req.include_usage:
            yield self._object("chat.completion.chunk", []) | {"usage": self.count.usage()}
