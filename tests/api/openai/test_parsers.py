"""The Responses API's and embeddings' parsers alone, no server: what a body becomes, and the
field each refused one names."""

from __future__ import annotations

import pytest

from server.api.errors import APIError
from server.api.openai.embeddings import parse_embeddings
from server.api.openai.responses import parse_response_line
from server.api.openai.responses_protocol import parse_responses_request

VOCAB = 1000


def refused(parse, body) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body, VOCAB)
    assert e.value.status == 400 and e.value.message
    return e.value


def test_a_response_body_becomes_a_chat_turn():
    req = parse_responses_request({
        "model": "m", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 9,
        "temperature": 0.2, "truncation": "auto", "store": False,
        "include": ["message.output_text.logprobs"], "top_logprobs": 2}, VOCAB)
    assert req.chat.messages == [{"role": "user", "content": "hi"}]
    assert (req.instructions, req.chat.max_tokens, req.truncate, req.store) == (
        "Be brief.", 9, True, False)
    p = req.chat.params
    assert (p.temperature, p.logprobs, p.top_logprobs) == (0.2, True, 2)
    assert req.echo["truncation"] == "auto" and req.echo["tool_choice"] == "auto"


def test_function_tools_are_flat_in_the_responses_api():
    req = parse_responses_request({"model": "m", "input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}]}, VOCAB)
    assert [t.name for t in req.chat.tool_use.tools] == ["f"]
    error = refused(parse_responses_request, {"model": "m", "input": "hi", "tools": [
        {"type": "function", "name": "bad name"}]})
    assert error.param == "tools[0].name"  # the flat form's field, not the chat form's


@pytest.mark.parametrize(("fields", "param"), [
    ({}, "input"),
    ({"input": "hi", "conversation": 5}, "conversation"),
    ({"input": "hi", "conversation": "c", "previous_response_id": "r"}, "conversation"),
    ({"input": "hi", "stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": "hi", "truncation": "sometimes"}, "truncation"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"input": "hi", "reasoning": {"summary": "long"}}, "reasoning.summary"),
    ({"input": "hi", "reasoning": {"effort": "low", "budget": 3}}, "reasoning.budget"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "frobnicate": 1}, "frobnicate"),
])
def test_refused_response_bodies(fields, param):
    assert refused(parse_responses_request, {"model": "m"} | fields).param == param


def test_a_batch_line_never_runs_in_the_background():
    assert not parse_response_line({"model": "m", "input": "hi"}, VOCAB).background
    assert refused(parse_response_line, {"model": "m", "input": "hi",
                                         "background": True}).param == "background"


def test_embedding_inputs():
    req = parse_embeddings({"model": "m", "input": ["a", [1, 2]], "dimensions": 8,
                            "encoding_format": "base64"}, VOCAB)
    assert (req.inputs, req.dimensions, req.encoding_format, req.stream) == (
        ["a", [1, 2]], 8, "base64", False)
    assert parse_embeddings({"model": "m", "input": "a"}, VOCAB).inputs == ["a"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[VOCAB]]}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "frobnicate": 1}, "frobnicate"),
])
def test_refused_embedding_bodies(fields, param):
    assert refused(parse_embeddings, {"model": "m"} | fields).param == param


def test_responses_leave_what_they_cannot_set_to_the_model():
    req = parse_responses_request({"model": "m", "input": "hi", "temperature": 0.5}, VOCAB)
    assert req.chat.left_out == {"top_p", "top_k", "min_p", "repetition_penalty"}
