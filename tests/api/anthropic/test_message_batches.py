"""Anthropic's Message Batches through the official anthropic SDK against real server processes
(the tiny model): results equal to plain messages, errored requests, list pages, cancel, expiry,
delete, the OpenAI batches kept apart, and kill -9 mid-batch."""

from __future__ import annotations

import json
import signal
import time

import anthropic
import httpx
import openai
import pytest

from tests.api.batch.test_batches import chat_line, submit
from tests.api.conftest import API_KEY, MODEL, OTHER_KEY
from tests.api.server import ServerProcess, home_with_models

BOTH_STORES = True  # tests of the shared server run on SQLite and on PostgreSQL

# Answers the grammar keeps long: a JSON string of 2,000 to 2,100 characters (no end of text
# before it; closed well within 3,000 tokens), so a batch of them is still running when the test
# cancels it.
LONG = {"format": {"type": "json_schema", "schema": {"type": "object", "properties": {
    "text": {"type": "string", "minLength": 2000, "maxLength": 2100}}, "required": ["text"]}}}


def params(i: int, max_tokens: int = 6, **extra) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": f"Question {i}"}]} | extra


def wait_ended(client, batch_id: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while (b := client.messages.batches.retrieve(batch_id)).processing_status != "ended":
        assert time.monotonic() < deadline, b
        time.sleep(0.1)
    return b


@pytest.fixture(scope="module")
def anthropic_client(server):
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0,
                             timeout=60) as c:
        yield c


def test_results_equal_plain_messages_and_bad_params_are_errored(anthropic_client, server):
    client = anthropic_client
    good = [{"custom_id": f"q-{i}", "params": params(i)} for i in range(4)]
    bad = [{"custom_id": "wrong-model", "params": params(9) | {"model": "nope"}},
           {"custom_id": "streams", "params": params(9) | {"stream": True}},
           {"custom_id": "unknown-field", "params": params(9) | {"colour": "red"}}]
    created = client.messages.batches.create(requests=good + bad)
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.processing_status == "in_progress" and created.results_url is None
    assert (created.expires_at - created.created_at).total_seconds() == 24 * 3600
    assert sum(created.request_counts.to_dict().values()) == 7
    b = wait_ended(client, created.id)
    assert b.ended_at is not None and b.cancel_initiated_at is None
    assert b.results_url == f"{server.url}/v1/messages/batches/{b.id}/results"
    assert b.request_counts.to_dict() == {"canceled": 0, "errored": 3, "expired": 0,
                                          "processing": 0, "succeeded": 4}
    results = list(client.messages.batches.results(b.id))
    assert [r.custom_id for r in results] == [x["custom_id"] for x in good + bad]
    for line, r in zip(good, results[:4], strict=True):
        assert r.result.type == "succeeded"
        sdk_params = dict(line["params"])  # the 2.x SDK sends temperature as extra_body
        temperature = sdk_params.pop("temperature")
        plain = client.messages.create(**sdk_params, extra_body={"temperature": temperature})
        assert r.result.message.content == plain.content
        assert r.result.message.stop_reason == plain.stop_reason
        assert r.result.message.usage.output_tokens == plain.usage.output_tokens
        assert (r.result.message.usage.input_tokens
                + r.result.message.usage.cache_read_input_tokens) \
            == plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    errors = {r.custom_id: r.result.error.error for r in results[4:]}
    assert all(r.result.type == "errored" for r in results[4:])
    assert errors["wrong-model"].type == "not_found_error"
    assert errors["streams"].type == "invalid_request_error"
    assert "colour" in errors["unknown-field"].message


