"""Disconnects free the request's KV blocks; a full queue answers 429; SIGTERM drains."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from tests.api.conftest import MODEL
from tests.api.server import ServerProcess, own_server

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me everything."}],
        "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
ABORTED = 'localserve:request_success_total{finished_reason="abort"}'
GENERATED = 'localserve:generation_tokens_total{kind="interactive"}'


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["localserve:num_requests_running"] == 0 and \
                m["localserve:kv_cache_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def open_stream(client: httpx.Client, body: dict):
    """Start a stream and read its first event: (response, line iterator). Dropping the
    iterator closes the response."""
    r = client.send(client.build_request("POST", "/v1/chat/completions",
                                         json=body | {"stream": True}), stream=True)
    assert r.status_code == 200
    lines = r.iter_lines()
    assert next(line for line in lines if line.startswith("data:"))
    return r, lines


def test_disconnect_mid_stream_frees_blocks(server):
    before = wait_idle(server)
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as client:
        r, lines = open_stream(client, LONG)
        assert server.metrics()["localserve:kv_cache_blocks_used"] > 0
        r.close()
    after = wait_idle(server)
    assert after[ABORTED] == before[ABORTED] + 1
    assert after[GENERATED] - before[GENERATED] < 4000  # stopped, not run to the end


def test_disconnect_while_waiting_for_a_plain_answer(server):
    before = wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=LONG, headers=server.headers,
                   timeout=0.5)
    after = wait_idle(server)
    assert after[ABORTED] == before[ABORTED] + 1
    assert after[GENERATED] - before[GENERATED] < 4000


@pytest.fixture
def small_server(tiny_home, tmp_path):
    """Its own process: a queue of 2 requests, a short drain."""
    proc = own_server(tiny_home, tmp_path, [MODEL, "--max-pending", "2", "--drain-timeout",
                                            "20"])
    yield proc
    proc.stop()


def test_full_queue_is_429_with_retry_after_then_recovers(small_server):
    with httpx.Client(base_url=small_server.url, timeout=30) as client:
        streams = [open_stream(client, LONG) for _ in range(2)]  # (kept: closing is leaving)
        r = client.post("/v1/chat/completions", json=LONG | {"max_tokens": 1})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        for response, _ in streams:
            response.close()
        deadline = time.monotonic() + 20
        while (r := client.post("/v1/chat/completions", json=LONG | {"max_tokens": 1})
               ).status_code == 429:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert r.status_code == 200
    assert small_server.metrics()["localserve:request_rejected_total"] >= 1


def test_sigterm_drains_in_flight_requests_and_exits_cleanly(small_server):
    """The stream in flight is LONG's 4,000 tokens, ~2.7 s of the tiny model on a Zen 4 (AMD
    EPYC family 25, 2 cores): 400 took 0.3 s there, as long as the test waits before its late
    request, and the drained server had already exited."""
    with httpx.Client(base_url=small_server.url, timeout=60) as client:
        r, lines = open_stream(client, LONG)
        small_server.signal(signal.SIGTERM)
        time.sleep(0.3)
        late = client.post("/v1/chat/completions", json=LONG | {"max_tokens": 1})
        assert late.status_code == 503 and late.json()["error"]["code"] == \
            "server_shutting_down"
        assert client.get("/health").json() == {"status": "draining", "auth_required": False}
        events = [line[len("data: "):] for line in lines if line.startswith("data:")]
        r.close()
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    assert small_server.proc.wait(30) == 0


def test_metrics_report_latency_histograms_and_cache(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as client:
        for _ in range(2):  # the second one hits the prefix cache
            r = client.post("/v1/chat/completions", json=LONG | {"max_tokens": 4})
            assert r.status_code == 200
        text = client.get("/metrics").text
    m = server.metrics()
    assert m["localserve:time_to_first_token_seconds_count"] >= 2
    assert m["localserve:inter_token_latency_seconds_count"] >= 6
    assert m["localserve:e2e_request_latency_seconds_count"] >= 2
    assert m["localserve:prefix_cache_hits_total"] > 0
    assert 0 <= m["localserve:kv_cache_usage_perc"] <= 1
    assert 'localserve:time_to_first_token_seconds_bucket{le="+Inf"' in text
    assert "# TYPE localserve:inter_token_latency_seconds histogram" in text


def test_kv_cache_dtype_bf16_doubles_the_pool_and_serves(tiny_home, tmp_path):
    totals = {}
    for kv in ("fp32", "bf16"):
        proc = own_server(tiny_home, tmp_path / kv, [MODEL, "--kv-cache-mb", "8",
                                                     "--kv-cache-dtype", kv])
        try:
            r = httpx.post(f"{proc.url}/v1/chat/completions", timeout=30, json=LONG | {
                "max_tokens": 5})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
            totals[kv] = proc.metrics()["localserve:kv_cache_blocks_total"]
        finally:
            proc.stop()
    assert totals["bf16"] == 2 * totals["fp32"] > 0


def test_idle_server_hands_kv_memory_back_and_says_what_the_pool_holds(tiny_home, tmp_path):
    # On the CPU (a GPU's pool is allocated whole and kept, and its start line says so).
    # 8 MB of fp32 KV for the tiny model: 16 KB a block (2 layers, K and V, 16 slots, 2 heads
    # of 32), 512 blocks, 8,192 tokens; the need (64 sequences at 512 tokens) is larger.
    proc = own_server(tiny_home, tmp_path, [MODEL, "--kv-cache-mb", "8", "--kv-cache-dtype",
                                            "fp32", "--idle-release-seconds", "1",
                                            "--idle-cache-mb", "0", "--device", "cpu",
                                            "--dtype", "fp32"])
    try:
        deadline = time.monotonic() + 30  # logged as the model is ready, maybe just after
        while "ready on cpu, float32 compute; KV cache: up to 8192 tokens (8 MB, float32), " \
                "resident only as used" not in proc.log.read_text():
            assert time.monotonic() < deadline, proc.log.read_text()[-2000:]
            time.sleep(0.05)
        body = LONG | {"max_tokens": 5, "temperature": 0}
        first = httpx.post(f"{proc.url}/v1/chat/completions", timeout=30, json=body).json()
        deadline = time.monotonic() + 60
        while proc.metrics()["localserve:kv_cache_resident_bytes"] > 0:  # released when idle
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert proc.metrics()["localserve:kv_cache_blocks_cached_free"] == 0
        again = httpx.post(f"{proc.url}/v1/chat/completions", timeout=30, json=body).json()
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing kept
    finally:
        proc.stop()


def test_the_start_line_says_a_gpu_pool_is_allocated_whole_and_kept():
    """Runs anywhere: the line a server on a GPU logs (its pool is not given back when idle)."""
    from server.api.app import kv_summary
    from server.engine.engine import EngineConfig

    stats = {"kv_blocks_total": 512, "kv_block_bytes": 16384, "kv_dtype": "bfloat16"}
    config = EngineConfig(idle_release_seconds=1.0)
    gpu = kv_summary(stats, config, "cuda:0")
    assert gpu.startswith("KV cache: up to 8192 tokens (8 MB, bfloat16), allocated on cuda:0;")
    assert gpu.endswith("kept while the server runs") and "idle" not in gpu
    cpu = kv_summary(stats, config, "cpu")
    assert "resident only as used" in cpu and cpu.endswith("after 1 s idle it keeps 0 MB")
