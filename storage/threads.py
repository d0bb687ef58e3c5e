"""Anthropic's message threads (beta): what a message adds to its conversation (the turn's new
messages and the reply), held under the message's id with the id it continues, so the next turn
sends only its new messages (`thread: {"type": "continue", "previous_message_id": ...}`) and a
conversation of N turns takes N rows, not N copies of itself. A row also keeps the fields a
thread holds from the turn that created it (its `system` and `tools`, as sent). A thread is a
line: a message is continued once. While a request continues it the message is claimed
(`continued_by` names the new message, which is stored when its reply is whole, `continued_on`
the replica answering it); a request that fails gives its claim back, the claims of a replica
that crashed (or stopped) are given back when a server starts, and messages untouched for
THREAD_DAYS are dropped then (a thread that lost one is not found: the SDK replays it).

Every method runs on the database thread (call it through Database.run / Database.call).
"""

from __future__ import annotations

import json
import time
from typing import Any

from storage.db import Database
from storage.replicas import LIVE, ReplicaStore

THREAD_DAYS = 30


class ThreadError(Exception):
    """Why a message cannot be continued: Anthropic's error_code (thread_not_found,
    thread_already_continued, thread_continue_in_flight)."""

    def __init__(self, code: str) -> None:
        super().__init__(code)
        self.code = code


class ThreadStore:
    def __init__(self, db: Database, replica: ReplicaStore | None = None) -> None:
        self.db = db
        self.replica = replica  # this server's (None: a store without replicas, in tests)

    def put(self, tenant: str, message_id: str, parent: str | None,
            messages: list[dict[str, Any]], fields: dict[str, Any] | None = None) -> None:
        """`message_id` continues `parent` (None: a new thread) with `messages`."""
        with self.db.transaction() as db:
            db.insert("message_threads", {
                "id": message_id, "tenant": tenant, "created_at": int(time.time()),
                "parent": parent, "messages": json.dumps(messages, ensure_ascii=False),
                "fields": json.dumps(fields or {}, ensure_ascii=False),
                "continued_by": None}, replace_on=("id",))

    def fields(self, tenant: str, message_id: str) -> dict[str, Any]:
        """The fields the thread keeps (system, tools); ThreadError where there is none."""
        return json.loads(self._row(self.db.conn, tenant, message_id)["fields"])

    def conversation(self, tenant: str, message_id: str) -> list[dict[str, Any]]:
        """The whole conversation `message_id` ends; ThreadError where a part of it is gone."""
        return self._conversation(self.db.conn, tenant, message_id)

    def claim(self, tenant: str, previous_id: str, message_id: str) -> list[dict[str, Any]]:
        """The conversation `previous_id` ends, now claimed by `message_id`; ThreadError where
        there is none, or another message continued it or is continuing it."""
        with self.db.transaction() as db:
            row = self._row(db, tenant, previous_id)
            if row["continued_by"] is not None:
                done = db.one("select 1 as found from message_threads where id = ?",
                              [row["continued_by"]])
                raise ThreadError("thread_already_continued" if done else
                                  "thread_continue_in_flight")
            conversation = self._conversation(db, tenant, previous_id)
            db.execute("update message_threads set continued_by = ?, continued_on = ? where "
                       "id = ?", [message_id, self.replica and self.replica.id, previous_id])
            return conversation

    def release(self, previous_id: str, message_id: str) -> None:
        """`message_id` failed: `previous_id` may be continued again."""
        with self.db.transaction() as db:
            db.execute("update message_threads set continued_by = null where id = ? and "
                       "continued_by = ?", [previous_id, message_id])

    def release_unfinished(self) -> int:
        """At start: give back the claims of messages never stored whose replica is gone (a
        crash; live replicas' are still being answered), and drop the messages older than
        THREAD_DAYS. Returns the claims given back."""
        live_after = self.replica.live_after() if self.replica else 1 << 62
        with self.db.transaction() as db:
            db.execute("delete from message_threads where created_at < ?",
                       [int(time.time()) - THREAD_DAYS * 86400])
            return db.execute(
                "update message_threads set continued_by = null, continued_on = null where "
                "continued_by is not null and continued_by not in (select id from "
                f"message_threads) and (continued_on is null or continued_on not in {LIVE})",
                [live_after])

    @staticmethod
    def _row(db: Any, tenant: str, message_id: str) -> dict[str, Any]:
        row = db.one("select * from message_threads where id = ? and tenant = ?",
                     [message_id, tenant])
        if row is None:
            raise ThreadError("thread_not_found")
        return row

    def _conversation(self, db: Any, tenant: str, message_id: str) -> list[dict[str, Any]]:
        parts, at = [], message_id
        while at is not None:
            row = self._row(db, tenant, at)
            parts.append(json.loads(row["messages"]))
            at = row["parent"]
        return [m for part in reversed(parts) for m in part]
