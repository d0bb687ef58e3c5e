"""The Conversations API through the official openai client against a real server (the tiny
model): conversations and their items, and responses that read a conversation and add their
turn to it. A response reading a conversation must see exactly what the same items sent as
its input give: the same input tokens and, greedy, the same answer."""

from __future__ import annotations

import time

import openai
import pytest

from tests.api.conftest import MODEL, OTHER_KEY

BOTH_STORES = True  # tests of the shared server run on SQLite and on PostgreSQL

GREEDY = {"temperature": 0.0, "max_output_tokens": 8}


def texts(items) -> list[tuple[str, str, str]]:
    return [(i.type, getattr(i, "role", ""), i.content[0].text if i.type == "message"
             else getattr(i, "arguments", None) or i.output) for i in items]


def test_create_retrieve_update_delete(client):
    conv = client.conversations.create(metadata={"topic": "rivers"}, items=[
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert conv.id.startswith("conv_") and conv.object == "conversation"
    assert conv.metadata == {"topic": "rivers"} and conv.created_at <= time.time() + 1
    assert client.conversations.retrieve(conv.id) == conv
    updated = client.conversations.update(conv.id, metadata={"topic": "lakes"})
    assert updated.metadata == {"topic": "lakes"} and updated.id == conv.id
    items = client.conversations.items.list(conv.id, order="asc").data
    # developer speaks as system (as in a response's input); a string becomes an input_text
    assert texts(items) == [("message", "system", "Be brief."), ("message", "user", "Hi")]
    assert all(i.status == "completed" and i.id.startswith("msg_") for i in items)
    deleted = client.conversations.delete(conv.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (conv.id, True,
                                                            "conversation.deleted")
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.delete(conv.id)


def test_responses_read_the_conversation_and_add_their_turn(client):
    conv = client.conversations.create(items=[{"role": "system", "content": "Be brief."}])
    first = client.responses.create(model=MODEL, input="Hello there", conversation=conv.id,
                                    **GREEDY)
    assert first.conversation.id == conv.id
    second = client.responses.create(model=MODEL, input="And then?",
                                     conversation={"id": conv.id}, **GREEDY)
    items = client.conversations.items.list(conv.id, order="asc").data
    assert texts(items) == [
        ("message", "system", "Be brief."), ("message", "user", "Hello there"),
        ("message", "assistant", first.output_text), ("message", "user", "And then?"),
        ("message", "assistant", second.output_text)]
    assert items[2].id == first.output[0].id and items[4].id == second.output[0].id
    # the same items as input: the same prompt, the same greedy answer
    inline = client.responses.create(model=MODEL, input=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}], store=False, **GREEDY)
    assert inline.usage.input_tokens == second.usage.input_tokens
    assert inline.output_text == second.output_text
    # a background response adds its turn when it ends
    bg = client.responses.create(model=MODEL, input="Last one", conversation=conv.id,
                                 background=True, **GREEDY)
    deadline = time.monotonic() + 60
    while client.responses.retrieve(bg.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    done = client.responses.retrieve(bg.id)
    items = client.conversations.items.list(conv.id, order="asc").data
    assert texts(items)[-2:] == [("message", "user", "Last one"),
                                 ("message", "assistant", done.output_text)]


def test_function_calls_and_outputs_are_items(client):
    conv = client.conversations.create()
    added = client.conversations.items.create(conv.id, items=[
        {"role": "user", "content": "Add 2 and 3"},
        {"type": "function_call", "call_id": "call_1", "name": "add",
         "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"}])
    assert [i.type for i in added.data] == ["message", "function_call", "function_call_output"]
    assert added.data[1].call_id == "call_1" and added.data[2].output == "5"
    assert client.conversations.items.list(conv.id, order="asc").data == added.data
    r = client.responses.create(model=MODEL, input="So?", conversation=conv.id, **GREEDY)
    inline = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Add 2 and 3"},
        {"type": "function_call", "call_id": "call_1", "name": "add",
         "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"role": "user", "content": "So?"}], store=False, **GREEDY)
    assert (r.usage.input_tokens, r.output_text) == (inline.usage.input_tokens,
                                                     inline.output_text)


def test_items_page_retrieve_and_delete(client):
    conv = client.conversations.create(items=[{"role": "user", "content": f"m{i}"}
                                              for i in range(5)])
    newest = client.conversations.items.list(conv.id, limit=2)  # newest first by default
    assert [i.content[0].text for i in newest.data] == ["m4", "m3"] and newest.has_more
    assert (newest.first_id, newest.last_id) == (newest.data[0].id, newest.data[1].id)
    rest = client.conversations.items.list(conv.id, limit=10, after=newest.last_id)
    assert [i.content[0].text for i in rest.data] == ["m2", "m1", "m0"] and not rest.has_more
    every = [i.content[0].text for i in client.conversations.items.list(conv.id)]  # auto-pages
    assert every == ["m4", "m3", "m2", "m1", "m0"]
    one = client.conversations.items.retrieve(rest.data[0].id, conversation_id=conv.id)
    assert one == rest.data[0]
    after = client.conversations.items.delete(one.id, conversation_id=conv.id)
    assert after.id == conv.id and after.object == "conversation"
    left = client.conversations.items.list(conv.id, order="asc").data
    assert [i.content[0].text for i in left] == ["m0", "m1", "m3", "m4"]
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.retrieve(one.id, conversation_id=conv.id)
    with pytest.raises(openai.NotFoundError):
        client.conversations.items.delete(one.id, conversation_id=conv.id)


def test_bad_requests_name_the_field(client, server):
    conv = client.conversations.create()
    cases = [
        (lambda: client.conversations.create(items=[{"role": "user", "content": "x"}] * 21),
         "items"),
        (lambda: client.conversations.create(metadata={"k": 1}), "metadata"),
        (lambda: client.conversations.create(extra_body={"color": "red"}), "color"),
        (lambda: client.conversations.items.create(conv.id, items=[]), "items"),
        (lambda: client.conversations.items.create(conv.id, items=[{"role": "robot",
                                                                    "content": "x"}]),
         "items[0].role"),
        (lambda: client.conversations.items.list(conv.id, order="up"), "order"),
        (lambda: client.conversations.items.list(conv.id, after="msg_nope"), "after"),
        (lambda: client.responses.create(model=MODEL, input="hi", conversation=conv.id,
                                         previous_response_id="resp_x"), "conversation"),
        (lambda: client.responses.create(model=MODEL, input="hi",
                                         conversation={"id": conv.id, "x": 1}), "conversation"),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param, (param, e.value.body)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi", conversation="conv_nope")
    assert e.value.body["param"] == "conversation"
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0)
    for call in (lambda: other.conversations.retrieve(conv.id),
                 lambda: other.conversations.items.list(conv.id),
                 lambda: other.responses.create(model=MODEL, input="hi", conversation=conv.id)):
        with pytest.raises(openai.NotFoundError):
            call()
