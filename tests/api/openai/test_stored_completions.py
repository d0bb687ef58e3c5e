"""Stored chat completions (`store: true`) through the official openai client against a real
server (the tiny model): what is stored is what the request was answered, whole or streamed,
with the messages it answered; listed, filtered, paged, given new metadata and deleted. Each
test lists only its own completions (a metadata value of its own)."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.api.conftest import MODEL, OTHER_KEY

BOTH_STORES = True  # tests of the shared server run on SQLite and on PostgreSQL

ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}}


def ask(client, tag: str, text: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": text}],
        **{"max_tokens": 6, "temperature": 0, "store": True, "metadata": {"test": tag}}
        | kwargs)


def test_stored_is_what_was_answered_whole_or_streamed(client):
    tag = uuid.uuid4().hex
    whole = ask(client, tag, "Hello")
    chunks = list(ask(client, tag, "Hi there", stream=True,
                      stream_options={"include_usage": True}, n=2))
    stored = client.chat.completions.list(metadata={"test": tag}).data
    assert [s.id for s in stored] == [whole.id, chunks[0].id]  # oldest first
    assert stored[0].model_dump(exclude={"metadata"}) == whole.model_dump(exclude={"metadata"})
    assert stored[0].metadata == {"test": tag}
    streamed = stored[1]
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks
                       if c.choices and c.choices[0].index == i)
        finish = [c.choices[0].finish_reason for c in chunks
                  if c.choices and c.choices[0].index == i and c.choices[0].finish_reason]
        assert streamed.choices[i].message.content == text
        assert [streamed.choices[i].finish_reason] == finish
    assert streamed.usage == chunks[-1].usage
    assert client.chat.completions.retrieve(whole.id) == stored[0]
    messages = client.chat.completions.messages.list(whole.id).data
    assert [(m.id, m.role, m.content) for m in messages] == [
        (f"{whole.id}-0", "system", "Be brief."), (f"{whole.id}-1", "user", "Hello")]
    # not stored without `store`
    plain = client.chat.completions.create(model=MODEL, max_tokens=2, metadata={"test": tag},
                                           messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(plain.id)


def test_a_stored_tool_call(client):
    tag = uuid.uuid4().hex
    r = ask(client, tag, "Add 2 and 3", tools=[ADD], tool_choice="required",
            parallel_tool_calls=False, max_tokens=120)
    stored = client.chat.completions.retrieve(r.id)
    assert stored.choices[0].message.tool_calls == r.choices[0].message.tool_calls
    assert stored.choices[0].finish_reason == r.choices[0].finish_reason == "tool_calls"


def test_list_filters_pages_updates_and_deletes(client, server):
    tag = uuid.uuid4().hex
    ids = [ask(client, tag, f"Question {i}").id for i in range(4)]
    listed = client.chat.completions.list(metadata={"test": tag}, limit=3, order="desc")
    assert [x.id for x in listed.data] == ids[::-1][:3] and listed.has_more
    assert [x.id for x in client.chat.completions.list(metadata={"test": tag}, model=MODEL)
            ] == ids  # auto-paging, oldest first
    assert client.chat.completions.list(metadata={"test": tag}, model="other").data == []
    updated = client.chat.completions.update(ids[0], metadata={"test": tag, "kept": "yes"})
    assert updated.id == ids[0] and updated.metadata == {"test": tag, "kept": "yes"}
    assert [x.id for x in client.chat.completions.list(metadata={"kept": "yes"})] == [ids[0]]
    deleted = client.chat.completions.delete(ids[1])
    assert (deleted.id, deleted.deleted, deleted.object) == (ids[1], True,
                                                            "chat.completion.deleted")
    assert [x.id for x in client.chat.completions.list(metadata={"test": tag})] == [
        ids[0], ids[2], ids[3]]
    for call in (lambda: client.chat.completions.retrieve(ids[1]),
                 lambda: client.chat.completions.delete(ids[1]),
                 lambda: client.chat.completions.messages.list(ids[1])):
        with pytest.raises(openai.NotFoundError):
            call()
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0)
    assert other.chat.completions.list(metadata={"test": tag}).data == []
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.retrieve(ids[0])
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.update(ids[0], metadata={})


def test_bad_requests_name_the_field(client):
    tag = uuid.uuid4().hex
    r = ask(client, tag, "Hi")
    cases = [
        (lambda: ask(client, tag, "Hi", extra_body={"metadata": {"k": 1}}), "metadata"),
        (lambda: client.chat.completions.create(model=MODEL, max_tokens=1, store="yes",
                                                messages=[{"role": "user", "content": "x"}]),
         "store"),
        (lambda: client.chat.completions.update(r.id, metadata=None), "metadata"),
        (lambda: client.chat.completions.list(order="up"), "order"),
        (lambda: client.chat.completions.list(limit=0), "limit"),
        (lambda: client.chat.completions.list(after="chatcmpl-nope"), "after"),
        (lambda: client.chat.completions.messages.list(r.id, order="sideways"), "order"),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param, (param, e.value.body)
