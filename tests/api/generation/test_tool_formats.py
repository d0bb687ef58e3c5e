"""Each family's tool-call format (tool_formats.py): its parser at every chunking, the format
found in the family's real chat template (llama.cpp keeps them in models/templates), past calls
and results rendered as transformers renders them, and a tiny model served behind each template
calling a tool under tool_choice required through the official client, streamed and whole."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from server.api.generation.harmony import HarmonyParser
from server.api.generation.tool_calls import ToolCallParser
from server.api.generation.tool_formats import FORMATS, detect
from server.api.generation.tools import parse_tools, tool_grammar, tool_messages
from server.api.generation.xml_calls import XmlCallParser
from tests.api.server import ServerProcess
from tests.helpers import QWEN3_ADDED, hf_model, make_tokenizer, pull_into

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"]}  # bounded: a random model's call ends
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                            "parameters": CITY}}
# format -> (its real template, the markup that is special in its tokenizer, or its own text)
CASES = {
    "hermes": ("Qwen-Qwen3-0.6B", dict(added=QWEN3_ADDED)),
    "llama3": ("meta-llama-Llama-3.2-3B-Instruct", dict(special=("<|python_tag|>",))),
    "mistral": ("mistralai-Mistral-Nemo-Instruct-2407", dict(special=("[TOOL_CALLS]",))),
    "granite": ("ibm-granite-granite-3.3-2B-Instruct", dict(special=("<|tool_call|>",))),
    "mistral-args": ("unsloth-mistral-Devstral-Small-2507",
                     dict(special=("[TOOL_CALLS]", "[ARGS]"))),
    "mistral-call-id": ("Mistral-Small-3.2-24B-Instruct-2506",
                        dict(special=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"))),
    "qwen3-coder": ("Qwen3-Coder", dict(added=QWEN3_ADDED)),
    "phi4": (None, dict(special=("<|tool_call|>", "<|/tool_call|>"))),  # PHI4_MINI below
    "harmony": ("openai-gpt-oss-120b", dict(special=(
        "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
        "<|call|>"))),
}
# Phi-4-mini-instruct's chat template (its tokenizer_config.json; llama.cpp keeps none): the
# tool list is the system message's `tools`, a JSON string
PHI4_MINI = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + "
    "'<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + "
    "message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")
SCHEMAS = {"get_weather": CITY, "add": {"type": "object", "properties": {
    "a": {"type": "integer"}, "note": {"type": "string"}, "tags": {"type": "array"}}}}
XML = ("<tool_call>\n<function=add>\n<parameter=a>\n42\n</parameter>\n<parameter=note>\n12, "
       "<b>not</b> a number\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n</function>"
       "\n</tool_call>")
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


def parse(fmt, pieces: list[str]):
    f = FORMATS[fmt]
    if f.harmony:
        return parse_harmony(pieces)[1:]
    parser = XmlCallParser(f, SCHEMAS) if f.xml else ToolCallParser(f)
    content, calls = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content, calls = content + out.content, calls + out.calls
    out = parser.finish()
    whole = [(c.name, json.loads(c.arguments)) for c in parser.calls]
    return content + out.content, whole, parser.calls


TWO = [CALL, {"name": "f", "arguments": {}}]


@pytest.mark.parametrize("fmt,text,content,calls", [
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama3", ' \n{"name": "f", "parameters": {}}', "", [("f", {})]),
    ("llama3", "It is sunny {really}.", "It is sunny {really}.", []),
    ("mistral", "[TOOL_CALLS]" + json.dumps(TWO), "",
     [("get_weather", {"city": "Paris"}), ("f", {})]),
    ("mistral", "Sure.[TOOL_CALLS]" + json.dumps([CALL]), "Sure.",
     [("get_weather", {"city": "Paris"})]),
    ("mistral", "No call [TOOL_CALLS here.", "No call [TOOL_CALLS here.", []),
    ("granite", "<|tool_call|>" + json.dumps(TWO), "",
     [("get_weather", {"city": "Paris"}), ("f", {})]),
    ("phi4", "<|tool_call|>" + json.dumps([CALL]) + "<|/tool_call|>", "",
     [("get_weather", {"city": "Paris"})]),
    ("hermes", "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>", "",
     [("get_weather", {"city": "Paris"})]),
    ("mistral-args", 'Ok.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}',
     "Ok.", [("get_weather", {"city": "Paris"}), ("f", {})]),
    ("mistral-call-id", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Rome"}', "",
     [("get_weather", {"city": "Rome"})]),
    ("mistral-args", "[TOOL_CALLS]get_wea", "", []),  # cut before its arguments: no call
    ("qwen3-coder", "Let me add.\n" + XML, "Let me add.",
     [("add", {"a": 42, "note": "12, <b>not</b> a number", "tags": ["x"]})]),
    ("qwen3-coder", "<tool_call>\n<function=f>\n</function>\n</tool_call>", "", [("f", {})]),
])
def test_every_format_parses_alike_at_every_chunking(fmt, text, content, calls):
    assert parse(fmt, [text])[:2] == (content, calls)
    for i in range(1, len(text)):
        assert parse(fmt, [text[:i], text[i:]])[:2] == (content, calls), i
    assert parse(fmt, list(text))[:2] == (content, calls)


def parse_harmony(pieces: list[str]):
    """(reasoning, content, calls, the parser's calls) of gpt-oss's text fed in pieces."""
    parser = HarmonyParser(FORMATS["harmony"])
    thought, content = "", ""
    for piece in [*pieces, None]:
        r, out = parser.feed(piece) if piece is not None else parser.finish()
        thought, content = thought + r, content + out.content
    return thought, content, [(c.name, json.loads(c.arguments)) for c in parser.calls], \
        parser.calls


HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city": "Paris"}')


@pytest.mark.parametrize("text,expected", [
    ("<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Four.", ("Two and two.", "Four.", [])),
    (HARMONY_CALL, ("Need the weather.", "", [("get_weather", {"city": "Paris"})])),
    ("<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}",
     ("", "", [("f", {})])),  # the recipient before the channel, as the template writes it
    ("<|channel|>analysis<|message|>Cut off wh", ("Cut off wh", "", [])),
    ("Plain text, no channels.", ("", "Plain text, no channels.", [])),
])
def test_harmony_channels_split_alike_at_every_chunking(text, expected):
    assert parse_harmony([text])[:3] == expected
    for i in range(1, len(text)):
        assert parse_harmony([text[:i], text[i:]])[:3] == expected, i
    assert parse_harmony(list(text))[:3] == expected


def test_mistral_call_ids_are_nine_letters_and_digits():
    _, _, calls = parse("mistral", ["[TOOL_CALLS]" + json.dumps(TWO)])
    assert all(re.fullmatch("[a-zA-Z0-9]{9}", c.id) for c in calls)
    _, _, calls = parse("mistral-call-id", ['[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{}'])
    assert [c.id for c in calls] == ["a1b2c3d4e"]  # the model's own
    fmt = FORMATS["mistral"]
    assert fmt.template_id("call_abc") == fmt.template_id("call_abc") != "call_abc"
    assert fmt.template_id("a1b2c3d4e") == "a1b2c3d4e"


def template(real_template, fmt: str) -> str:
    stem = CASES[fmt][0]
    return real_template(stem) if stem else PHI4_MINI


@pytest.mark.parametrize("fmt", CASES)
def test_the_format_is_the_templates(real_template, fmt):
    assert detect(template(real_template, fmt)).name == fmt


@pytest.mark.parametrize("stem,fmt", [
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3"), ("meta-llama-Llama-3.3-70B-Instruct", "llama3"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "hermes"),
    ("Qwen-Qwen2.5-7B-Instruct", "hermes"), ("HuggingFaceTB-SmolLM3-3B", "hermes"),
    ("Qwen3.5-4B", "qwen3-coder"), ("ibm-granite-granite-4.0", "hermes"),
    ("mistralai-Ministral-3-14B-Reasoning-2512", "mistral-args"),
])
def test_more_families_formats(real_template, stem, fmt):
    assert detect(real_template(stem)).name == fmt


def history(call_id: str) -> list[dict]:
    """A turn that called the tool and got its result, as the client sends it back."""
    return [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 21 C."}]


@pytest.mark.parametrize("fmt", CASES)
def test_a_call_and_its_result_render_as_transformers_renders_them(real_template, fmt,
                                                                   tmp_path):
    """Our rendering of a past call and its result (through the family's template, or written
    into the content as the family writes calls where the template does not) against
    transformers' of the same turn as its documentation writes it."""
    from transformers import AutoTokenizer

    from server.models.tokenizer import Tokenizer

    tok = make_tokenizer(**CASES[fmt][1])
    tok.chat_template = template(real_template, fmt)
    tok.save_pretrained(tmp_path)
    ours = Tokenizer(tmp_path)
    f = FORMATS[fmt]
    call_id = "a1b2c3d4e"  # nine letters and digits: every family takes it as it is
    use = parse_tools([WEATHER], "auto", None)
    messages, tools = tool_messages(history(call_id), use, ours.chat_template, f)
    got = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                   enable_thinking=True)
    hf_call = {"id": call_id, "type": "function",
               "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turn = {"role": "assistant", "content": "", "tool_calls": [hf_call]}
    if "tool_calls" not in ours.chat_template:  # Granite 3: the call as the model writes it
        turn = {"role": "assistant", "content": f.call_text(history(call_id)[1]["tool_calls"])}
    hf = [history(call_id)[0], turn, {"role": "tool", "tool_call_id": call_id,
                                      "content": "Sunny, 21 C."}]
    if fmt == "phi4":  # as its model card writes it: the functions in the system message
        hf = [{"role": "system", "content": "", "tools": json.dumps([WEATHER["function"]])},
              *hf]
    want = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        hf, tools=[WEATHER], add_generation_prompt=True, tokenize=False, enable_thinking=True)
    assert got == want
    assert "Sunny, 21 C." in got and "Paris" in got


