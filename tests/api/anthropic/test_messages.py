"""Anthropic's Messages API through the official anthropic SDK against a real server (the
tiny model): create, stream, system, stop sequences, count_tokens, a forced tool, errors in
Anthropic's envelope, and the x-api-key header."""

from __future__ import annotations

import datetime
import json

import httpx
import jsonschema
import pytest

from tests.api.conftest import API_KEY, MODEL

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def anthropic_client(server):
    from anthropic import Anthropic

    with Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def test_create_answers_a_message_with_usage(anthropic_client):
    m = anthropic_client.messages.create(
        model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "Hello there"}],
        extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg")
    assert [b.type for b in m.content] == ["text"]
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert 0 < m.usage.output_tokens <= 12
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_models_list_and_retrieve_fill_anthropic_s_fields(anthropic_client):
    page = anthropic_client.models.list()
    assert [m.id for m in page.data] == [MODEL]
    assert page.has_more is False and page.first_id == page.last_id == MODEL
    model = anthropic_client.models.retrieve(MODEL)
    assert model.type == "model" and model.display_name == MODEL
    assert isinstance(model.created_at, datetime.datetime)
    assert model.created_at.utcoffset() == datetime.timedelta(0)
    assert model.model_dump() == page.data[0].model_dump()


def test_stream_events_add_up_to_the_created_message(anthropic_client):
    kwargs = dict(model=MODEL, max_tokens=16, system="You are terse.",
                  messages=[{"role": "user", "content": "Tell me about the sea"}],
                  extra_body=GREEDY)
    whole = anthropic_client.messages.create(**kwargs)
    with anthropic_client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_system_is_part_of_the_prompt(anthropic_client):
    messages = [{"role": "user", "content": "Hi"}]
    plain = anthropic_client.messages.count_tokens(model=MODEL, messages=messages)
    with_system = anthropic_client.messages.count_tokens(
        model=MODEL, messages=messages, system="You answer in one word, always.")
    blocks = anthropic_client.messages.count_tokens(
        model=MODEL, messages=messages,
        system=[{"type": "text", "text": "You answer in one word, always."}])
    # The tiny tokenizer spells "You answer in one word, always." in bytes and 8 merges:
    # the system turn adds its text plus the template's role markers.
    assert with_system.input_tokens > plain.input_tokens
    assert blocks.input_tokens == with_system.input_tokens


