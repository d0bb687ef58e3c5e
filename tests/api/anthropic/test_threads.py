"""Anthropic's message threads: the store's line of claims, the refusals the SDK recovers from,
and the SDK's own tool runner (which threads by default) looping against the server."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from storage.db import Database
from storage.replicas import ReplicaStore
from storage.threads import THREAD_DAYS, ThreadError, ThreadStore
from tests.api.conftest import API_KEY, MODEL

BOTH_STORES = True  # tests of the shared server run on SQLite and on PostgreSQL

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                            "required": ["city"]}}  # bounded: the random model's call ends


def test_a_message_is_continued_once(store_target):
    db = Database(store_target)
    store = ThreadStore(db)
    try:
        turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
        more = [{"role": "user", "content": "And?"}, {"role": "assistant", "content": "So."}]
        db.call(store.put, "alice", "msg_1", None, turn)
        with pytest.raises(ThreadError, match="thread_not_found"):
            db.call(store.claim, "bob", "msg_1", "msg_2")  # another tenant's
        assert db.call(store.claim, "alice", "msg_1", "msg_2") == turn
        with pytest.raises(ThreadError, match="thread_continue_in_flight"):
            db.call(store.claim, "alice", "msg_1", "msg_3")
        db.call(store.release, "msg_1", "msg_2")  # msg_2 failed
        assert db.call(store.claim, "alice", "msg_1", "msg_3") == turn
        db.call(store.put, "alice", "msg_3", "msg_1", more)  # its part, after msg_1's
        with pytest.raises(ThreadError, match="thread_already_continued"):
            db.call(store.claim, "alice", "msg_1", "msg_4")
        assert db.call(store.claim, "alice", "msg_3", "msg_5") == turn + more
        assert db.call(store.release_unfinished) == 1  # msg_5 never came (a crash)
        assert db.call(store.claim, "alice", "msg_3", "msg_6") == turn + more
        rows = db.call(lambda: [json.loads(r["messages"]) for r in db.conn.query(
            "select messages from message_threads order by id")])
        assert rows == [turn, more]  # each turn's part once, not the conversation again
    finally:
        db.close()


def test_a_live_replicas_continuation_is_its_own_until_it_goes(store_target):
    db = Database(store_target)
    try:
        a, b = ReplicaStore(db, "a"), ReplicaStore(db, "b")
        db.call(a.beat)
        db.call(b.beat)
        on_a, on_b = ThreadStore(db, a), ThreadStore(db, b)
        turn = [{"role": "user", "content": "Hi"}]
        db.call(on_a.put, "alice", "msg_1", None, turn)
        db.call(on_a.claim, "alice", "msg_1", "msg_2")  # a is answering msg_2
        assert db.call(on_b.release_unfinished) == 0  # b starting up leaves it alone
        with pytest.raises(ThreadError, match="thread_continue_in_flight"):
            db.call(on_b.claim, "alice", "msg_1", "msg_3")
        db.call(lambda: db.conn.execute(  # a falls silent past the stale window
            "update replicas set heartbeat_at = heartbeat_at - 31 where id = 'a'"))
        assert db.call(on_b.release_unfinished) == 1
        assert db.call(on_b.claim, "alice", "msg_1", "msg_3") == turn
    finally:
        db.close()


def test_old_messages_go_and_their_threads_are_not_found(store_target):
    db = Database(store_target)
    store = ThreadStore(db)
    try:
        db.call(store.put, "alice", "msg_1", None, [{"role": "user", "content": "Hi"}])
        db.call(store.put, "alice", "msg_2", "msg_1", [{"role": "user", "content": "And?"}])
        old = int(time.time()) - (THREAD_DAYS + 1) * 86400
        db.call(lambda: db.conn.execute("update message_threads set created_at = ? where id = ?",
                                      [old, "msg_1"]))
        db.call(store.release_unfinished)
        with pytest.raises(ThreadError, match="thread_not_found"):  # its first part is gone
            db.call(store.claim, "alice", "msg_2", "msg_3")
    finally:
        db.close()


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"})


def test_a_continued_thread_answers_as_the_whole_conversation(server):
    """A turn that continues a thread sends only its new messages: its prompt is the whole
    conversation's, and its answer the one the whole conversation gets."""
    first = post(server, {"model": MODEL, "max_tokens": 5, "temperature": 0,
                          "thread": {"type": "create"},
                          "messages": [{"role": "user", "content": "Count to three."}]})
    assert first.status_code == 200, first.text
    reply = first.json()
    more = {"role": "user", "content": "And on to five?"}
    threaded = post(server, {"model": MODEL, "max_tokens": 5, "temperature": 0,
                             "thread": {"type": "continue", "previous_message_id": reply["id"]},
                             "messages": [more]})
    assert threaded.status_code == 200, threaded.text
    whole = post(server, {"model": MODEL, "max_tokens": 5, "temperature": 0, "messages": [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": reply["content"]}, more]})
    assert threaded.json()["content"] == whole.json()["content"]
    assert threaded.json()["usage"] == whole.json()["usage"] | {
        "cache_read_input_tokens": threaded.json()["usage"]["cache_read_input_tokens"],
        "input_tokens": threaded.json()["usage"]["input_tokens"]}
    again = post(server, {"model": MODEL, "max_tokens": 5, "thread": {
        "type": "continue", "previous_message_id": reply["id"]}, "messages": [more]})
    assert again.status_code == 409
    assert again.json()["error"]["details"] == {"error_code": "thread_already_continued"}
    lost = post(server, {"model": MODEL, "max_tokens": 5, "thread": {
        "type": "continue", "previous_message_id": "msg_nope"}, "messages": [more]})
    assert lost.status_code == 404
    assert lost.json()["error"]["details"] == {"error_code": "thread_not_found"}
    bad = post(server, {"model": MODEL, "max_tokens": 5, "thread": {"type": "resume"},
                        "messages": [more]})
    assert bad.status_code == 400 and "thread.type" in bad.json()["error"]["message"]


def test_the_sdk_tool_runner_loops_on_a_thread(server):
    from anthropic import Anthropic, beta_tool

    calls = []

    @beta_tool(input_schema=WEATHER["input_schema"])
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    with Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        runner = c.beta.messages.tool_runner(
            model=MODEL, max_tokens=120, tools=[get_weather], max_iterations=3,
            tool_choice={"type": "tool", "name": "get_weather"},
            messages=[{"role": "user", "content": "What is the weather in Paris?"}])
        replies = list(runner)
    assert len(replies) == 3 and len(calls) == 3  # each turn called the tool (it must)
    assert all(r.content[-1].type == "tool_use" for r in replies)
    rows = server.sql("select id, continued_by from message_threads")  # the turns' thread
    chain = {r["id"]: r["continued_by"] for r in rows}
    assert chain[replies[0].id] == replies[1].id and chain[replies[1].id] == replies[2].id
