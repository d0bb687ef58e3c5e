"""BatchStore and ReplicaStore on both stores (SQLite, PostgreSQL): lines grouped by model and
claimed by one live replica at a time, each result stored once with its usage, the output
written from the stored lines when the batch ends; what a gone replica held, taken over."""

from __future__ import annotations

import json

import pytest

from storage.batches import BatchStore
from storage.db import Database
from storage.files import FileStore
from storage.replicas import ReplicaStore
from storage.responses import ResponseStore
from storage.sql import to_pyformat
from tests.helpers import database_at_version

FIELDS = {"endpoint": "/v1/chat/completions", "input_file_id": "file-in",
          "completion_window": "24h", "metadata": {"k": "v"}}
USAGE = {"day": "2026-12-05", "tenant": "t", "kind": "batch", "model": "m"}


@pytest.fixture
def store(store_target, tmp_path):
    db = Database(store_target)
    yield BatchStore(db, FileStore(db, tmp_path / "files"))
    db.close()


def started(store: BatchStore, models: list[str]) -> str:
    batch = store.db.call(store.create, "t", FIELDS, 3600)
    lines = [(n, f"l{n}", json.dumps({"model": m})) for n, m in enumerate(models)]
    assert store.db.call(store.start, batch["id"], "m", lines)
    assert not store.db.call(store.start, batch["id"], "m", lines)  # once: not validating now
    return batch["id"]


def replica(store: BatchStore, name: str, stale_seconds: float = 30) -> ReplicaStore:
    r = ReplicaStore(store.db, name, stale_seconds)
    store.db.call(r.beat)
    return r


def claimed(store: BatchStore, batch_id: str, by: ReplicaStore, limit: int = 10,
            skip: frozenset = frozenset(), loaded: tuple = ()) -> list[str]:
    rows = store.db.call(store.claim, batch_id, by, limit, set(skip), loaded)
    return [r["custom_id"] for r in rows]


def test_lines_are_claimed_by_model_loaded_first(store):
    batch_id = started(store, ["b", "a", "b", "c", "a", "b"])
    me = replica(store, "me")
    assert claimed(store, batch_id, me) == ["l1", "l4", "l0", "l2", "l5", "l3"]  # a, b, c
    # its own claims come back to it, but for those it runs (`skip`); the loaded model first
    assert claimed(store, batch_id, me, skip={"l5"}, loaded=("c",)) == [
        "l3", "l1", "l4", "l0", "l2"]


def test_a_live_replicas_claims_are_its_own_until_it_goes(store):
    batch_id = started(store, ["m"] * 5)
    a, b = replica(store, "a"), replica(store, "b")
    assert claimed(store, batch_id, a, limit=3) == ["l0", "l1", "l2"]
    assert claimed(store, batch_id, b) == ["l3", "l4"]  # not a's
    assert claimed(store, batch_id, b) == ["l3", "l4"]  # (its own, again: it lost them)
    call = store.db.call
    assert call(store.record, batch_id, "l0", "req_0", 200, {}, None)
    call(b.leave)  # a clean stop: its lines are free at once
    assert claimed(store, batch_id, a) == ["l1", "l2", "l3", "l4"]
    assert claimed(store, batch_id, replica(store, "c")) == []
    # a's heartbeat stops: once it is older than the stale window, c takes a's lines
    call(lambda: store.db.conn.execute("update replicas set heartbeat_at = heartbeat_at - 31 "
                                       "where id = 'a'"))
    assert claimed(store, batch_id, replica(store, "c")) == ["l1", "l2", "l3", "l4"]
    assert [r["id"] for r in call(a.live)] == ["c"]


def test_a_gone_replicas_background_responses_are_stored_failed(store):
    on_a = ResponseStore(store.db, replica(store, "a"))
    on_b = ResponseStore(store.db, replica(store, "b"))
    call = store.db.call
    call(on_a.put, "t", {"id": "resp_a", "status": "in_progress"}, [])
    call(on_b.put, "t", {"id": "resp_b", "status": "queued"}, [])
    call(on_a.put, "t", {"id": "resp_done", "status": "completed"}, [])
    error = {"code": "server_error", "message": "gone"}
    assert call(on_b.fail_orphaned, error) == 0  # a lives: its response is its own
    call(lambda: store.db.conn.execute("update replicas set heartbeat_at = heartbeat_at - 31 "
                                       "where id = 'a'"))
    assert call(on_b.fail_orphaned, error) == 1
    got = call(ResponseStore(store.db).get, "t", "resp_a")[0]
    assert got == {"id": "resp_a", "status": "failed", "error": error}
    assert call(ResponseStore(store.db).get, "t", "resp_b")[0]["status"] == "queued"


