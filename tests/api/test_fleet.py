"""Two replicas (real server processes) on one real PostgreSQL database: what one stores the
other serves; a 200-line batch runs on both and ends with every line once, through a kill -9
of a replica and a restart of PostgreSQL; vLLM's router (vllm-router) in front keeps a shared
prefix on one replica and routes around a killed one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest

from server.api.fleet import REPLICA_HEADER
from tests.api.batch.test_batches import chat_line, read_lines, submit, wait
from tests.api.conftest import MODEL
from tests.api.openai.test_background_responses import ENDLESS
from tests.api.server import ServerProcess, home_with_models, wait_healthy
from tests.postgres import free_port

STALE = "2"  # seconds: a killed replica's lines are taken over quickly
# docs/fleet.md's router flags: a replica that fails a request is skipped at once (its circuit
# opens) and the request retried on another; health checked every second
FLEET_ROUTER_ARGS = ("--cb-failure-threshold", "1", "--retry-max-retries", "3",
                     "--health-check-interval-secs", "1", "--health-failure-threshold", "1")


@pytest.fixture
def fleet(request, postgres, tiny_home, tmp_path):
    """Two replicas; a test that parametrizes `fleet` (indirect) with N gives each N threads."""
    store = postgres.create_database()
    threads = ["--threads", str(request.param)] if hasattr(request, "param") else []
    replicas = []
    try:
        for name in ("a", "b"):  # launched together: they load side by side
            replicas.append(ServerProcess(
                home_with_models(tiny_home, tmp_path / name),
                [MODEL, "--stale-seconds", STALE, "--batch-max-running", "8", *threads],
                tmp_path / f"{name}.log", store=store).launch())
        for replica in replicas:
            replica.ready()
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


# one thread each, as replicas on machines of their own: two replicas of two threads on the
# two cores of CI took 18-26 s for these lines, one each ~3 s
@pytest.mark.parametrize("fleet", [1], indirect=True, ids=["one-thread-each"])
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


def test_a_batch_cancelled_through_one_replica_stops_on_both(fleet):
    a, b = fleet
    lines = [chat_line(i, max_tokens=400) for i in range(40)]
    batch_id = submit(client(a), lines).id
    deadline = time.monotonic() + 60
    while len(b.sql("select distinct claimed_by from batch_lines where batch_id = ? and "
                    "state = 'pending' and claimed_by is not null", [batch_id])) < 2:
        assert time.monotonic() < deadline, "both replicas should be running lines"
        time.sleep(0.05)
    client(b).batches.cancel(batch_id)
    done = wait(client(a), batch_id)
    assert done.status == "cancelled" and done.request_counts.total == 40
    out = read_lines(client(a), done.output_file_id) + read_lines(client(a), done.error_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in lines)
    while any(r.metrics().get("localserve:num_requests_running", 0) for r in fleet):
        assert time.monotonic() < deadline + 60, "both replicas should stop its lines"
        time.sleep(0.1)


def test_a_background_response_is_its_replicas_until_that_one_is_gone(fleet, tiny_home,
                                                                     tmp_path):
    """Its replica generates it: a third replica starting leaves it alone, a cancel through
    another replica reaches it, and once its replica is killed it is stored failed."""
    a, b = fleet
    r = client(a).responses.create(model=MODEL, input="Say anything", background=True,
                                   **ENDLESS)
    third = ServerProcess(home_with_models(tiny_home, tmp_path / "c"),
                          [MODEL, "--stale-seconds", STALE], tmp_path / "c.log",
                          store=a.store).start()  # starting up, it leaves a's response alone
    try:
        assert client(third).responses.retrieve(r.id).status in ("queued", "in_progress")
    finally:
        third.stop()
    cancelled = client(b).responses.create(model=MODEL, input="Say more", background=True,
                                           **ENDLESS)  # generated on b
    assert client(a).responses.cancel(cancelled.id).status == "cancelled"  # through a
    a.signal(signal.SIGKILL)
    a.proc.wait(10)
    deadline = time.monotonic() + 60
    while (got := client(b).responses.retrieve(r.id)).status != "failed":
        assert got.status in ("queued", "in_progress") and time.monotonic() < deadline, got
        time.sleep(0.1)  # failed by b once a has been silent for the stale window
    assert got.error.code == "server_error"


class Router:
    """vllm-router (PyPI) in front of the replicas, on a free port."""

    def __init__(self, replicas: list[ServerProcess], policy: str, log: Path) -> None:
        self.port = free_port()
        binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        self.proc = subprocess.Popen(
            [binary, "--worker-urls", *(r.url for r in replicas), "--policy", policy,
             "--host", "127.0.0.1", "--port", str(self.port),
             "--prometheus-port", str(free_port()), *FLEET_ROUTER_ARGS],
            stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_healthy(self.url, self.proc, log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def ask(router: Router, text: str) -> tuple[str, int]:
    """(the replica that answered, the prompt tokens it had cached)."""
    r = httpx.post(f"{router.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return r.headers[REPLICA_HEADER], details.get("cached_tokens", 0)


def shared_prefix_load(router: Router, tag: str) -> tuple[dict[int, set[str]], int]:
    """3 long documents, 4 questions on each, asked in turn: (the replicas each document's
    questions reached, the prompt tokens found cached over all of them)."""
    seen: dict[int, set[str]] = {}
    cached = 0
    for question in range(4):
        for doc in range(3):
            text = f"{tag} document {doc}: " + " ".join(
                f"line {i} of document {doc} says {tag} {i * 7 + doc}." for i in range(60))
            replica, hit = ask(router, f"{text}\nQuestion {question}: what does it say?")
            seen.setdefault(doc, set()).add(replica)
            cached += hit
    return seen, cached


def test_the_router_keeps_a_prefix_on_one_replica_and_survives_a_kill(fleet, tmp_path):
    routers = {policy: Router(fleet, policy, tmp_path / f"{policy}.log")
               for policy in ("cache_aware", "round_robin")}
    try:
        seen, aware_hits = shared_prefix_load(routers["cache_aware"], "aware")
        assert all(len(replicas) == 1 for replicas in seen.values()), seen
        seen, robin_hits = shared_prefix_load(routers["round_robin"], "robin")
        assert all(len(replicas) == 2 for replicas in seen.values()), seen
        assert aware_hits > robin_hits > 0, (aware_hits, robin_hits)
        fleet[0].signal(signal.SIGKILL)
        fleet[0].proc.wait(10)
        answered = {ask(routers["cache_aware"], f"After the kill, question {i}")[0]
                    for i in range(20)}
        assert answered == {httpx.get(f"{fleet[1].url}/health").headers[REPLICA_HEADER]}
    finally:
        for router in routers.values():
            router.stop()


def test_render_and_load_answer_what_a_router_asks(server):
    """What vllm-router asks a replica before it routes (its added fields included)."""
    messages = [{"role": "user", "content": "Hello there"}]
    post = partial(httpx.post, headers=server.headers, timeout=30)
    chat = post(f"{server.url}/v1/chat/completions/render", json={
        "model": MODEL, "messages": messages, "no_stop_trim": False,
        "skip_special_tokens": True, "include_reasoning": True}).json()
    tokenized = post(f"{server.url}/tokenize", json={"messages": messages}).json()
    assert chat == {"token_ids": tokenized["tokens"], "features": None}
    done = post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == len(chat["token_ids"])  # what it ran
    rendered = post(f"{server.url}/v1/completions/render", json={
        "model": MODEL, "prompt": ["Hello there", "Bye"]}).json()
    assert [r["token_ids"] for r in rendered] == [
        post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]
        for text in ("Hello there", "Bye")]
    rendered = post(f"{server.url}/v1/completions/render", json={
        "model": MODEL, "prompt": [[5, 6, 7]]}).json()
    assert rendered == [{"token_ids": [5, 6, 7], "features": None}]
    body = {"model": MODEL, "input": "Hello there", "instructions": "Be brief."}
    rendered = post(f"{server.url}/v1/responses/render", json=body).json()
    count = post(f"{server.url}/v1/responses/input_tokens", json=body).json()["input_tokens"]
    assert rendered["features"] is None and len(rendered["token_ids"]) == count
    bad = post(f"{server.url}/v1/chat/completions/render", json={"model": MODEL})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    load = httpx.get(f"{server.url}/get_load", timeout=10).json()  # --policy power_of_two's
    assert set(load) == {"load", "num_reqs", "num_waiting_reqs"}
    assert load["load"] == load["num_reqs"] + load["num_waiting_reqs"] >= 0


def test_one_endpoint_through_docs_nginx_conf(fleet, tmp_path):
    """docs/fleet/nginx.conf as written, its addresses made the test's: generation through the
    router, the rest to the replicas, streams as they come."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            "nginx is not installed (Debian: apt-get install nginx; .ci/run installs it)")
    router = Router(fleet, "cache_aware", tmp_path / "router.log")
    port = free_port()
    conf = (Path(__file__).parents[2] / "docs" / "fleet" / "nginx.conf").read_text()
    for old, new in [("127.0.0.1:8080", f"127.0.0.1:{router.port}"),
                     ("127.0.0.1:8001", fleet[0].url[7:]), ("127.0.0.1:8002", fleet[1].url[7:]),
                     ("listen 8000;", f"listen 127.0.0.1:{port};"),
                     ("http {", "http {\n" + "".join(  # where a non-root nginx may write
                         f"{kind}_temp_path {tmp_path / kind};\n"
                         for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")))]:
        assert old in conf, old
        conf = conf.replace(old, new)
    (tmp_path / "nginx.conf").write_text(conf)
    proc = subprocess.Popen([nginx, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"),
                             "-e", str(tmp_path / "error.log"),
                             "-g", f"daemon off; pid {tmp_path / 'nginx.pid'};"])
    try:  # up once /health comes back from a replica
        wait_healthy(f"http://127.0.0.1:{port}", proc, tmp_path / "error.log")
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        answer = c.chat.completions.create(model=MODEL, max_tokens=3, store=True, messages=[
            {"role": "user", "content": "Hello"}])
        assert answer.id in [x.id for x in c.chat.completions.list().data]  # GET: a replica
        chunks = list(c.chat.completions.create(
            model=MODEL, max_tokens=3, stream=True, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "Hi"}]))  # 3 tokens, whatever it samples
        assert chunks[-1].choices[0].finish_reason == "length"
        batch = submit(c, [chat_line(i) for i in range(4)])
        assert wait(c, batch.id).request_counts.completed == 4
    finally:
        proc.terminate()
        proc.wait(10)
        router.stop()
