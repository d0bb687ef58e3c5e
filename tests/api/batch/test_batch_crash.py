"""kill -9 in the middle of a batch: after a restart every line ends up exactly once."""

from __future__ import annotations

import json
import signal
import time

import openai

from tests.api.batch.test_batches import chat_line, read_lines, submit, wait
from tests.api.conftest import MODEL
from tests.api.server import ServerProcess, home_with_models


def test_kill_9_mid_batch_then_restart_completes_each_line_once(tiny_home, tmp_path):
    home = home_with_models(tiny_home, tmp_path / "home")
    args = [MODEL, "--batch-max-running", "16"]
    first = ServerProcess(home, args, tmp_path / "first.log").start()
    try:
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="x", max_retries=0)
        lines = [chat_line(i, max_tokens=40) for i in range(200)]
        batch_id = submit(client, lines).id
        deadline = time.monotonic() + 120
        while client.batches.retrieve(batch_id).request_counts.completed < 30:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first.signal(signal.SIGKILL)  # no chance to clean up: lines are mid-flight
        first.proc.wait(10)
    finally:
        first.stop()
    second = ServerProcess(home, args, tmp_path / "second.log").start()
    try:
        client = openai.OpenAI(base_url=f"{second.url}/v1", api_key="x", max_retries=0)
        b = client.batches.retrieve(batch_id)
        assert b.status == "in_progress" and 30 <= b.request_counts.completed < 200
        b = wait(client, batch_id, timeout=180)
        assert b.status == "completed" and b.error_file_id is None
        assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) \
            == (200, 200, 0)
        out = read_lines(client, b.output_file_id)
        assert len(out) == 200
        assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
        assert all(x["response"]["body"]["usage"]["completion_tokens"] == 40 for x in out)
        assert b.usage.output_tokens == 200 * 40
        raw = client.files.content(b.output_file_id).text
        assert raw.endswith("\n") and all(json.loads(x) for x in raw.splitlines())
    finally:
        second.stop()


def test_kill_9_right_after_answers_keeps_their_usage(tiny_home, tmp_path):
    """Interactive usage is written as requests finish (group commit), not every 2 s: once the
    three answers' rows are in the database (polled read-only, nothing flushed for us), a
    kill -9 loses none of it. The answers sample, so they may end early: the totals are compared
    with the usage the responses reported."""
    import sqlite3

    import httpx

    home = home_with_models(tiny_home, tmp_path / "home")
    first = ServerProcess(home, [MODEL], tmp_path / "first.log").start()
    try:
        client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="x", max_retries=0)
        reported = [client.chat.completions.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": f"Question {i}"}]).usage for i in range(3)]
        db = sqlite3.connect(f"file:{home / 'localserve.db'}?mode=ro", uri=True)
        deadline = time.monotonic() + 30
        while db.execute("SELECT coalesce(sum(requests), 0) FROM usage").fetchone()[0] < 3:
            assert time.monotonic() < deadline, "usage not written within 30 s"
            time.sleep(0.02)
        db.close()
        first.signal(signal.SIGKILL)
        first.proc.wait(10)
    finally:
        first.stop()
    second = ServerProcess(home, [MODEL], tmp_path / "second.log").start()
    try:
        usage = httpx.get(f"{second.url}/v1/usage").json()
        interactive = [r for r in usage["data"] if r["kind"] == "interactive"]
        assert sum(r["requests"] for r in interactive) == 3
        assert sum(r["completion_tokens"] for r in interactive) == sum(
            u.completion_tokens for u in reported)
        assert sum(r["prompt_tokens"] for r in interactive) == sum(
            u.prompt_tokens for u in reported)
    finally:
        second.stop()
