"""The one SQLite database in $LOCALSERVE_HOME (sqlite-utils, WAL mode).

All access goes through one worker thread (`Database.run`), so the event loop never waits on
disk and no two writes interleave. Writes are short `BEGIN IMMEDIATE` transactions: what a
caller is told was stored is on disk (synchronous=FULL) before it is told.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import sqlite3
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import sqlite_utils

T = TypeVar("T")

SCHEMA_VERSION = 5  # 2: batches.output_expires_after; 3: responses; 4: conversations and
# stored chat completions; 5: Anthropic's message threads


class DatabaseBusyError(Exception):
    """Another server process holds this database."""


class DatabaseCorruptError(Exception):
    """The database file is not one SQLite can read."""


class Database:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # One server per $LOCALSERVE_HOME: two would run the same batches twice.
        self._lock = (path.parent / f"{path.name}.lock").open("a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise DatabaseBusyError(f"another localserve server is using {path.parent} "
                                    "(stop it, or set LOCALSERVE_HOME)") from None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="db")
        self._local = threading.local()
        try:
            self.call(self._create)
        except sqlite3.DatabaseError as e:
            self.close()
            raise DatabaseCorruptError(
                f"{path} is not a database SQLite can read ({e}): move it away to start with an "
                "empty one (it holds the files, batches, stored responses and usage)") from None

    # -- running ---------------------------------------------------------------------------------

    @property
    def db(self) -> sqlite_utils.Database:
        """This thread's connection (only the worker thread uses one)."""
        db = getattr(self._local, "db", None)
        if db is None:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=30)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            db = self._local.db = sqlite_utils.Database(conn)
        return db

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the database thread, without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the database thread and wait (for code outside the event loop)."""
        return self._executor.submit(fn, *args).result()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite_utils.Database]:
        """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error); only on the database thread."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        """Close the connection and release the home (safe to call twice)."""
        if self._lock.closed:
            return

        def _close() -> None:
            db = getattr(self._local, "db", None)
            if db is not None:
                db.conn.close()
                self._local.db = None

        self._executor.submit(_close).result()
        self._executor.shutdown(wait=True)
        self._lock.close()  # releases the flock

    # -- schema ----------------------------------------------------------------------------------

    def _create(self) -> None:
        with self.transaction() as db:
            db["files"].create({
                "id": str, "tenant": str, "filename": str, "purpose": str, "bytes": int,
                "created_at": int, "expires_at": int, "path": str,
            }, pk="id", if_not_exists=True)
            db["batches"].create({
                "id": str, "tenant": str, "input_file_id": str, "endpoint": str,
                "completion_window": str, "status": str, "model": str, "errors": str,
                "metadata": str, "output_file_id": str, "error_file_id": str,
                "created_at": int, "in_progress_at": int, "expires_at": int,
                "finalizing_at": int, "completed_at": int, "failed_at": int, "expired_at": int,
                "cancelling_at": int, "cancelled_at": int,
                "total": int, "completed": int, "failed": int, "output_expires_after": int,
            }, pk="id", if_not_exists=True, defaults={"total": 0, "completed": 0, "failed": 0})
            if "output_expires_after" not in db["batches"].columns_dict:  # a version 1 home
                db.execute("alter table batches add column output_expires_after integer")
            # One row per input line. A line's result is written once (state leaves
            # 'pending' in the same transaction that stores it): nothing runs twice into the
            # output, whatever crashes.
            db["batch_lines"].create({
                "batch_id": str, "custom_id": str, "line": int, "body": str, "state": str,
                "status_code": int, "response": str, "error": str, "request_id": str,
                "prompt_tokens": int, "completion_tokens": int, "cached_tokens": int,
            }, pk=("batch_id", "custom_id"), if_not_exists=True,
                foreign_keys=[("batch_id", "batches", "id")])
            db["batch_lines"].create_index(["batch_id", "state", "line"], if_not_exists=True)
            db["idempotency"].create({
                "tenant": str, "route": str, "key": str, "object_id": str, "created_at": int,
            }, pk=("tenant", "route", "key"), if_not_exists=True)
            db["usage"].create({
                "day": str, "tenant": str, "kind": str, "model": str, "requests": int,
                "prompt_tokens": int, "completion_tokens": int, "cached_tokens": int,
            }, pk=("day", "tenant", "kind", "model"), if_not_exists=True)
            db["responses"].create({
                "id": str, "tenant": str, "created_at": int, "response": str,
                "conversation": str,
            }, pk="id", if_not_exists=True)
            db["conversations"].create({
                "id": str, "tenant": str, "created_at": int, "metadata": str, "items": str,
            }, pk="id", if_not_exists=True)
            db["chat_completions"].create({
                "id": str, "tenant": str, "created_at": int, "model": str, "metadata": str,
                "completion": str, "messages": str,
            }, pk="id", if_not_exists=True)
            db["chat_completions"].create_index(["tenant", "created_at"], if_not_exists=True)
            if "parent" not in db["message_threads"].columns_dict:  # a development version's
                db["message_threads"].drop(ignore=True)
            db["message_threads"].create({
                "id": str, "tenant": str, "created_at": int, "parent": str, "messages": str,
                "fields": str, "continued_by": str,
            }, pk="id", if_not_exists=True)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
