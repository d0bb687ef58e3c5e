"""Stored chat completions (`store: true` on /v1/chat/completions): the `chat.completion` as it
was answered, the messages it answered and its metadata, listed oldest first. Per tenant, like
stored responses.

Every method runs on the database thread (call it through Database.run / Database.call).
"""

from __future__ import annotations

import json
from typing import Any

from storage.db import Database


class ChatCompletionStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def put(self, tenant: str, completion: dict[str, Any], messages: list[dict[str, Any]],
            metadata: dict[str, str]) -> None:
        with self.db.transaction() as db:
            db.insert("chat_completions", {
                "id": completion["id"], "tenant": tenant, "created_at": completion["created"],
                "model": completion["model"], "metadata": json.dumps(metadata),
                "completion": json.dumps(completion, ensure_ascii=False),
                "messages": json.dumps(messages, ensure_ascii=False)}, replace_on=("id",))

    def get(self, tenant: str, completion_id: str
            ) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the completion with its metadata, the messages it answered), or None."""
        row = self.db.conn.one(
            "select completion, metadata, messages from chat_completions where id = ? and "
            "tenant = ?", [completion_id, tenant])
        if row is None:
            return None
        return _completion(row), json.loads(row["messages"])

    def list(self, tenant: str, model: str | None, metadata: dict[str, str]
             ) -> list[dict[str, Any]]:
        """The tenant's completions oldest first, of `model` if given, holding every pair of
        `metadata`."""
        where, args = "tenant = ?", [tenant]
        if model is not None:
            where, args = where + " and model = ?", [tenant, model]
        rows = self.db.conn.query(f"select completion, metadata from chat_completions where "
                                  f"{where} order by created_at, rowid", args)
        out = [_completion(row) for row in rows]
        return [c for c in out if metadata.items() <= c["metadata"].items()]

    def set_metadata(self, tenant: str, completion_id: str, metadata: dict[str, str]
                     ) -> dict[str, Any] | None:
        with self.db.transaction() as db:
            changed = db.execute("update chat_completions set metadata = ? where id = ? and "
                                 "tenant = ?", [json.dumps(metadata), completion_id, tenant])
        found = self.get(tenant, completion_id) if changed else None
        return found[0] if found else None

    def delete(self, tenant: str, completion_id: str) -> bool:
        with self.db.transaction() as db:
            return db.execute("delete from chat_completions where id = ? and tenant = ?",
                              [completion_id, tenant]) > 0


def _completion(row: dict[str, Any]) -> dict[str, Any]:
    return json.loads(row["completion"]) | {"metadata": json.loads(row["metadata"])}
