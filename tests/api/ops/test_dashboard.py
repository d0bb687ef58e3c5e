"""The dashboard at `/` in a real headless Chromium (Debian's, driven by Playwright through
executable_path; .ci/run installs it): the page asks for the key, shows the model and live
state, streams a chat, stops one (the server's running count returns to 0), shows a batch's
progress moving and cancels one, of either API; `chromium --dump-dom` of the page holds the
state."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import httpx
import pytest

from tests.api.batch.test_batches import jsonl
from tests.api.conftest import API_KEY, MODEL
from tests.api.server import num_aborted, own_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# CI installs Chromium (.ci/run): there a missing browser fails; elsewhere these tests skip.
NEEDS_CHROMIUM = pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                                    reason="no chromium on this machine (apt-get install "
                                    "chromium)")
pytestmark = NEEDS_CHROMIUM
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
SYSTEM, QUESTION = "You are a helpful assistant.", "Tell me a long story."


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM or "chromium", args=FLAGS)
        yield b
        b.close()


class Page:
    """A fresh page that records console errors and uncaught exceptions."""

    def __init__(self, browser, url: str, key: str | None = None) -> None:
        self.context = browser.new_context()
        if key is not None:  # as if the key had been entered before
            self.context.add_init_script(
                f"localStorage.setItem('localserve-api-key', {key!r})")
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)

    def text(self, selector: str) -> str:
        return self.page.text_content(selector) or ""

    def wait_text(self, selector: str, needle: str, timeout: float = 20_000) -> None:
        self.page.wait_for_function(
            "([s, n]) => (document.querySelector(s)?.textContent || '').includes(n)",
            arg=[selector, needle], timeout=timeout)

    def close(self) -> None:
        self.context.close()


def running(server) -> int:
    s = httpx.get(f"{server.url}/v1/dashboard/state", headers=server.headers).json()
    return s["requests"]["running"] + s["requests"]["waiting"]


def test_the_page_asks_for_the_key_then_shows_the_model_and_state(browser, server):
    page = Page(browser, server.url)
    try:
        page.page.wait_for_selector("#key-form", state="visible")
        page.page.fill("#api-key", API_KEY)
        page.page.click("#key-submit")
        page.wait_text("#model", MODEL)
        page.wait_text("#kv", "blocks used")
        page.wait_text("#status", "ok")
        assert page.text("#bits") == "16-bit"
        assert page.errors == []
    finally:
        page.close()


def test_a_chat_streams_into_the_playground(browser, server, client):
    expected = client.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    page = Page(browser, server.url, API_KEY)
    try:
        page.wait_text("#model", MODEL)
        page.page.fill("#message", QUESTION)
        page.page.fill("#temperature", "0")
        page.page.fill("#max-tokens", "16")
        page.page.click("#send")
        page.wait_text("#chat-stats", "finished: length")
        assert page.text("#answer") == expected.choices[0].message.content
        assert "tokens/s" in page.text("#chat-stats")
        assert page.errors == []
    finally:
        page.close()


def test_stop_ends_a_generation_on_the_server(browser, server):
    aborted = num_aborted(server)
    page = Page(browser, server.url, API_KEY)
    try:
        page.wait_text("#model", MODEL)
        page.page.fill("#message", QUESTION)
        page.page.fill("#temperature", "0")  # greedy: this answer has no end token early
        page.page.fill("#max-tokens", "3000")  # far more than streams before the click
        page.page.click("#send")
        page.page.wait_for_function("document.querySelector('#answer').textContent.length > 20")
        page.page.click("#stop")
        page.wait_text("#chat-stats", "stopped")
        deadline = time.monotonic() + 20
        while running(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert running(server) == 0
        assert num_aborted(server) == aborted + 1  # the server aborted it: it did not finish
        assert page.errors == []
    finally:
        page.close()


@pytest.fixture(scope="module")
def open_server(tiny_home, tmp_path_factory):
    """No API key; one batch line at a time, so a batch's progress takes a few seconds."""
    proc = own_server(tiny_home, tmp_path_factory.mktemp("dashboard"),
                      [MODEL, "--batch-max-running", "1"])
    yield proc
    proc.stop()


def batch_row(page: Page, batch_id: str) -> str:
    """The selector of the batches table's row of `batch_id`, once the page shows it."""
    row = f"#batches tr[data-id='{batch_id}']"
    page.page.wait_for_selector(row)
    return row


