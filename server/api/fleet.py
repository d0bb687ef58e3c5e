"""What a server does as one replica of a fleet sharing a store (docs/fleet.md), and as the
only one on a SQLite file: it beats its heartbeat, takes over what replicas gone silent left
(their background responses stored failed, their thread continuations given back), and names
itself on every response (x-localserve-replica), so a router's choice can be seen."""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.state import ServerState

log = logging.getLogger("localserve")

REPLICA_HEADER = "x-localserve-replica"
BEATS_PER_WINDOW = 5  # heartbeats within a stale window: a missed one or two is not death
# A background response's error once the server generating it stopped (or is gone)
STOPPED = {"code": "server_error",
           "message": "The server stopped before this response finished."}


async def join(state: ServerState) -> None:
    """At start: register, and fail what dead replicas left (on a SQLite file: every earlier
    process of this home, whose lock this one now holds)."""
    replica = state.replica
    if not state.db.postgres:
        await state.db.run(replica.alone)
    await state.db.run(replica.beat)
    await _take_over(state)
    if state.db.postgres:
        log.info("store: PostgreSQL at %s, as replica %s", state.db.describe(), replica.id)


async def heartbeat(state: ServerState) -> None:
    """Until cancelled: beat, and take over from replicas gone silent. A SQLite file has no
    other replicas (its lock): nothing to do, and no write every few seconds."""
    if not state.db.postgres:
        return
    replica = state.replica
    while True:
        await asyncio.sleep(replica.stale_seconds / BEATS_PER_WINDOW)
        try:
            await state.db.run(replica.beat)
            await _take_over(state)
        except Exception as e:  # noqa: BLE001 - the store is away: beat again later
            log.warning("heartbeat failed: %s", e)


async def _take_over(state: ServerState) -> None:
    """What replicas gone silent left: their background responses stored failed, the thread
    continuations they were answering given back (the batch lines they claimed need nothing:
    the next claim takes them)."""
    failed = await state.db.run(state.responses.fail_orphaned, STOPPED)
    if failed:
        log.info("%d background responses of a stopped server stored failed", failed)
    await state.db.run(state.threads.release_unfinished)
    await state.db.run(state.replica.forget_gone)


async def leave(state: ServerState) -> None:
    """A clean stop: this replica's claimed batch lines go back to the queue at once."""
    await state.db.run(state.replica.leave)


class ReplicaHeader:
    """x-localserve-replica: <replica id> on every HTTP response."""

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)
        await self.app(scope, receive, named)
