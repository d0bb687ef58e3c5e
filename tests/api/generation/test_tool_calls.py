"""Tool calls: the output parser (exact, at every chunking), the prompt a template without
tools gets, and tools through the official client on the tiny model (n, seed, logprobs)."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from server.api.generation.messages import parse_messages
from server.api.generation.tool_calls import ToolCallParser, openai_deltas
from server.api.generation.tools import (
    hermes_system_prompt,
    parse_functions,
    parse_tools,
    tool_grammar,
    tool_messages,
)
from server.engine.grammar import GrammarCompiler, GrammarMasks, lark_grammar
from tests.api.conftest import API_KEY, MODEL
from tests.engine.test_grammar import allowed
from tests.helpers import CHAT_TEMPLATE, VOCAB_SIZE, make_tokenizer


def parse(pieces: list[str]):
    parser = ToolCallParser()
    content, deltas = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content, deltas = content + out.content, deltas + out.calls
    out = parser.finish()
    return content + out.content, [(c.name, c.arguments) for c in parser.calls], deltas


CASES = [
    # the grammar's shape: content before, one call
    ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}"}}'
     "\n</tool_call>", "Let me check.", [("get_weather", '{"city": "Pa\\"ris}"}')]),
    # SmolLM2's own shape: a list in one tag; then a second tag; trailing blanks dropped
    ('<tool_call>[{"name": "a", "arguments": {"x": [1, {"y": 2}]}}, {"name": "b", '
     '"arguments": {}}]</tool_call>\n<tool_call>{"name": "c", "arguments": {"z": "<"}}'
     "</tool_call>\n ", "", [("a", '{"x": [1, {"y": 2}]}'), ("b", "{}"), ("c", '{"z": "<"}')]),
    # keys in another order, "parameters": read whole at the closing tag
    ('<tool_call>{"parameters": {"x": 1}, "name": "a"}</tool_call> done', " done",
     [("a", '{"x": 1}')]),
    # not a call: the text stays content, untouched
    ("a <tool_call>not json</tool_call> b <tool_c", "a <tool_call>not json</tool_call> b "
     "<tool_c", []),
    # cut off by max_tokens before the name: no call, and no markup in the content
    ('Sure. <tool_call>\n{"name": "get_w', "Sure.", []),
    ("<tool_call>\n[", "", []),
    ("Sure.\n<tool_call>\n", "Sure.", []),
    # an unclosed tag that holds no JSON: the text as written
    ("a <tool_call>maybe", "a <tool_call>maybe", []),
    # cut off by max_tokens inside the arguments: the call so far
    ('<tool_call>\n{"name": "a", "arguments": {"x": 1, "y"', "", [("a", '{"x": 1, "y"')]),
    ("no calls at all  \n", "no calls at all  \n", []),
    # an unpaired surrogate the model escaped (no UTF-8 text holds it): it stays escaped
    ('<tool_call>{"name": "a", "arguments": {"x": "\\ud800"}}</tool_call>', "",
     [("a", '{"x": "\\ud800"}')]),
    ('<tool_call>{"parameters": {"x": "\\ud800\\u00e9"}, "name": "a"}</tool_call>', "",
     [("a", '{"x": "\\ud800\\u00e9"}')]),
    # nested past the JSON parser's depth: no call, the text stays
    ("<tool_call>" + "[" * 5000 + "</tool_call> x", "<tool_call>" + "[" * 5000 + "</tool_call> x",
     []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_chunking_gives_the_same_content_and_calls(text, content, calls):
    assert parse([text])[:2] == (content, calls)
    for cut in range(1, len(text)):  # every split in two
        assert parse([text[:cut], text[cut:]])[:2] == (content, calls), cut
    assert parse(list(text))[:2] == (content, calls)  # a character at a time


def test_streamed_pieces_give_the_name_first_then_the_arguments():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    parser = ToolCallParser()
    events = [e for ch in text for e in openai_deltas(parser.feed(ch).calls)]
    assert openai_deltas(parser.finish().calls) == []
    head, *rest = events
    assert head["function"] == {"name": "f", "arguments": ""} and head["index"] == 0
    assert head["id"].startswith("call_") and head["type"] == "function"
    assert [e["function"]["arguments"] for e in rest] == list('{"a": 1}')  # as they came
    # Fed at once, the call's pieces merge into one entry.
    assert [e["function"] for e in openai_deltas(ToolCallParser().feed(text).calls)] == \
        [{"name": "f", "arguments": '{"a": 1}'}]


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}}


def test_a_template_without_tools_gets_them_in_the_system_prompt_and_tool_turns():
    use = parse_tools([WEATHER], "auto", None)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]
    out, tools = tool_messages(messages, use, CHAT_TEMPLATE)
    spec = {"type": "function", "function": {"name": "get_weather", "description": "",
                                             "parameters": WEATHER["function"]["parameters"]}}
    assert tools is None  # the template cannot render them: they are in the system prompt
    assert out == [
        {"role": "system", "content": "Be brief.\n\n" + hermes_system_prompt([spec])},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                         '{"city": "Paris"}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>\n"
                                    "<tool_response>\nsunny\n</tool_response>"},
    ]
    # A template that knows tools gets them as they are.
    native = "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}" \
             "{{ m.tool_calls }}{% endfor %}"
    out, tools = tool_messages(messages, use, native)
    assert tools == [spec] and out[2]["tool_calls"][0]["function"]["arguments"] == \
        {"city": "Paris"}
    # arguments nested past the JSON parser's depth go to the template as the string they are
    messages[2]["tool_calls"][0]["function"]["arguments"] = "[" * 100_000
    out, _ = tool_messages(messages, use, native)
    assert out[2]["tool_calls"][0]["function"]["arguments"] == "[" * 100_000


def next_tokens(use, text: str) -> tuple[list[int], object]:
    """The tokens the tool grammar allows after `text`, and the tokenizer."""
    tokenizer = make_tokenizer()
    compiler = GrammarCompiler(tokenizer, VOCAB_SIZE, [tokenizer.eos_token_id])
    state = compiler.compile(lark_grammar(tool_grammar(use, None))).start()
    for token_id in tokenizer.encode(text):
        state.accept(token_id)
    return allowed(GrammarMasks(VOCAB_SIZE), state), tokenizer


@pytest.mark.parametrize("choice, parallel, more", [
    ("required", None, True), ("required", False, False),
    ({"type": "function", "function": {"name": "get_weather"}}, None, False)])
def test_a_named_tool_is_called_once_and_required_as_often_as_parallel_allows(choice, parallel,
                                                                              more):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    next_ids, tokenizer = next_tokens(parse_tools([WEATHER], choice, parallel), call)
    newline = tokenizer.convert_tokens_to_ids("\u010a")  # byte-level BPE's "\n"
    assert tokenizer.eos_token_id in next_ids
    assert (newline in next_ids) is more  # a second call may follow


def test_arguments_take_no_keys_their_schema_does_not_list():
    # No additionalProperties, as pydantic's and LangChain's tool schemas come: the arguments end
    # after the listed keys (a small model would otherwise write keys of its own).
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}
    next_ids, tokenizer = next_tokens(parse_tools([tool], "required", None),
                                     '<tool_call>\n{"name": "f", "arguments": {"x": 1')
    assert tokenizer.convert_tokens_to_ids("}") in next_ids
    assert tokenizer.convert_tokens_to_ids(",") not in next_ids


def test_each_tools_references_resolve_in_its_own_parameters():
    # Two tools whose parameters both define "Color" under $defs, pydantic's way.
    def tool(name, colors):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"color": {"$ref": "#/$defs/Color"},
                                             "more": {"$ref": "#"}},
            "required": ["color"], "$defs": {"Color": {"enum": colors}}}}}

    def firsts(text: str) -> set[str]:  # the first letters the grammar allows next
        next_ids, tokenizer = next_tokens(use, text)
        return {t[0] for t in tokenizer.convert_ids_to_tokens(next_ids)}

    use = parse_tools([tool("a", ["red"]), tool("b", ["blue"])], "required", None)
    assert firsts('<tool_call>\n{"name": "a", "arguments": {"color": "') == {"r"}
    assert firsts('<tool_call>\n{"name": "b", "arguments": {"color": "') == {"b"}
    # "#" is the parameters' own root: "more" holds another arguments object of tool b
    assert firsts('<tool_call>\n{"name": "b", "arguments": {"color": "blue", "more": '
                  '{"color": "') == {"b"}
    # parameters with an $id are a resource of their own: their references resolve within it
    own = tool("c", ["green"])
    own["function"]["parameters"]["$id"] = "https://example.com/c.json"
    use = parse_tools([tool("a", ["red"]), own], "required", None)
    assert firsts('<tool_call>\n{"name": "c", "arguments": {"color": "') == {"g"}


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_with_n_seed_and_logprobs(client, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
              tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, n=2,
              seed=5, temperature=1.0, max_tokens=120, logprobs=True)
    whole = client.chat.completions.create(**kw)
    if stream:
        calls: dict[tuple[int, int], list[str]] = {}
        finish = {}
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                assert not c.delta.content
                for d in c.delta.tool_calls or []:
                    entry = calls.setdefault((c.index, d.index), ["", ""])
                    entry[0] += d.function.name or ""
                    entry[1] += d.function.arguments or ""
                finish[c.index] = c.finish_reason or finish.get(c.index)
        assert finish == {0: "tool_calls", 1: "tool_calls"}
        assert {k: tuple(v) for k, v in calls.items()} == {
            (c.index, 0): (c.message.tool_calls[0].function.name,
                           c.message.tool_calls[0].function.arguments) for c in whole.choices}
        return
    assert len(whole.choices) == 2
    for c in whole.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        [call] = c.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])
        assert c.logprobs.content  # one entry per token, the call's tokens included


def test_deprecated_function_messages_become_tool_turns():
    # An assistant's `function_call` is a call; the `function` message after it, its result.
    messages = parse_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": "21 C"},
        {"role": "function", "name": "get_weather", "content": None},  # content may be null
    ])
    assert messages[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert messages[2] == {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}
    assert messages[3] == {"role": "tool", "content": "", "tool_call_id": "call_1"}
    # `functions` are the same tools, one call at most, answered as `function_call`
    use = parse_functions([WEATHER["function"]], None)
    assert use == replace(parse_tools([WEATHER], "auto", False), legacy=True)
    assert parse_functions([WEATHER["function"]], {"name": "get_weather"}) == replace(
        parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, False),
        legacy=True)
    out, _ = tool_messages(messages, use, CHAT_TEMPLATE)
    assert out[2:] == [
        {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                         '{"city": "Paris"}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>\n"
                                    "<tool_response>\n\n</tool_response>"}]


@pytest.mark.parametrize("stream", [False, True])
def test_deprecated_functions_through_the_official_client(client, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
              functions=[WEATHER["function"]], function_call={"name": "get_weather"}, n=2,
              seed=5, temperature=1.0, max_tokens=120)
    whole = client.chat.completions.create(**kw)
    for c in whole.choices:
        assert c.finish_reason == "function_call" and c.message.content is None
        assert c.message.tool_calls is None and c.message.function_call.name == "get_weather"
        jsonschema.validate(json.loads(c.message.function_call.arguments),
                            WEATHER["function"]["parameters"])
    if not stream:
        return
    calls: dict[int, list[str]] = {0: ["", ""], 1: ["", ""]}
    finish = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content and not c.delta.tool_calls
            if c.delta.function_call is not None:
                calls[c.index][0] += c.delta.function_call.name or ""
                calls[c.index][1] += c.delta.function_call.arguments or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert finish == {0: "function_call", 1: "function_call"}
    assert {i: tuple(v) for i, v in calls.items()} == {
        c.index: (c.message.function_call.name, c.message.function_call.arguments)
        for c in whole.choices}


def test_langchain_functions_and_function_messages(server):
    # LangChain's function-calling chains: `functions` bound, the call read back from
    # `function_call`, and a FunctionMessage with the result sent in the next turn.
    from langchain_core.messages import FunctionMessage, HumanMessage
    from langchain_core.output_parsers.openai_functions import JsonOutputFunctionsParser
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY,
                     temperature=0, max_tokens=120, max_retries=0)
    forced = llm.bind(functions=[WEATHER["function"]], function_call={"name": "get_weather"})
    arguments = (forced | JsonOutputFunctionsParser()).invoke("Weather in Paris?")
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    message = forced.invoke("Weather in Paris?")
    assert message.additional_kwargs["function_call"]["name"] == "get_weather"
    answer = llm.bind(functions=[WEATHER["function"]], max_tokens=8).invoke(
        [HumanMessage("Weather in Paris?"), message,
         FunctionMessage(name="get_weather", content="21 C")])
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "function_call")