def test_bad_creates_are_refused_in_anthropic_s_envelope(anthropic_client, server):
    client = anthropic_client
    one = {"custom_id": "a", "params": params(0)}
    cases = [
        ([], "requests"),
        ([one, one], "requests.1.custom_id"),
        ([{"custom_id": "has space", "params": params(0)}], "requests.0.custom_id"),
        ([{"custom_id": "x" * 65, "params": params(0)}], "requests.0.custom_id"),
        ([{"custom_id": "a", "params": "hello"}], "requests.0.params"),
        ([{"custom_id": "a", "params": params(0), "extra": 1}], "requests.0.extra"),
        (["not an object"], "requests.0"),
    ]
    for requests, where in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.batches.create(requests=requests)
        assert e.value.body["type"] == "error", requests
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert e.value.body["error"]["message"].startswith(where), (requests, e.value.body)
    r = httpx.post(f"{server.url}/v1/messages/batches", headers={"x-api-key": API_KEY},
                   json={"requests": [one], "metadata": {}}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.batches.retrieve("msgbatch_nope")
    assert e.value.body["error"]["type"] == "not_found_error"


def test_cancel_delete_and_the_two_apis_kept_apart(anthropic_client, client, server):
    """80 long answers (16 run at a time): the cancel comes while most are still waiting."""
    messages = anthropic_client.messages
    requests = [{"custom_id": f"long-{i}", "params": params(i, max_tokens=3000,
                                                             output_config=LONG)}
                for i in range(80)]
    b = messages.batches.create(requests=requests)
    results = f"{server.url}/v1/messages/batches/{b.id}/results"
    r = httpx.get(results, headers={"x-api-key": API_KEY}, timeout=10)
    assert r.status_code == 409 and r.json()["type"] == "error"
    with pytest.raises(anthropic.ConflictError):
        messages.batches.delete(b.id)
    # the OpenAI routes neither list nor show it, nor the other way round
    assert b.id not in [x.id for x in client.batches.list(limit=100).data]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve(b.id)
    openai_batch = submit(client, [chat_line(0, max_tokens=1)])
    with pytest.raises(anthropic.NotFoundError):
        messages.batches.retrieve(openai_batch.id)
    assert openai_batch.id not in [x.id for x in messages.batches.list(limit=1000).data]
    other = anthropic.Anthropic(base_url=server.url, api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        other.messages.batches.retrieve(b.id)

    cancelling = messages.batches.cancel(b.id)
    assert cancelling.processing_status in ("canceling", "ended")
    assert cancelling.cancel_initiated_at is not None
    b = wait_ended(anthropic_client, b.id)
    counts = b.request_counts
    assert counts.processing == 0 and counts.canceled > 0
    assert counts.canceled + counts.succeeded + counts.errored == 80
    lines = list(messages.batches.results(b.id))
    assert sorted(x.custom_id for x in lines) == sorted(x["custom_id"] for x in requests)
    assert sum(x.result.type == "canceled" for x in lines) == counts.canceled
    for x in lines:
        if x.result.type == "succeeded":
            assert len(json.loads(x.result.message.content[0].text)["text"]) >= 2000
    with pytest.raises(anthropic.ConflictError):
        messages.batches.cancel(b.id)
    deleted = messages.batches.delete(b.id)
    assert (deleted.id, deleted.type) == (b.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        messages.batches.retrieve(b.id)
    assert httpx.get(results, headers={"x-api-key": API_KEY}, timeout=10).status_code == 404


def test_list_pages_newest_first_both_ways(anthropic_client):
    batches = anthropic_client.messages.batches
    ids = [batches.create(requests=[{"custom_id": "one", "params": params(i, max_tokens=1)}]).id
           for i in range(3)]
    first = batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    assert (first.first_id, first.last_id) == (ids[2], ids[1])
    older = batches.list(limit=2, after_id=first.last_id)
    assert older.data[0].id == ids[0]
    newer = batches.list(limit=1, before_id=ids[0])
    assert [b.id for b in newer.data] == [ids[1]] and newer.has_more
    assert [b.id for b in batches.list(limit=5, before_id=ids[1]).data][-1:] == [ids[2]]
    every = [b.id for b in batches.list(limit=2)]  # the SDK follows the cursor
    assert every[:3] == ids[::-1]


def test_kill_9_mid_batch_then_restart_gives_every_result_once(tiny_home, tmp_path):
    home = home_with_models(tiny_home, tmp_path / "home")
    args = [MODEL, "--batch-max-running", "16"]
    requests = [{"custom_id": f"r-{i}", "params": params(i, max_tokens=40)} for i in range(120)]
    first = ServerProcess(home, args, tmp_path / "first.log").start()
    try:
        client = anthropic.Anthropic(base_url=first.url, api_key="x", max_retries=0)
        batch_id = client.messages.batches.create(requests=requests).id
        deadline = time.monotonic() + 120
        while client.messages.batches.retrieve(batch_id).request_counts.succeeded < 20:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first.signal(signal.SIGKILL)  # lines are mid-flight
        first.proc.wait(10)
    finally:
        first.stop()
    second = ServerProcess(home, args, tmp_path / "second.log").start()
    try:
        client = anthropic.Anthropic(base_url=second.url, api_key="x", max_retries=0)
        b = wait_ended(client, batch_id, timeout=180)
        assert b.request_counts.succeeded == 120
        lines = list(client.messages.batches.results(batch_id))
        assert [x.custom_id for x in lines] == [x["custom_id"] for x in requests]
        assert all(x.result.type == "succeeded" for x in lines)
        # usage counted once a stored result, in Anthropic's accounting: input_tokens are
        # the uncached part of the prompt
        usage = [x.result.message.usage for x in lines]
        rows = [r for r in httpx.get(f"{second.url}/v1/usage", timeout=10).json()["data"]
                if r["kind"] == "batch"]
        assert sum(r["requests"] for r in rows) == 120
        assert sum(r["prompt_tokens"] for r in rows) == sum(
            u.input_tokens + u.cache_read_input_tokens for u in usage)
        assert sum(r["cached_tokens"] for r in rows) == sum(
            u.cache_read_input_tokens for u in usage)
        assert sum(r["completion_tokens"] for r in rows) == sum(u.output_tokens for u in usage)
    finally:
        second.stop()


def test_expiry_keeps_finished_results_and_expires_the_rest(tiny_home, tmp_path):
    """The 4 short requests run first (4 at a time, in order); once they are done the batch's
    deadline is moved into the past in the server's own database, as time would move it: the
    long answers, running or waiting, are `expired`."""
    server = ServerProcess(home_with_models(tiny_home, tmp_path / "home"),
                           [MODEL, "--batch-window", "3600", "--batch-max-running", "4"],
                           tmp_path / "server.log").start()
    try:
        client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        requests = [{"custom_id": f"r-{i}", "params": params(i, max_tokens=3) if i < 4 else
                     params(i, max_tokens=3000, output_config=LONG)} for i in range(12)]
        b = client.messages.batches.create(requests=requests)
        assert (b.expires_at - b.created_at).total_seconds() == 3600  # --batch-window
        deadline = time.monotonic() + 60
        while client.messages.batches.retrieve(b.id).request_counts.succeeded < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.sql("update batches set expires_at = ? where id = ?",
                   [int(time.time()) - 1, b.id])
        b = wait_ended(client, b.id, timeout=60)
        assert b.request_counts.to_dict() == {"canceled": 0, "errored": 0, "expired": 8,
                                              "processing": 0, "succeeded": 4}
        results = {x.custom_id: x.result.type for x in client.messages.batches.results(b.id)}
        assert results == {f"r-{i}": "succeeded" if i < 4 else "expired" for i in range(12)}
    finally:
        server.stop()