def test_count_tokens_equals_the_prompt_a_message_uses(anthropic_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Count these words"}])
    counted = anthropic_client.messages.count_tokens(**kwargs).input_tokens
    used = anthropic_client.messages.create(max_tokens=1, **kwargs).usage
    assert counted == used.input_tokens + used.cache_read_input_tokens


def test_a_final_assistant_message_is_the_start_of_the_reply(anthropic_client):
    """Anthropic's prefill: the prompt ends with the final assistant text itself (no end of
    turn, no new turn after it), so the reply continues it; an empty one is a plain reply."""
    import anthropic

    from tests.helpers import make_tokenizer

    ask = {"role": "user", "content": "Count from 1 to 10."}

    def count(*messages) -> int:
        return anthropic_client.messages.count_tokens(model=MODEL,
                                                      messages=list(messages)).input_tokens
    prefill = {"role": "assistant", "content": "1, 2, 3,"}
    added = len(make_tokenizer().encode("1, 2, 3,", add_special_tokens=False))
    assert count(ask, prefill) == count(ask) + added  # after "<|im_start|>assistant\n"
    assert count(ask, {"role": "assistant", "content": ""}) == count(ask)
    m = anthropic_client.messages.create(model=MODEL, max_tokens=3, messages=[ask, prefill],
                                         extra_body=GREEDY)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count(ask, prefill)
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=MODEL, max_tokens=3, messages=[
            ask, {"role": "assistant", "content": "1, 2, 3, "}])
    assert e.value.body["error"]["message"] == ("messages: final assistant content cannot end "
                                                "with trailing whitespace")


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_starts_the_answer_that_output_config_and_tools_constrain(anthropic_client,
                                                                            stream):
    """The grammar goes on from the prefill: prefill and reply together follow the schema;
    a prefill the schema or tool_choice cannot start is a 400 naming it."""
    import anthropic

    ask = {"role": "user", "content": "Describe a person."}
    prefill = '{"name": "Al'
    kw = dict(model=MODEL, max_tokens=60, messages=[ask, {"role": "assistant",
                                                           "content": prefill}],
              extra_body={"output_config": {"format": {"type": "json_schema",
                                                       "schema": PERSON}}, **GREEDY})
    if stream:
        with anthropic_client.messages.stream(**kw) as s:
            text, reason = s.get_final_text(), s.get_final_message().stop_reason
    else:
        m = anthropic_client.messages.create(**kw)
        text, reason = m.content[0].text, m.stop_reason
    assert reason == "end_turn" and not text.startswith(prefill)
    jsonschema.validate(json.loads(prefill + text), PERSON)
    for messages, extra in (([ask, {"role": "assistant", "content": "Hello"}], kw["extra_body"]),
                            ([ask, {"role": "assistant", "content": "Sure"}],
                             {"tools": [WEATHER], "tool_choice": {"type": "any"}})):
        with pytest.raises(anthropic.BadRequestError) as e:
            anthropic_client.messages.create(model=MODEL, max_tokens=3, messages=messages,
                                             extra_body=extra)
        assert "prefill" in e.value.body["error"]["message"]
    # With tools it may call ("auto"), the reply goes on from the text; markup is refused.
    m = anthropic_client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER],
                                         messages=[ask, {"role": "assistant",
                                                         "content": "Let me see."}])
    assert m.content and m.usage.output_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="tool-call markup"):
        anthropic_client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], messages=[
            ask, {"role": "assistant", "content": "Let me see. <tool"}])


def test_a_plain_text_document_is_the_user_s_text_in_document_tags(anthropic_client):
    import anthropic

    ask = {"type": "text", "text": "What colour is the sea?"}
    doc = {"type": "document", "title": "Sea", "context": "A note",
           "source": {"type": "text", "media_type": "text/plain", "data": "The sea is blue."}}
    same = ("<document>\n<title>Sea</title>\n<context>A note</context>\nThe sea is blue.\n"
            "</document>\nWhat colour is the sea?")
    blocks = {"type": "content", "content": [{"type": "text", "text": "The sea is blue."}]}

    def count(content) -> int:
        return anthropic_client.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": content}]).input_tokens
    assert count([doc, ask]) == count(same) == count([doc | {"source": blocks}, ask])
    assert count([doc, ask]) > count([ask])
    m = anthropic_client.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY,
                                         messages=[{"role": "user", "content": [doc, ask]}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count(same)
    pdf = {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}
    for bad, field in ((doc | {"source": pdf}, "messages.0.content.0.source.type"),
                       (doc | {"citations": {"enabled": True}}, "messages.0.content.0.citations"),
                       (doc | {"citations": "yes"}, "messages.0.content.0.citations"),
                       (doc | {"title": 5}, "messages.0.content.0.title")):
        with pytest.raises(anthropic.BadRequestError) as e:
            count([bad, ask])
        assert field in e.value.body["error"]["message"]


def test_request_settings_that_change_nothing_are_taken(anthropic_client):
    """The SDK's request-level cache_control, speed and inference_geo (and its workspace and
    user profile headers): the same answer as without; container and diagnostics, which would
    change it, are refused by name."""
    import anthropic

    kwargs = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                  extra_body=GREEDY)
    plain = anthropic_client.messages.create(**kwargs)
    hinted = anthropic_client.messages.create(
        cache_control={"type": "ephemeral"}, speed="fast", inference_geo="us",
        workspace_id="wrkspc_1", user_profile_id="up_1", **kwargs)
    assert hinted.content == plain.content
    counted = anthropic_client.messages.count_tokens(
        model=MODEL, messages=kwargs["messages"], cache_control={"type": "ephemeral"})
    assert counted.input_tokens == plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    for bad, field in ((dict(speed="warp"), "speed"), (dict(cache_control={"type": "x"}),
                                                        "cache_control"),
                       (dict(container="c1"), "container"),
                       (dict(diagnostics={"previous_message_id": "msg_1"}), "diagnostics")):
        with pytest.raises(anthropic.BadRequestError) as e:
            anthropic_client.messages.create(**kwargs | bad)
        assert field in e.value.body["error"]["message"]


