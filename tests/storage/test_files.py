"""The file store on both stores (a SQLite file with the bytes beside it, PostgreSQL with them
inside): ownership, idempotency, expiry; SQLite's leftovers, lock and corrupt files."""

from __future__ import annotations

import pytest

from storage.db import SCHEMA_VERSION, Database, DatabaseBusyError, DatabaseCorruptError
from storage.files import CHUNK, FileStore, split_lines
from storage.sql import StoreError
from tests.helpers import database_at_version


@pytest.fixture
def store(store_target, tmp_path):
    db = Database(store_target)
    yield FileStore(db, tmp_path / "files")
    db.close()


def content(store: FileStore, row: dict) -> bytes | None:
    chunks = store.read(row)
    return None if chunks is None else b"".join(chunks)


def num_stored(store: FileStore) -> int:
    """Files whose bytes are kept (on the disk, or in the store's chunks)."""
    if store.in_store:
        return store.db.call(lambda: store.db.conn.one(
            "select count(distinct file_id) as n from file_chunks")["n"])
    return sum(1 for p in store.root.iterdir() if not p.name.startswith("."))


def upload(store: FileStore, tenant: str, data: bytes, key: str | None = None) -> dict:
    scratch = store.scratch()
    scratch.write_bytes(data)
    return store.db.call(store.add, tenant, "in.jsonl", "batch", scratch, key)


def test_owner_only_and_idempotent(store):
    a = upload(store, "alice", b"{}\n", key="k1")
    again = upload(store, "alice", b"other bytes\n", key="k1")
    assert again["id"] == a["id"] and content(store, a) == b"{}\n"
    assert upload(store, "bob", b"{}\n", key="k1")["id"] != a["id"]  # keys are per tenant
    assert store.db.call(store.get, "bob", a["id"]) is None
    assert store.db.call(store.delete, "bob", a["id"]) is False
    assert store.db.call(store.delete, "alice", a["id"]) is True
    assert num_stored(store) == 1  # bob's
    assert not list(store.root.glob(".upload-*"))  # the second upload's bytes were dropped


def test_leftovers_of_a_killed_upload_are_swept(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    (files / ".upload-abc").write_bytes(b"half")
    (files / ".file-x-output.tmp").write_bytes(b"half")
    (files / "file-keep").write_bytes(b"whole")
    db = Database(tmp_path / "localserve.db")
    try:
        FileStore(db, files)
        assert sorted(p.name for p in files.iterdir()) == ["file-keep"]
    finally:
        db.close()


def test_one_database_user_at_a_time(tmp_path):
    db = Database(tmp_path / "localserve.db")
    try:
        with pytest.raises(DatabaseBusyError):
            Database(tmp_path / "localserve.db")
    finally:
        db.close()
    Database(tmp_path / "localserve.db").close()  # free again once closed


@pytest.mark.parametrize("content", [b"\x00\x13garbage" * 400, b"SQLite format 3\x00garbage"],
                         ids=["noise", "bad-header"])
def test_a_corrupt_database_is_named_and_the_home_left_free(tmp_path, content):
    path = tmp_path / "localserve.db"
    path.write_bytes(content)
    with pytest.raises(DatabaseCorruptError, match="localserve.db is not a database SQLite can "
                                                   "read .*: move it away"):
        Database(path)
    path.rename(tmp_path / "corrupt.db")
    Database(path).close()  # the lock was let go: moved away, a fresh one opens


def test_expired_files_are_gone_then_swept(store):
    keep = upload(store, "alice", b"keep\n")
    scratch = store.scratch()
    scratch.write_bytes(b"short-lived\n")
    old = store.db.call(store.add, "alice", "old.jsonl", "batch", scratch, None, 3600)
    assert old["expires_at"] == old["created_at"] + 3600
    assert store.db.call(store.sweep_expired) == 0  # not yet expired: kept
    assert store.db.call(store.get, "alice", old["id"])["id"] == old["id"]

    def backdate():  # as if the hour had passed
        store.db.conn.execute("update files set expires_at = expires_at - 3601 where id = ?",
                            [old["id"]])
    store.db.call(backdate)
    assert store.db.call(store.get, "alice", old["id"]) is None  # gone for clients at once
    listed, _ = store.db.call(store.list, "alice", None, None, 100, "desc")
    assert [r["id"] for r in listed] == [keep["id"]]
    assert num_stored(store) == 2  # the bytes stay until the sweep
    assert store.db.call(store.sweep_expired) == 1
    assert num_stored(store) == 1 and content(store, keep) == b"keep\n"
    assert store.db.call(store.get, "alice", keep["id"]) is not None


def test_a_version_1_database_gains_the_expiry_column(tmp_path):
    db = database_at_version(tmp_path / "localserve.db", 1,
                             "alter table batches drop column output_expires_after")
    try:
        columns = db.call(lambda: db.conn.query("pragma table_info(batches)"))
        assert "output_expires_after" in {c["name"] for c in columns}
    finally:
        db.close()


def test_bytes_over_several_chunks_come_back_whole(store):
    # 2.5 chunks of lines of 100 bytes: lines straddle the 1 MiB chunk edges
    data = b"".join(b"%099d\n" % n for n in range(int(2.5 * CHUNK) // 100))
    row = upload(store, "alice", data)
    assert row["bytes"] == len(data) and content(store, row) == data
    assert list(split_lines(store.read(row))) == data.splitlines(keepends=True)

    def write(lines):
        with store.db.transaction() as db:
            return store.write(db, "file-out", "alice", "out.jsonl", "batch_output", lines)
    assert store.db.call(write, ["x" * 700_000] * 3)["bytes"] == 3 * 700_001
    assert store.db.call(write, ["second", "time"])["bytes"] == 12  # written again: replaced
    assert content(store, store.db.call(store.get, "alice", "file-out")) == b"second\ntime\n"


def test_split_lines_keeps_every_byte():
    assert list(split_lines([b"ab\ncd", b"e", b"f\n\ng", b"h"])) == [
        b"ab\n", b"cdef\n", b"\n", b"gh"]
    assert list(split_lines([b"x\n"])) == [b"x\n"] and list(split_lines([])) == []


def test_a_postgresql_store_out_of_reach_or_too_new_is_a_clear_error(postgres):
    with pytest.raises(StoreError, match=r"PostgreSQL at postgresql://u:\*\*\*@127.0.0.1:1/x "
                                         "is unreachable: connection failed"):
        Database("postgresql://u:secret@127.0.0.1:1/x", reconnect_seconds=0.2)
    url = postgres.create_database()
    Database(url).close()
    db = Database(url)
    db.call(lambda: db.conn.execute("update schema_version set version = ?",
                                    [SCHEMA_VERSION + 1]))
    db.close()
    with pytest.raises(StoreError, match=f"schema is version {SCHEMA_VERSION + 1}, newer"):
        Database(url)
