"""The request pipeline chat and completions share: admission, tokenization off the event
loop, streaming from the engine with latency metrics, and aborting on disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.auth import tenant
from server.api.body import read_json
from server.api.errors import APIError, invalid
from server.api.sse import sse_response
from server.api.state import ServerState
from server.api.usage import TokenCount
from server.engine.async_engine import CompletionChunk
from server.engine.scheduler import RequestTooLargeError
from server.engine.sequence import PRIORITY_INTERACTIVE, SamplingParams
from server.models.tokenizer import byte_to_unicode

log = logging.getLogger("localserve")


@dataclass(slots=True)
class Generation:
    """A started request of either endpoint, answered whole or as a stream of chunks."""

    collect: Callable[[], Awaitable[dict[str, Any]]]
    stream: Callable[[], AsyncIterator[dict[str, Any]]]


Starter = Callable[[ServerState, Any, str, int], Awaitable[Generation]]


async def respond(request: Request, parse: Callable[[dict, int], Any], start: Starter,
                  dialect: str = "chat") -> Response:
    """What the generation endpoints do: parse, take a place in the queue (or 429), start,
    then answer whole (aborted if the client leaves) or stream (events in `dialect`)."""
    state: ServerState = request.app.state.server
    body = await read_json(request, state.settings.max_body_bytes)
    state.ready_engine()
    req = parse(body, state.vocab_size)
    state.check_model(req.model)
    state.check_generates()
    state.acquire()
    handed_to_stream = False  # a stream releases its place when it ends
    try:
        generation = await start(state, req, tenant(request), PRIORITY_INTERACTIVE)
        if req.stream:
            handed_to_stream = True
            return sse_response(generation.stream(), state.release, dialect)
        return JSONResponse(await until_disconnect(request, generation.collect()))
    finally:
        if not handed_to_stream:
            state.release()


async def answer_for_batch(state: ServerState, body: dict[str, Any], salt: str, priority: int,
                           parse: Callable[[dict, int], Any], start: Starter
                           ) -> dict[str, Any]:
    """The body a plain request would get (the batch queue's way in); raises APIError as the
    endpoint would answer."""
    req = parse(body, state.vocab_size)
    state.check_model(req.model)
    state.check_generates()
    if req.stream:
        raise invalid("stream", "Batch requests cannot stream.")
    return await (await start(state, req, salt, priority)).collect()


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def off_loop(fn: Callable, *args) -> Any:
    """Tokenization and templating run in a worker thread, never on the event loop."""
    return await asyncio.to_thread(fn, *args)


def with_max_tokens(state: ServerState, params: SamplingParams, max_tokens: int | None,
                    num_prompt_tokens: int, param: str) -> SamplingParams:
    """Fill in max_tokens (default: the rest of the context) and refuse what cannot fit."""
    limit = state.max_request_tokens
    if num_prompt_tokens == 0:
        raise invalid(param, "The prompt is empty.")
    if max_tokens is None:
        max_tokens = limit - num_prompt_tokens
        if max_tokens < 1:
            raise invalid(param, f"This model's maximum context length is {limit} tokens. "
                          f"However, your messages resulted in {num_prompt_tokens} tokens.",
                          code="context_length_exceeded")
    params = replace(params, max_tokens=max_tokens)
    try:
        state.ready_engine().check(num_prompt_tokens, params)
    except RequestTooLargeError as e:
        raise invalid(param, str(e), code="context_length_exceeded") from None
    return params


async def stream_engine(
    state: ServerState, prompt_ids: list[int], params: SamplingParams, request_id: str,
    salt: str, priority: int = PRIORITY_INTERACTIVE,
) -> AsyncIterator[CompletionChunk]:
    """engine.generate with TTFT / inter-token / end-to-end metrics and finish counts."""
    engine = state.ready_engine()
    start = last = time.perf_counter()
    first = True
    m = state.metrics
    num_open = params.n
    count = TokenCount(len(prompt_ids))  # what the request used so far, even if abandoned
    try:
        async for chunk in engine.generate(prompt_ids, params, priority, salt, request_id):
            now = time.perf_counter()
            (m.ttft if first else m.itl).observe(now - last)
            first, last = False, now
            count.add(chunk)
            if chunk.finish_reason is not None:
                m.finished[chunk.finish_reason] += 1
                num_open -= 1
            yield chunk
        m.e2e.observe(time.perf_counter() - start)
    finally:
        m.finished["abort"] += num_open  # the client left (or the request failed)
        if priority == PRIORITY_INTERACTIVE:  # batch lines count when their result is stored
            state.usage.add(salt, "interactive", state.served_name, count.num_prompt,
                            count.num_output, count.num_cached)
            state.usage_added()


async def merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async iterators as they come, tagged with the iterator's index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    out: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[Any]) -> None:
        try:
            async for item in it:
                await out.put((i, item))
            await out.put((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await out.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await out.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it (its requests are aborted)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise APIError(499, "The client closed the request.", code="client_closed_request")
    return task.result()


class TokenText:
    """Token strings and bytes for logprobs (byte-level BPE tokens map back to raw bytes; a
    token that is not whole UTF-8 reads `bytes:\\xe2\\x80`, as OpenAI writes it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder = {c: b for b, c in byte_to_unicode().items()}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            if piece and all(c in self._byte_decoder for c in piece):
                raw = bytes(self._byte_decoder[c] for c in piece)
            else:
                raw = self.tokenizer.decode([token_id]).encode()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: OpenAI's escaped form
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, list(raw))
        return hit

    def entries(self, logprobs: list) -> list[dict[str, Any]]:
        """An engine chunk's (token, logprob, top alternatives) as OpenAI's logprob objects
        (chat's `logprobs.content`, the Responses API's output_text `logprobs`)."""
        out = []
        for token_id, lp, tops in logprobs:
            text, raw = self(token_id)
            out.append({"token": text, "logprob": lp, "bytes": raw,
                        "top_logprobs": [{"token": self(t)[0], "logprob": v,
                                          "bytes": self(t)[1]} for t, v in tops]})
        return out