def test_thinking_is_taken_and_earlier_thinking_blocks_are_dropped(anthropic_client):
    """The model does not think: with thinking on (enabled with a budget, or adaptive) the
    reply is the one without, and holds no thinking block; an earlier assistant turn's thinking
    and redacted_thinking blocks are dropped from the prompt, as Anthropic drops them. A
    budget Anthropic would refuse is refused by name."""
    import anthropic

    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "And then?"}]
    kwargs = dict(model=MODEL, max_tokens=2000, extra_body=GREEDY)
    plain = anthropic_client.messages.create(messages=history, **kwargs | {"max_tokens": 8})
    for thinking in ({"type": "enabled", "budget_tokens": 1024},
                     {"type": "adaptive", "display": "omitted"}, {"type": "disabled"}):
        m = anthropic_client.messages.create(messages=history, thinking=thinking,
                                             **kwargs | {"max_tokens": 1025})
        assert [b.type for b in m.content] == ["text"], thinking
        assert m.content[0].text.startswith(plain.content[0].text), thinking
    with_blocks = history[:1] + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "They greet me.", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "b3BhcXVl"},
        {"type": "text", "text": "Hello."}]}] + history[2:]
    again = anthropic_client.messages.create(messages=with_blocks, **kwargs | {"max_tokens": 8})
    assert again.content == plain.content
    counted = anthropic_client.messages.count_tokens(
        model=MODEL, messages=with_blocks, thinking={"type": "enabled", "budget_tokens": 1024})
    assert counted.input_tokens == plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    for bad, field in (({"type": "enabled", "budget_tokens": 1000}, "budget_tokens"),
                       ({"type": "enabled"}, "budget_tokens"),
                       ({"type": "enabled", "budget_tokens": 4000}, "budget_tokens"),
                       ({"type": "sometimes"}, "thinking.type"),
                       ({"type": "disabled", "budget_tokens": 1024}, "budget_tokens"),
                       ({"type": "adaptive", "display": "full"}, "display")):
        with pytest.raises(anthropic.BadRequestError) as e:
            anthropic_client.messages.create(messages=history, thinking=bad, **kwargs)
        assert field in e.value.body["error"]["message"], (bad, e.value.body)
    for block, field in (({"type": "thinking", "thinking": "x"}, "signature"),
                         ({"type": "redacted_thinking", "data": 1}, "data")):
        with pytest.raises(anthropic.BadRequestError) as e:
            anthropic_client.messages.create(messages=history[:1] + [
                {"role": "assistant", "content": [block, {"type": "text", "text": "Hello."}]}
            ] + history[2:], **kwargs | {"max_tokens": 8})
        assert field in e.value.body["error"]["message"], (block, e.value.body)


def test_a_forced_tool_is_used_with_input_following_its_schema(anthropic_client):
    for stream in (False, True):
        kwargs = dict(model=MODEL, max_tokens=60, tools=[WEATHER],
                      tool_choice={"type": "tool", "name": "get_weather"},
                      messages=[{"role": "user", "content": "Weather in Paris?"}],
                      extra_body=GREEDY)
        if stream:
            with anthropic_client.messages.stream(**kwargs) as s:
                m = s.get_final_message()
        else:
            m = anthropic_client.messages.create(**kwargs)
        uses = [b for b in m.content if b.type == "tool_use"]
        assert uses, m.content
        assert uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
        if m.stop_reason == "tool_use":  # the call closed within max_tokens
            jsonschema.validate(uses[0].input, WEATHER["input_schema"])


