"""The servers sharing a store (several on one PostgreSQL database; one on a SQLite file), known
by their heartbeats. A replica whose heartbeat is older than the stale window is gone: the batch
lines it had claimed are free for the others (storage/batches.py claims them), the background
responses it was generating are stored failed (storage/responses.py), since nothing generates
them now, and the thread continuations it was answering are given back (storage/threads.py).

Every method runs on the database thread (call it through Database.run / Database.call).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import Any

from storage.db import Database

STALE_SECONDS = 30.0  # a replica silent this long is gone (--stale-seconds)
FORGET_AFTER = 24 * 3600  # a gone replica's row is deleted after this
# The live replicas' ids, for a query that is given ReplicaStore.live_after() for the ?
LIVE = "(select id from replicas where heartbeat_at >= ?)"


def new_replica_id() -> str:
    """host-pid-random: names the process in logs and in the x-localserve-replica header."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


class ReplicaStore:
    def __init__(self, db: Database, replica_id: str, stale_seconds: float = STALE_SECONDS
                 ) -> None:
        self.db = db
        self.id = replica_id
        self.stale_seconds = stale_seconds

    def live_after(self) -> int:
        """Heartbeats at or after this time are a live replica's."""
        return int(time.time() - self.stale_seconds)

    def beat(self) -> None:
        """This replica is alive (its first beat registers it)."""
        now = int(time.time())
        with self.db.transaction(serializable=False) as db:
            if db.execute("update replicas set heartbeat_at = ? where id = ?",
                          [now, self.id]) == 0:
                db.insert("replicas", {"id": self.id, "started_at": now, "heartbeat_at": now})

    def alone(self) -> None:
        """At start on a SQLite file (whose lock makes this the only server): every other
        replica there is a process that died, so what it held is free at once."""
        with self.db.transaction() as db:
            db.execute("delete from replicas where id != ?", [self.id])

    def leave(self) -> None:
        """A clean stop: the lines still claimed go back to the queue now, not after the stale
        window, and the replica is gone."""
        with self.db.transaction(serializable=False) as db:
            db.execute("update batch_lines set claimed_by = null, claimed_at = null where "
                       "claimed_by = ? and state = 'pending'", [self.id])
            db.execute("delete from replicas where id = ?", [self.id])

    def live(self) -> list[dict[str, Any]]:
        """The live replicas, oldest first."""
        return self.db.conn.query("select id, started_at, heartbeat_at from replicas where "
                                  "heartbeat_at >= ? order by started_at, id",
                                  [self.live_after()])

    def forget_gone(self) -> None:
        """Delete the rows of replicas gone for a day."""
        with self.db.transaction(serializable=False) as db:
            db.execute("delete from replicas where heartbeat_at < ?",
                       [int(time.time()) - FORGET_AFTER])
