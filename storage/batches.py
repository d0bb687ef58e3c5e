"""Batches and their lines in the store: the durable half of the Batch API.

A line is 'pending' until its result is stored; storing it moves it to 'done' (2xx), 'failed'
(an error answer) or 'cancelled' / 'expired' in the same transaction that counts it, and only
if it was still pending. So a line that ran twice (a crash between running and storing) is
stored once, and the output file, written from these rows, has every custom_id exactly once.
Replicas sharing the store claim lines before running them (`claim`): a claim only keeps the
others from running the line too while its replica lives; the pending guard is what makes a
result count once.
Every method runs on the database thread.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from storage.db import Database
from storage.files import FileStore, idempotent_hit, remember
from storage.replicas import LIVE, ReplicaStore
from storage.sql import Conn

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
ENDED = ("completed", "failed", "expired", "cancelled")
TIMESTAMPS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
              "failed_at", "expired_at", "cancelling_at", "cancelled_at")


MESSAGES = "/v1/messages"  # the endpoint of Anthropic's Message Batches (message_batches.py)


def new_batch_id(endpoint: str) -> str:
    return f"{'msgbatch' if endpoint == MESSAGES else 'batch'}_{uuid.uuid4().hex}"


class BatchStore:
    def __init__(self, db: Database, files: FileStore) -> None:
        self.db = db
        self.files = files

    # -- batches ---------------------------------------------------------------------------------

    def create(self, tenant: str, fields: dict[str, Any], window_seconds: int,
               idempotency_key: str | None = None,
               lines: list[tuple[int, str, str]] | None = None) -> dict[str, Any]:
        """A batch 'validating' its input file, or, given its `lines` (Anthropic's Message
        Batches, whose requests come with them), 'in_progress' with them in the same
        transaction."""
        with self.db.transaction() as db:
            if idempotency_key:
                first = idempotent_hit(db, tenant, "batches", idempotency_key)
                if first is not None and (row := self._get(db, tenant, first)) is not None:
                    return row
            now = int(time.time())
            row = {"id": new_batch_id(fields["endpoint"]), "tenant": tenant,
                   "status": "validating", "created_at": now,
                   "expires_at": now + window_seconds, "errors": None, "total": 0,
                   "completed": 0, "failed": 0, **fields}
            row["metadata"] = json.dumps(fields.get("metadata"))
            if lines is not None:
                row |= {"status": "in_progress", "in_progress_at": now, "total": len(lines)}
            db.insert("batches", row)
            if lines is not None:
                self._insert_lines(db, row["id"], lines)
            if idempotency_key:
                remember(db, tenant, "batches", idempotency_key, row["id"])
        return self._get(self.db.conn, tenant, row["id"])

    def get(self, tenant: str, batch_id: str, messages: bool = False
            ) -> dict[str, Any] | None:
        """The tenant's OpenAI batch or (messages) Anthropic Message Batch of that id."""
        row = self._get(self.db.conn, tenant, batch_id)
        return row if row is not None and (row["endpoint"] == MESSAGES) == messages else None

    def _get(self, db: Conn, tenant: str | None, batch_id: str) -> dict[str, Any] | None:
        sql, args = "select * from batches where id = ?", [batch_id]
        if tenant is not None:
            sql, args = sql + " and tenant = ?", [batch_id, tenant]
        return db.one(sql, args)

    def list(self, tenant: str, limit: int, after: str | None = None, before: str | None = None,
             messages: bool = False) -> tuple[list[dict[str, Any]], bool]:
        """OpenAI's batches or (messages) Anthropic's Message Batches, newest first (creation
        order is rowid order). `after` / `before` are batch id cursors: the page of older /
        newer batches next to that one; has_more says whether more lie beyond the page."""
        where = f"tenant = ? and endpoint {'=' if messages else '!='} ?"
        args: list[Any] = [tenant, MESSAGES]
        if after:
            where += " and rowid < coalesce((select rowid from batches where id = ?), ?)"
            args += [after, -1]
        if before:
            where += " and rowid > coalesce((select rowid from batches where id = ?), ?)"
            args += [before, 1 << 62]
        order = "asc" if before and not after else "desc"  # nearest the cursor first
        rows = self.db.conn.query(f"select * from batches where {where} order by rowid "
                                  f"{order} limit ?", [*args, limit + 1])
        page = rows[:limit]
        return (page[::-1] if order == "asc" else page), len(rows) > limit

    def delete(self, tenant: str, batch_id: str) -> None:
        """The batch and its lines, gone (the caller checked that it has ended)."""
        with self.db.transaction() as db:
            db.execute("delete from batch_lines where batch_id = (select id from batches where "
                       "id = ? and tenant = ?)", [batch_id, tenant])
            db.execute("delete from batches where id = ? and tenant = ?", [batch_id, tenant])

    def active(self) -> list[dict[str, Any]]:
        """Batches with work left (all tenants), oldest first."""
        marks = ",".join("?" * len(ACTIVE))
        return self.db.conn.query(f"select * from batches where status in ({marks}) "
                                  "order by rowid", list(ACTIVE))

    def usage(self, batch_id: str) -> dict[str, int]:
        row = self.db.conn.one(
            "select coalesce(sum(prompt_tokens), 0) as p, coalesce(sum(completion_tokens), 0) "
            "as c, coalesce(sum(cached_tokens), 0) as k from batch_lines where batch_id = ?",
            [batch_id])
        return {k: int(v) for k, v in row.items()}  # PostgreSQL's sums are numeric

    def set_status(self, batch_id: str, status: str, from_statuses: tuple[str, ...]) -> bool:
        """Move to `status` (stamping `<status>_at`) if the batch is in one of from_statuses."""
        with self.db.transaction() as db:
            return self._move(db, batch_id, status, from_statuses)

    def _move(self, db: Conn, batch_id: str, status: str, from_statuses: tuple[str, ...]) -> bool:
        marks = ",".join("?" * len(from_statuses))
        stamp = f", {status}_at = ?" if f"{status}_at" in TIMESTAMPS else ""
        args = [status] + ([int(time.time())] if stamp else []) + [batch_id, *from_statuses]
        return db.execute(f"update batches set status = ?{stamp} where id = ? and status in "
                          f"({marks})", args) == 1

    # -- validation ------------------------------------------------------------------------------

    def start(self, batch_id: str, model: str, lines: list[tuple[int, str, str]]) -> bool:
        """validating -> in_progress with its lines [(line number, custom_id, body json)],
        all in one transaction."""
        with self.db.transaction() as db:
            if not self._move(db, batch_id, "in_progress", ("validating",)):
                return False
            db.execute("update batches set total = ?, model = ? where id = ?",
                       [len(lines), model, batch_id])
            self._insert_lines(db, batch_id, lines)
        return True

    @staticmethod
    def _insert_lines(db: Conn, batch_id: str, lines: list[tuple[int, str, str]]) -> None:
        db.executemany(
            "insert into batch_lines (batch_id, custom_id, line, body, model, state) "
            "values (?, ?, ?, ?, ?, 'pending') on conflict do nothing",
            [(batch_id, cid, n, body, _model(body)) for n, cid, body in lines])

    def fail(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        with self.db.transaction() as db:
            if self._move(db, batch_id, "failed", ("validating",)):
                db.execute("update batches set errors = ? where id = ?",
                           [json.dumps({"object": "list", "data": errors}), batch_id])

    # -- lines -----------------------------------------------------------------------------------

    def claim(self, batch_id: str, replica: ReplicaStore, limit: int, skip: set[str],
              loaded: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """Up to `limit` pending lines no live replica holds, now held by this one, leaving out
        those it runs already (`skip`): those naming a `loaded` model first, then grouped by
        the model they name, each group in input order (so a batch of several models loads
        each once, not at every other line). On PostgreSQL the rows another replica is
        claiming at the moment are skipped, not waited for (FOR UPDATE SKIP LOCKED)."""
        first = f"case when model in ({', '.join('?' * len(loaded))}) then 0 else 1 end, " \
            if loaded else ""
        lock = " for update skip locked" if self.db.postgres else ""
        with self.db.transaction(serializable=False) as db:
            rows = db.query(
                "select custom_id, line, body from batch_lines where batch_id = ? and state = "
                f"'pending' and (claimed_by is null or claimed_by = ? or claimed_by not in {LIVE}) "
                f"order by {first}model, line limit ?{lock}",
                [batch_id, replica.id, replica.live_after(), *loaded, limit + len(skip)])
            rows = [r for r in rows if r["custom_id"] not in skip][:limit]
            now = int(time.time())
            db.executemany("update batch_lines set claimed_by = ?, claimed_at = ? where "
                           "batch_id = ? and custom_id = ?",
                           [(replica.id, now, batch_id, r["custom_id"]) for r in rows])
        return rows

    def line_counts(self, batch_id: str) -> dict[str, int]:
        """Lines by state: pending, done, failed, cancelled, expired."""
        rows = self.db.conn.query("select state, count(*) as n from batch_lines where "
                                  "batch_id = ? group by state", [batch_id])
        return {r["state"]: r["n"] for r in rows}

    def lines_after(self, batch_id: str, line: int, limit: int) -> list[dict[str, Any]]:
        """Up to `limit` lines after line number `line`, in input order."""
        return self.db.conn.query("select * from batch_lines where batch_id = ? and line > ? "
                                  "order by line limit ?", [batch_id, line, limit])

    def num_pending(self, batch_id: str) -> int:
        return self.db.conn.one("select count(*) as n from batch_lines where batch_id = ? and "
                                "state = 'pending'", [batch_id])["n"]

    def record(self, batch_id: str, custom_id: str, request_id: str, status_code: int,
               body: dict[str, Any], usage_row: dict[str, Any] | None,
               replica_id: str | None = None) -> bool:
        """Store one line's answer, once (claimed_by then names the replica that ran it);
        returns False if it was already stored."""
        state = "done" if status_code < 300 else "failed"
        prompt, completion, cached = _token_counts(body.get("usage") if status_code < 300
                                                   else None)
        # READ COMMITTED: the line's update is conditional on 'pending', the counters add
        with self.db.transaction(serializable=False) as db:
            changed = db.execute(
                "update batch_lines set state = ?, status_code = ?, response = ?, "
                "request_id = ?, prompt_tokens = ?, completion_tokens = ?, cached_tokens = ?, "
                "claimed_by = coalesce(?, claimed_by) where batch_id = ? and custom_id = ? and "
                "state = 'pending'",
                [state, status_code, json.dumps(body, ensure_ascii=False), request_id,
                 prompt, completion, cached, replica_id, batch_id, custom_id])
            if changed != 1:
                return False
            column = "completed" if state == "done" else "failed"
            db.execute(f"update batches set {column} = {column} + 1 where id = ?", [batch_id])
            if usage_row is not None and state == "done":
                add_usage(db, usage_row | {
                    "requests": 1, "prompt_tokens": prompt, "completion_tokens": completion,
                    "cached_tokens": cached})
        return True

    def close_pending(self, batch_id: str, state: str, code: str, message: str) -> int:
        """Every pending line becomes `state` ('cancelled' / 'expired') with an error."""
        error = json.dumps({"code": code, "message": message})
        with self.db.transaction() as db:
            closed = db.execute("update batch_lines set state = ?, error = ? where batch_id = ? "
                                "and state = 'pending'", [state, error, batch_id])
            db.execute("update batches set failed = failed + ? where id = ?",
                       [closed, batch_id])
        return closed

    # -- finalizing ------------------------------------------------------------------------------

    def finalize(self, batch_id: str, final_status: str) -> None:
        """Write the output and error files from the stored lines and end the batch, in one
        transaction (files under fixed ids, so doing it again after a crash is harmless)."""
        with self.db.transaction() as db:
            batch = self._get(db, None, batch_id)
            if batch is None or batch["status"] in ENDED:
                return
            # Anthropic's results are read from the lines themselves
            output_id, error_id = (None, None) if batch["endpoint"] == MESSAGES else \
                self._write_outputs(db, batch)
            now = int(time.time())
            stamps = {f"{final_status}_at": now}
            if final_status == "completed":
                stamps["finalizing_at"] = batch["finalizing_at"] or now
            db.update("batches", "id", batch_id, {
                "status": final_status, "output_file_id": output_id, "error_file_id": error_id,
                **stamps})

    def _write_outputs(self, db: Conn, batch: dict[str, Any]) -> tuple[str | None, str | None]:
        """OpenAI's output and error files (ids of those written)."""
        batch_id = batch["id"]
        rows = db.query("select * from batch_lines where batch_id = ? order by line",
                        [batch_id])
        good = [_output_line(r) for r in rows if r["state"] == "done"]
        bad = [_output_line(r) for r in rows if r["state"] != "done"]
        output_id = error_id = None
        if good or not bad:
            output_id = f"file-{batch_id}-output"
            self.files.write(db, output_id, batch["tenant"], f"{batch_id}_output.jsonl",
                             "batch_output", good, batch["output_expires_after"])
        if bad:
            error_id = f"file-{batch_id}-errors"
            self.files.write(db, error_id, batch["tenant"], f"{batch_id}_errors.jsonl",
                             "batch_output", bad, batch["output_expires_after"])
        return output_id, error_id


def _model(body: str) -> str | None:
    """The model a line's body names (lines are grouped by it)."""
    model = json.loads(body).get("model")
    return model if isinstance(model, str) else None


def _output_line(row: dict[str, Any]) -> str:
    """OpenAI's batch output line: {id, custom_id, response: {status_code, request_id, body},
    error}; lines that never ran have response null and an error."""
    if row["response"] is not None:
        response = {"status_code": row["status_code"], "request_id": row["request_id"],
                    "body": json.loads(row["response"])}
        error = None
    else:
        response, error = None, json.loads(row["error"])
    # A line that never ran gets an id derived from its batch and custom_id (stable).
    rid = row["request_id"] or "batch_req_" + uuid.uuid5(
        uuid.NAMESPACE_URL, f"{row['batch_id']}/{row['custom_id']}").hex
    return json.dumps({"id": rid, "custom_id": row["custom_id"], "response": response,
                       "error": error}, ensure_ascii=False)


def add_usage(db: Conn, row: dict[str, Any]) -> None:
    """Add a request's tokens to the (day, tenant, kind, model) counters."""
    db.execute(
        "insert into usage (day, tenant, kind, model, requests, prompt_tokens, "
        "completion_tokens, cached_tokens) values (:day, :tenant, :kind, :model, :requests, "
        ":prompt_tokens, :completion_tokens, :cached_tokens) on conflict (day, tenant, kind, "
        "model) do update set requests = usage.requests + excluded.requests, prompt_tokens = "
        "usage.prompt_tokens + excluded.prompt_tokens, completion_tokens = "
        "usage.completion_tokens + excluded.completion_tokens, cached_tokens = "
        "usage.cached_tokens + excluded.cached_tokens",
        row)


def batch_object(row: dict[str, Any], usage: dict[str, int] | None = None) -> dict[str, Any]:
    """OpenAI's Batch object."""
    out = {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
           "model": row["model"], "errors": json.loads(row["errors"]) if row["errors"] else None,
           "input_file_id": row["input_file_id"],
           "completion_window": row["completion_window"], "status": row["status"],
           "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"]}
    out |= {k: row[k] for k in TIMESTAMPS}
    out["request_counts"] = {"total": row["total"], "completed": row["completed"],
                             "failed": row["failed"]}
    out["metadata"] = json.loads(row["metadata"]) if row["metadata"] else None
    if usage is not None:
        out["usage"] = {"input_tokens": usage["p"], "output_tokens": usage["c"],
                        "total_tokens": usage["p"] + usage["c"],
                        "input_tokens_details": {"cached_tokens": usage["k"]},
                        "output_tokens_details": {"reasoning_tokens": 0}}
    return out


def _token_counts(usage: dict[str, Any] | None) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of a usage object in either of OpenAI's shapes,
    chat's and embeddings' (prompt_tokens ...) or the Responses API's (input_tokens ...), or in
    Anthropic's (input_tokens, cache_read_input_tokens ...)."""
    if not usage:
        return 0, 0, 0
    if "cache_read_input_tokens" in usage:  # Anthropic's: input_tokens leaves out the cached
        cached = usage["cache_read_input_tokens"]
        return usage["input_tokens"] + cached, usage.get("output_tokens", 0), cached
    if "input_tokens" in usage:
        details = usage.get("input_tokens_details") or {}
        return usage["input_tokens"], usage.get("output_tokens", 0), details.get(
            "cached_tokens", 0)
    details = usage.get("prompt_tokens_details") or {}
    return (usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
            details.get("cached_tokens", 0))
