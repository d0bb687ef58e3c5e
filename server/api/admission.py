"""The one way in for work that reaches the engine: every generating endpoint, embeddings and
the batch worker admit a parsed request here before they start it.

A handler reads top-down: `read_request` (the body, parsed once the model is ready), `admit`
(the request names the served model, an embedding model is not asked to generate, and a place
in the bounded interactive queue is taken, or for a batch line `stream` is refused), start the
work, reply. The place is given back when the handler leaves the `async with`, or, for a
stream, when the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.body import read_json
from server.api.errors import APIError, invalid
from server.api.sse import ndjson_response, sse_response
from server.api.state import ServerState
from server.engine.sequence import PRIORITY_INTERACTIVE


async def read_request(request: Request, parse: Callable[[dict, int], Any],
                       prepare: Callable[[ServerState, Any], Awaitable[Any]] | None = None
                       ) -> tuple[ServerState, Any]:
    """The state of the model the body names (held.py) and the body parsed by `parse` (a 400
    names the field); 503 while the first model loads (parsing needs its vocabulary).
    `prepare`: what the body needs from the server's store before it is parsed (a thread's
    fields)."""
    state: ServerState = request.app.state.server
    body = await read_json(request, state.settings.max_body_bytes)
    state.ready_engine()
    # the model the body names: the first, or one held beside it (loaded now if need be)
    state = await state.held.view_for(body.get("model") if isinstance(body, dict) else None)
    if prepare is not None:
        body = await prepare(state, body)
    return state, parse(body, state.vocab_size)


@dataclass(slots=True)
class Admission:
    """A request let in: whose it is, at which priority, and whether it holds a place in the
    interactive queue (released on leaving the `async with`, or by the stream it hands it to)."""

    state: ServerState
    owner: str  # the API key's tenant: prefix-cache salt, usage, stored objects
    priority: int
    holds_place: bool

    async def __aenter__(self) -> Admission:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.holds_place:
            self.holds_place = False
            self.state.release()

    async def reply(self, request: Request, run: Any, stream: bool, dialect: str) -> Response:
        """A started run's reply: its events streamed (`run.stream()`, in `dialect`), or its
        whole answer (`run.collect()`)."""
        if stream:
            return self.stream(run.stream(), dialect)
        return await self.answer(request, run.collect())

    def stream(self, events: AsyncIterator[dict[str, Any]], dialect: str) -> Response:
        """Reply with server-sent events (in `dialect`); the place goes with the stream."""
        handed, self.holds_place = self.holds_place, False
        on_close = self.state.release if handed else _nothing
        if dialect == "ollama":
            return ndjson_response(events, on_close)
        return sse_response(events, on_close, dialect)

    async def answer(self, request: Request, work: Awaitable[dict[str, Any]]) -> Response:
        """Reply with what `work` returns as JSON; cancelled if the client leaves first."""
        return JSONResponse(await until_disconnect(request, work))


def admit(state: ServerState, req: Any, owner: str, priority: int = PRIORITY_INTERACTIVE,
          generates: bool = True) -> Admission:
    """Let `req` (a parsed request with `model` and `stream`) in, or raise: 503 loading, 404
    another model, 400 generating on an embedding model, 429 the queue is full; a batch line
    (any other priority) takes no place and may not stream."""
    state.ready_engine()
    state.check_model(req.model)
    state.held.keep(state, getattr(req, "keep_alive", None))  # how long its model stays
    if generates:
        state.check_generates()
    if priority != PRIORITY_INTERACTIVE:
        if req.stream:
            raise invalid("stream", "Batch requests cannot stream.")
        return Admission(state, owner, priority, holds_place=False)
    state.acquire()
    return Admission(state, owner, priority, holds_place=True)


def _nothing() -> None:
    pass


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
