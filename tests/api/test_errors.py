"""Bad input over raw HTTP: always OpenAI's error body with the right status, type and param."""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import API_KEY, MODEL

MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == type_
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**fields):
    return {"model": MODEL, "messages": MSG} | fields


# (body, the field its 400 names): tests/api/generation/test_protocol.py parses them too
BAD_CHAT = [
    ({"messages": MSG}, "model"),
    ({"model": MODEL}, "messages"),
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=["hi"]), "messages[0]"),
    (chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages[0].content[0].type"),
    (chat(messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]),
     "messages[0].content[0].type"),
    (chat(messages=[{"role": "assistant", "content": [{"type": "refusal", "refusal": 5}]}]),
     "messages[0].content[0].refusal"),
    (chat(messages=[{"role": "assistant", "content": None, "refusal": 5}]),
     "messages[0].refusal"),
    (chat(model=7), "model"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens="ten"), "max_tokens"),
    (chat(max_completion_tokens=-1), "max_completion_tokens"),
    (chat(temperature=-0.5), "temperature"),
    (chat(temperature="hot"), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(top_p=1.5), "top_p"),
    (chat(n=0), "n"),
    (chat(n=1000), "n"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(stop=123), "stop"),
    (chat(stop=["a", 1]), "stop"),
    (chat(stream="yes"), "stream"),
    (chat(stream_options={"include_usage": True}), "stream_options"),
    (chat(presence_penalty=3), "presence_penalty"),
    (chat(logit_bias={"999999": 5}), "logit_bias"),
    (chat(logit_bias={"5": 500}), "logit_bias"),
    (chat(seed="x"), "seed"),
    (chat(tools=[{"type": "function", "function": {"name": "bad name"}}]),
     "tools[0].function.name"),
    (chat(tools=[{"type": "custom", "custom": {"name": "f"}}]), "tools[0].type"),
    (chat(tools=[TOOL, TOOL]), "tools[1].function.name"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(tools=[TOOL], tool_choice="sometimes"), "tool_choice"),
    (chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
     "tool_choice"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}]), "tools"),
    (chat(functions=[{"name": "f"}], tools=[TOOL]), "functions"),
    (chat(functions=[{"name": "f"}], tool_choice="auto"), "tool_choice"),
    (chat(function_call="auto"), "function_call"),
    (chat(functions=[{"name": "f"}], function_call={"name": "g"}), "function_call"),
    (chat(functions=[{"name": "f"}], function_call="required"), "function_call"),
    (chat(functions=[{"name": "bad name"}]), "functions[0].name"),
    (chat(functions=[{"name": "f"}, {"name": "f"}]), "functions[1].name"),
    (chat(functions=[{"name": "f", "parameters": {"type": "objekt"}}]), "functions"),
    (chat(functions={"name": "f"}), "functions"),
    (chat(functions=[{"name": "f"}], prediction={"type": "content", "content": "x"}),
     "functions"),
    (chat(messages=[{"role": "function", "content": "21 C"}]), "messages[0].name"),
    (chat(messages=[{"role": "assistant", "function_call": {"name": "f"}}]),
     "messages[0].function_call"),
    (chat(messages=[{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"},
                     "tool_calls": [{"id": "c", "type": "function", "function": {
                         "name": "f", "arguments": "{}"}}]}]), "messages[0].function_call"),
    (chat(messages=[{"role": "user", "content": "hi", "function_call": {}}]),
     "messages[0].function_call"),
    (chat(messages=[{"role": "tool", "content": "21 C"}]), "messages[0].tool_call_id"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c"}]}]),
     "messages[0].tool_calls[0]"),
    (chat(response_format={"type": "json_schema", "json_schema": {}}),
     "response_format.json_schema.name"),
    (chat(response_format={"type": "yaml"}), "response_format.type"),
    (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}), "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer",
                                                                       "minimum": "zero"}}}}}),
     "response_format"),
    (chat(frobnicate=1), "frobnicate"),
    (chat(prompt_cache_retention="1w"), "prompt_cache_retention"),
    (chat(prompt_cache_options="implicit"), "prompt_cache_options"),
    (chat(prompt_cache_options={"mode": "sometimes"}), "prompt_cache_options.mode"),
    (chat(prompt_cache_options={"ttl": 30}), "prompt_cache_options.ttl"),
    (chat(prompt_cache_options={"size": 1}), "prompt_cache_options.size"),
    (chat(moderation={"model": "omni-moderation-latest"}), "moderation"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT)
def test_invalid_chat_fields_name_the_param(http, body, param):
    assert_error(http.post(CHAT, json=body), 400, param)


def test_an_unsupported_schema_keyword_is_named(http):
    schema = {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    r = http.post(CHAT, json=chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}))
    error = assert_error(r, 400, "response_format", "unsupported_parameter")
    assert '"if"' in error["message"] and '"then"' in error["message"]


BAD_COMPLETION = [
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": [1, "a"]}, "prompt"),
    ({"model": MODEL, "prompt": [10**9]}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 99}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "suffix": "end"}, "suffix"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETION)
def test_invalid_completion_fields_name_the_param(http, body, param):
    assert_error(http.post(COMPLETIONS, json=body), 400, param)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'"text"', b"\xff\xfe",
                                     b'{"a": ' + b"[" * 100_000,  # nested past the parser's depth
                                     # an unpaired surrogate: no UTF-8 text holds it (was a 500)
                                     b'{"model": "m", "messages": [{"role": "user", "content": '
                                     b'"a\\ud800b"}], "stream": true}'])
def test_body_that_is_not_a_json_object(http, content):
    r = http.post(CHAT, content=content, headers={"Content-Type": "application/json"})
    assert_error(r, 400, None)


@pytest.mark.parametrize("stream", [False, True])
def test_context_length_exceeded_before_any_stream(http, stream):
    # 4,096-token context; "x " is two tokens here.
    long = [{"role": "user", "content": "x " * 2000}]
    r = http.post(CHAT, json=chat(messages=long, max_tokens=200, stream=stream))
    error = assert_error(r, 400, "messages", "context_length_exceeded")
    assert "maximum context length is 4096 tokens" in error["message"]
    r = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "x " * 2100, "stream": stream})
    assert_error(r, 400, "prompt", "context_length_exceeded")


def test_unknown_model_is_404(http):
    assert_error(http.post(CHAT, json=chat(model="gpt-9")), 404, "model", "model_not_found")
    assert_error(http.post(COMPLETIONS, json={"model": "gpt-9", "prompt": "x"}), 404, "model",
                 "model_not_found")


def test_body_over_the_limit_is_413(http):
    big = chat(messages=[{"role": "user", "content": "x" * (2 << 20)}])  # limit: 1 MB
    assert_error(http.post(CHAT, json=big), 413, None, "request_too_large")


def test_unknown_route_and_wrong_method(http):
    assert_error(http.get("/v1/nothing-here"), 404, None)
    assert_error(http.put(CHAT), 405, None)  # (GET lists stored completions)


def test_auth(server):
    url = f"{server.url}{CHAT}"
    body = chat(max_tokens=1)
    assert_error(httpx.post(url, json=body), 401, None, "invalid_api_key")
    assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401,
                 None, "invalid_api_key")
    assert_error(httpx.get(f"{server.url}/v1/models", headers={"Authorization": API_KEY}),
                 401, None)  # no "Bearer"
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # open
    ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200, ok.text