@pytest.fixture(scope="module", params=list(CASES))
def family(request, real_template, tmp_path_factory):
    fmt = request.param
    root = tmp_path_factory.mktemp(fmt)
    tok = make_tokenizer(**CASES[fmt][1])
    tok.chat_template = template(real_template, fmt)
    folder = root / f"tiny-{fmt}"
    hf_model("qwen3", seed=7, vocab_size=len(tok) + 3,
             max_position_embeddings=8192).save_pretrained(folder)
    tok.save_pretrained(folder)
    pull_into(root / "home", folder)
    proc = ServerProcess(root / "home", [f"tiny-{fmt}:bf16", "--kv-cache-mb", "32"],
                         root / "server.log").start()
    proc.fmt = fmt
    yield proc
    proc.stop()


def test_required_calls_in_the_familys_format(family):
    """tool_choice required: a call whose arguments validate, streamed as it is whole; then the
    call and its result go back through the family's template and the model answers."""
    from openai import OpenAI

    model = f"tiny-{family.fmt}:bf16"
    body = dict(model=model, messages=history("x")[:1], tools=[WEATHER],
                tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                temperature=0, extra_body={"max_reasoning_tokens": 4})  # Qwen3 thinks first
    with OpenAI(base_url=f"{family.url}/v1", api_key="x", max_retries=0, timeout=60) as c:
        whole = c.chat.completions.create(**body)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
        call = message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), CITY)
        if family.fmt.startswith("mistral"):
            assert re.fullmatch("[a-zA-Z0-9]{9}", call.id)
        streamed: dict[int, list] = {}
        for chunk in c.chat.completions.create(**body, stream=True):
            assert not chunk.choices or not chunk.choices[0].delta.content  # no markup as text
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = streamed.setdefault(d.index, [None, ""])
                entry[0] = entry[0] or d.function.name
                entry[1] += d.function.arguments or ""
        assert [(n, json.loads(a)) for n, a in streamed.values()] == [
            (t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls]
        turn = [*history(call.id)[:1], message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."}]
        answer = c.chat.completions.create(model=model, messages=turn, tools=[WEATHER],
                                           max_tokens=3, temperature=0)
        assert answer.usage.prompt_tokens > whole.usage.prompt_tokens


def test_the_xml_grammar_takes_raw_strings_and_json_values():
    """Qwen3-Coder's grammar: a string parameter is text up to its closing tag, any other is
    its schema's JSON; the markup is the template's, <tool_call> its own token."""
    import llguidance

    from server.engine.grammar import lark_grammar

    tok = make_tokenizer(added=QWEN3_ADDED)
    llt = llguidance.LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=len(tok),
                                 eos_token=[tok.eos_token_id])
    atoms = {t: f"<[{tok.convert_tokens_to_ids(t)}]>" for t in ("<tool_call>", "</tool_call>")}
    use = parse_tools([{"type": "function", "function": {"name": "add", "parameters":
                                                         SCHEMAS["add"]}}], "required", False)
    grammar = lark_grammar(tool_grammar(use, None, FORMATS["qwen3-coder"], atoms))

    def fits(text: str) -> bool:
        m = llguidance.LLMatcher(llt, grammar, log_level=0)
        for t in tok.encode(text, add_special_tokens=False):
            m.consume_token(t)
            if m.is_error():
                return False
        return m.is_accepting()
    assert fits(XML)
    assert fits(XML.replace("<parameter=a>\n42\n</parameter>\n", ""))  # a is optional
    assert not fits(XML.replace("\n42\n", "\nforty\n"))  # an integer's JSON
    assert not fits(XML.replace("function=add", "function=sub"))


def test_a_schema_answer_in_every_family(family):
    """response_format: the answer validates, without markup (gpt-oss's on its final channel,
    after its analysis)."""
    from openai import OpenAI

    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": CITY}}
    with OpenAI(base_url=f"{family.url}/v1", api_key="x", max_retries=0, timeout=60) as c:
        got = c.chat.completions.create(
            model=f"tiny-{family.fmt}:bf16", messages=history("x")[:1], response_format=fmt,
            max_tokens=60, temperature=0, extra_body={"max_reasoning_tokens": 4})
    jsonschema.validate(json.loads(got.choices[0].message.content), CITY)
    assert got.choices[0].finish_reason == "stop"
