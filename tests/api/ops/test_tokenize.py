"""/tokenize, /detokenize and /tokenizer_info (vLLM's shapes; lm-evaluation-harness's remote
tokenizer and llama.cpp's clients) against the real server on the tiny model."""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import MODEL
from tests.helpers import make_tokenizer


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as c:
        yield c


def test_tokenize_and_detokenize_are_the_model_s_tokenizer(http):
    tokenizer = make_tokenizer()
    text = "count the sheep"
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 4096
    # llama.cpp's name for the text, and the model named
    assert http.post("/tokenize", json={"content": text, "model": MODEL}).json()["tokens"] == \
        tokenizer.encode(text)
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == back["content"] == text
    # a chat: the prompt /v1/chat/completions would run
    chat = [{"role": "user", "content": "hi"}]
    tokens = http.post("/tokenize", json={"messages": chat}).json()["tokens"]
    used = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat,
                                                   "max_tokens": 1}).json()["usage"]
    assert len(tokens) == used["prompt_tokens"]


def test_tokenizer_info_is_what_lm_evaluation_harness_checks(http):
    info = http.get("/tokenizer_info").json()
    tokenizer = make_tokenizer()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"]
    assert info["model_max_length"] == 4096 and info["model"] == MODEL
    # its check_remote_tokenizer_support: then a special token encodes to its id
    eos = http.post("/tokenize", json={"prompt": info["eos_token"],
                                       "add_special_tokens": False}).json()["tokens"]
    assert eos == [tokenizer.eos_token_id]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "content": "b"}, "prompt"),
    ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_input_names_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_they_need_the_api_key_and_the_served_model(server, http):
    for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"),
                         ("GET", "/tokenizer_info")):
        r = httpx.request(method, f"{server.url}{path}", json={"prompt": "a", "tokens": [1]})
        assert r.status_code == 401
    r = http.post("/tokenize", json={"prompt": "a", "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
