"""Uploaded and generated files: bytes under $LOCALSERVE_HOME/files, metadata in SQLite.

Every method runs on the database thread (call it through Database.run / Database.call).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from storage.db import Database


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
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        # Leftovers of a killed upload or file write (the database lock makes this server
        # the only one using the folder, so nothing here is in use).
        for stale in (*root.glob(".upload-*"), *root.glob(".*.tmp")):
            stale.unlink(missing_ok=True)

    def scratch(self) -> Path:
        """A fresh temporary path on the same disk (uploads land here, then are renamed)."""
        fd, name = tempfile.mkstemp(prefix=".upload-", dir=self.root)
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
            db["files"].insert(row)
            if idempotency_key:
                remember(db, tenant, "files", idempotency_key, file_id)
            os.replace(scratch, self.root / file_id)
        return row

    def write(self, db, file_id: str, tenant: str, filename: str, purpose: str,
              lines: Iterable[str], expires_after: int | None = None) -> dict[str, Any]:
        """Write a generated file atomically under a fixed id (inside the caller's
        transaction): writing it again replaces it, so finalizing twice is harmless."""
        path = self.root / file_id
        tmp = path.with_name(f".{file_id}.tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        row = _row(file_id, tenant, filename, purpose, path.stat().st_size, expires_after)
        db["files"].upsert(row, pk="id")
        return row

    def get(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        return _get(self.db.db, tenant, file_id)

    def path(self, row: dict[str, Any]) -> Path:
        return self.root / row["path"]

    def list(self, tenant: str, purpose: str | None, after: str | None, limit: int,
             order: str) -> tuple[list[dict[str, Any]], bool]:
        """Newest first (order='desc') or oldest first; `after` is a cursor (a file id)."""
        db = self.db.db
        where, params = ["tenant = ?", LIVE], [tenant, int(time.time())]
        if purpose:
            where.append("purpose = ?")
            params.append(purpose)
        op = "<" if order == "desc" else ">"
        if after:  # creation order is rowid order
            where.append(f"rowid {op} coalesce((select rowid from files where id = ?), "
                         f"{'-1' if order == 'desc' else '1 << 62'})")
            params.append(after)
        direction = "desc" if order == "desc" else "asc"
        rows = list(db.query(
            f"select * from files where {' and '.join(where)} order by rowid {direction} "
            "limit ?", [*params, limit + 1]))
        return rows[:limit], len(rows) > limit

    def delete(self, tenant: str, file_id: str) -> bool:
        with self.db.transaction() as db:
            row = _get(db, tenant, file_id)
            if row is None:
                return False
            db["files"].delete(file_id)
        (self.root / row["path"]).unlink(missing_ok=True)
        return True

    def sweep_expired(self) -> int:
        """Delete the files past their expiry (rows, then bytes); returns how many."""
        with self.db.transaction() as db:
            rows = list(db.query("select id, path from files where expires_at <= ?",
                                 [int(time.time())]))
            for row in rows:
                db["files"].delete(row["id"])
        for row in rows:
            (self.root / row["path"]).unlink(missing_ok=True)
        return len(rows)


# An expired file is gone for clients at once; sweep_expired removes it from disk later.
LIVE = "(expires_at is null or expires_at > ?)"


def _row(file_id: str, tenant: str, filename: str, purpose: str, size: int,
         expires_after: int | None) -> dict[str, Any]:
    now = int(time.time())
    return {"id": file_id, "tenant": tenant, "filename": filename, "purpose": purpose,
            "bytes": size, "created_at": now,
            "expires_at": None if expires_after is None else now + expires_after,
            "path": file_id}


def _get(db, tenant: str, file_id: str) -> dict[str, Any] | None:
    rows = list(db.query(f"select * from files where id = ? and tenant = ? and {LIVE}",
                         [file_id, tenant, int(time.time())]))
    return rows[0] if rows else None


def idempotent_hit(db, tenant: str, route: str, key: str) -> str | None:
    rows = list(db.query("select object_id from idempotency where tenant = ? and route = ? "
                         "and key = ?", [tenant, route, key]))
    return rows[0]["object_id"] if rows else None


def remember(db, tenant: str, route: str, key: str, object_id: str) -> None:
    db["idempotency"].insert({"tenant": tenant, "route": route, "key": key,
                              "object_id": object_id, "created_at": int(time.time())})


