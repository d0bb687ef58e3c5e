"""ChatCompletionStore on both stores (SQLite, PostgreSQL): oldest first, filtered by model and
by every metadata pair asked, per tenant."""

from __future__ import annotations

from storage.chat_completions import ChatCompletionStore
from storage.db import Database


def completion(n: int, model: str = "m") -> dict:
    return {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 100 + n,
            "model": model, "choices": []}


def test_list_filters_and_keeps_the_order_per_tenant(store_target):
    db = Database(store_target)
    try:
        store = ChatCompletionStore(db)
        messages = [{"role": "user", "content": "hi"}]
        db.call(store.put, "alice", completion(2), messages, {"a": "1", "b": "2"})
        db.call(store.put, "alice", completion(1, "other"), messages, {"a": "1"})
        db.call(store.put, "bob", completion(3), messages, {"a": "1"})

        def ids(model=None, metadata=None):
            return [c["id"] for c in db.call(store.list, "alice", model, metadata or {})]
        assert ids() == ["chatcmpl-1", "chatcmpl-2"]  # by creation time
        assert ids("m") == ["chatcmpl-2"]
        assert ids(None, {"a": "1"}) == ["chatcmpl-1", "chatcmpl-2"]
        assert ids(None, {"a": "1", "b": "2"}) == ["chatcmpl-2"]
        assert ids(None, {"b": "3"}) == []
        got, got_messages = db.call(store.get, "alice", "chatcmpl-2")
        assert got == completion(2) | {"metadata": {"a": "1", "b": "2"}}
        assert got_messages == messages
        assert db.call(store.get, "bob", "chatcmpl-2") is None
        assert db.call(store.set_metadata, "bob", "chatcmpl-2", {}) is None
        assert db.call(store.set_metadata, "alice", "chatcmpl-2", {"c": "3"})["metadata"] == {
            "c": "3"}
        assert not db.call(store.delete, "bob", "chatcmpl-2")
        assert db.call(store.delete, "alice", "chatcmpl-2")
        assert ids() == ["chatcmpl-1"]
    finally:
        db.close()
