"""The Batch API through the official `openai` client, against real server processes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.api.conftest import API_KEY, MODEL, OTHER_KEY
from tests.api.server import own_server

BOTH_STORES = True  # tests of the shared server run on SQLite and on PostgreSQL
FINAL = ("completed", "failed", "expired", "cancelled")


def jsonl(lines: list[dict]) -> io.BytesIO:
    return io.BytesIO("\n".join(json.dumps(x) for x in lines).encode())


def chat_line(i: int, max_tokens: int = 6, url: str = "/v1/chat/completions", **body) -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": url,
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Question {i}"}],
                     "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | body}


def submit(client, lines: list[dict], endpoint: str = "/v1/chat/completions", **kw):
    f = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return submit_file(client, f.id, endpoint, **kw)


def submit_file(client, file_id: str, endpoint: str = "/v1/chat/completions", **kw):
    return client.batches.create(input_file_id=file_id, endpoint=endpoint,
                                 completion_window="24h", **kw)


def wait(client, batch_id: str, until=FINAL, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        assert time.monotonic() < deadline, b
        time.sleep(0.1)


def read_lines(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_batch_output_equals_interactive_answers(client):
    lines = [chat_line(i) for i in range(6)]
    b = submit(client, lines, metadata={"job": "nightly"})
    assert b.status == "validating" and b.metadata == {"job": "nightly"}
    b = wait(client, b.id)
    assert b.status == "completed" and b.error_file_id is None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == \
        (6, 6, 0)
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    out = {x["custom_id"]: x for x in read_lines(client, b.output_file_id)}
    assert sorted(out) == sorted(x["custom_id"] for x in lines)
    for line in lines:
        result = out[line["custom_id"]]
        assert result["error"] is None and result["response"]["status_code"] == 200
        assert result["id"].startswith("batch_req_")
        body = result["response"]["body"]
        live = client.chat.completions.create(**{k: v for k, v in line["body"].items()
                                                 if k != "ignore_eos"},
                                              extra_body={"ignore_eos": True})
        assert body["choices"][0]["message"]["content"] == live.choices[0].message.content
        assert body["usage"]["completion_tokens"] == 6
    assert b.usage.output_tokens == 36
    assert b.usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"]
                                       for x in out.values())


def test_completions_batch_and_line_errors_go_to_the_error_file(client):
    lines = [{"custom_id": "ok", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": "The sky is", "max_tokens": 4,
                       "temperature": 0}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": "x", "max_tokens": 0}}]
    b = wait(client, submit(client, lines, endpoint="/v1/completions").id)
    assert b.status == "completed"
    assert (b.request_counts.completed, b.request_counts.failed) == (1, 1)
    [ok] = read_lines(client, b.output_file_id)
    live = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4,
                                     temperature=0)
    assert ok["response"]["body"]["choices"][0]["text"] == live.choices[0].text
    [bad] = read_lines(client, b.error_file_id)
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "max_tokens"


SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 8},
    "score": {"type": "integer", "minimum": 0, "maximum": 10},
    "labels": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
    "required": ["title", "score", "labels"], "additionalProperties": False}


def test_a_batch_of_schema_lines_completes_with_every_line_valid(client):
    """The tiny random model writes no JSON by itself: every line is valid by construction
    (the schema bounds the output, so temperature 1 always finishes within max_tokens)."""
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "review", "schema": SCHEMA,
                                                  "strict": True}}
    lines = [chat_line(i, 120, response_format=fmt, temperature=1.0, seed=i, ignore_eos=False)
             for i in range(8)]
    lines.append({"custom_id": "bad-schema", "method": "POST", "url": "/v1/chat/completions",
                  "body": lines[0]["body"] | {"response_format": {"type": "json_schema",
                                                                 "json_schema": {
                                                                     "name": "x", "schema": {
                                                                         "type": "objekt"}}}}})
    b = wait(client, submit(client, lines).id)
    assert (b.status, b.request_counts.completed, b.request_counts.failed) == ("completed", 8, 1)
    out = read_lines(client, b.output_file_id)
    assert len(out) == 8
    for line in out:
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    [bad] = read_lines(client, b.error_file_id)
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "response_format"


@pytest.mark.parametrize(("make_lines", "line", "code"), [
    (lambda: [chat_line(0), "{oops"], 2, "invalid_json_line"),
    (lambda: [chat_line(0), "[" * 100_000], 2, "invalid_json_line"),
    (lambda: [chat_line(0), json.dumps(chat_line(1)).replace("Question", "\\udfff")], 2,
     "invalid_json_line"),
    (lambda: [chat_line(0), chat_line(0)], 2, "duplicate_custom_id"),
    (lambda: [chat_line(0), chat_line(1, url="/v1/completions")], 2, "invalid_url"),
    (lambda: [chat_line(0) | {"method": "GET"}], 1, "invalid_method"),
    (lambda: [chat_line(0), chat_line(1, model="gpt-9")], 2, "model_not_found"),
])
def test_validation_failures_name_the_line(client, make_lines, line, code):
    raw = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in make_lines())
    f = client.files.create(file=("input.jsonl", io.BytesIO(raw.encode())), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    b = wait(client, b.id)
    assert b.status == "failed" and b.failed_at and b.output_file_id is None
    assert b.request_counts.total == 0
    first = b.errors.data[0]
    assert (first.code, first.line) == (code, line)


def test_bad_create_requests(client):
    f = client.files.create(file=("input.jsonl", jsonl([chat_line(0)])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="1h")
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                              completion_window="24h")
    assert e.value.body["param"] == "input_file_id"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/moderations",
                              completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("input.jsonl", jsonl([chat_line(0)])), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"


def test_expiration_policies_for_uploads_and_outputs(client):
    policy = {"anchor": "created_at", "seconds": 3600}
    f = client.files.create(file=("input.jsonl", jsonl([chat_line(0)])), purpose="batch",
                            expires_after=policy)
    assert f.expires_at == f.created_at + 3600
    assert client.files.retrieve(f.id).expires_at == f.expires_at
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 7200})
    b = wait(client, b.id)
    assert b.status == "completed"
    out = client.files.retrieve(b.output_file_id)
    assert out.expires_at == out.created_at + 7200
    assert client.files.retrieve(submit(client, [chat_line(1)]).input_file_id).expires_at is None
    for bad, param in (({"anchor": "created_at", "seconds": 60}, "seconds"),
                       ({"anchor": "last_active_at", "seconds": 3600}, "anchor"),
                       ({"anchor": "created_at", "seconds": 2592001}, "seconds"),
                       ({"anchor": "created_at", "seconds": "soon"}, "seconds")):
        with pytest.raises(openai.BadRequestError) as e:
            client.files.create(file=("input.jsonl", jsonl([chat_line(0)])), purpose="batch",
                                expires_after=bad)
        assert e.value.body["param"] == f"expires_after.{param}"
        with pytest.raises(openai.BadRequestError) as e:
            client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", output_expires_after=bad)
        assert e.value.body["param"] == f"output_expires_after.{param}"
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h", output_expires_after=3600)
    assert e.value.body["param"] == "output_expires_after"


def test_cancel_keeps_finished_lines_and_reports_the_rest(client):
    lines = [chat_line(i, max_tokens=3000) for i in range(80)]  # > one engine batch of 64
    b = submit(client, lines)
    wait(client, b.id, until=("in_progress",))
    cancelling = client.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled")
    b = wait(client, b.id)
    assert b.status == "cancelled" and b.cancelling_at and b.cancelled_at
    done, failed = read_lines(client, b.output_file_id), read_lines(client, b.error_file_id)
    assert b.request_counts.completed == len(done)
    assert b.request_counts.failed == len(failed) == 80 - len(done)
    assert sorted(x["custom_id"] for x in done + failed) == sorted(x["custom_id"] for x in lines)
    assert all(x["response"] is None and x["error"]["code"] == "batch_cancelled"
               for x in failed)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(b.id)


def test_idempotent_create_and_upload(client):
    headers = {"Idempotency-Key": "upload-1"}
    f1 = client.files.create(file=("a.jsonl", jsonl([chat_line(0)])), purpose="batch",
                             extra_headers=headers)
    f2 = client.files.create(file=("a.jsonl", jsonl([chat_line(0)])), purpose="batch",
                             extra_headers=headers)
    assert f1.id == f2.id
    headers = {"Idempotency-Key": "create-1"}
    kw = dict(input_file_id=f1.id, endpoint="/v1/chat/completions", completion_window="24h",
              extra_headers=headers)
    b1 = client.batches.create(**kw)
    b2 = client.batches.create(**kw)
    assert b1.id == b2.id
    assert [b.id for b in client.batches.list(limit=100).data].count(b1.id) == 1


def test_list_pagination_newest_first(client):
    ids = [submit(client, [chat_line(0, max_tokens=1)]).id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert rest.data[0].id == ids[0]
    every = [b.id for b in client.batches.list(limit=2)]  # the client follows the cursor
    assert every[:3] == ids[::-1]


def test_files_routes(client):
    f = client.files.create(file=("mine.jsonl", jsonl([chat_line(0)])), purpose="batch")
    assert f.filename == "mine.jsonl" and f.purpose == "batch" and f.bytes > 0
    assert client.files.retrieve(f.id).id == f.id
    assert f.id in [x.id for x in client.files.list(purpose="batch").data]
    assert json.loads(client.files.content(f.id).text) == chat_line(0)
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_an_input_file_gone_from_disk_fails_its_batch_and_the_queue_goes_on(client, server):
    f = client.files.create(file=("gone.jsonl", jsonl([chat_line(0)])), purpose="batch")
    if server.store:  # lost outside the server (a disk, a person)
        server.sql("delete from file_chunks where file_id = ?", [f.id])
    else:
        (server.home / "files" / f.id).unlink()
    with pytest.raises(openai.NotFoundError) as e:
        client.files.content(f.id)
    assert "no longer" in e.value.body["message"]
    lost = submit_file(client, f.id)
    after = submit(client, [chat_line(1)])
    lost, after = wait(client, lost.id), wait(client, after.id)
    assert lost.status == "failed" and lost.errors.data[0].code == "unreadable_file"
    assert after.status == "completed" and after.request_counts.completed == 1


def test_a_key_sees_only_its_own_files_and_batches(client, server):
    b = submit(client, [chat_line(0, max_tokens=1)])
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(b.id)
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(b.input_file_id)
    with pytest.raises(openai.BadRequestError):  # cannot run a batch on someone else's file
        other.batches.create(input_file_id=b.input_file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    assert b.id not in [x.id for x in other.batches.list().data]


def test_usage_splits_batch_from_interactive_with_the_discount(client, server):
    b = wait(client, submit(client, [chat_line(i, max_tokens=2) for i in range(3)]).id)
    assert b.status == "completed"
    r = httpx.get(f"{server.url}/v1/usage", headers=server.headers, timeout=10).json()
    prices = r["prices"]
    kinds = {}
    for row in r["data"]:
        assert row["api_key_id"]  # the tenant, never the key itself
        assert API_KEY not in json.dumps(row)
        kinds.setdefault(row["kind"], []).append(row)
    assert set(kinds) == {"interactive", "batch"}
    for kind, rows in kinds.items():
        for row in rows:
            full = (row["prompt_tokens"] * prices["input_per_million"]
                    + row["completion_tokens"] * prices["output_per_million"]) / 1e6
            factor = 1 - prices["batch_discount"] if kind == "batch" else 1
            assert row["cost_usd"] == pytest.approx(full * factor)
    assert sum(row["completion_tokens"] for row in kinds["batch"]) >= 6


@pytest.fixture
def window_server(tiny_home, tmp_path):
    """Batches get a one-hour window; the expiry test moves a batch's deadline itself."""
    proc = own_server(tiny_home, tmp_path, [MODEL, "--batch-window", "3600",
                                            "--batch-max-running", "4"])
    yield proc
    proc.stop()


