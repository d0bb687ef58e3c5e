"""The store: one SQLite file in $LOCALSERVE_HOME (the default), or a PostgreSQL database that
several replicas share (`--store postgresql://...`, psycopg 3).

All access goes through one worker thread (`Database.run`), so the event loop never waits on
the database and no two of this process's writes interleave. Writes are short transactions:
SQLite's `BEGIN IMMEDIATE` (on disk, synchronous=FULL, before the caller is told), PostgreSQL's
SERIALIZABLE. There another replica's transaction can make one fail; the whole function then
runs again, so a function run through `run` / `call` holds at most one write transaction and
reads after it only. A lost connection (PostgreSQL restarting) is opened again and the function
retried for up to RECONNECT_SECONDS.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import random
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from storage import schema
from storage.sql import Conn, StoreError

T = TypeVar("T")
log = logging.getLogger("localserve.store")

RECONNECT_SECONDS = 120.0  # a PostgreSQL restart, a failover
CONFLICT_RETRIES = 30
SCHEMA_VERSION = schema.SCHEMA_VERSION


class DatabaseBusyError(StoreError):
    """Another server process holds this SQLite database."""


class DatabaseCorruptError(StoreError):
    """The database file is not one SQLite can read."""


def is_url(target: str | Path) -> bool:
    return isinstance(target, str) and target.startswith(("postgresql://", "postgres://"))


def redact(url: str) -> str:
    """The URL without its password (for logs and errors)."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


class Database:
    def __init__(self, target: str | Path, reconnect_seconds: float = RECONNECT_SECONDS
                 ) -> None:
        """`target`: the SQLite file's path, or a postgresql:// URL; `reconnect_seconds`: how
        long PostgreSQL may be out of reach before a call fails."""
        self.reconnect_seconds = reconnect_seconds
        self.postgres = is_url(target)
        self.url = str(target) if self.postgres else ""
        self.path = None if self.postgres else Path(target)
        self._lock = None if self.postgres else _lock_home(self.path)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="db")
        self._local = threading.local()
        try:
            self.call(self._create)
        except sqlite3.DatabaseError as e:
            self.close()
            raise DatabaseCorruptError(
                f"{self.path} is not a database SQLite can read ({e}): move it away to start "
                "with an empty one (it holds the files, batches, stored responses and usage)"
            ) from None
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        return redact(self.url) if self.postgres else str(self.path)

    # -- running ---------------------------------------------------------------------------------

    @property
    def conn(self) -> Conn:
        """This thread's connection (only the worker thread uses one)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
        return conn

    def _connect(self) -> Conn:
        if self.postgres:
            try:
                import psycopg
                from psycopg.rows import dict_row
            except ImportError:
                raise StoreError("a PostgreSQL store needs psycopg: pip install "
                                 "'localserve[fleet]'") from None
            try:
                raw = psycopg.connect(self.url, autocommit=True, row_factory=dict_row,
                                      connect_timeout=10)
            except psycopg.OperationalError as e:
                raise _Disconnected(_one_line(e)) from None
            return Conn(raw, postgres=True)
        raw = sqlite3.connect(self.path, isolation_level=None, timeout=30)
        raw.execute("PRAGMA journal_mode=WAL")
        raw.execute("PRAGMA synchronous=FULL")
        raw.execute("PRAGMA foreign_keys=ON")
        return Conn(raw, postgres=False)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the database thread, without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self._retrying, fn, *args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the database thread and wait (for code outside the event loop)."""
        return self._executor.submit(self._retrying, fn, *args).result()

    def _retrying(self, fn: Callable[..., T], *args: Any) -> T:
        if not self.postgres:
            return fn(*args)
        started, conflicts, wait = time.monotonic(), 0, 0.05
        while True:
            try:
                return fn(*args)
            except Exception as e:  # noqa: BLE001 - sorted below; the rest is raised
                kind = _failure_kind(e)
                if kind == "conflict" and conflicts < CONFLICT_RETRIES:
                    conflicts += 1
                    time.sleep(random.uniform(0, 0.002 * conflicts))
                    continue
                if kind != "disconnect":
                    raise
                self._drop()
                if time.monotonic() - started > self.reconnect_seconds:
                    raise StoreError(f"PostgreSQL at {self.describe()} is unreachable: "
                                     f"{_one_line(e)}") from None
                if wait == 0.05:  # the first failure of this call
                    log.warning("store: %s; trying again for up to %.0f s", _one_line(e),
                                self.reconnect_seconds)
                time.sleep(wait)
                wait = min(wait * 2, 2.0)

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.raw.close()

    @contextlib.contextmanager
    def transaction(self, serializable: bool = True) -> Iterator[Conn]:
        """A write transaction (ROLLBACK on error); only on the database thread. On
        PostgreSQL, serializable=False is READ COMMITTED: for a queue's statements, each a
        conditional update of its own rows, which PostgreSQL re-checks on the row it waited
        for (safe without SERIALIZABLE, and no conflicts to retry among many claimers)."""
        conn = self.conn
        level = "SERIALIZABLE" if serializable else "READ COMMITTED"
        conn.execute(f"BEGIN ISOLATION LEVEL {level}" if self.postgres else "BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            with contextlib.suppress(Exception):  # a broken connection has nothing to undo
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        """Close the connection and release the home (safe to call twice)."""
        if self._executor is None:
            return
        self._executor.submit(self._drop).result()
        self._executor.shutdown(wait=True)
        self._executor = None
        if self._lock is not None:
            self._lock.close()  # releases the flock

    def _create(self) -> None:
        with self.transaction() as db:
            schema.create(db)


class _Disconnected(Exception):
    """Connecting failed (retried as a lost connection is)."""


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _failure_kind(e: Exception) -> str | None:
    """'conflict' (another transaction won: run again), 'disconnect', or None."""
    if isinstance(e, _Disconnected):
        return "disconnect"
    import psycopg
    if getattr(e, "sqlstate", None) in ("40001", "40P01"):  # serialization, deadlock
        return "conflict"
    if isinstance(e, psycopg.OperationalError | psycopg.InterfaceError):
        return "disconnect"
    return None


def _lock_home(path: Path):
    """One server per SQLite file: two would run the same batches twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = (path.parent / f"{path.name}.lock").open("a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise DatabaseBusyError(f"another localserve server is using {path.parent} "
                                "(stop it, or set LOCALSERVE_HOME)") from None
    return lock