def submit(server, num_lines: int, max_tokens: int) -> str:
    lines = [{"custom_id": f"d-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": f"Q {i}"}],
                       "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}}
             for i in range(num_lines)]
    f = httpx.post(f"{server.url}/v1/files", files={"file": ("in.jsonl", jsonl(lines))},
                   data={"purpose": "batch"}).json()
    return httpx.post(f"{server.url}/v1/batches", json={
        "input_file_id": f["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}).json()["id"]


def test_a_running_batch_moves_and_can_be_cancelled(browser, open_server):
    """The bar moves while the page watches, a batch is cancelled from the page, and one run
    to its end says so. The watched batch's lines are long enough (4,000 tokens each, one line
    at a time) that it runs for many polls on any machine: a batch of short lines could finish
    between two polls on a fast one."""
    page = Page(browser, open_server.url)
    try:
        page.wait_text("#model", MODEL)
        long = submit(open_server, 6, 4000)
        row = batch_row(page, long)
        page.wait_text(f"{row} .progress", "0 done, 0 failed of 6", timeout=60_000)
        page.wait_text(f"{row} .progress", "1 done, 0 failed of 6", timeout=120_000)

        page.page.click(f"{row} button.cancel")
        status = httpx.get(f"{open_server.url}/v1/batches/{long}").json()["status"]
        assert status in ("cancelling", "cancelled")
        page.wait_text(f"{row} td:nth-child(2)", "cancelled")

        short = batch_row(page, submit(open_server, 6, 8))
        page.wait_text(f"{short} td:nth-child(2)", "completed", timeout=120_000)
        page.wait_text(f"{short} .progress", "6 done, 0 failed of 6")
        assert page.errors == []
    finally:
        page.close()


def submit_messages(server, num_requests: int, chars: int) -> str:
    """An Anthropic Message Batch whose answers are a JSON string of `chars` to `chars` + 50
    characters (the grammar holds them that long, ended well within max_tokens)."""
    schema = {"type": "object", "required": ["text"], "properties": {
        "text": {"type": "string", "minLength": chars, "maxLength": chars + 50}}}
    requests = [{"custom_id": f"m-{i}", "params": {
        "model": MODEL, "max_tokens": chars + 200, "temperature": 0,
        "messages": [{"role": "user", "content": f"Q {i}"}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}}}}
        for i in range(num_requests)]
    return httpx.post(f"{server.url}/v1/messages/batches", json={"requests": requests},
                      timeout=30).json()["id"]


def test_a_message_batch_shows_beside_openai_s_and_can_be_cancelled(browser, open_server):
    page = Page(browser, open_server.url)
    try:
        page.wait_text("#model", MODEL)
        row = batch_row(page, submit_messages(open_server, 3, 100))
        page.wait_text(f"{row} td:nth-child(2)", "ended", timeout=120_000)
        page.wait_text(f"{row} .progress", "3 done, 0 failed of 3")

        other = submit_messages(open_server, 6, 2000)  # one at a time: ~2,000 tokens each
        row = batch_row(page, other)
        page.page.wait_for_selector(f"{row} button.cancel")
        page.page.click(f"{row} button.cancel")
        page.wait_text(f"{row} td:nth-child(2)", "ended", timeout=60_000)
        counts = httpx.get(f"{open_server.url}/v1/messages/batches/{other}").json()[
            "request_counts"]
        assert counts["canceled"] > 0 and counts["processing"] == 0
        failed = counts["errored"] + counts["canceled"] + counts["expired"]
        page.wait_text(f"{row} .progress", f"{counts['succeeded']} done, {failed} failed of 6")
        assert page.errors == []
    finally:
        page.close()


def test_dump_dom_holds_the_model_batches_and_kv(open_server):
    batch_id = submit(open_server, 2, 4)
    deadline = time.monotonic() + 60
    while httpx.get(f"{open_server.url}/v1/batches/{batch_id}").json()["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    dom = subprocess.run(
        [CHROMIUM or "chromium", "--headless", *FLAGS, "--virtual-time-budget=8000",
         "--dump-dom", f"{open_server.url}/"],
        capture_output=True, text=True, timeout=120).stdout
    assert MODEL in dom
    assert "blocks used" in dom  # the KV card, filled from the state endpoint
    assert batch_id in dom and "2 done, 0 failed of 2" in dom  # the batches table
