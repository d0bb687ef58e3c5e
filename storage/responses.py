"""Stored responses of the Responses API (`store`, default true): the response object as it was
answered, and the conversation it ends (its input and output as chat messages), which a later
request continues with `previous_response_id`. Per tenant, like files and batches.

Every method runs on the database thread (call it through Database.run / Database.call).
"""

from __future__ import annotations

import json
import time
from typing import Any

from storage.db import Database


class ResponseStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def put(self, tenant: str, response: dict[str, Any], conversation: list[dict[str, Any]]
            ) -> None:
        with self.db.transaction() as db:
            db.insert("responses", {
                "id": response["id"], "tenant": tenant, "created_at": int(time.time()),
                "response": json.dumps(response, ensure_ascii=False),
                "conversation": json.dumps(conversation, ensure_ascii=False),
                "status": response.get("status")}, replace_on=("id",))

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

    def fail_unfinished(self, error: dict[str, str]) -> int:
        """Store every queued or in-progress (background) response failed with `error`; at
        start, since none can still be running. Returns how many."""
        with self.db.transaction() as db:
            rows = db.query("select id, tenant, response from responses where status in "
                            "('queued', 'in_progress')")
            for row in rows:
                response = json.loads(row["response"]) | {"status": "failed", "error": error}
                db.execute("update responses set response = ?, status = 'failed' where id = ? "
                           "and tenant = ?", [json.dumps(response, ensure_ascii=False),
                                              row["id"], row["tenant"]])
        return len(rows)