def test_tool_results_go_back_into_the_conversation(anthropic_client):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]},
    ]
    short = anthropic_client.messages.count_tokens(model=MODEL, messages=history[:1],
                                                   tools=[WEATHER])
    full = anthropic_client.messages.count_tokens(model=MODEL, messages=history,
                                                  tools=[WEATHER])
    assert full.input_tokens > short.input_tokens
    m = anthropic_client.messages.create(model=MODEL, max_tokens=4, messages=history,
                                         tools=[WEATHER], extra_body=GREEDY)
    assert m.usage.output_tokens >= 1


def test_a_stop_sequence_ends_the_message_and_is_named(anthropic_client):
    base = anthropic_client.messages.create(
        model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Go on"}],
        extra_body=GREEDY)
    text = base.content[0].text
    stop = next((text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip()),
                None)
    if stop is None:
        pytest.fail(f"the greedy answer {text!r} has no two-character piece to stop at")
    m = anthropic_client.messages.create(
        model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Go on"}],
        stop_sequences=[stop], extra_body=GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


def test_errors_are_in_anthropics_envelope(anthropic_client, server):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=MODEL, max_tokens=8, messages=[])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages" in e.value.body["error"]["message"]
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": MODEL, "max_tokens": 5, "bogus": 1,
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["error"]["message"] == "bogus: Extra inputs are not permitted"
    for messages in ([{"role": "user", "content": []}],  # was a 500
                     [{"role": "user", "content": ""}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []},
                      {"role": "user", "content": "and?"}]):
        r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": API_KEY},
                       json={"model": MODEL, "max_tokens": 5, "messages": messages})
        assert r.status_code == 400, messages
        assert "must have non-empty content" in r.json()["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        anthropic_client.messages.create(model="claude-nonexistent", max_tokens=8,
                                         messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"


def test_the_key_works_as_x_api_key_and_is_required(server):
    from anthropic import Anthropic, AuthenticationError

    with (Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0) as bad,
          pytest.raises(AuthenticationError) as e):
        bad.messages.create(model=MODEL, max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": API_KEY}, json=body)
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = httpx.post(f"{server.url}/v1/messages",
                   headers={"Authorization": f"Bearer {API_KEY}"}, json=body)
    assert r.status_code == 200


def test_raw_stream_is_anthropics_event_sequence(server):
    body = {"model": MODEL, "max_tokens": 6, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body,
                      headers={"x-api-key": API_KEY}) as r:
        lines = [line for line in r.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines
             if line.startswith("data: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert names[-2] == "message_delta" and names[-3] == "content_block_stop"
    assert [d["type"] for d in datas] == names
    assert "[DONE]" not in "".join(lines)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"max_tokens": 3000}),
    ("/v1/responses", {"max_output_tokens": 3000, "input": "Tell me a long story."}),
])
def test_a_client_leaving_a_stream_aborts_its_request(server, path, body):
    """Closing the connection mid-stream ends the engine request (Messages and Responses): it
    is counted as aborted, not finished, and nothing stays running."""
    import time

    from tests.api.server import num_aborted

    aborted = num_aborted(server)

    body = {"model": MODEL, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a long story."}]} | body
    if path == "/v1/responses":
        body.pop("messages")
    headers = {"x-api-key": API_KEY}
    with httpx.stream("POST", f"{server.url}{path}", json=body, headers=headers) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += '"text_delta"' in line or "output_text.delta" in line
            if deltas >= 5:
                break  # leave with the answer far from done
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        s = httpx.get(f"{server.url}/v1/dashboard/state", headers=headers).json()
        if s["requests"]["running"] + s["requests"]["waiting"] == 0:
            break
        time.sleep(0.05)
    assert s["requests"]["running"] + s["requests"]["waiting"] == 0
    assert num_aborted(server) == aborted + 1
