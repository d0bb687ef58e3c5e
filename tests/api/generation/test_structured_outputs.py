"""Structured outputs and tool calls end to end: the official openai client and LangChain
against `localserve serve` on the real smollm2-135m.

Every schema bounds its output (strings with maxLength, arrays with maxItems, integers with
bounds, no free numbers), and the grammar allows no whitespace, so every answer ends within
max_tokens whatever the model samples: the tests check validity, never what the model chose.
"""

from __future__ import annotations

import asyncio
import json
from enum import StrEnum
from typing import Annotated

import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m"


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: int = Field(ge=0, le=99999)


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    favorite: Color
    address: Address
    tags: list[Annotated[str, Field(max_length=12)]] = Field(min_length=1, max_length=3)


# Its longest answer: ~60 characters of keys and punctuation, 20 + 20 + 3 * 12 of strings,
# 3 + 5 digits: under 200 characters, so under 200 tokens whatever the model picks.
MAX_TOKENS = 256
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
        "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(real_server):
    from openai import OpenAI

    with OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0,
                timeout=120) as c:
        yield c


def person_schema() -> dict:
    from openai.lib._pydantic import to_strict_json_schema

    return to_strict_json_schema(Person)


def test_parse_returns_a_parsed_pydantic_instance(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=Person, max_tokens=MAX_TOKENS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    jsonschema.validate(json.loads(choice.message.content), person_schema())


def test_sixteen_concurrent_schema_requests_at_temperature_one_all_validate(real_server):
    from openai import AsyncOpenAI

    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": person_schema(), "strict": True}}

    async def run():
        async with AsyncOpenAI(base_url=f"{real_server.url}/v1", api_key="unused",
                               max_retries=0, timeout=300) as c:
            return await asyncio.gather(*[c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Person number {i}."}],
                response_format=fmt, temperature=1.0, max_tokens=MAX_TOKENS)
                for i in range(16)])

    for r in asyncio.run(run()):
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), person_schema())


def test_json_object_is_an_object(client):
    r = client.chat.completions.create(
        model=MODEL, response_format={"type": "json_object"}, temperature=0, max_tokens=400,
        messages=[{"role": "user", "content": 'Return a JSON object with a key "capital" for '
                   "France."}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert r.choices[0].finish_reason == "stop"


def test_streamed_schema_answer_equals_the_whole_one(client):
    kw = dict(model=MODEL, temperature=0, max_tokens=MAX_TOKENS,
              messages=[{"role": "user", "content": "Describe a person as JSON."}],
              response_format={"type": "json_schema", "json_schema": {
                  "name": "person", "schema": person_schema(), "strict": True}})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    pieces = [c.choices[0].delta.content or "" for c in
              client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(pieces) == whole


def test_max_tokens_cutting_the_json_finishes_with_length(client):
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=5, messages=ASK,
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": person_schema()}})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_tool_choice_calls_with_valid_arguments(client, choice):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[ADD, WEATHER],
                                       tool_choice=choice, temperature=0, max_tokens=200,
                                       parallel_tool_calls=False)
    choice_ = r.choices[0]
    assert choice_.finish_reason == "tool_calls"
    [call] = choice_.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    tool = {"add": ADD, "get_weather": WEATHER}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("strict", [True, False])
def test_a_tool_whose_parameters_refer_to_their_own_defs(client, strict):
    # pydantic puts nested models and enums under $defs and refers to them from the
    # parameters' root ("#/$defs/Address"); openai.pydantic_function_tool closes every object,
    # a plain model_json_schema() does not (its objects take no other keys here all the same).
    import openai

    tool = openai.pydantic_function_tool(Person) if strict else {"type": "function", "function": {
        "name": "Person", "parameters": Person.model_json_schema()}}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person."}], tools=[tool],
        tool_choice={"type": "function", "function": {"name": "Person"}}, temperature=0,
        max_tokens=MAX_TOKENS)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert Person.model_validate(arguments)
    assert set(arguments) == set(Person.model_fields)  # no key of the model's own


def test_streamed_tool_call_reassembles_into_the_whole_one(client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
              temperature=0, max_tokens=200)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type != "chunk" or not event.chunk.choices:
                continue
            c = event.chunk.choices[0]
            assert c.delta.content is None  # never raw <tool_call> text, nor "": calls only
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": d.id})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
        final = stream.get_final_completion().choices[0].message
    assert finish == "tool_calls"
    expected = [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == expected
    assert [(t.function.name, t.function.arguments) for t in final.tool_calls] == expected
    assert final.content is None and whole.message.content is None


def test_tool_choice_none_answers_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       tool_choice="none", temperature=0, max_tokens=30)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content


def test_a_tool_result_round_trips(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           tool_choice="required", temperature=0,
                                           max_tokens=200, parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id,
                      "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                       temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "tool_calls", "length")
    # The prompt held the first prompt, the call as the model wrote it, and the result.
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16


def test_langchain_bind_tools_and_with_structured_output(real_server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Annotated[str, Field(max_length=30)]) -> str:
        """The current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(model=MODEL, base_url=f"{real_server.url}/v1", api_key="unused",
                     temperature=0, max_tokens=MAX_TOKENS, max_retries=0)
    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What is the weather in Paris?")
    [call] = message.tool_calls[:1]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    person = llm.with_structured_output(Person).invoke("Describe a person.")
    assert isinstance(person, Person)
