"""Conversations of the Responses API (/v1/conversations): their metadata and items (Responses
items: messages, function calls and their outputs, each with its id), in order. Per tenant,
like stored responses. A response created with `conversation` adds its input and output items
at its end.

Every method runs on the database thread (call it through Database.run / Database.call).
"""

from __future__ import annotations

import json
import time
from typing import Any

from storage.db import Database


class ConversationStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, tenant: str, conversation_id: str, metadata: dict[str, str],
               items: list[dict[str, Any]]) -> dict[str, Any]:
        with self.db.transaction() as db:
            db.insert("conversations", {
                "id": conversation_id, "tenant": tenant, "created_at": int(time.time()),
                "metadata": json.dumps(metadata, ensure_ascii=False),
                "items": json.dumps(items, ensure_ascii=False)})
        return self.get(tenant, conversation_id)[0]

    def get(self, tenant: str, conversation_id: str
            ) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the conversation object, its items oldest first), or None if the tenant has none
        such."""
        row = self.db.conn.one(
            "select id, created_at, metadata, items from conversations where id = ? and "
            "tenant = ?", [conversation_id, tenant])
        if row is None:
            return None
        return ({"id": row["id"], "object": "conversation", "created_at": row["created_at"],
                 "metadata": json.loads(row["metadata"])}, json.loads(row["items"]))

    def set_metadata(self, tenant: str, conversation_id: str, metadata: dict[str, str]
                     ) -> dict[str, Any] | None:
        with self.db.transaction() as db:
            changed = db.execute("update conversations set metadata = ? where id = ? and "
                                 "tenant = ?", [json.dumps(metadata, ensure_ascii=False),
                                                conversation_id, tenant])
        return self.get(tenant, conversation_id)[0] if changed else None

    def add_items(self, tenant: str, conversation_id: str, items: list[dict[str, Any]]
                  ) -> bool:
        """Append items (in one transaction); False if the conversation is gone."""
        with self.db.transaction() as db:
            row = db.one("select items from conversations where id = ? and tenant = ?",
                         [conversation_id, tenant])
            if row is None:
                return False
            db.execute("update conversations set items = ? where id = ? and tenant = ?",
                       [json.dumps(json.loads(row["items"]) + items, ensure_ascii=False),
                        conversation_id, tenant])
        return True

    def delete_item(self, tenant: str, conversation_id: str, item_id: str) -> bool:
        """False if the conversation or the item is not there."""
        with self.db.transaction() as db:
            row = db.one("select items from conversations where id = ? and tenant = ?",
                         [conversation_id, tenant])
            items = json.loads(row["items"]) if row else []
            kept = [item for item in items if item["id"] != item_id]
            if len(kept) == len(items):
                return False
            db.execute("update conversations set items = ? where id = ? and tenant = ?",
                       [json.dumps(kept, ensure_ascii=False), conversation_id, tenant])
        return True

    def delete(self, tenant: str, conversation_id: str) -> bool:
        with self.db.transaction() as db:
            return db.execute("delete from conversations where id = ? and tenant = ?",
                              [conversation_id, tenant]) > 0
