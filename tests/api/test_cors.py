"""Web pages calling the API from a browser (CORS), in a real headless Chromium: a page served
from this machine may (as Ollama allows by default), a page from another origin only when
`serve --allow-origin` names it; errors reach the page too."""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest

from tests.api.conftest import API_KEY, MODEL
from tests.api.ops.test_dashboard import NEEDS_CHROMIUM, browser  # noqa: F401 - the fixture
from tests.api.server import own_server

pytestmark = NEEDS_CHROMIUM

FETCH = """async ([api, key, model]) => {
    const headers = {"Content-Type": "application/json"};
    if (key) headers["Authorization"] = "Bearer " + key;
    try {
        const r = await fetch(api + "/v1/chat/completions", {method: "POST", headers,
            body: JSON.stringify({model, max_tokens: 2,
                                  messages: [{role: "user", content: "hi"}]})});
        const body = await r.json();
        return [r.status, body.object || body.error.code];
    } catch (e) {
        return ["blocked", String(e)];
    }
}"""


class PageServer:
    """A blank page at http://HOST:PORT/ (its own origin), served from a thread."""

    def __init__(self, host: str) -> None:
        class Blank(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                body = b"<!doctype html><title>page</title>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer((host, 0), Blank)
        self.origin = f"http://{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def pages():
    local, other = PageServer("127.0.0.1"), PageServer("127.0.0.2")  # two origins
    yield local, other
    local.close()
    other.close()


def call_from(browser, page_url: str, api: str, key: str | None):  # noqa: F811
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(page_url)
        return page.evaluate(FETCH, [api, key, MODEL])
    finally:
        context.close()


def test_pages_on_this_machine_may_call_the_api_and_read_its_errors(browser, server, pages):  # noqa: F811
    local, other = pages
    localhost_page = local.origin.replace("127.0.0.1", "localhost")
    for page in (local.origin, localhost_page):
        assert call_from(browser, page, server.url, API_KEY) == [200, "chat.completion"]
        assert call_from(browser, page, server.url, None) == [401, "invalid_api_key"]
    status, error = call_from(browser, other.origin, server.url, API_KEY)
    assert status == "blocked" and "Failed to fetch" in error
    # What the browser was told: no permission for that origin (preflight refused).
    preflight = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": other.origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers


def test_allow_origin_lets_another_page_call_the_api(browser, tiny_home, tmp_path, pages):  # noqa: F811
    _, other = pages
    proc = own_server(tiny_home, tmp_path, [MODEL, "--api-key", API_KEY,
                                            "--allow-origin", other.origin])
    try:
        assert call_from(browser, other.origin, proc.url, API_KEY) == [200, "chat.completion"]
        assert call_from(browser, other.origin, proc.url, "wrong") == [401, "invalid_api_key"]
    finally:
        proc.stop()
