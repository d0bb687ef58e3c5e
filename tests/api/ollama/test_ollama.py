"""Ollama's native API through the official `ollama` Python client against the shared server:
the same answers as the OpenAI endpoints give, streamed as whole, a schema, tools, generate,
the store, what is loaded, and Ollama's errors."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.api.conftest import API_KEY, MODEL

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Tell me a long story."}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def ollama_client(server):
    import ollama

    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"})


def test_chat_answers_as_chat_completions_do(ollama_client, client):
    want = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                          max_tokens=8)
    got = ollama_client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    assert got.message.role == "assistant"
    assert got.message.content == want.choices[0].message.content
    assert (got.done, got.done_reason, got.eval_count) == (
        True, want.choices[0].finish_reason, want.usage.completion_tokens)
    assert got.prompt_eval_count == want.usage.prompt_tokens and got.total_duration > 0
    chunks = list(ollama_client.chat(model=MODEL, messages=MESSAGES, options=GREEDY,
                                     stream=True))
    assert "".join(c.message.content for c in chunks) == got.message.content
    assert [c.done for c in chunks].count(True) == 1 and chunks[-1].done


def test_a_schema_format_and_tools(ollama_client):
    schema = {"type": "object", "properties": {"mood": {"enum": ["calm", "rough"]}},
              "required": ["mood"]}
    got = ollama_client.chat(model=MODEL, messages=MESSAGES, format=schema,
                             options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(got.message.content), schema)

    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city
        """
        return "Sunny."
    answer = ollama_client.chat(model=MODEL, messages=MESSAGES, tools=[get_weather],
                                options={"temperature": 0, "num_predict": 60})
    for call in answer.message.tool_calls or []:  # the model decides; a call is whole
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    assert answer.done


def test_generate_list_ps_show(ollama_client, client):
    want = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "Once upon a time"}], temperature=0, max_tokens=6)
    got = ollama_client.generate(model=MODEL, prompt="Once upon a time",
                                 options={"temperature": 0, "num_predict": 6})
    assert got.response == want.choices[0].message.content and got.done
    streamed = "".join(c.response for c in ollama_client.generate(
        model=MODEL, prompt="Once upon a time", options={"temperature": 0, "num_predict": 6},
        stream=True))
    assert streamed == got.response
    assert ollama_client.generate(model=MODEL, prompt="").done_reason == "load"
    assert MODEL in [m.model for m in ollama_client.list().models]
    assert [m.model for m in ollama_client.ps().models] == [MODEL]
    shown = ollama_client.show(MODEL)
    assert "completion" in shown.capabilities and shown.details.format == "safetensors"


def test_errors_are_ollamas(ollama_client, server):
    import httpx
    import ollama

    with pytest.raises(ollama.ResponseError) as e:
        ollama_client.chat(model="no-such-model", messages=MESSAGES)
    assert e.value.status_code == 404
    bad = httpx.post(f"{server.url}/api/chat", json={"model": MODEL, "messages": MESSAGES,
                                                     "options": {"top_k": "many"}},
                     headers={"Authorization": f"Bearer {API_KEY}"})
    assert bad.status_code == 400 and bad.json() == {"error": "options.top_k: expected a number"}
    assert httpx.get(f"{server.url}/api/tags").status_code == 401  # the key, as /v1's


def test_embed_gives_the_vectors_v1_embeddings_gives(ollama_client, client):
    want = client.embeddings.create(model=MODEL, input=["the sea", "a story"],
                                    encoding_format="float")
    got = ollama_client.embed(model=MODEL, input=["the sea", "a story"])
    assert got.embeddings == [d.embedding for d in want.data]
    assert got.prompt_eval_count == want.usage.prompt_tokens
    assert ollama_client.embeddings(model=MODEL, prompt="the sea").embedding == \
        want.data[0].embedding
