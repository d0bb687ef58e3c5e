"""End to end: `localserve serve` with no model name on the real smollm2-135m (int4)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real_model

VIETNAMESE = ("Việt Nam là một quốc gia nằm ở phía đông bán đảo Đông Dương. Thủ đô của Việt "
              "Nam là")


def test_health_was_503_while_loading(real_server):
    """The fixture polled /health from the moment the port was open (the tiny test model now
    loads faster than one poll; the real one takes a second)."""
    assert real_server.health_seen[0] == 503 and real_server.health_seen[-1] == 200


def test_the_int4_model_computes_in_the_dtype_picked_for_int4_here(real_server):
    """The server picks the compute dtype from the model's bits: fp32 for int4 where its layers
    run avx2_gemm.c (an Intel CPU with AVX-512 BF16 and no AMX too), bf16 where the kernels take
    bf16 (AMX, Zen 4/5)."""
    import torch

    from server.models.device import pick_dtype

    want = str(pick_dtype(torch.device("cpu"), None, 4)).removeprefix("torch.")
    assert f"smollm2-135m:int4 ready on cpu, {want} compute;" in real_server.log.read_text()


@pytest.fixture(scope="module")
def client(real_server):
    from openai import OpenAI

    with OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0,
                timeout=120) as c:
        yield c


def test_default_model_is_served_and_answers_paris(client):
    listed = client.models.list().data  # the store, the served model first and loaded
    assert (listed[0].id, listed[0].model_extra["loaded"]) == ("smollm2-135m:int4", True)
    assert all(not m.model_extra["loaded"] for m in listed[1:])
    r = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Name the capital of France."}],
        max_tokens=24, temperature=0)  # a wide-margin prompt (tests/test_real_model.py)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_the_readme_request_at_the_model_s_defaults_answers_paris(client, real_server):
    """The README's first request sends no temperature: the default model's card settings
    (temperature 0.2, top_p 0.9; the catalogue's, its offline GGUF has none) apply, where the
    API's temperature 1 wrote nonsense. Not a near tie: greedy, each token up to " Paris"
    leads the next by more than 1 nat (1.5 at the first, "The" over "L", on a Zen 4), so at
    temperature 0.2 another is drawn with probability under e^-5 a token."""
    ask = [{"role": "user", "content": "Name the capital of France."}]
    greedy = client.chat.completions.create(model="smollm2-135m", messages=ask, max_tokens=32,
                                            temperature=0, logprobs=True, top_logprobs=2)
    text = ""
    for token in greedy.choices[0].logprobs.content:
        first, second = token.top_logprobs
        assert first.logprob - second.logprob > 1.0, (text, token.token, second.token)
        text += token.token
        if "Paris" in text:
            break
    assert text == "The capital of France is Paris"
    for seed in (1, 2, 3):
        r = client.chat.completions.create(model="smollm2-135m", messages=ask, max_tokens=32,
                                           seed=seed)
        assert "Paris" in r.choices[0].message.content
    assert "sampling defaults: temperature 0.2, top_p 0.9 (catalogue)" in \
        real_server.log.read_text()


@pytest.mark.parametrize("max_tokens", [40, 41, 42, 43])  # some end inside a character
def test_vietnamese_stream_has_no_replacement_characters(client, max_tokens):
    kw = dict(model="smollm2-135m:int4", prompt=VIETNAMESE, max_tokens=max_tokens,
              temperature=0)
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kw)
              if c.choices]
    text = "".join(pieces)
    assert not any("\ufffd" in p for p in pieces)
    assert text == client.completions.create(**kw).choices[0].text
    assert sum(not c.isascii() for c in text) >= 5  # really Vietnamese, multi-byte
    assert len([p for p in pieces if p]) > 10  # really streamed


CAT = [{"role": "user", "content": "Invent a name for a cat."}]


def seeded_cat(client) -> tuple[str, list, int]:
    r = client.chat.completions.create(model="smollm2-135m", messages=CAT, temperature=0.9,
                                       seed=42, max_tokens=24, logprobs=True, top_logprobs=2)
    lps = [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
           for t in r.choices[0].logprobs.content]
    return r.choices[0].message.content, lps, r.usage.prompt_tokens_details.cached_tokens


def test_seeded_request_is_the_same_cold_cached_batched_and_chunked(real_server, real_home,
                                                                    tmp_path):
    """The same seeded request, sampled at temperature 0.9, gives the same text and logprobs
    cold, from the prefix cache, among 8 other requests and with its prompt in 16-token chunks
    (each server fresh, so "cold" has nothing cached)."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from tests.api.server import own_server

    fresh = own_server(real_home, tmp_path / "a", [])
    chunking = own_server(real_home, tmp_path / "b", ["--max-num-batched-tokens", "16",
                                                      "--no-prefix-caching"])
    try:
        with OpenAI(base_url=f"{fresh.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            cold = seeded_cat(c)
            cached = seeded_cat(c)
            with ThreadPoolExecutor(9) as pool:
                others = [pool.submit(c.chat.completions.create, model="smollm2-135m",
                                      messages=[{"role": "user", "content": f"Count to {i}."}],
                                      max_tokens=16 + 3 * i, temperature=0.7) for i in range(4)]
                batched = pool.submit(seeded_cat, c)
                others += [pool.submit(c.chat.completions.create, model="smollm2-135m",
                                       messages=[{"role": "user", "content": f"Spell {i}."}],
                                       max_tokens=20, temperature=0.7) for i in range(4)]
                batched = batched.result()
                assert all(f.result().choices for f in others)
        with OpenAI(base_url=f"{chunking.url}/v1", api_key="x", max_retries=0,
                    timeout=120) as c:
            chunked = seeded_cat(c)
    finally:
        fresh.stop()
        chunking.stop()
    assert cold[2] == 0 and cached[2] >= 32 and chunked[2] == 0
    assert len(cold[1]) > 3 and cold[0].strip()
    assert cached[:2] == cold[:2]
    assert batched[:2] == cold[:2]
    assert chunked[:2] == cold[:2]


def test_next_turn_reuses_the_reply_the_idle_server_computed_as_prompt(client, real_server):
    """A chat's next turn repeats the reply (re-tokenized from its text, the same ids here).
    Replies' own blocks are never reused as prompt (other kernels, other numbers); the idle
    server computes each as prompt instead, and the next turn hits those blocks."""
    import time

    messages = [{"role": "user", "content": "Write three sentences about rivers."}]
    first = client.chat.completions.create(model="smollm2-135m", messages=messages,
                                           max_tokens=80, temperature=0)
    deadline = time.monotonic() + 120  # the server starts after 0.5 s idle; no timing assumed
    while real_server.metrics()["localserve:replies_to_recache"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert real_server.metrics()["localserve:replies_to_recache"] == 0
    assert real_server.metrics()["localserve:replies_recached_total"] >= 1
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Now one more."}]
    second = client.chat.completions.create(model="smollm2-135m", messages=messages,
                                            max_tokens=4, temperature=0)
    turn_one = first.usage.prompt_tokens + first.usage.completion_tokens
    assert first.usage.completion_tokens >= 32  # the reply fills blocks of its own
    assert second.usage.prompt_tokens_details.cached_tokens == turn_one // 16 * 16


def test_every_protocol_gives_the_same_greedy_answer(client, real_server):
    """Chat, Responses and Anthropic Messages render the same messages through the same
    template, so a greedy answer is the same tokens whichever SDK asks (no margin needed:
    the same computation, not a guess of the model's answer)."""
    from anthropic import Anthropic

    system, question = "You are a helpful assistant.", "Name the capital of France."
    chat = client.chat.completions.create(
        model="smollm2-135m", max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    responses = client.responses.create(model="smollm2-135m", instructions=system,
                                        input=question, max_output_tokens=24, temperature=0)
    with Anthropic(base_url=real_server.url, api_key="unused", max_retries=0) as a:
        message = a.messages.create(model="smollm2-135m", max_tokens=24, system=system,
                                    messages=[{"role": "user", "content": question}],
                                    extra_body={"temperature": 0})
    text = chat.choices[0].message.content
    assert "Paris" in text
    assert responses.output_text == text and message.content[0].text == text
    assert responses.usage.output_tokens == message.usage.output_tokens \
        == chat.usage.completion_tokens


def test_an_anthropic_prefill_is_continued(real_server):
    """The reply continues the final assistant text: after "1, 2, 3," the model's next tokens
    are " 4," by margins of 6.5 nats and more (top logprobs of the same prompt through
    /v1/completions: " " -0.003 against "  " -6.7, "4" -0.002 against "5" -6.5)."""
    import httpx

    r = httpx.post(f"{real_server.url}/v1/messages", timeout=60, json={
        "model": "smollm2-135m", "max_tokens": 4, "temperature": 0, "messages": [
            {"role": "user", "content": "Count from 1 to 10, separated by commas."},
            {"role": "assistant", "content": "1, 2, 3,"}]})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"].startswith(" 4,")


def test_real_model_embeddings_are_unit_vectors_of_its_width(client):
    r = client.embeddings.create(model="smollm2-135m", input=["Paris is in France.",
                                                              "Madrid is in Spain."])
    assert [len(d.embedding) for d in r.data] == [576, 576]  # SmolLM2-135M's hidden size
    assert all(abs(sum(x * x for x in d.embedding) - 1) < 1e-4 for d in r.data)


def test_a_predicted_reply_is_the_reply_without_it(client):
    """Predicted outputs on the real int4 model (the decode plan's path, several generated
    rows a step): a prediction that is the reply with a word changed (a client's edit of the
    last answer) gets that same reply, having kept most of the prediction's tokens."""
    kw = dict(model="smollm2-135m:int4", max_tokens=60, temperature=0, messages=[
        {"role": "user", "content": "Write the days of the week."}])
    plain = client.chat.completions.create(**kw).choices[0].message.content
    assert plain.count("Thursday") >= 2
    edited = plain.replace("Thursday", "Caturday", 1)
    predicted = client.chat.completions.create(
        prediction={"type": "content", "content": edited}, **kw)
    assert predicted.choices[0].message.content == plain
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 30 and details.rejected_prediction_tokens > 0
