"""The store's tables, in SQL both SQLite and PostgreSQL run, and the migrations from older
SQLite homes (PostgreSQL stores start at the current version).

Version history: 2 batches.output_expires_after; 3 responses; 4 conversations and stored chat
completions; 5 Anthropic's message threads; 6 replicas sharing a PostgreSQL store: the
replicas and their heartbeats, batch lines claimed by one, the replica running a background
response or a thread's continuation, batch_lines.model and responses.status as columns (no
JSON functions in queries), file bytes in file_chunks on PostgreSQL.
"""

from __future__ import annotations

from storage.sql import Conn, StoreError

SCHEMA_VERSION = 6

TABLES = {
    "files": "id text primary key, tenant text, filename text, purpose text, bytes bigint, "
             "created_at bigint, expires_at bigint, path text",
    "batches": "id text primary key, tenant text, input_file_id text, endpoint text, "
               "completion_window text, status text, model text, errors text, metadata text, "
               "output_file_id text, error_file_id text, created_at bigint, "
               "in_progress_at bigint, expires_at bigint, finalizing_at bigint, "
               "completed_at bigint, failed_at bigint, expired_at bigint, "
               "cancelling_at bigint, cancelled_at bigint, total bigint default 0, "
               "completed bigint default 0, failed bigint default 0, "
               "output_expires_after bigint",
    # One row per input line. A line's result is written once (state leaves 'pending' in the
    # same transaction that stores it): nothing runs twice into the output, whatever crashes.
    "batch_lines": "batch_id text references batches (id), custom_id text, line bigint, "
                   "body text, model text, state text, status_code bigint, response text, "
                   "error text, request_id text, prompt_tokens bigint, "
                   "completion_tokens bigint, cached_tokens bigint, claimed_by text, "
                   "claimed_at bigint, primary key (batch_id, custom_id)",
    "idempotency": "tenant text, route text, key text, object_id text, created_at bigint, "
                   "primary key (tenant, route, key)",
    "usage": "day text, tenant text, kind text, model text, requests bigint, "
             "prompt_tokens bigint, completion_tokens bigint, cached_tokens bigint, "
             "primary key (day, tenant, kind, model)",
    "responses": "id text primary key, tenant text, created_at bigint, response text, "
                 "conversation text, status text, replica text, cancel_requested bigint",
    "conversations": "id text primary key, tenant text, created_at bigint, metadata text, "
                     "items text",
    "chat_completions": "id text primary key, tenant text, created_at bigint, model text, "
                        "metadata text, completion text, messages text",
    "message_threads": "id text primary key, tenant text, created_at bigint, parent text, "
                       "messages text, fields text, continued_by text, "
                       "continued_on text",
    # The servers sharing this store (one for a SQLite file): a replica whose heartbeat is
    # older than the stale window is gone, and what it had claimed is free again
    "replicas": "id text primary key, started_at bigint, heartbeat_at bigint",
}
# Listed in creation order (`order by rowid`): PostgreSQL gets a rowid column for them
ORDERED = ("files", "batches", "chat_completions")
# File bytes in PostgreSQL (SQLite keeps them as files beside the database)
CHUNKS = "file_id text, n bigint, data bytea, primary key (file_id, n)"
# Columns later versions added: (table, column, type, what an older row's value is)
ADDED = (
    ("batches", "output_expires_after", "bigint", None),  # version 2
    ("batch_lines", "model", "text", "json_extract(body, '$.model')"),  # 6 from here
    ("batch_lines", "claimed_by", "text", None),
    ("batch_lines", "claimed_at", "bigint", None),
    ("responses", "status", "text", "json_extract(response, '$.status')"),
    ("responses", "replica", "text", None),
    ("responses", "cancel_requested", "bigint", None),
    ("message_threads", "continued_on", "text", None),
)
INDEXES = (
    "create index if not exists idx_batch_lines_batch_id_state_line on batch_lines "
    "(batch_id, state, line)",
    "create index if not exists idx_chat_completions_tenant_created_at on chat_completions "
    "(tenant, created_at)",
)


def create(db: Conn) -> None:
    """Every table as this version has it (inside the caller's transaction)."""
    if db.postgres:
        db.execute("select pg_advisory_xact_lock(7316504)")  # replicas starting together
        version = _postgres_version(db)
        if version is not None and version > SCHEMA_VERSION:
            raise StoreError(f"the store's schema is version {version}, newer than this "
                               f"localserve's {SCHEMA_VERSION}: upgrade localserve")
    else:
        _migrate_sqlite(db)
    for name, columns in TABLES.items():
        if db.postgres and name in ORDERED:
            columns = "rowid bigint generated always as identity, " + columns
        db.execute(f"create table if not exists {name} ({columns})")
    if db.postgres:
        db.execute(f"create table if not exists file_chunks ({CHUNKS})")
    for sql in INDEXES:
        db.execute(sql)
    if db.postgres:  # later versions migrate here, from `version`
        if version is None:
            db.execute("insert into schema_version values (?)", [SCHEMA_VERSION])
    else:
        db.execute(f"pragma user_version={SCHEMA_VERSION}")


def _postgres_version(db: Conn) -> int | None:
    db.execute("create table if not exists schema_version (version integer)")
    row = db.one("select max(version) as v from schema_version")
    return row["v"] if row else None


def _columns(db: Conn, table: str) -> set[str]:
    return {r["name"] for r in db.query(f"pragma table_info({table})")}


def _migrate_sqlite(db: Conn) -> None:
    """Bring an older SQLite home's existing tables to this version's columns (each step looks
    at the columns there: a new home has no tables yet)."""
    threads = _columns(db, "message_threads")
    if threads and "parent" not in threads:  # a development version's
        db.execute("drop table message_threads")
    for table, column, kind, fill in ADDED:
        columns = _columns(db, table)
        if columns and column not in columns:
            db.execute(f"alter table {table} add column {column} {kind}")
            if fill:
                db.execute(f"update {table} set {column} = {fill}")
