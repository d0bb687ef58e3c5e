"""A thinking model served: a tiny random-weight Qwen3 with Qwen3's real chat template (llama.cpp
keeps it in models/templates) and its <think> tokens of its own. A JSON schema's grammar makes
it open the block and then answer; where its own closing tag is biased out, the budget closes
every block after exactly its tokens. So what is split, counted and answered does not depend
on what the random model prefers; where a protocol cannot bias, the protocols are compared
with chat's greedy answer to the same prompt."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest

from tests.api.batch.test_batches import read_lines, submit, wait
from tests.api.ops.test_dashboard import NEEDS_CHROMIUM
from tests.api.server import ServerProcess
from tests.helpers import QWEN3_ADDED, hf_model, make_tokenizer, pull_into

MODEL = "qwen3-thinking:bf16"
BUDGET = 6  # the server's --max-reasoning-tokens
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}},
          "required": ["answer"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "Is 2 + 2 four?"}]


def serve_thinker(template: str, root) -> ServerProcess:
    """The tiny Qwen3 with a real template (a file of llama.cpp's models/templates)."""
    tok = make_tokenizer(added=QWEN3_ADDED)
    tok.chat_template = template
    folder = root / "qwen3-thinking"
    hf_model("qwen3", seed=5, max_position_embeddings=4096).save_pretrained(folder)
    tok.save_pretrained(folder)
    pull_into(root / "home", folder)
    proc = ServerProcess(root / "home", [MODEL, "--kv-cache-mb", "32", "--max-reasoning-tokens",
                                         str(BUDGET)], root / "server.log").start()
    proc.end_id = tok.convert_tokens_to_ids("</think>")
    return proc


@pytest.fixture(scope="module")
def thinker(real_template, tmp_path_factory):
    proc = serve_thinker(real_template("Qwen-Qwen3-0.6B"), tmp_path_factory.mktemp("qwen3"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def opener(real_template, tmp_path_factory):
    """The same model behind DeepSeek-R1's template, whose generation prompt opens the block."""
    template = real_template("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B")
    proc = serve_thinker(template, tmp_path_factory.mktemp("r1"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(thinker):
    from openai import OpenAI

    with OpenAI(base_url=f"{thinker.url}/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def chat(client, thinker, biased: bool = True, **kw):
    bias = {str(thinker.end_id): -100} if biased else {}
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40,
                                          temperature=0, response_format=FORMAT,
                                          logit_bias=bias, **kw)


def budget_spent(num_reasoning: int, expected: int) -> bool:
    """The block closed when its budget was spent: `expected` tokens (tags included), or up to
    three more where the grammar let the model finish a character whose bytes span tokens
    (a UTF-8 character is at most four bytes) before the closing tag."""
    return expected <= num_reasoning <= expected + 3


def extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


def test_reasoning_is_split_off_whole_and_streamed_alike(client, thinker):
    whole = chat(client, thinker)
    message = whole.choices[0].message
    reasoning = extra(message, "reasoning_content")
    assert reasoning and extra(message, "reasoning") == reasoning
    for tag in ("<think>", "</think>"):
        assert tag not in message.content and tag not in reasoning
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert whole.choices[0].finish_reason == "stop"
    # the opening tag, BUDGET tokens, then the closing tag the engine wrote
    assert budget_spent(whole.usage.completion_tokens_details.reasoning_tokens, BUDGET + 2)

    stream = chat(client, thinker, stream=True, stream_options={"include_usage": True})
    thought, content, names = "", "", set()
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += extra(delta, "reasoning_content") or ""
            names |= {n for n in ("reasoning", "reasoning_content") if extra(delta, n)}
            content += delta.content or ""
        else:
            usage = chunk.usage
    assert (thought, content) == (reasoning, message.content)
    assert names == {"reasoning", "reasoning_content"}
    assert usage.completion_tokens_details == whole.usage.completion_tokens_details
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_request_sets_its_own_budget(client, thinker):
    got = chat(client, thinker, extra_body={"max_reasoning_tokens": 2})
    assert budget_spent(got.usage.completion_tokens_details.reasoning_tokens, 2 + 2)
    jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("off", [{"reasoning_effort": "none"},
                                 {"extra_body": {"chat_template_kwargs":
                                                 {"enable_thinking": False}}},
                                 {"extra_body": {"think": False}}])
def test_thinking_off_gives_no_reasoning(client, thinker, off):
    got = chat(client, thinker, **off)
    message = got.choices[0].message
    assert extra(message, "reasoning_content") is None and extra(message, "reasoning") is None
    assert got.usage.completion_tokens_details.reasoning_tokens == 0
    jsonschema.validate(json.loads(message.content), SCHEMA)


def test_reasoning_sent_back_reaches_the_template(client, thinker):
    """Qwen3's template shows the last turn's reasoning again: a different one sent back is a
    different prompt."""
    def prompt_tokens(reasoning: dict) -> int:
        turn = [*MESSAGES, {"role": "assistant", "content": "Yes.", **reasoning},
                {"role": "tool", "tool_call_id": "c", "content": "ok"}]
        return client.chat.completions.create(model=MODEL, messages=turn, max_tokens=1
                                              ).usage.prompt_tokens
    plain = prompt_tokens({})
    assert prompt_tokens({"reasoning_content": "Two and two make four."}) > plain
    assert prompt_tokens({"reasoning": "Two and two make four."}) > plain
    bad = httpx.post(f"{thinker.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [*MESSAGES, {"role": "assistant", "content": "Yes.",
                                                 "reasoning": "a", "reasoning_content": "b"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[1].reasoning"


def test_responses_give_a_reasoning_item(client, thinker):
    want = chat(client, thinker, biased=False)
    thought = extra(want.choices[0].message, "reasoning_content") or ""
    fmt = {"type": "json_schema", "name": "reply", "schema": SCHEMA}
    got = client.responses.create(model=MODEL, input=MESSAGES[0]["content"], temperature=0,
                                  max_output_tokens=40, text={"format": fmt},
                                  reasoning={"effort": "high"})
    kinds = [item.type for item in got.output]
    assert kinds == (["reasoning", "message"] if thought else ["message"])
    if thought:
        assert got.output[0].content[0].text == thought and got.output[0].summary == []
    assert got.output_text == want.choices[0].message.content
    assert (got.usage.output_tokens_details.reasoning_tokens
            == want.usage.completion_tokens_details.reasoning_tokens >= 2)
    events = list(client.responses.create(model=MODEL, input=MESSAGES[0]["content"],
                                          temperature=0, max_output_tokens=40,
                                          text={"format": fmt}, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thought
    assert events[-1].response.output[0].model_dump() == got.output[0].model_dump() | {
        "id": events[-1].response.output[0].id}
    off = client.responses.create(model=MODEL, input="Hi", max_output_tokens=8,
                                  reasoning={"effort": "none"}, text={"format": fmt})
    assert [item.type for item in off.output] == ["message"]


def test_anthropic_thinking_blocks_are_signed(client, thinker):
    import anthropic

    want = extra(chat(client, thinker, biased=False).choices[0].message,
                 "reasoning_content") or ""
    c = anthropic.Anthropic(base_url=thinker.url, api_key="x", max_retries=0)
    body = dict(model=MODEL, max_tokens=40, messages=MESSAGES, extra_body={
        "temperature": 0, "output_config": {"format": {"type": "json_schema",
                                                       "schema": SCHEMA}}})
    got = c.messages.create(**body)
    assert [b.type for b in got.content] == (["thinking", "text"] if want else ["text"])
    jsonschema.validate(json.loads(got.content[-1].text), SCHEMA)
    if want:
        block = got.content[0]
        assert block.thinking == want and block.signature
        streamed = c.messages.create(**body, stream=True)
        events = list(streamed)
        text = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")
        signatures = [e.delta.signature for e in events if e.type == "content_block_delta"
                      and e.delta.type == "signature_delta"]
        assert text == want and signatures == [block.signature]
        # Sent back, a block reaches Qwen3's template (which shows the reasoning of the turns
        # after the last question) if it is ours, unchanged; a forged one is dropped.
        def prompt(blocks: list[dict]) -> int:
            turn = [*MESSAGES, {"role": "assistant", "content": [*blocks, {
                "type": "text", "text": got.content[-1].text}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                              "content": "ok"}]}]
            return c.messages.count_tokens(model=MODEL, messages=turn).input_tokens
        plain = prompt([])
        assert prompt([block.model_dump()]) > plain
        assert prompt([dict(block.model_dump(), thinking="Not mine.")]) == plain
    off = c.messages.create(**body | {"thinking": {"type": "disabled"}})
    assert [b.type for b in off.content] == ["text"]


def test_a_batch_line_gets_the_same_split(client, thinker):
    want = chat(client, thinker)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0,
            "response_format": FORMAT, "logit_bias": {str(thinker.end_id): -100}}
    batch = submit(client, [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                             "body": body}])
    done = wait(client, batch.id)
    line = read_lines(client, done.output_file_id)[0]["response"]["body"]
    message = line["choices"][0]["message"]
    assert message["reasoning_content"] == extra(want.choices[0].message, "reasoning_content")
    assert message["content"] == want.choices[0].message.content
    assert line["usage"]["completion_tokens_details"]["reasoning_tokens"] == \
        want.usage.completion_tokens_details.reasoning_tokens


@NEEDS_CHROMIUM
def test_the_playground_folds_the_reasoning_above_the_answer(opener):
    from openai import OpenAI
    from playwright.sync_api import sync_playwright

    from tests.api.ops.test_dashboard import CHROMIUM, FLAGS, SYSTEM, Page

    question = "Think it over: is 2 + 2 four?"
    with OpenAI(base_url=f"{opener.url}/v1", api_key="x", max_retries=0) as c:
        want = c.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    reasoning = extra(want.choices[0].message, "reasoning_content")
    assert reasoning  # the prompt opened the block: the reply starts with its text
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = Page(browser, opener.url)
        try:
            page.wait_text("#model", MODEL)
            page.page.fill("#system", SYSTEM)
            page.page.fill("#message", question)
            page.page.fill("#temperature", "0")
            page.page.fill("#max-tokens", "24")
            page.page.click("#send")
            page.wait_text("#chat-stats", "finished:")
            assert page.page.is_visible("#thinking summary")
            assert not page.page.is_visible("#reasoning")  # folded until opened
            page.page.click("#thinking summary")
            assert page.text("#reasoning") == reasoning
            assert page.text("#answer") == (want.choices[0].message.content or "")
            assert page.errors == []
        finally:
            page.close()
            browser.close()


def test_a_block_the_prompt_opened(opener):
    """The output starts inside the block (no opening tag): what comes before the closing
    tag is reasoning, the tag the engine writes after the budget included."""
    from openai import OpenAI

    with OpenAI(base_url=f"{opener.url}/v1", api_key="x", max_retries=0) as c:
        got = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                        temperature=0, logit_bias={str(opener.end_id): -100})
        assert got.usage.completion_tokens_details.reasoning_tokens == BUDGET + 1
        assert "</think>" not in (got.choices[0].message.content or "")
        off = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                        temperature=0, reasoning_effort="none")
        assert off.usage.completion_tokens_details.reasoning_tokens == 0


def weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    return f"Sunny in {city}."


def test_the_openai_agents_sdk_runs_a_tool_loop_on_a_thinking_model(thinker):
    """The agent thinks (the server's budget closes it), calls the tool (required), and the
    tool's result ends the run; no reasoning reached the content the SDK kept."""
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{thinker.url}/v1", api_key="x", max_retries=0)
    agent = Agent(name="weather", instructions="Use the tool.", tools=[function_tool(weather)],
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0,
                                               max_tokens=120, parallel_tool_calls=False),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "Weather in Paris?"))
    assert result.final_output in ("Sunny in Paris.", "Sunny in Rome.")
    said = json.dumps([item.raw_item.model_dump() if hasattr(item.raw_item, "model_dump")
                       else item.raw_item for item in result.new_items], default=str)
    assert "<think>" not in said and "</think>" not in said


def test_a_langchain_agent_runs_a_tool_loop_on_a_thinking_model(thinker):
    """LangChain's agent: its first model turn must call (a middleware asks for it), the tool
    runs, the next turn sees the result; no reasoning in any message's content."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @wrap_model_call
    def call_first(request, handler):
        first = not any(m.type == "tool" for m in request.messages)
        return handler(request.override(tool_choice="any") if first else request)

    llm = ChatOpenAI(model=MODEL, base_url=f"{thinker.url}/v1", api_key="x", temperature=0,
                     max_tokens=120, max_retries=0)
    agent = create_agent(llm, tools=[tool(weather)], middleware=[call_first])
    seen = []
    try:  # the second turn may call again (tool_choice auto): the limit bounds the loop
        for state in agent.stream({"messages": [("user", "Weather in Paris?")]},
                                  {"recursion_limit": 6}, stream_mode="values"):
            seen = state["messages"]
    except Exception as e:  # noqa: BLE001 - only the limit may end it
        assert type(e).__name__ == "GraphRecursionError", e
    calls = [m for m in seen if getattr(m, "tool_calls", None)]
    results = [m for m in seen if m.type == "tool"]
    assert calls and results and results[0].content in ("Sunny in Paris.", "Sunny in Rome.")
    assert not any("<think>" in str(m.content) or "</think>" in str(m.content) for m in seen)