def test_a_result_is_stored_once_and_the_output_has_each_line_once(store):
    batch_id = started(store, ["m", "m", "m"])
    body = {"usage": {"prompt_tokens": 5, "completion_tokens": 7,
                      "prompt_tokens_details": {"cached_tokens": 2}}}
    call = store.db.call
    assert call(store.record, batch_id, "l0", "req_0", 200, body, USAGE)
    assert not call(store.record, batch_id, "l0", "req_x", 200, body, USAGE)  # ran twice
    assert call(store.record, batch_id, "l1", "req_1", 400, {"error": {"message": "no"}}, USAGE)
    assert call(store.close_pending, batch_id, "cancelled", "batch_cancelled", "gone") == 1
    assert call(store.line_counts, batch_id) == {"done": 1, "failed": 1, "cancelled": 1}
    assert call(store.usage, batch_id) == {"p": 5, "c": 7, "k": 2}  # the 2xx line's only
    rows = call(lambda: store.db.conn.query("select * from usage"))
    assert [(r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        (1, 5, 7)]
    call(store.finalize, batch_id, "completed")
    call(store.finalize, batch_id, "completed")  # again (a crash before it returned): no change
    batch = call(store.get, "t", batch_id)
    assert (batch["status"], batch["total"], batch["completed"], batch["failed"]) == (
        "completed", 3, 1, 2)
    files = store.files

    def lines(file_id: str) -> list[dict]:
        row = call(files.get, "t", file_id)
        return [json.loads(line) for line in b"".join(files.read(row)).splitlines()]
    out, errors = lines(batch["output_file_id"]), lines(batch["error_file_id"])
    assert [(r["custom_id"], r["id"], r["response"]["status_code"]) for r in out] == [
        ("l0", "req_0", 200)]
    assert [(r["custom_id"], r["error"] and r["error"]["code"]) for r in errors] == [
        ("l1", None), ("l2", "batch_cancelled")]


def test_batches_list_newest_first_with_cursors(store):
    ids = [store.db.call(store.create, "t", FIELDS, 3600)["id"] for _ in range(5)]
    page, more = store.db.call(store.list, "t", 2)
    assert [b["id"] for b in page] == ids[:-3:-1] and more
    page, more = store.db.call(store.list, "t", 2, ids[3])
    assert [b["id"] for b in page] == [ids[2], ids[1]] and more
    page, more = store.db.call(store.list, "t", 10, None, ids[1])
    assert [b["id"] for b in page] == ids[:1:-1] and not more
    assert store.db.call(store.list, "other", 10) == ([], False)


def test_a_version_5_database_gains_the_model_and_status_columns(tmp_path):
    path = tmp_path / "localserve.db"
    db = Database(path)
    batch_id = started(BatchStore(db, FileStore(db, tmp_path / "files")), ["a", "b"])
    db.call(ResponseStore(db).put, "t", {"id": "resp_1", "status": "in_progress"}, [])
    db.close()
    db = database_at_version(path, 5, "alter table batch_lines drop column model",
                             "alter table responses drop column status")
    try:  # the columns came back, filled from the JSON they were taken from
        store = BatchStore(db, FileStore(db, tmp_path / "files"))
        me = replica(store, "me")
        assert claimed(store, batch_id, me, loaded=("b",)) == ["l1", "l0"]
        assert db.call(ResponseStore(db, me).fail_orphaned, {"code": "x", "message": "y"}) == 1
    finally:
        db.close()


def test_sqlite_placeholders_become_psycopgs():
    assert to_pyformat("select * from t where a = ? and b = :name") == \
        "select * from t where a = %s and b = %(name)s"
    # inside a literal nothing is a placeholder, and % is doubled everywhere
    assert to_pyformat("select '?:x%' as s, a % 2 from t where c like 'a%' and d = ?") == \
        "select '?:x%%' as s, a %% 2 from t where c like 'a%%' and d = %s"
    assert to_pyformat("select 'it''s ?' where e = ?") == "select 'it''s ?' where e = %s"
