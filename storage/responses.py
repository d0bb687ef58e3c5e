"""Stored responses of the Responses API (`store`, default true): the response object as it was
answered, and the conversation it ends (its input and output as chat messages), which a later
request continues with `previous_response_id`. Per tenant, like files and batches. A background
response names the replica generating it: once that one is gone (storage/replicas.py), it is
stored failed.

Every method runs on the database thread (call it through Database.run / Database.call).
"""

from __future__ import annotations

import json
import time
from typing import Any

from storage.db import Database
from storage.replicas import LIVE, ReplicaStore


class ResponseStore:
    def __init__(self, db: Database, replica: ReplicaStore | None = None) -> None:
        self.db = db
        self.replica = replica  # this server's: it generates the background responses it puts

    def put(self, tenant: str, response: dict[str, Any], conversation: list[dict[str, Any]]
            ) -> None:
        with self.db.transaction() as db:
            db.insert("responses", {
                "id": response["id"], "tenant": tenant, "created_at": int(time.time()),
                "response": json.dumps(response, ensure_ascii=False),
                "conversation": json.dumps(conversation, ensure_ascii=False),
                "status": response.get("status"),
                "replica": self.replica and self.replica.id},
                replace_on=("id",))

    def get(self, tenant: str, response_id: str
            ) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(response, conversation), or None if this tenant stored no such response."""
        row = self.db.conn.one(
            "select response, conversation from responses where id = ? and tenant = ?",
            [response_id, tenant])
        if row is None:
            return None
        return json.loads(row["response"]), json.loads(row["conversation"])

    def delete(self, tenant: str, response_id: str) -> bool:
        with self.db.transaction() as db:
            return db.execute("delete from responses where id = ? and tenant = ?",
                              [response_id, tenant]) > 0

    def request_cancel(self, tenant: str, response_id: str) -> None:
        """Ask the replica generating a background response to stop it (a fleet's: the
        request came to another one); the replica sees it in `cancels_asked`."""
        with self.db.transaction() as db:
            db.execute("update responses set cancel_requested = ? where id = ? and tenant = ? "
                       "and status in ('queued', 'in_progress')",
                       [int(time.time()), response_id, tenant])

    def cancels_asked(self, response_ids: list[str]) -> list[str]:
        """Those of `response_ids` (running here) that another replica was asked to cancel."""
        marks = ", ".join("?" * len(response_ids))
        rows = self.db.conn.query(f"select id from responses where id in ({marks}) and "
                                  "cancel_requested is not null", response_ids)
        return [row["id"] for row in rows]

    def fail_orphaned(self, error: dict[str, str]) -> int:
        """Store failed, with `error`, every background response (queued or in progress) whose
        replica is gone (all of them without a replica store). Returns how many."""
        live_after = self.replica.live_after() if self.replica else 1 << 62
        with self.db.transaction() as db:
            rows = db.query("select id, tenant, response from responses where status in "
                            f"('queued', 'in_progress') and (replica is null or replica not in "
                            f"{LIVE})", [live_after])
            for row in rows:
                response = json.loads(row["response"]) | {"status": "failed", "error": error}
                db.execute("update responses set response = ?, status = 'failed' where id = ? "
                           "and tenant = ?", [json.dumps(response, ensure_ascii=False),
                                              row["id"], row["tenant"]])
        return len(rows)
