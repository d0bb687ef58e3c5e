"""ConversationStore on both stores (SQLite, PostgreSQL): items in order, per tenant; a version
3 SQLite database (before conversations) gains the table."""

from __future__ import annotations

from storage.conversations import ConversationStore
from storage.db import SCHEMA_VERSION, Database
from tests.helpers import database_at_version


def item(n: int) -> dict:
    return {"id": f"msg_{n}", "type": "message", "role": "user", "status": "completed",
            "content": [{"type": "input_text", "text": str(n)}]}


def test_items_keep_their_order_per_tenant(store_target):
    db = Database(store_target)
    try:
        store = ConversationStore(db)
        conv = db.call(store.create, "alice", "conv_1", {"k": "v"}, [item(0)])
        assert conv == {"id": "conv_1", "object": "conversation",
                        "created_at": conv["created_at"], "metadata": {"k": "v"}}
        assert db.call(store.add_items, "alice", "conv_1", [item(1), item(2)])
        assert db.call(store.get, "alice", "conv_1")[1] == [item(0), item(1), item(2)]
        assert db.call(store.delete_item, "alice", "conv_1", "msg_1")
        assert not db.call(store.delete_item, "alice", "conv_1", "msg_1")  # gone already
        assert db.call(store.get, "alice", "conv_1")[1] == [item(0), item(2)]
        # another tenant sees nothing and changes nothing
        assert db.call(store.get, "bob", "conv_1") is None
        assert not db.call(store.add_items, "bob", "conv_1", [item(3)])
        assert not db.call(store.delete_item, "bob", "conv_1", "msg_0")
        assert db.call(store.set_metadata, "bob", "conv_1", {}) is None
        assert not db.call(store.delete, "bob", "conv_1")
        assert db.call(store.set_metadata, "alice", "conv_1", {"k": "w"})["metadata"] == {
            "k": "w"}
        assert db.call(store.delete, "alice", "conv_1")
        assert db.call(store.get, "alice", "conv_1") is None
        assert not db.call(store.add_items, "alice", "conv_1", [item(3)])
    finally:
        db.close()


def test_a_version_3_database_gains_the_conversations_table(tmp_path):
    db = database_at_version(tmp_path / "localserve.db", 3, "drop table conversations")
    try:
        store = ConversationStore(db)
        db.call(store.create, "alice", "conv_1", {}, [])
        assert db.call(store.get, "alice", "conv_1")[1] == []
        version = db.call(lambda: db.conn.one("pragma user_version"))["user_version"]
        assert version == SCHEMA_VERSION
    finally:
        db.close()
