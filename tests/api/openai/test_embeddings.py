"""/v1/embeddings through the official openai client (and LangChain) against real servers: the
tiny chat model (mean pooling) and a tiny random Qwen3 embedding backbone pulled from a
sentence-transformers folder (last-token pooling, normalized), against transformers."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
from torch.nn import functional as F

from tests.api.batch.test_batches import jsonl, read_lines, wait
from tests.api.conftest import API_KEY, MODEL
from tests.api.server import own_server
from tests.helpers import hf_config, make_tokenizer, pull_into

TEXTS = ["The sea is calm tonight.", "A cat sat on the mat.", "Hello", "Embeddings!"]


def cosine(a, b) -> float:
    return F.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0).item()


def test_float_and_base64_give_the_same_unit_vector(client):
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    # Without encoding_format the client asks for base64 and decodes it to floats.
    decoded = client.embeddings.create(model=MODEL, input=TEXTS[0])
    vector = floats.data[0].embedding
    assert len(vector) == 128  # the tiny model's hidden size
    assert math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-5)
    assert decoded.data[0].embedding == pytest.approx(vector, abs=1e-7)
    assert floats.model == MODEL and floats.object == "list"
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0


def test_a_text_alone_and_among_others_gets_the_same_vector(client):
    alone = [client.embeddings.create(model=MODEL, input=t, encoding_format="float")
             .data[0].embedding for t in TEXTS]
    together = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in together.data] == [0, 1, 2, 3]
    for a, d in zip(alone, together.data, strict=True):
        assert cosine(a, d.embedding) > 0.999
    assert cosine(alone[0], alone[1]) < 0.999  # different texts: different vectors


def test_token_ids_embed_like_their_text(client, server):
    ids = make_tokenizer().encode(TEXTS[1], add_special_tokens=True)
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    by_ids = client.embeddings.create(model=MODEL, input=[ids, ids[:3]],
                                      encoding_format="float")
    assert cosine(by_text.data[0].embedding, by_ids.data[0].embedding) > 0.999
    assert by_ids.usage.prompt_tokens == len(ids) + 3


def test_dimensions_and_bad_input_are_400s(client):
    import openai

    same = client.embeddings.create(model=MODEL, input="x", dimensions=128,
                                    encoding_format="float")
    assert len(same.data[0].embedding) == 128
    cases = [(dict(input="x", dimensions=64), "dimensions"), (dict(input=""), "input"),
             (dict(input=[]), "input"), (dict(input=[[1, 99999]]), "input"),
             (dict(input="x", encoding_format="int8"), "encoding_format")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=MODEL, **kwargs)
        assert e.value.body["param"] == param, kwargs


def test_langchain_embeddings(server):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send text (LangChain would tokenize with tiktoken).
    lc = OpenAIEmbeddings(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY,
                          check_embedding_ctx_length=False, max_retries=0)
    docs = lc.embed_documents(TEXTS[:2])
    query = lc.embed_query(TEXTS[0])
    assert len(docs) == 2 and cosine(docs[0], query) > 0.999


def test_embeddings_through_the_batch_api(client):
    lines = [{"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": MODEL, "input": t, "encoding_format": "float"}}
             for i, t in enumerate(TEXTS)]
    f = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                              completion_window="24h")
    b = wait(client, b.id)
    assert b.status == "completed" and b.request_counts.completed == len(TEXTS)
    out = {x["custom_id"]: x["response"] for x in read_lines(client, b.output_file_id)}
    for i, t in enumerate(TEXTS):
        body = out[f"e-{i}"]["body"]
        interactive = client.embeddings.create(model=MODEL, input=t, encoding_format="float")
        assert cosine(body["data"][0]["embedding"], interactive.data[0].embedding) > 0.999
        assert body["usage"]["prompt_tokens"] == interactive.usage.prompt_tokens


# -- an embedding model ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """A tiny random Qwen3 backbone saved as Qwen3-Embedding is: no LM head, weights named
    without `model.`, sentence-transformers pooling (last token) and Normalize; pulled and
    served. Yields (server, the transformers backbone)."""
    from transformers import AutoModel

    torch.manual_seed(5)
    hf = AutoModel.from_config(hf_config("qwen3", tie_word_embeddings=True),
                               dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())  # stored exactly at bf16
    folder = tmp_path_factory.mktemp("st") / "tiny-embed"
    hf.save_pretrained(folder, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {
        "architectures": ["Qwen3ForCausalLM"]}))  # as the real model's config says
    make_tokenizer().save_pretrained(folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 128, "pooling_mode_lasttoken": True,
         "pooling_mode_mean_tokens": False}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    home = tmp_path_factory.mktemp("embed-home")
    pull_into(home, folder)
    proc = own_server(home, tmp_path_factory.mktemp("embed-server"),
                      ["tiny-embed:bf16", "--dtype", "fp32",
                                                     "--kv-cache-dtype", "fp32"])
    yield proc, hf
    proc.stop()


def test_an_embedding_model_pools_its_own_way(embedder):
    from openai import OpenAI

    proc, hf = embedder
    ids = make_tokenizer().encode(TEXTS[0], add_special_tokens=True)
    with torch.no_grad():
        hidden = hf(torch.tensor([ids])).last_hidden_state[0]
    expected = F.normalize(hidden[-1], dim=0)
    with OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0) as c:
        got = c.embeddings.create(model="tiny-embed", input=TEXTS[0], encoding_format="float")
    assert cosine(got.data[0].embedding, expected.tolist()) > 0.9999
    torch.testing.assert_close(torch.tensor(got.data[0].embedding), expected, atol=1e-4,
                               rtol=1e-3)
    r = httpx.post(f"{proc.url}/v1/chat/completions", json={
        "model": "tiny-embed", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported"
