"""Anthropic's message threads (beta): the conversation a message ends, held under the message's
id, so that the next turn sends only its new messages (`thread: {"type": "continue",
"previous_message_id": ...}`), and the fields a thread keeps from the turn that created it
(its `system` and `tools`, as sent). A thread is a line: a message is continued once. While a
request continues it the message is claimed (`continued_by` names the new message, which is
stored when its reply is whole); a request that fails gives its claim back, and a crash's
claims are given back at start.

Every method runs on the database thread (call it through Database.run / Database.call).
"""

from __future__ import annotations

import json
import time
from typing import Any

from storage.db import Database


class ThreadError(Exception):
    """Why a message cannot be continued: Anthropic's error_code (thread_not_found,
    thread_already_continued, thread_continue_in_flight)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class ThreadStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    def put(self, tenant: str, message_id: str, conversation: list[dict[str, Any]],
            fields: dict[str, Any] | None = None) -> None:
        with self.db.transaction() as db:
            db["message_threads"].insert({
                "id": message_id, "tenant": tenant, "created_at": int(time.time()),
                "conversation": json.dumps(conversation, ensure_ascii=False),
                "fields": json.dumps(fields or {}, ensure_ascii=False),
                "continued_by": None}, replace=True)

    def fields(self, tenant: str, message_id: str) -> dict[str, Any]:
        """The fields the thread keeps (system, tools); ThreadError where there is none."""
        rows = list(self.db.db.query("select fields from message_threads where id = ? and "
                                     "tenant = ?", [message_id, tenant]))
        if not rows:
            raise ThreadError("thread_not_found")
        return json.loads(rows[0]["fields"])

    def claim(self, tenant: str, previous_id: str, message_id: str) -> list[dict[str, Any]]:
        """The conversation `previous_id` ends, now claimed by `message_id`; ThreadError where
        there is none, or another message continued it or is continuing it."""
        with self.db.transaction() as db:
            row = next(iter(db.query("select conversation, continued_by from message_threads "
                                     "where id = ? and tenant = ?", [previous_id, tenant])),
                       None)
            if row is None:
                raise ThreadError("thread_not_found")
            if row["continued_by"] is not None:
                done = next(iter(db.query("select 1 from message_threads where id = ?",
                                          [row["continued_by"]])), None)
                raise ThreadError("thread_already_continued" if done else
                                  "thread_continue_in_flight")
            db.execute("update message_threads set continued_by = ? where id = ?",
                       [message_id, previous_id])
            return json.loads(row["conversation"])

    def conversation(self, tenant: str, previous_id: str) -> list[dict[str, Any]]:
        """The conversation `previous_id` ends, unclaimed (counting tokens); ThreadError."""
        rows = list(self.db.db.query("select conversation from message_threads where id = ? "
                                     "and tenant = ?", [previous_id, tenant]))
        if not rows:
            raise ThreadError("thread_not_found")
        return json.loads(rows[0]["conversation"])

    def release(self, previous_id: str, message_id: str) -> None:
        """`message_id` failed: `previous_id` may be continued again."""
        with self.db.transaction() as db:
            db.execute("update message_threads set continued_by = null where id = ? and "
                       "continued_by = ?", [previous_id, message_id])

    def release_unfinished(self) -> int:
        """Give back the claims of messages that were never stored (a crash); at start."""
        with self.db.transaction() as db:
            return db.execute(
                "update message_threads set continued_by = null where continued_by is not null "
                "and continued_by not in (select id from message_threads)").rowcount
