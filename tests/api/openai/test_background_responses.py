"""Background responses (`background: true`) through the official openai client against real
server processes (the tiny model): queued at once, polled to the answer a plain request gives,
cancelled, streamed again from a sequence number, and stored failed when the server stops
first. A response that must still be running when it is cancelled follows a string schema of
at least 5,000 characters with a 3,000-token limit: it cannot end before thousands of steps,
however the random model samples."""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest

from tests.api.conftest import MODEL, OTHER_KEY
from tests.api.server import ServerProcess, home_with_models

BOTH_STORES = True  # tests of the shared server run on SQLite and on PostgreSQL

GREEDY = {"temperature": 0.0}
ENDLESS = {"max_output_tokens": 3000, "text": {"format": {
    "type": "json_schema", "name": "endless", "schema": {"type": "string", "minLength": 5000}}}}
TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def poll(client, response_id: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while (r := client.responses.retrieve(response_id)).status not in TERMINAL:
        assert r.status in ("queued", "in_progress"), r.status
        assert time.monotonic() < deadline, f"{response_id} still {r.status}"
        time.sleep(0.02)
    return r


def test_background_is_queued_then_polled_to_the_plain_answer(client):
    kwargs = dict(model=MODEL, input="Tell me about rivers", max_output_tokens=24, **GREEDY)
    queued = client.responses.create(background=True, **kwargs)
    assert queued.status == "queued" and queued.background is True
    assert queued.output == [] and queued.usage is None
    done = poll(client, queued.id)
    plain = client.responses.create(**kwargs)  # greedy: rows do not depend on their neighbours
    assert plain.background is False
    assert done.id == queued.id and done.background is True
    assert done.status == plain.status and done.output_text == plain.output_text
    assert done.usage.output_tokens == plain.usage.output_tokens
    # stored like any response: the conversation goes on from it
    again = client.responses.create(model=MODEL, input="And lakes?", max_output_tokens=4,
                                    previous_response_id=done.id, **GREEDY)
    assert again.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens


def test_cancel_stops_a_running_background_response(client, server):
    r = client.responses.create(model=MODEL, input="Say anything", background=True, **ENDLESS)
    with pytest.raises(openai.BadRequestError) as e:  # its reply is not written yet
        client.responses.create(model=MODEL, input="Go on", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(r.id)
    assert cancelled.id == r.id and cancelled.status == "cancelled"
    assert cancelled.usage is None and cancelled.background is True
    assert client.responses.retrieve(r.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == "cancelled"  # again: as it is
    # its engine request is gone: the server's running sequences go back to none
    deadline = time.monotonic() + 30
    while server.metrics().get("localserve:num_requests_running", 0):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # one that ended is returned as it is; only background responses can be cancelled
    ended = poll(client, client.responses.create(model=MODEL, input="Hi", background=True,
                                                 max_output_tokens=3).id)
    assert client.responses.cancel(ended.id).status == ended.status
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    with pytest.raises(openai.BadRequestError, match="background=true"):
        client.responses.cancel(plain.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.cancel(ended.id)


def test_deleting_a_running_background_response_stops_it(client, server):
    r = client.responses.create(model=MODEL, input="Say anything", background=True, **ENDLESS)
    assert client.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    deadline = time.monotonic() + 30
    while server.metrics().get("localserve:num_requests_running", 0):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(openai.NotFoundError):  # the stopped run did not store it back
        client.responses.retrieve(r.id)


def events(lines) -> list[dict]:
    return [json.loads(line[5:]) for line in lines if line.startswith("data:")]


def test_a_background_stream_resumes_after_a_sequence_number(client, server):
    stream = client.responses.create(model=MODEL, input="Tell me about bees", background=True,
                                     stream=True, max_output_tokens=30, **GREEDY)
    first = []
    for event in stream:
        first.append(event)
        if len(first) == 5:
            break
    stream.close()  # the client leaves; the response goes on
    response_id = first[0].response.id
    assert [e.sequence_number for e in first] == [0, 1, 2, 3, 4]
    assert first[0].type == "response.created" and first[0].response.background is True
    assert first[0].response.status == "queued" and first[1].response.status == "in_progress"
    url = f"{server.url}/v1/responses/{response_id}"
    with httpx.stream("GET", url, params={"stream": "true", "starting_after": 4},
                      headers=server.headers, timeout=60) as r:
        assert r.status_code == 200
        rest = events(r.iter_lines())
    assert [e["sequence_number"] for e in rest] == list(range(5, 5 + len(rest)))
    assert rest[-1]["type"] in ("response.completed", "response.incomplete")
    stored = client.responses.retrieve(response_id)
    assert rest[-1]["response"]["status"] == stored.status
    assert rest[-1]["response"]["output"][0]["content"][0]["text"] == stored.output_text
    deltas = [e.delta for e in first if e.type == "response.output_text.delta"] + [
        e["delta"] for e in rest if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == stored.output_text
    # from the start, after it ended: the same events
    with httpx.stream("GET", url, params={"stream": "true"}, headers=server.headers,
                      timeout=60) as r:
        whole = events(r.iter_lines())
    assert whole[5:] == rest and [e["type"] for e in whole[:5]] == [e.type for e in first]


def test_background_requests_that_cannot_be_are_refused(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", background=True, store=False)
    assert e.value.body["param"] == "background"
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    url = f"{server.url}/v1/responses/{plain.id}"
    for params, param in [({"stream": "true"}, "stream"), ({"stream": "yes"}, "stream")]:
        r = httpx.get(url, params=params, headers=server.headers, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    bg = poll(client, client.responses.create(model=MODEL, input="Hi", background=True,
                                              max_output_tokens=2).id)
    r = httpx.get(f"{server.url}/v1/responses/{bg.id}", headers=server.headers, timeout=10,
                  params={"stream": "true", "starting_after": "-2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"
    r = httpx.get(f"{server.url}/v1/responses/{bg.id}", params={"stream": "true"},
                  headers={"Authorization": f"Bearer {OTHER_KEY}"}, timeout=10)
    assert r.status_code == 404


def test_a_background_line_in_a_batch_is_an_error_line(client):
    from tests.api.batch.test_batches import jsonl, read_lines, wait

    line = {"custom_id": "bg", "method": "POST", "url": "/v1/responses",
            "body": {"model": MODEL, "input": "hi", "background": True}}
    f = client.files.create(file=("input.jsonl", jsonl([line])), purpose="batch")
    b = wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/responses",
                                           completion_window="24h").id)
    assert b.request_counts.failed == 1
    (out,) = read_lines(client, b.error_file_id)
    assert out["response"]["body"]["error"]["param"] == "background"


def test_a_server_that_stops_first_stores_them_failed(tiny_home, tmp_path):
    """SIGTERM past the drain timeout, and kill -9: after a restart each is `failed`, with the
    server's error, and can no longer be cancelled into anything else."""
    home = home_with_models(tiny_home, tmp_path / "home")
    ids = []
    for i, sig in enumerate((signal.SIGTERM, signal.SIGKILL)):
        server = ServerProcess(home, [MODEL, "--drain-timeout", "0.2"],
                               tmp_path / f"{i}.log").start()
        try:
            c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            ids.append(c.responses.create(model=MODEL, input="Say anything", background=True,
                                          **ENDLESS).id)
            server.signal(sig)
            server.proc.wait(30)
        finally:
            server.stop()
    server = ServerProcess(home, [MODEL], tmp_path / "last.log").start()
    try:
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        for response_id in ids:
            r = c.responses.retrieve(response_id)
            assert r.status == "failed" and r.error.code == "server_error", r
            assert "stopped before this response finished" in r.error.message
            assert c.responses.cancel(response_id).status == "failed"
    finally:
        server.stop()
