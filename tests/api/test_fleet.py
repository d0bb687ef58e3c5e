"""Two replicas (real server processes) on one real PostgreSQL database: what one stores the
other serves, and a 200-line batch runs on both and ends with every line once, through a
kill -9 of a replica and a restart of PostgreSQL."""

from __future__ import annotations

import json
import signal
import time

import httpx
import openai
import pytest

from tests.api.batch.test_batches import chat_line, read_lines, submit, wait
from tests.api.conftest import MODEL
from tests.api.server import ServerProcess, home_with_models

STALE = "2"  # seconds: a killed replica's lines are taken over quickly


@pytest.fixture
def fleet(postgres, tiny_home, tmp_path):
    store = postgres.create_database()
    replicas = []
    try:
        for name in ("a", "b"):
            replicas.append(ServerProcess(
                home_with_models(tiny_home, tmp_path / name),
                [MODEL, "--stale-seconds", STALE, "--batch-max-running", "8"],
                tmp_path / f"{name}.log", store=store).start())
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


def client(replica: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{replica.url}/v1", api_key="x", max_retries=0, timeout=60)


def usage(replica: ServerProcess) -> dict:
    return httpx.get(f"{replica.url}/v1/usage", timeout=10).json()


def test_what_one_replica_stores_the_other_serves(fleet):
    a, b = fleet
    f = client(a).files.create(file=("in.jsonl", "\n".join(
        json.dumps(chat_line(i)) for i in range(3))), purpose="batch")
    batch = client(b).batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
    done = wait(client(a), batch.id)
    assert (done.status, done.request_counts.completed) == ("completed", 3)
    assert sorted(x["custom_id"] for x in read_lines(client(b), done.output_file_id)) == [
        "req-0", "req-1", "req-2"]
    first = client(a).responses.create(model=MODEL, input="Hello there", max_output_tokens=4)
    second = client(b).responses.create(model=MODEL, input="And then?", max_output_tokens=4,
                                        previous_response_id=first.id)
    items = client(b).responses.input_items.list(second.id, order="asc").data
    assert [i.content[0].text for i in items if i.type == "message" and i.role == "user"] == [
        "Hello there", "And then?"]  # a's turn, continued on b
    deadline = time.monotonic() + 30
    while (seen := usage(a)) != usage(b) or seen["total"]["requests"] < 5:
        assert time.monotonic() < deadline, (seen, usage(b))  # written as requests end
        time.sleep(0.1)
    kinds = {row["kind"] for row in seen["data"]}
    assert kinds == {"batch", "interactive"} and seen["total"]["requests"] == 5


def recorders(replica: ServerProcess, batch_id: str) -> set[str]:
    """The replicas that stored lines of the batch."""
    rows = replica.sql("select distinct claimed_by from batch_lines where batch_id = ? and "
                       "state = 'done'", [batch_id])
    return {r["claimed_by"] for r in rows}


def run_200_lines(fleet, disturb=None) -> None:
    """Submit 200 lines through the first replica; once both replicas have stored lines,
    `disturb(fleet)`; the batch must end with each line once, its usage counted once."""
    a, b = fleet
    lines = [chat_line(i, max_tokens=24) for i in range(200)]
    batch_id = submit(client(a), lines).id
    deadline = time.monotonic() + 120
    while len(recorders(b, batch_id)) < 2:
        assert time.monotonic() < deadline, "both replicas should run lines"
        time.sleep(0.05)
    survivor = disturb(fleet) if disturb else b
    assert client(survivor).batches.retrieve(batch_id).request_counts.completed < 200
    done = wait(client(survivor), batch_id, timeout=180)
    assert done.status == "completed" and done.error_file_id is None
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (200, 200, 0)
    out = read_lines(client(survivor), done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    assert done.usage.output_tokens == 200 * 24
    assert len(recorders(survivor, batch_id)) == 2  # both replicas' results are in it
    batch_usage = [row for row in usage(survivor)["data"] if row["kind"] == "batch"]
    assert sum(row["requests"] for row in batch_usage) == 200  # counted once
    assert sum(row["completion_tokens"] for row in batch_usage) == 200 * 24


def test_a_batch_runs_on_both_replicas_once(fleet):
    run_200_lines(fleet)


def test_kill_9_of_a_replica_mid_batch_the_other_finishes_it(fleet):
    def kill_a(fleet):
        fleet[0].signal(signal.SIGKILL)  # its claimed lines wait out the stale window
        fleet[0].proc.wait(10)
        return fleet[1]
    run_200_lines(fleet, kill_a)


def test_a_postgresql_restart_mid_batch_still_ends_it_once(fleet, postgres):
    def restart(fleet):
        postgres.stop()  # fast shutdown: open transactions are cut off
        time.sleep(1)
        postgres.start()
        return fleet[1]
    run_200_lines(fleet, restart)
    assert all(replica.proc.poll() is None for replica in fleet)
