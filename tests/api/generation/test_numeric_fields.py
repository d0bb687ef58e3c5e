"""Every numeric field of every endpoint, sent large, negative, fractional and huge: a 200 or a
400 that names the field, never a 5xx (a seed of 1e308 once overflowed into a 500)."""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import MODEL

MSG = [{"role": "user", "content": "hi"}]
VALUES = [-1, -(2**63) - 1, 2**63, 2**64, 10**30, 0.5, -2.5, 1e308, -1e308, 1e19, 3.0,
          2**63 - 1, -(2**63)]
CHAT_FIELDS = ["seed", "n", "max_tokens", "max_completion_tokens", "top_k", "top_logprobs",
               "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
               "repetition_penalty"]
COMPLETION_FIELDS = ["seed", "n", "max_tokens", "top_k", "logprobs", "best_of", "temperature"]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


def check(r: httpx.Response, param: str | None) -> None:
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        if error["code"] == "context_length_exceeded":  # OpenAI's answer to a huge max_tokens
            assert param in ("max_tokens", "max_completion_tokens"), r.text
        elif param is not None:
            assert error["param"] == param, r.text


def extras(name: str) -> dict:
    """Fields a value needs beside it: a short answer unless the field is the length itself,
    logprobs for top_logprobs."""
    base = {} if name in ("max_tokens", "max_completion_tokens") else {"max_tokens": 2}
    return base | ({"logprobs": True} if name == "top_logprobs" else {})


@pytest.mark.parametrize("name", CHAT_FIELDS)
def test_chat_numbers(http, name):
    for value in VALUES:
        body = {"model": MODEL, "messages": MSG, name: value} | extras(name)
        check(http.post("/v1/chat/completions", json=body), name)


@pytest.mark.parametrize("name", COMPLETION_FIELDS)
def test_completion_numbers(http, name):
    for value in VALUES:
        body = {"model": MODEL, "prompt": "hi", name: value} | extras(name)
        check(http.post("/v1/completions", json=body), name)


def test_token_ids_and_logit_bias(http):
    for value in VALUES:
        for body, param in [
            ({"prompt": [1, value]}, "prompt"),
            ({"prompt": "hi", "stop_token_ids": [value]}, "stop_token_ids"),
            ({"prompt": "hi", "logit_bias": {str(value): 1}}, "logit_bias"),
            ({"prompt": "hi", "logit_bias": {"5": value}}, "logit_bias"),
        ]:
            r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 2} | body)
            check(r, param)


def test_list_limits(http):
    for value in VALUES + ["1e308", "abc", ""]:
        for path in ("/v1/batches", "/v1/files"):
            check(http.get(path, params={"limit": str(value)}), "limit")


def test_file_expiry_seconds(http):
    for value in VALUES:
        r = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={
            "purpose": "batch", "expires_after[anchor]": "created_at",
            "expires_after[seconds]": str(value)})
        check(r, "expires_after.seconds")


def test_batch_expiry_and_lines_with_huge_numbers(client, http):
    """The batch API's own numbers, and the same values inside batch lines: each line ends in
    the output (200) or the error file (400), never a 5xx, and the batch completes."""
    from tests.api.batch.test_batches import chat_line, read_lines, submit, wait

    f = client.files.create(file=("in.jsonl", b""), purpose="batch")
    for value in VALUES:
        r = http.post("/v1/batches", json={
            "input_file_id": f.id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "output_expires_after": {"anchor": "created_at", "seconds": value}})
        check(r, "output_expires_after.seconds")
    fields = [(n, v) for n in ("seed", "n", "top_k", "max_tokens")
              for v in (2**64, 1e308, -1e308, 0.5)]
    lines = [chat_line(i, **{name: value}) for i, (name, value) in enumerate(fields)]
    b = wait(client, submit(client, lines).id, timeout=120)
    assert b.status == "completed" and b.request_counts.total == len(lines)
    results = read_lines(client, b.output_file_id) + read_lines(client, b.error_file_id)
    assert sorted(x["custom_id"] for x in results) == sorted(x["custom_id"] for x in lines)
    for x in results:
        status = x["response"]["status_code"] if x.get("response") else 400
        assert status in (200, 400), x
