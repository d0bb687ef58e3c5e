"""The chat and completions parsers alone, no server: each bad body of the HTTP tests
(tests/api/test_errors.py) is a 400 naming the same field here, and good bodies parse into
exactly the request the engine gets."""

from __future__ import annotations

import pytest

from server.api.errors import APIError
from server.api.generation.protocol import parse_chat, parse_completion
from tests.api.test_errors import BAD_CHAT, BAD_COMPLETION

VOCAB = 1000
MSG = [{"role": "user", "content": "hi"}]
# Refused later than the parser: a schema's or a tool's parameters are checked when their
# grammar compiles (turn.py), an empty prompt once it is tokenized (pipeline.with_max_tokens).
AFTER_PARSING = {"tools", "functions", "response_format", "prompt"}


def refused(parse, body) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body, VOCAB)
    assert e.value.status == 400 and e.value.message
    return e.value


@pytest.mark.parametrize(("parse", "body", "param"), [
    *((parse_chat, body, param) for body, param in BAD_CHAT),
    *((parse_completion, body, param) for body, param in BAD_COMPLETION)])
def test_bad_bodies_name_their_field(parse, body, param):
    try:
        parse(body, VOCAB)
    except APIError as e:
        assert (e.status, e.param) == (400, param), e.message
    else:
        assert param in AFTER_PARSING, f"{param}: parsed"


def test_a_full_chat_body_parses_into_the_engine_request():
    req = parse_chat({
        "model": "m", "messages": MSG, "max_completion_tokens": 12, "temperature": 0.5,
        "top_p": 0.9, "n": 2, "seed": 7, "stop": "END", "logprobs": True, "top_logprobs": 3,
        "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {"5": -100},
        "store": True, "metadata": {"k": "v"}, "user": "u"}, VOCAB)
    assert (req.model, req.max_tokens, req.stream, req.include_usage) == ("m", 12, True, True)
    assert req.messages == MSG and req.store and req.metadata == {"k": "v"}
    assert req.user == "u" and req.tool_use is None and req.output_schema is None
    p = req.params
    assert (p.temperature, p.top_p, p.n, p.seed, p.stop) == (0.5, 0.9, 2, 7, ("END",))
    assert (p.logprobs, p.top_logprobs, p.logit_bias) == (True, 3, {5: -100.0})


def test_chat_defaults():
    req = parse_chat({"model": "m", "messages": MSG}, VOCAB)
    assert req.max_tokens is None  # the rest of the context, filled in by the turn
    assert (req.stream, req.include_usage, req.store, req.continue_final) == (
        False, False, False, False)
    assert (req.params.temperature, req.params.n, req.params.stop) == (1.0, 1, ())


def test_tools_and_a_schema_parse_into_the_turn_request():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    req = parse_chat({"model": "m", "messages": MSG, "tools": [tool],
                      "tool_choice": "required"}, VOCAB)
    assert [t.name for t in req.tool_use.tools] == ["f"] and req.tool_use.forced
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_chat({"model": "m", "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, VOCAB)
    assert req.output_schema == schema


def test_completion_prompts_of_text_and_token_ids():
    req = parse_completion({"model": "m", "prompt": ["a", "b"], "max_tokens": 3, "echo": True,
                            "logprobs": 2}, VOCAB)
    assert (req.prompts, req.max_tokens, req.echo, req.logprobs) == (["a", "b"], 3, True, 2)
    req = parse_completion({"model": "m", "prompt": [[1, 2], [3]]}, VOCAB)
    assert req.prompts == [[1, 2], [3]]
    assert refused(parse_completion, {"model": "m", "prompt": [VOCAB]}).param == "prompt"


def test_the_sampling_fields_a_request_leaves_to_the_model():
    """What the model's recommended sampling may fill (pipeline.with_model_defaults): the fields
    a body leaves out or sets to null, and those its API has no field for."""
    every = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    assert parse_chat({"model": "m", "messages": MSG}, VOCAB).left_out == every
    req = parse_chat({"model": "m", "messages": MSG, "temperature": 0, "top_k": None}, VOCAB)
    assert req.left_out == every - {"temperature"}
    req = parse_completion({"model": "m", "prompt": "a", "top_p": 0.5, "min_p": 0.1}, VOCAB)
    assert req.left_out == {"temperature", "top_k", "repetition_penalty"}


# What vllm-router (--policy cache_aware) sent on, captured from it: its defaults beside the
# client's fields
ROUTED_CHAT = {"model": "m", "messages": MSG, "stream": False, "max_tokens": 3,
               "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
               "continue_final_message": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False, "include_reasoning": True}
ROUTED_COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": False,
                     "echo": False, "no_stop_trim": False, "ignore_eos": False,
                     "skip_special_tokens": True, "return_hidden_states": False}


def test_a_routers_added_fields_parse_as_the_bare_body():
    routed = parse_chat(ROUTED_CHAT, VOCAB)
    assert routed.params == parse_chat({"model": "m", "messages": MSG, "max_tokens": 3},
                                       VOCAB).params
    routed = parse_completion(ROUTED_COMPLETION, VOCAB)
    assert routed.params == parse_completion({"model": "m", "prompt": "hi", "max_tokens": 3},
                                             VOCAB).params
    # any other value asks for what localserve does not do: refused, naming the field
    for name in ("no_stop_trim", "skip_special_tokens", "include_reasoning"):
        e = refused(parse_chat, ROUTED_CHAT | {name: not ROUTED_CHAT[name]})
        assert (e.param, e.code) == (name, "unsupported_parameter")