def test_expiry_returns_finished_lines_and_expires_the_rest(window_server):
    """The 4 short lines run first (4 at a time, in order). Once they are done, the batch's
    deadline passes: set in the past in the server's own database, as time would, so no clock
    decides the test. The 3,000-token lines, running or queued, are far from done: they expire."""
    client = openai.OpenAI(base_url=f"{window_server.url}/v1", api_key="x", max_retries=0)
    lines = [chat_line(i, max_tokens=3 if i < 4 else 3000) for i in range(12)]
    b = submit(client, lines)
    assert b.expires_at - b.created_at == 3600  # --batch-window
    deadline = time.monotonic() + 60
    while (b := client.batches.retrieve(b.id)).request_counts.completed < 4:
        assert b.status in ("validating", "in_progress"), b
        assert time.monotonic() < deadline, b
        time.sleep(0.05)
    window_server.sql("update batches set expires_at = ? where id = ?",
                      [int(time.time()) - 1, b.id])
    b = wait(client, b.id, timeout=60)
    assert b.status == "expired" and b.expired_at
    done, failed = read_lines(client, b.output_file_id), read_lines(client, b.error_file_id)
    assert {x["custom_id"] for x in done} == {"req-0", "req-1", "req-2", "req-3"}
    assert all(x["error"]["code"] == "batch_expired" for x in failed)
    assert len(failed) == 8 and b.request_counts.total == 12
    assert b.request_counts.completed == 4


def test_one_server_per_home(window_server):
    """A second server on the same home would run the same batches: it refuses to start."""
    proc = subprocess.run([sys.executable, "-m", "cli.main", "serve", MODEL, "--port", "0"],
                          env=dict(os.environ, LOCALSERVE_HOME=str(window_server.home)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "another localserve server is using" in proc.stderr
