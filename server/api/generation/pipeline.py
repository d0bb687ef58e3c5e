"""What every generating request does between its admission and its reply: prompts are
tokenized off the event loop, max_tokens is filled in and checked against the context, and the
engine's chunks stream with latency metrics, finish counts and interactive usage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from server.api.errors import invalid
from server.api.state import ServerState
from server.api.usage import TokenCount
from server.engine.output import CompletionChunk
from server.engine.scheduler import RequestTooLargeError
from server.engine.sequence import PRIORITY_INTERACTIVE, SamplingParams


async def off_loop(fn: Callable, *args) -> Any:
    """Tokenization and templating run in a worker thread, never on the event loop."""
    return await asyncio.to_thread(fn, *args)


def with_model_defaults(state: ServerState, params: SamplingParams, left_out: frozenset[str]
                        ) -> SamplingParams:
    """`params` with the model's recommended sampling (storage/sampling.py: its
    generation_config.json, or the catalogue's) in the fields the request left out."""
    chosen = {k: v for k, v in state.sampling_defaults.items() if k in left_out}
    return replace(params, **chosen) if chosen else params


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
