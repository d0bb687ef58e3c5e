"""Background responses (`background: true`): POST /v1/responses answers at once with the
response `queued`, and the model writes it after; GET /v1/responses/{id} shows its status until
it ends (`completed`, `incomplete`, `failed` or `cancelled`), POST /v1/responses/{id}/cancel
stops it, and GET with `stream=true` follows its events (from `starting_after`), as OpenAI's
background mode does for long tasks and clients that must not hold a connection.

A background response is generated like any other (the same turn, the interactive queue) and
holds a place among the server's pending requests while it runs. Its status is stored at each
change, so a poll reads the database; its events stay in memory for followers until
KEEP_SECONDS after it ends. A client leaving its stream does not stop it. A server that stops
first stores it `failed` (at shutdown, or at the next start after a crash).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from server.api.errors import APIError, invalid, log
from server.api.fleet import STOPPED
from server.api.openai.response_run import ResponseRun
from server.api.pagination import int_param
from server.api.sse import sse_response
from server.api.state import ServerState

UNFINISHED = ("queued", "in_progress")
KEEP_SECONDS = 600  # a finished response's events, for followers (OpenAI keeps ~10 minutes)
# A cancel that reached another replica of a fleet: how often the replica generating the
# response looks for it, and how long the cancelling request waits to see it stored
CANCEL_POLL_SECONDS = 1.0
CANCEL_WAIT_SECONDS = 15.0
SHUTDOWN = STOPPED


class BackgroundRun:
    """One background response: its task and the stream events it has written so far."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.events: list[dict[str, Any]] = []
        self.task: asyncio.Task | None = None
        self.cancelled = False  # a client cancelled it (else a stop means the server's)
        self.ended_at: float | None = None
        self._more = asyncio.Event()  # set when an event is added or the run ends

    def add(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        self._wake()

    def end(self) -> None:
        self.ended_at = time.monotonic()
        self._wake()

    def _wake(self) -> None:
        self._more.set()
        self._more = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[dict[str, Any]]:
        """The events numbered above `after`, then each as it comes, until the run ends."""
        sent = max(0, after + 1)
        while True:
            more = self._more
            while sent < len(self.events):
                yield self.events[sent]
                sent += 1
            if self.ended_at is not None:
                return
            await more.wait()


@dataclass(slots=True)
class Queued:
    """What the request that starts a background response answers: the response as stored
    queued, or a stream that follows the task's events from the first."""

    response: dict[str, Any]
    run: BackgroundRun

    async def collect(self) -> dict[str, Any]:
        return self.response

    def stream(self) -> AsyncIterator[dict[str, Any]]:
        return self.run.follow(-1)


async def start(state: ServerState, run: ResponseRun, owner: str) -> Queued:
    """Store `run`'s response queued and generate it in a task of its own."""
    _forget_old(state)
    state.hand_on()  # the request's place, kept until the task ends
    bg = BackgroundRun(owner)
    try:
        queued = run.response("queued", [])
        await state.db.run(state.responses.put, owner, queued, run.conversation)
    except BaseException:
        state.release()
        raise
    state.background[queued["id"]] = bg
    bg.task = asyncio.get_running_loop().create_task(_generate(state, run, bg))
    return Queued(queued, bg)


async def _generate(state: ServerState, run: ResponseRun, bg: BackgroundRun) -> None:
    put = state.responses.put
    try:
        await state.db.run(put, bg.owner, run.response("in_progress", []), run.conversation)
        async for event in run.stream():  # stores the finished response itself
            bg.add(event)
    except asyncio.CancelledError:
        status, error = ("cancelled", None) if bg.cancelled else ("failed", SHUTDOWN)
        await asyncio.shield(state.db.run(put, bg.owner, run.response(status, [], error=error),
                                          run.conversation))
    except Exception as e:  # noqa: BLE001 - the response fails, not the server
        if not isinstance(e, APIError):
            log.exception("background response %s failed", run.turn.request_id)
        error = {"code": e.code or e.type, "message": e.message} if isinstance(
            e, APIError) else {"code": "server_error", "message": f"{type(e).__name__}: {e}"}
        failed = run.response("failed", [], error=error)
        await state.db.run(put, bg.owner, failed, run.conversation)
        bg.add({"type": "response.failed", "sequence_number": len(bg.events),
                "response": failed})
    finally:
        bg.end()
        state.release()


def _forget_old(state: ServerState) -> None:
    now = time.monotonic()
    for response_id, bg in list(state.background.items()):
        if bg.ended_at is not None and now - bg.ended_at > KEEP_SECONDS:
            del state.background[response_id]


async def stop(state: ServerState, response_id: str) -> None:
    """Cancel the response's generation if it runs here, and wait until its status is stored."""
    bg = state.background.get(response_id)
    if bg is not None and bg.task is not None and not bg.task.done():
        bg.cancelled = True
        bg.task.cancel()
        await asyncio.wait([bg.task])


async def follow_cancels(state: ServerState) -> None:
    """Until cancelled, on a fleet's store: stop the background responses running here that a
    client cancelled through another replica (ResponseStore.request_cancel), looking once a
    second while any runs."""
    while state.db.postgres:
        await asyncio.sleep(CANCEL_POLL_SECONDS)
        running = [rid for rid, bg in state.background.items() if bg.ended_at is None]
        if not running:
            continue
        try:
            asked = await state.db.run(state.responses.cancels_asked, running)
        except Exception as e:  # noqa: BLE001 - the store is away: look again later
            log.warning("looking for cancelled responses failed: %s", e)
            continue
        for response_id in asked:
            await stop(state, response_id)


async def wait_ended(state: ServerState, owner: str, response_id: str) -> dict[str, Any]:
    """The stored response once it has ended (its replica stopped it), or as it is after
    CANCEL_WAIT_SECONDS."""
    deadline = time.monotonic() + CANCEL_WAIT_SECONDS
    while True:
        found = await state.db.run(state.responses.get, owner, response_id)
        if found is None or found[0]["status"] not in UNFINISHED \
                or time.monotonic() > deadline:
            return found[0] if found else {}
        await asyncio.sleep(0.1)


async def stop_all(state: ServerState) -> None:
    """Server shutdown: every running background response is stored failed."""
    tasks = [bg.task for bg in state.background.values() if bg.task and not bg.task.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)


def follow_stream(request: Request, state: ServerState, response: dict[str, Any]) -> Response:
    """GET /v1/responses/{id}?stream=true: the background response's events after
    `starting_after` (default: all), then the rest as they come."""
    q = request.query_params
    after = int_param(q.get("starting_after"), "starting_after", -1, -1, 1 << 62)
    bg = state.background.get(response["id"])
    if not response.get("background"):
        raise invalid("stream", "Only a response created with background=true can be "
                      "streamed from GET.")
    if bg is None:  # (the caller found the response this key's)
        raise invalid("stream", f"The events of response '{response['id']}' are not kept "
                      f"on this server (the server generating a response keeps them until "
                      f"{KEEP_SECONDS} s after it ends); GET it without 'stream' for the "
                      "response.")
    state.acquire()
    return sse_response(bg.follow(after), state.release, "responses")
