"""The app in-process over a fake engine: failures inside the engine, seen through HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

from server.api.app import create_app
from server.api.state import ServerSettings, ServerState
from server.engine.output import CompletionChunk
from tests.helpers import make_tokenizer


class FailingEngine:
    """Streams one chunk, then fails like a crashed engine step."""

    def __init__(self) -> None:
        self.tokenizer = make_tokenizer()
        self.aborted: list[str] = []

    def check(self, num_prompt_tokens, params) -> None:
        pass

    async def generate(self, prompt_ids, params, priority, salt, request_id):
        yield CompletionChunk(0, "Hel", [40], None, num_prompt_tokens=len(prompt_ids))
        raise RuntimeError("CUDA error: device lost")

    def shutdown(self) -> None:
        pass


@pytest.fixture
def app(tmp_path):
    settings = ServerSettings(model="fake:bf16", home=tmp_path)
    state = ServerState(settings)
    state.engine, state.tokenizer = FailingEngine(), make_tokenizer()
    state.vocab_size, state.max_request_tokens = 300, 1024
    return create_app(settings, state)


async def post(app, body):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/v1/chat/completions", json=body)


BODY = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.mark.asyncio
async def test_failure_after_the_stream_began_is_an_error_event_then_done(app):
    r = await post(app, BODY | {"stream": True})
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data:")]
    assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(events[1])["choices"][0]["delta"] == {"content": "Hel"}
    error = json.loads(events[2])["error"]
    assert error["type"] == "server_error" and "device lost" in error["message"]
    assert events[3:] == ["[DONE]"]
    assert app.state.server.num_pending == 0  # the place in the queue was given back


@pytest.mark.asyncio
async def test_failure_of_a_plain_request_is_a_500_in_openai_shape(app):
    r = await post(app, BODY)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert app.state.server.num_pending == 0


@pytest.mark.asyncio
async def test_before_the_model_is_ready_health_and_requests_are_503(tmp_path):
    settings = ServerSettings(model="fake:bf16", home=tmp_path)
    state = ServerState(settings)
    app = create_app(settings, state)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "loading", "auth_required": False})
        r = await client.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "model_not_ready"
        state.load_error = "model.safetensors: checksum mismatch"
        r = await client.get("/health")
        assert r.status_code == 503 and "checksum" in r.json()["error"]
        r = await client.post("/v1/chat/completions", json=BODY)
        assert r.status_code == 503 and "checksum" in r.json()["error"]["message"]
        state.engine, state.tokenizer = FailingEngine(), make_tokenizer()
        state.served_name = "fake:bf16"
        r = await client.get("/health")
        assert (r.status_code, r.json()["status"]) == (200, "ok")
