"""POST /v1/rerank and /rerank over a real server: a tiny random Qwen3 whose vocabulary has
"yes" and "no" tokens scores each (query, document) pair as Qwen3-Reranker's model card does
with transformers (P(yes) from the last position's yes/no logits); Cohere's and llama-server's
request shapes; refusals name their field."""

from __future__ import annotations

import httpx
import pytest
import torch

from server.api.rerank.rerank import DEFAULT_INSTRUCTION, PREFIX, SUFFIX
from tests.api.conftest import MODEL as TINY
from tests.api.server import own_server
from tests.helpers import ANSWER_MERGES, hf_model, make_tokenizer, pull_into

MODEL = "tiny-reranker:bf16"
QUERY = "the capital of France"
DOCUMENTS = ["Paris is the capital of France.", "Bread is made of flour.", "A cat sat.",
             "France borders Spain."]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    hf = hf_model("qwen3", seed=13)
    folder = tmp_path_factory.mktemp("hf") / "tiny-reranker"
    hf.save_pretrained(folder, safe_serialization=True)
    make_tokenizer(ANSWER_MERGES).save_pretrained(folder)
    home = tmp_path_factory.mktemp("rerank-home")
    pull_into(home, folder)
    server = own_server(home, tmp_path_factory.mktemp("rerank"),
                        [MODEL, "--dtype", "fp32", "--kv-cache-dtype", "fp32"])  # as the reference
    yield hf, server
    server.stop()


def model_card_scores(hf, query: str, documents: list[str]) -> list[float]:
    """Qwen3-Reranker's model card, in transformers: prefix + pair + suffix, tokenized apart;
    the last position's "no" and "yes" logits; log_softmax; P(yes)."""
    tok = make_tokenizer(ANSWER_MERGES)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    scores = []
    for doc in documents:
        pair = f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
        ids = [tok.encode(text, add_special_tokens=False) for text in (PREFIX, pair, SUFFIX)]
        with torch.no_grad():
            logits = hf(torch.tensor([sum(ids, [])])).logits[0, -1]
        pair_scores = torch.log_softmax(torch.stack([logits[no], logits[yes]]), dim=0)
        scores.append(pair_scores[1].exp().item())
    return scores


def test_scores_are_the_model_card_s_most_relevant_first(reranker):
    hf, server = reranker
    want = model_card_scores(hf, QUERY, DOCUMENTS)
    r = httpx.post(f"{server.url}/v1/rerank", json={
        "model": MODEL, "query": QUERY, "documents": DOCUMENTS}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert [x["index"] for x in results] == sorted(range(4), key=lambda i: -want[i])
    for x in results:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-4)
        assert "document" not in x
    assert body["model"] == MODEL and body["usage"]["prompt_tokens"] > 4 * 40


def test_cohere_and_llama_server_shapes(reranker):
    _, server = reranker
    # Cohere (and Jina): documents as objects, top_n, return_documents
    r = httpx.post(f"{server.url}/v1/rerank", json={
        "model": MODEL, "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
        "top_n": 2, "return_documents": True}, timeout=60).json()
    assert len(r["results"]) == 2
    assert all(x["document"] == {"text": DOCUMENTS[x["index"]]} for x in r["results"])
    assert r["results"][0]["relevance_score"] >= r["results"][1]["relevance_score"]
    # llama-server: POST /rerank with plain strings
    s = httpx.post(f"{server.url}/rerank", json={
        "model": MODEL, "query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
    assert {x["index"] for x in s["results"]} == {0, 1, 2, 3}
    assert [x["index"] for x in s["results"][:2]] == [x["index"] for x in r["results"]]


@pytest.mark.parametrize(("fields", "param"), [
    ({"documents": DOCUMENTS}, "query"),
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": ["a", 5]}, "documents[1]"),
    ({"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": ["a"], "rank_fields": ["x"]}, "rank_fields"),
])
def test_bad_requests_name_their_field(reranker, fields, param):
    _, server = reranker
    r = httpx.post(f"{server.url}/v1/rerank", json={"model": MODEL} | fields, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_model_without_yes_and_no_tokens_cannot_rerank(server):
    r = httpx.post(f"{server.url}/v1/rerank", headers=server.headers, json={
        "model": TINY, "query": QUERY, "documents": DOCUMENTS}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_both_paths_need_the_api_key(server, path):
    r = httpx.post(f"{server.url}{path}", json={"model": TINY, "query": QUERY,
                                                "documents": DOCUMENTS}, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
