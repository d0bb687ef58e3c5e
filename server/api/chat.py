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
    chunks = stream_engine(state, prompt_ids, params, rid, salt, priority)
    n = len(prompt_ids)
    return Generation(lambda: _collect(state, req, rid, chunks, n),
                      lambda: _stream(state, req, rid, chunks, n))


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


async def _collect(state: ServerState, req: ChatRequest, rid: str,
                   chunks: AsyncIterator[CompletionChunk], num_prompt: int) -> dict[str, Any]:
    n = req.params.n
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[dict]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    count = TokenCount(num_prompt)
    token_text = TokenText(state.tokenizer)
    async for chunk in chunks:
        i = chunk.index
        texts[i].append(chunk.text)
        count.add(chunk)
        lp = _logprobs(token_text, chunk)
        if lp is not None:
            logprobs[i] += lp["content"]
        if chunk.finish_reason is not None:
            finish[i] = chunk.finish_reason
    choices = [{
        "index": i,
        "message": {"role": "assistant", "content": "".join(texts[i]), "refusal": None},
        "logprobs": {"content": logprobs[i], "refusal": None} if req.params.logprobs else None,
        "finish_reason": finish[i],
    } for i in range(n)]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": state.served_name, "choices": choices,
            "usage": count.usage(),
            "system_fingerprint": SYSTEM_FINGERPRINT}


async def _stream(state: ServerState, req: ChatRequest, rid: str,
                  chunks: AsyncIterator[CompletionChunk], num_prompt: int
                  ) -> AsyncIterator[dict[str, Any]]:
    created = int(time.time())
    token_text = TokenText(state.tokenizer)
    extra = {"usage": None} if req.include_usage else {}

    def event(index: int, delta: dict, finish: str | None = None, logprobs=None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": state.served_name, "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                             "finish_reason": finish}], **extra}

    for i in range(req.params.n):
        yield event(i, {"role": "assistant", "content": ""})
    count = TokenCount(num_prompt)
    async for chunk in chunks:
        count.add(chunk)
        lp = _logprobs(token_text, chunk)
        if chunk.text or lp is not None:
            yield event(chunk.index, {"content": chunk.text}, logprobs=lp)
        if chunk.finish_reason is not None:
            yield event(chunk.index, {}, chunk.finish_reason)
    if req.include_usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created,
               "model": state.served_name, "system_fingerprint": SYSTEM_FINGERPRINT,
               "choices": [], "usage": count.usage()}
