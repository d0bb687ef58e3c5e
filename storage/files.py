"""Uploaded and generated files: their metadata in the store, their bytes under
$LOCALSERVE_HOME/files (SQLite) or in the store itself, in 1 MiB chunks (PostgreSQL: every
replica reads them, and a batch's output is written in the transaction that ends it).

Every method but `read` runs on the database thread (call it through Database.run /
Database.call); `read` runs anywhere else.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from storage.db import Database
from storage.models import pid_alive
from storage.sql import Conn

CHUNK = 1 << 20
UPLOAD_PREFIX = ".upload-"  # an upload's bytes before they are stored: .upload-<pid>-<random>


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's FileObject."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"],
            "created_at": row["created_at"], "filename": row["filename"],
            "purpose": row["purpose"], "status": "processed", "status_details": None,
            "expires_at": row["expires_at"]}


class FileStore:
    def __init__(self, db: Database, root: Path) -> None:
        self.db = db
        self.root = root  # uploads land here first; SQLite's stores keep the bytes here
        self.in_store = db.postgres
        root.mkdir(parents=True, exist_ok=True)
        # Leftovers of a killed upload or file write
        for stale in root.glob(f"{UPLOAD_PREFIX}*"):
            pid = stale.name[len(UPLOAD_PREFIX):].split("-")[0]
            if not (pid.isdigit() and pid_alive(int(pid))):
                stale.unlink(missing_ok=True)
        if not self.in_store:  # the SQLite lock: nobody else writes here
            for stale in root.glob(".*.tmp"):
                stale.unlink(missing_ok=True)

    def scratch(self) -> Path:
        """A fresh temporary path on the same disk (uploads land here, then are stored)."""
        fd, name = tempfile.mkstemp(prefix=f"{UPLOAD_PREFIX}{os.getpid()}-", dir=self.root)
        os.close(fd)
        return Path(name)

    def add(self, tenant: str, filename: str, purpose: str, scratch: Path,
            idempotency_key: str | None = None, expires_after: int | None = None
            ) -> dict[str, Any]:
        """Take ownership of `scratch` as a new file; a repeated idempotency key returns the
        first file (and drops the new bytes). `expires_after`: seconds from creation after
        which the file is gone."""
        with self.db.transaction() as db:
            if idempotency_key:
                first = idempotent_hit(db, tenant, "files", idempotency_key)
                if first is not None and (row := _get(db, tenant, first)) is not None:
                    scratch.unlink(missing_ok=True)
                    return row
            file_id = new_file_id()
            row = _row(file_id, tenant, filename, purpose, scratch.stat().st_size,
                       expires_after)
            db.insert("files", row)
            if idempotency_key:
                remember(db, tenant, "files", idempotency_key, file_id)
            if self.in_store:
                with scratch.open("rb") as f:
                    _put_chunks(db, file_id, iter(lambda: f.read(CHUNK), b""))
            else:
                os.replace(scratch, self.root / file_id)
        scratch.unlink(missing_ok=True)
        return row

    def write(self, db: Conn, file_id: str, tenant: str, filename: str, purpose: str,
              lines: Iterable[str], expires_after: int | None = None) -> dict[str, Any]:
        """Write a generated file atomically under a fixed id (inside the caller's
        transaction): writing it again replaces it, so finalizing twice is harmless."""
        data = (line.encode() + b"\n" for line in lines)
        if self.in_store:
            db.execute("delete from file_chunks where file_id = ?", [file_id])
            size = _put_chunks(db, file_id, _rechunk(data))
        else:
            path = self.root / file_id
            tmp = path.with_name(f".{file_id}.tmp")
            with tmp.open("wb") as f:
                f.writelines(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            size = path.stat().st_size
        row = _row(file_id, tenant, filename, purpose, size, expires_after)
        db.insert("files", row, replace_on=("id",))
        return row

    def get(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        return _get(self.db.conn, tenant, file_id)

    def read(self, row: dict[str, Any]) -> Iterator[bytes] | None:
        """The file's bytes in chunks, or None where they are gone (removed from the disk
        outside the server). Not on the database thread: it reads through it."""
        if not self.in_store:
            path = self.root / row["path"]
            return _read_path(path) if path.is_file() else None
        return _read_chunks(self.db, row["id"], row["bytes"])

    def list(self, tenant: str, purpose: str | None, after: str | None, limit: int,
             order: str) -> tuple[list[dict[str, Any]], bool]:
        """Newest first (order='desc') or oldest first; `after` is a cursor (a file id)."""
        where, params = ["tenant = ?", LIVE], [tenant, int(time.time())]
        if purpose:
            where.append("purpose = ?")
            params.append(purpose)
        if after:  # creation order is rowid order
            op, edge = ("<", -1) if order == "desc" else (">", 1 << 62)
            where.append(f"rowid {op} coalesce((select rowid from files where id = ?), ?)")
            params += [after, edge]
        direction = "desc" if order == "desc" else "asc"
        rows = self.db.conn.query(
            f"select * from files where {' and '.join(where)} order by rowid {direction} "
            "limit ?", [*params, limit + 1])
        return rows[:limit], len(rows) > limit

    def delete(self, tenant: str, file_id: str) -> bool:
        with self.db.transaction() as db:
            row = _get(db, tenant, file_id)
            if row is None:
                return False
            self._drop(db, [row])
        self._unlink([row])
        return True

    def sweep_expired(self) -> int:
        """Delete the files past their expiry (rows, then bytes); returns how many."""
        with self.db.transaction() as db:
            rows = db.query("select id, path from files where expires_at <= ?",
                            [int(time.time())])
            self._drop(db, rows)
        self._unlink(rows)
        return len(rows)

    def _drop(self, db: Conn, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            db.execute("delete from files where id = ?", [row["id"]])
            if self.in_store:
                db.execute("delete from file_chunks where file_id = ?", [row["id"]])

    def _unlink(self, rows: list[dict[str, Any]]) -> None:
        if not self.in_store:
            for row in rows:
                (self.root / row["path"]).unlink(missing_ok=True)


# An expired file is gone for clients at once; sweep_expired removes it later.
LIVE = "(expires_at is null or expires_at > ?)"


def _row(file_id: str, tenant: str, filename: str, purpose: str, size: int,
         expires_after: int | None) -> dict[str, Any]:
    now = int(time.time())
    return {"id": file_id, "tenant": tenant, "filename": filename, "purpose": purpose,
            "bytes": size, "created_at": now,
            "expires_at": None if expires_after is None else now + expires_after,
            "path": file_id}


def _get(db: Conn, tenant: str, file_id: str) -> dict[str, Any] | None:
    return db.one(f"select * from files where id = ? and tenant = ? and {LIVE}",
                  [file_id, tenant, int(time.time())])


def _put_chunks(db: Conn, file_id: str, chunks: Iterable[bytes]) -> int:
    size = 0
    for n, chunk in enumerate(chunks):
        db.execute("insert into file_chunks (file_id, n, data) values (?, ?, ?)",
                   [file_id, n, chunk])
        size += len(chunk)
    return size


def _rechunk(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """Pieces of any size as CHUNK-sized ones (the last shorter)."""
    buf = bytearray()
    for piece in pieces:
        buf += piece
        while len(buf) >= CHUNK:
            yield bytes(buf[:CHUNK])
            del buf[:CHUNK]
    if buf:
        yield bytes(buf)


def split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """The lines of a file read in chunks, each with its b"\\n" (the last one may lack it)."""
    pending: list[bytes] = []  # the start of a line longer than the chunks so far
    for chunk in chunks:
        *whole, rest = chunk.split(b"\n")
        if whole:
            whole[0] = b"".join([*pending, whole[0]])
            pending = []
            yield from (line + b"\n" for line in whole)
        pending.append(rest)
    if last := b"".join(pending):
        yield last


def _read_path(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        yield from iter(lambda: f.read(CHUNK), b"")


def _read_chunks(db: Database, file_id: str, size: int) -> Iterator[bytes] | None:
    def chunk(n: int) -> bytes | None:
        row = db.conn.one("select data from file_chunks where file_id = ? and n = ?",
                          [file_id, n])
        return None if row is None else bytes(row["data"])

    def rest(first: bytes) -> Iterator[bytes]:
        yield first
        n = 1
        while (data := db.call(chunk, n)) is not None:
            yield data
            n += 1

    first = db.call(chunk, 0)
    if first is None:  # deleted outside the server (an empty file has no chunks either)
        return None if size else iter(())
    return rest(first)


def idempotent_hit(db: Conn, tenant: str, route: str, key: str) -> str | None:
    row = db.one("select object_id from idempotency where tenant = ? and route = ? and "
                 "key = ?", [tenant, route, key])
    return row["object_id"] if row else None


def remember(db: Conn, tenant: str, route: str, key: str, object_id: str) -> None:
    db.insert("idempotency", {"tenant": tenant, "route": route, "key": key,
                              "object_id": object_id, "created_at": int(time.time())})
