"""The dashboard's data without a browser: the tokens/s sampler and recent percentiles (exact),
and over HTTP the page (public) and its state endpoint (needs the key)."""

from __future__ import annotations

import httpx

from server.api.metrics import Histogram, Throughput
from tests.api.conftest import MODEL


def test_throughput_turns_running_totals_into_rates():
    t = Throughput()
    t.observe(100.0, {"generation_tokens": {0: 10, 10: 5}, "prompt_tokens": {0: 100}})
    assert list(t.samples) == []  # a rate needs two observations
    # 2 s later: interactive 10 -> 30, batch 5 -> 25, prompt 100 -> 160 (+20 of batch)
    t.observe(102.0, {"generation_tokens": {0: 30, 10: 25}, "prompt_tokens": {0: 140, 10: 20}})
    assert list(t.samples) == [{"t": 102.0, "interactive": 10.0, "batch": 10.0, "prompt": 30.0}]


def test_recent_percentiles_are_nearest_rank():
    h = Histogram((1.0,))
    assert h.recent_percentiles(0.5, 0.95) == [None, None]
    for v in range(100, 0, -1):  # 1..100 in any order
        h.observe(float(v))
    assert h.recent_percentiles(0.5, 0.95, 1.0) == [50.0, 95.0, 100.0]


def test_the_page_is_public_and_its_state_needs_the_key(server):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/dashboard.js"' in page.text
    assert httpx.get(f"{server.url}/static/dashboard.js").status_code == 200
    assert httpx.get(f"{server.url}/static/secret.py").status_code == 404
    assert httpx.get(f"{server.url}/health").json()["auth_required"] is True
    assert httpx.get(f"{server.url}/v1/dashboard/state").status_code == 401
    state = httpx.get(f"{server.url}/v1/dashboard/state", headers=server.headers).json()
    assert state["model"] == MODEL and state["bits"] == 16 and state["status"] == "ok"
    assert state["kv"]["blocks_total"] > 0 and set(state["latency"]) == {
        "ttft_p50", "ttft_p95", "itl_p50", "itl_p95"}
