"""A model's recommended sampling fills in what a request leaves out, on every generating API
(`serve --generation-config auto`, the default), and the API's own defaults stay with
`--generation-config none`. The tiny model's generation_config.json says temperature 0.7,
top_p 0.8 and top_k 1: top_k 1 makes any draw the greedy token, so "the defaults were applied"
is an exact equality with the greedy answer, not a matter of sampling luck."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.api.server import own_server
from tests.helpers import hf_model, pull_into, save_hf_folder

MODEL = "tiny-sampling:bf16"
ASK = [{"role": "user", "content": "Say something."}]
GENERATION = {"temperature": 0.7, "top_p": 0.8, "top_k": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def models_home(tmp_path_factory):
    folder = save_hf_folder(hf_model("llama", seed=5), tmp_path_factory.mktemp("hf") /
                            "tiny-sampling")
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    home = tmp_path_factory.mktemp("sampling-home")
    pull_into(home, folder)
    return home


def chat(server, **fields) -> str:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 24, "ignore_eos": True} | fields
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_the_model_s_defaults_fill_what_a_request_leaves_out(models_home, tmp_path):
    server = own_server(models_home, tmp_path, [MODEL])
    try:
        greedy = chat(server, temperature=0)
        # left out: the model's 0.7 / 0.8 / 1 (top_k 1: the greedy token whatever the seed)
        assert chat(server, seed=1) == chat(server, seed=2) == greedy
        assert chat(server, seed=1, temperature=0.7, top_p=0.8, top_k=1) == greedy
        r = httpx.post(f"{server.url}/v1/completions", json={
            "model": MODEL, "prompt": "Once", "max_tokens": 12, "seed": 3}, timeout=60).json()
        assert r["choices"][0]["text"] == httpx.post(f"{server.url}/v1/completions", json={
            "model": MODEL, "prompt": "Once", "max_tokens": 12, "temperature": 0},
            timeout=60).json()["choices"][0]["text"]
        # the Responses API says what it ran with: the model's temperature and top_p
        resp = httpx.post(f"{server.url}/v1/responses", json={
            "model": MODEL, "input": "Say something.", "max_output_tokens": 8}, timeout=60).json()
        assert (resp["temperature"], resp["top_p"]) == (0.7, 0.8)
        resp = httpx.post(f"{server.url}/v1/responses", json={
            "model": MODEL, "input": "Say something.", "max_output_tokens": 8,
            "temperature": 0.3}, timeout=60).json()
        assert (resp["temperature"], resp["top_p"]) == (0.3, 0.8)
        # Anthropic's Messages: no temperature given, the model's (top_k 1: greedy)
        m = httpx.post(f"{server.url}/v1/messages", json={
            "model": MODEL, "max_tokens": 24, "messages": ASK}, timeout=60).json()
        assert m["content"][0]["text"] == chat(server, temperature=0, ignore_eos=False)
        assert "sampling defaults: temperature 0.7, top_p 0.8, top_k 1 " \
               "(generation_config.json)" in server.log.read_text()
    finally:
        server.stop()


def test_none_keeps_the_api_s_defaults(models_home, tmp_path):
    server = own_server(models_home, tmp_path, [MODEL, "--generation-config", "none"])
    try:
        # left out: temperature 1, top_p 1, top_k off; the same seeded draw as asking for them
        assert chat(server, seed=7) == chat(server, seed=7, temperature=1, top_p=1, top_k=0)
        resp = httpx.post(f"{server.url}/v1/responses", json={
            "model": MODEL, "input": "Say something.", "max_output_tokens": 8}, timeout=60).json()
        assert (resp["temperature"], resp["top_p"]) == (1.0, 1.0)
        assert "sampling defaults: the API's" in server.log.read_text()
    finally:
        server.stop()


def test_show_names_the_defaults(models_home, monkeypatch, capsys):
    from cli.main import main

    monkeypatch.setenv("LOCALSERVE_HOME", str(models_home))
    assert main(["show", MODEL]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("sampling"))
    assert line.split(None, 1)[1] == ("temperature 0.7, top_p 0.8, top_k 1 "
                                      "(generation_config.json)")
