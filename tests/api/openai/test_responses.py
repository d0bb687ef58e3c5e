"""The Responses API through the official openai client against a real server (the tiny
model): create, stream, stored responses and previous_response_id, a json_schema format and a
required function call. Schemas bound their output, so every answer closes within its
max_output_tokens whatever the random model samples."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.api.conftest import API_KEY, MODEL, OTHER_KEY

BOTH_STORES = True  # tests of the shared server run on SQLite and on PostgreSQL

GREEDY = {"temperature": 0.0}
ANSWER = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "word": {"type": "string", "maxLength": 12}},
    "required": ["ok", "word"], "additionalProperties": False}
ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {
           "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
           "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
           "required": ["a", "b"], "additionalProperties": False}}
LONG_QUESTION = "Please tell me, in a few words, what the weather is like by the sea today?"


def test_create_answers_with_output_text_and_usage(client):
    r = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=10,
                                **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text"
    assert r.output_text == r.output[0].content[0].text
    assert 0 < r.usage.output_tokens <= 10 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_stream_deltas_equal_the_created_text(client):
    kwargs = dict(model=MODEL, input=[{"role": "user", "content": "Tell me about the sea"}],
                  instructions="You are terse.", max_output_tokens=16, **GREEDY)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_helper_gives_the_final_response(client):
    # The helper's final response needs `response.completed`: a schema makes the answer end
    # (one cut off by max_output_tokens ends with `response.incomplete`, as OpenAI's does).
    with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=64, text={
            "format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text


def test_previous_response_id_continues_the_stored_conversation(client):
    first = client.responses.create(model=MODEL, input=LONG_QUESTION, max_output_tokens=8,
                                    **GREEDY)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=MODEL, input="And tomorrow?",
                                     previous_response_id=first.id, max_output_tokens=4,
                                     **GREEDY)
    assert second.previous_response_id == first.id
    alone = client.responses.create(model=MODEL, input="And tomorrow?", max_output_tokens=4,
                                    store=False, **GREEDY)
    # The history (question and answer) is in the prompt, and its blocks come from the cache.
    assert second.usage.input_tokens >= (alone.usage.input_tokens
                                         + first.usage.input_tokens
                                         + first.usage.output_tokens - 2)
    assert second.usage.input_tokens_details.cached_tokens >= 16
    import openai

    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store=False: never stored


def test_input_items_list_the_conversation_newest_first(client):
    first = client.responses.create(model=MODEL, input="First question", max_output_tokens=3,
                                    instructions="Be brief.", **GREEDY)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, max_output_tokens=3, **GREEDY,
        input=[{"type": "function_call_output", "call_id": "call_1", "output": "42"},
               {"role": "user", "content": "Second question"}])
    items = client.responses.input_items.list(second.id).data
    # Newest first: this request's input, then the first response's output and input (its
    # instructions are not part of the conversation).
    assert [i.type for i in items] == ["message", "function_call_output", "message",
                                       "message"]
    assert items[0].content[0].text == "Second question" and items[1].output == "42"
    assert items[2].role == "assistant" and items[2].content[0].text == first.output_text
    assert items[3].content[0].text == "First question"
    asc = client.responses.input_items.list(second.id, order="asc", limit=2)
    assert [i.id for i in asc.data] == [items[3].id, items[2].id] and asc.has_more
    rest = client.responses.input_items.list(second.id, order="asc", after=asc.data[-1].id)
    assert [i.id for i in rest.data] == [items[1].id, items[0].id] and not rest.has_more


def test_stored_responses_belong_to_their_key_and_can_be_deleted(client, server):
    from openai import NotFoundError, OpenAI

    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    with OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0) as other:
        with pytest.raises(NotFoundError):
            other.responses.retrieve(r.id)
        with pytest.raises(NotFoundError) as e:
            other.responses.create(model=MODEL, input="Hi", previous_response_id=r.id)
        assert e.value.body["param"] == "previous_response_id"
    deleted = client.responses.delete(r.id)
    assert deleted is None  # the client returns nothing; the server said deleted
    with pytest.raises(NotFoundError):
        client.responses.retrieve(r.id)
    gone = httpx.delete(f"{server.url}/v1/responses/{r.id}",
                        headers={"Authorization": f"Bearer {API_KEY}"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"


def test_json_schema_format_gives_valid_json(client):
    for stream in (False, True):
        kwargs = dict(model=MODEL, input="Answer as JSON.", max_output_tokens=64,
                      text={"format": {"type": "json_schema", "name": "answer",
                                       "schema": ANSWER, "strict": True}})
        if stream:
            events = list(client.responses.create(stream=True, **kwargs))
            r = events[-1].response
        else:
            r = client.responses.create(**kwargs)
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), ANSWER)
        assert r.text.format.type == "json_schema"


def test_required_function_call_and_its_output_sent_back(client):
    r = client.responses.create(model=MODEL, input="What is 2 + 3?", tools=[ADD],
                                tool_choice="required", max_output_tokens=64,
                                parallel_tool_calls=False, max_tool_calls=1, **GREEDY)
    assert r.max_tool_calls == 1  # built-in tools only: function calls are not counted
    calls = [i for i in r.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    jsonschema.validate(json.loads(calls[0].arguments), ADD["parameters"])
    events = list(client.responses.create(
        model=MODEL, input="What is 2 + 3?", tools=[ADD], tool_choice="required",
        max_output_tokens=64, parallel_tool_calls=False, stream=True, **GREEDY))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert done and done[0].arguments == deltas == calls[0].arguments
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, max_output_tokens=4, tools=[ADD],
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}])
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_included_logprobs_are_chat_s_for_the_same_turn(client):
    said = [{"role": "user", "content": "Say hi"}]  # a first token 0.46 above the next
    kwargs = dict(model=MODEL, input=said, include=["message.output_text.logprobs"],
                  top_logprobs=2, max_output_tokens=12, **GREEDY)
    r = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model=MODEL, messages=said, logprobs=True,
                                          top_logprobs=2, max_tokens=12, **GREEDY)
    part = r.output[0].content[0]
    assert part.text == chat.choices[0].message.content
    want = [lp.model_dump() for lp in chat.choices[0].logprobs.content]
    assert [lp.model_dump() for lp in part.logprobs] == want and want
    assert all(len(lp["top_logprobs"]) == 2 for lp in want) and r.top_logprobs == 2
    assert len(want) == r.usage.output_tokens

    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [lp.model_dump() for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    [added] = [e.part for e in events if e.type == "response.content_part.added"]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert streamed == want and [lp.model_dump() for lp in done.logprobs] == want
    assert added.logprobs == []
    final = events[-1].response.output[0].content[0]
    assert [lp.model_dump() for lp in final.logprobs] == want

    # top_logprobs alone asks for none, as on OpenAI; other include values add nothing here,
    # nor do the prompt cache's settings
    r = client.responses.create(**kwargs | {"include": ["reasoning.encrypted_content"],
                                            "prompt_cache_retention": "in_memory",
                                            "prompt_cache_options": {"mode": "implicit"}})
    assert r.output[0].content[0].logprobs == [] and r.top_logprobs == 2
    assert r.output_text == part.text


def test_truncation_auto_drops_the_oldest_items_until_the_input_fits(client):
    import openai

    old = [{"role": "user", "content": "Tell me everything. " * 250},  # past 4,096 tokens
           {"role": "assistant", "content": "The sea is wide and deep."}]
    ask = {"role": "user", "content": "And the rivers?"}
    kwargs = dict(model=MODEL, max_output_tokens=8, **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:  # "disabled", the default
        client.responses.create(input=[*old, ask], **kwargs)
    assert e.value.code == "context_length_exceeded"
    cut = client.responses.create(input=[*old, ask], truncation="auto", **kwargs)
    rest = client.responses.create(input=[old[1], ask], **kwargs)
    assert cut.truncation == "auto" and cut.usage.input_tokens == rest.usage.input_tokens
    assert cut.output_text == rest.output_text
    # stored whole: the items listed are all of them, though the turn saw the last two
    assert len(client.responses.input_items.list(cut.id).data) == 3
    with pytest.raises(openai.BadRequestError) as e:  # nothing to drop: the last cannot go
        client.responses.create(input=[old[0]], truncation="auto", **kwargs)
    assert e.value.code == "context_length_exceeded"


def test_truncation_auto_keeps_the_longest_tail_that_fits(client):
    """Far over the context, with tool calls between: the tail kept is the longest that fits
    (found by a binary search), the one a scan dropping one item at a time finds."""
    import openai

    words = "the sea is wide and the rivers are long and the hills are green " * 4
    items = []
    for i in range(24):
        items.append({"role": "user", "content": f"{i}: {words}"})
        if i % 5 == 2:  # a call and its result, which go with the call when it is dropped
            items += [{"type": "function_call", "call_id": f"c{i}", "name": "add",
                       "arguments": '{"a": 1, "b": 2}'},
                      {"type": "function_call_output", "call_id": f"c{i}", "output": "3"}]
        items.append({"role": "assistant", "content": f"{i}: {words}"})
    items.append({"role": "user", "content": "And the rivers?"})
    kwargs = dict(model=MODEL, max_output_tokens=8, tools=[ADD], **GREEDY)
    cut = client.responses.create(input=items, truncation="auto", **kwargs)
    for start in range(1, len(items)):  # the reference: the first tail that is not refused
        if items[start].get("type") == "function_call_output":
            continue  # a result whose call went
        try:
            rest = client.responses.create(input=items[start:], **kwargs)
        except openai.BadRequestError as e:
            assert e.code == "context_length_exceeded"
            continue
        break
    assert 3 < start < len(items) - 10  # it dropped some, and kept some
    assert cut.usage.input_tokens == rest.usage.input_tokens
    assert cut.output_text == rest.output_text and cut.status == rest.status


def test_truncation_cuts_drop_tool_results_with_their_call():
    from server.api.openai.responses import _cuts

    def m(role):
        return {"role": role}

    messages = [m("user"), m("assistant"), m("tool"), m("tool"), m("user"), m("tool")]
    assert _cuts(messages) == [0, 1, 4, 5]  # the last item always stays
    assert _cuts([m("user")]) == [0]


def test_input_tokens_count_what_a_response_takes(client):
    import openai

    kw = dict(input="What is 2 + 3?", instructions="Be brief.", tools=[ADD])
    counted = client.responses.input_tokens.count(model=MODEL, **kw)
    assert counted.object == "response.input_tokens"
    r = client.responses.create(model=MODEL, max_output_tokens=4, **GREEDY, **kw)
    assert counted.input_tokens == r.usage.input_tokens
    first = client.responses.create(model=MODEL, input="Hello there", max_output_tokens=4,
                                    **GREEDY)
    # a stored conversation before the input, and `model` left out (OpenAI allows it)
    follow = client.responses.input_tokens.count(input="And you?", previous_response_id=first.id)
    r = client.responses.create(model=MODEL, input="And you?", previous_response_id=first.id,
                                max_output_tokens=4, **GREEDY)
    assert follow.input_tokens == r.usage.input_tokens > first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.input_tokens.count(input="Hi", previous_response_id="resp_nope")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.input_tokens.count(model=MODEL, input=5)
    assert e.value.body["param"] == "input"


def test_bad_requests_name_the_field(client):
    import openai

    cases = [
        (dict(input=[]), "input"),
        (dict(input="hi", tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(input="hi", tools=[{"type": "function", "name": "a b"}]), "tools[0].name"),
        (dict(input="hi", text={"format": {"type": "xml"}}), "text.format.type"),
        (dict(input="hi", text={"format": {"type": "json_schema", "schema": {}}}),
         "text.format.name"),
        (dict(input=[{"role": "robot", "content": "hi"}]), "input[0].role"),
        (dict(input="hi", extra_body={"bogus": 1}), "bogus"),
        (dict(input="hi", max_output_tokens=0), "max_output_tokens"),
        (dict(input="hi", include=["message.output_text.bogus"]), "include"),
        (dict(input="hi", include="message.output_text.logprobs"), "include"),
        (dict(input="hi", top_logprobs=21), "top_logprobs"),
        (dict(input="hi", prompt_cache_retention="forever"), "prompt_cache_retention"),
        (dict(input="hi", truncation="middle"), "truncation"),
        (dict(input="hi", max_tool_calls=0), "max_tool_calls"),
        (dict(input="hi", context_management=[{"type": "compaction"}]), "context_management"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)


def batch_tokens(server) -> tuple[int, int]:
    rows = httpx.get(f"{server.url}/v1/usage", headers=server.headers, timeout=10).json()["data"]
    return (sum(r["prompt_tokens"] for r in rows if r["kind"] == "batch"),
            sum(r["completion_tokens"] for r in rows if r["kind"] == "batch"))


def test_responses_through_the_batch_api(client, server):
    from tests.api.batch.test_batches import jsonl, read_lines, wait

    before = batch_tokens(server)
    bodies = [{"model": MODEL, "input": f"Question {i}", "max_output_tokens": 6,
               "temperature": 0, "store": False} for i in range(3)]
    lines = [{"custom_id": f"r-{i}", "method": "POST", "url": "/v1/responses", "body": b}
             for i, b in enumerate(bodies)]
    f = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    b = wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/responses",
                                           completion_window="24h").id)
    assert b.status == "completed" and b.request_counts.completed == 3
    out = {x["custom_id"]: x["response"]["body"] for x in read_lines(client, b.output_file_id)}
    for i, body in enumerate(bodies):
        interactive = client.responses.create(**body)
        batched = out[f"r-{i}"]
        assert batched["object"] == "response"
        assert batched["output"][0]["content"][0]["text"] == interactive.output_text
        assert batched["usage"]["output_tokens"] == interactive.usage.output_tokens
    # The lines' usage (Responses' input/output token names) counts as batch usage.
    after = batch_tokens(server)
    assert after[0] - before[0] == sum(out[k]["usage"]["input_tokens"] for k in out)
    assert after[1] - before[1] == sum(out[k]["usage"]["output_tokens"] for k in out)
