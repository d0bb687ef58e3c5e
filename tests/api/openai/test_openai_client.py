"""The real server process driven by the official `openai` client (tiny random model)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch

from tests.api.conftest import API_KEY, MODEL

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
HELLO = [{"role": "user", "content": "Say hello to the world."}]
# The tiny vocabulary starts with 3 special tokens, then bytes 33..126 in order: bias the
# random model towards a-z so its text is printable.
LETTERS = {str(3 + b - 33): 8 for b in range(ord("a"), ord("z") + 1)}


def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve("tiny").id == MODEL  # the bare alias resolves too
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.code == "model_not_found"


def test_chat_stream_joins_to_the_plain_answer(client):
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=24, **GREEDY)
    assert plain.object == "chat.completion" and plain.id.startswith("chatcmpl-")
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert plain.usage.completion_tokens == 24
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 24

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=24, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}, **GREEDY))
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    *content, finish, last = chunks
    assert finish.choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content)
    assert last.choices == [] and last.usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in content) == \
        choice.message.content


def test_cached_tokens_reported_for_a_repeated_prompt(client):
    messages = [{"role": "system", "content": "You are a careful assistant. " * 8},
                {"role": "user", "content": "What is a prefix cache?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           **GREEDY)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           **GREEDY)
    n = first.usage.prompt_tokens
    # At first only the chat template's opening, which other requests share, can be found...
    assert first.usage.prompt_tokens_details.cached_tokens < 16
    # ...then every token but the last (always computed), to the token.
    assert again.usage.prompt_tokens_details.cached_tokens == n - 1
    assert again.choices[0].message.content == first.choices[0].message.content


def ascii_window(text: str, start: int) -> str:
    for i in range(start, len(text) - 2):
        if all(c.isascii() and c.isprintable() and c != " " for c in text[i:i + 2]):
            return text[i:i + 2]
    raise AssertionError(f"no printable pair in {text!r}")


def test_a_past_refusal_is_history_like_any_assistant_text(client):
    said = "I can't help with that."
    ask = {"role": "user", "content": "Why not?"}
    plain = client.chat.completions.create(
        model=MODEL, messages=[*HELLO, {"role": "assistant", "content": said}, ask],
        max_tokens=8, logit_bias=LETTERS, **GREEDY)
    for refused in ({"role": "assistant", "content": [{"type": "refusal", "refusal": said}]},
                    {"role": "assistant", "content": None, "refusal": said}):
        r = client.chat.completions.create(model=MODEL, messages=[*HELLO, refused, ask],
                                           max_tokens=8, logit_bias=LETTERS, **GREEDY)
        assert r.usage.prompt_tokens == plain.usage.prompt_tokens
        assert r.choices[0].message.content == plain.choices[0].message.content


def test_prompt_cache_settings_are_taken_and_change_nothing(client):
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=8, logit_bias=LETTERS, **GREEDY)
    plain = client.chat.completions.create(**kwargs)
    hinted = client.chat.completions.create(
        prompt_cache_key="k", prompt_cache_retention="24h",
        prompt_cache_options={"mode": "explicit", "ttl": "30m"}, **kwargs)
    assert hinted.choices[0].message.content == plain.choices[0].message.content


def test_vllm_s_continue_final_message_continues_the_last_text(client):
    """vLLM's extra `continue_final_message` (as Anthropic's prefill): the prompt is the plain
    one plus the final message's tokens, no end of turn and no new turn after them."""
    from tests.helpers import make_tokenizer

    ask = {"role": "user", "content": "Count from 1 to 10."}
    prefill = {"role": "assistant", "content": "1, 2, 3,"}

    def prompt_tokens(messages, **extra) -> int:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           temperature=0, extra_body=extra or None)
        return r.usage.prompt_tokens
    added = len(make_tokenizer().encode("1, 2, 3,", add_special_tokens=False))
    assert prompt_tokens([ask, prefill], continue_final_message=True) == \
        prompt_tokens([ask]) + added
    assert prompt_tokens([ask, prefill], continue_final_message=True,
                         add_generation_prompt=False) == prompt_tokens([ask]) + added
    with pytest.raises(openai.BadRequestError, match="Cannot set both"):
        prompt_tokens([ask, prefill], continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(openai.BadRequestError, match="needs a final message with text"):
        prompt_tokens([ask, {"role": "assistant", "content": ""}], continue_final_message=True)
    # With a response_format the schema's grammar goes on from the final message's text.
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[ask, {"role": "assistant", "content": '{"n": '}], max_tokens=20,
        temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "n", "schema": schema}}, extra_body={"continue_final_message": True})
    assert r.choices[0].finish_reason == "stop"
    assert 0 <= json.loads('{"n": ' + r.choices[0].message.content)["n"] <= 99


def test_stop_string_ends_the_text_and_is_never_streamed(client):
    kw = dict(model=MODEL, messages=HELLO, max_tokens=40, logit_bias=LETTERS, **GREEDY)
    full = client.chat.completions.create(**kw).choices[0].message.content
    stop = ascii_window(full, 6)
    expected = full[:full.index(stop)]
    got = client.chat.completions.create(stop=[stop], **kw).choices[0]
    assert (got.message.content, got.finish_reason) == (expected, "stop")
    streamed = client.chat.completions.create(stop=stop, stream=True, **kw)
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == expected


def test_n_choices_and_seed_reproducibility(client):
    kw = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.chat.completions.create(n=3, seed=7, **kw)
    b = client.chat.completions.create(n=3, seed=7, **kw)
    c = client.chat.completions.create(n=3, seed=8, **kw)
    texts = [ch.message.content for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts == [ch.message.content for ch in b.choices]
    assert texts != [ch.message.content for ch in c.choices]
    assert len(set(texts)) == 3  # each choice has its own generator
    assert a.usage.completion_tokens == 36


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, logprobs=True,
                                       top_logprobs=3, **GREEDY)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 6
    for e in entries:
        assert len(e.top_logprobs) == 3
        best = e.top_logprobs[0]
        # Greedy: the chosen token is the most likely one.
        assert (best.token, best.bytes) == (e.token, e.bytes)
        assert best.logprob == pytest.approx(e.logprob, abs=1e-4)
        assert e.logprob <= 0
        try:
            assert bytes(e.bytes).decode() == e.token
        except UnicodeDecodeError:  # part of a character
            assert e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in e.bytes)


def test_completions_prompt_forms_echo_and_logprobs(client):
    one = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5,
                                    **GREEDY)
    assert one.object == "text_completion" and one.choices[0].finish_reason == "length"
    many = client.completions.create(model=MODEL, prompt=["The sky is", "Grass is"], n=2,
                                     max_tokens=5, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == one.choices[0].text == many.choices[1].text
    assert many.usage.completion_tokens == 20
    ids = client.completions.create(model=MODEL, prompt=[40, 41, 42, 43], max_tokens=3, **GREEDY)
    assert ids.usage.prompt_tokens == 4
    echo = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, echo=True,
                                     **GREEDY)
    assert echo.choices[0].text == "The sky is" + one.choices[0].text
    lp = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, logprobs=2,
                                   **GREEDY).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)
    streamed = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5,
                                         stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == one.choices[0].text


def test_32_concurrent_streams_all_complete(server):
    async def one(client, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=16, stream=True, stream_options={"include_usage": True}, **GREEDY)
        finish, usage = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return finish, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(main()) == [("length", 16)] * 32


def test_predicted_outputs_change_the_usage_not_the_reply(client, server):
    """`prediction` (a file being edited, say): the reply is the one without it, whole and
    streamed, greedy and seeded; the usage says how many predicted tokens it kept and dropped,
    /metrics how many the server drafted and kept."""
    before = server.metrics()
    kw = dict(model=MODEL, messages=HELLO, max_tokens=40, logit_bias=LETTERS, **GREEDY)
    full = client.chat.completions.create(**kw)
    text = full.choices[0].message.content
    assert full.usage.completion_tokens_details is None  # only with a prediction
    right = client.chat.completions.create(prediction={"type": "content", "content": text}, **kw)
    assert right.choices[0].message.content == text
    details = right.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 20
    edited = text[:10] + "-----" + text[15:]
    parts = [{"type": "text", "text": edited[:7]}, {"type": "text", "text": edited[7:]}]
    streamed = client.chat.completions.create(
        prediction={"type": "content", "content": parts}, stream=True,
        stream_options={"include_usage": True}, **kw)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    last = chunks[-1].usage.completion_tokens_details
    assert last.accepted_prediction_tokens > 0 and last.rejected_prediction_tokens > 0
    seeded = dict(model=MODEL, messages=HELLO, max_tokens=30, temperature=1.0, seed=5,
                  logit_bias=LETTERS, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**seeded).choices[0].message.content
    again = client.chat.completions.create(prediction={"type": "content", "content": plain},
                                           **seeded)
    assert again.choices[0].message.content == plain
    assert again.usage.completion_tokens_details.accepted_prediction_tokens >= 15
    # several tokens a step: their logprobs each, and a stop string inside a run of them ends
    # the text and the token count where a token a step does
    logprobs = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    predicted = client.chat.completions.create(
        prediction={"type": "content", "content": text}, logprobs=True, top_logprobs=2, **kw)
    assert predicted.choices[0].logprobs == logprobs.choices[0].logprobs
    stop = ascii_window(text, 20)
    plain = client.chat.completions.create(stop=[stop], **kw)
    for stream in (False, True):
        got = client.chat.completions.create(
            stop=[stop], prediction={"type": "content", "content": text}, stream=stream,
            stream_options={"include_usage": True} if stream else None, **kw)
        if stream:
            chunks = list(got)
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            content, usage = got.choices[0].message.content, got.usage
        assert content == plain.choices[0].message.content == text[:text.index(stop)]
        assert usage.completion_tokens == plain.usage.completion_tokens
    after = server.metrics()
    drafted, kept = (after[f"localserve:prediction_{k}_tokens_total"]
                     - before.get(f"localserve:prediction_{k}_tokens_total", 0)
                     for k in ("draft", "accepted"))
    assert drafted > kept >= 20 + 15


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 2}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"prediction": {"type": "text", "content": "x"}}, "prediction.type"),
    ({"prediction": {"type": "content", "content": 3}}, "prediction.content"),
    ({"prediction": {"type": "content", "content": [{"type": "image_url"}]}},
     "prediction.content"),
    ({"prediction": "x"}, "prediction"),
])
def test_predicted_outputs_refuse_what_openai_refuses(client, extra, param):
    body = {"prediction": {"type": "content", "content": "hello"}} | extra
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, **body)
    assert e.value.body["param"] == param


def test_a_prediction_beside_a_response_format_is_taken_and_changes_nothing(client):
    """Under a grammar a prediction is not drafted (each draft would need its own grammar
    state): the request is answered as without it, and the usage says nothing was kept."""
    kw = dict(model=MODEL, messages=HELLO, max_tokens=30, response_format={"type": "json_object"},
              **GREEDY)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    got = client.chat.completions.create(prediction={"type": "content", "content": plain}, **kw)
    assert got.choices[0].message.content == plain
    details = got.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)


def test_echo_with_logprobs_gives_each_prompt_token_its_own(client):
    """Completions' echo with logprobs (how lm-evaluation-harness scores answers): every
    prompt token after the first gets its logprob after the ones before it, the model's own
    numbers: the same as sampling reports for a token in that place, as a reference forward
    computes, and the same whatever the prefix cache holds or the reply streams."""
    from tests.helpers import hf_model, make_tokenizer

    tokenizer = make_tokenizer()
    prompt = tokenizer.encode("count the sheep in the field", add_special_tokens=False)
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=3,
                                       temperature=0)
    scored = [*prompt, prompt[0]]  # one token more: its place is the one greedy sampled at
    kw = dict(model=MODEL, prompt=scored, max_tokens=1, logprobs=3, echo=True, temperature=0)
    first = client.completions.create(**kw).choices[0]
    lp = first.logprobs
    assert first.text.startswith(tokenizer.decode(scored))
    assert "".join(lp.tokens[:len(scored)]) == tokenizer.decode(scored)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.token_logprobs) == len(scored) + 1 and lp.text_offset[0] == 0
    # that place's distribution is the one sampling read there, bit for bit
    assert lp.top_logprobs[len(prompt)] == greedy.choices[0].logprobs.top_logprobs[0]
    # the reference: a transformers forward of the same weights (the server computes in its
    # own dtype, so within bf16's rounding; a token scored at a wrong place is off by units)
    with torch.no_grad():
        logits = hf_model("llama", seed=3, max_position_embeddings=4096)(
            torch.tensor([scored])).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(scored) - 1), scored[1:]]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:len(scored)]), want, atol=0.1)
    # the prompt is now in the prefix cache: scored again, and streamed, the same numbers
    assert client.completions.create(**kw).choices[0].logprobs == lp
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)]
    assert streamed[0].token_logprobs[:len(scored)] == lp.token_logprobs[:len(scored)]


def test_lm_evaluation_harness_loglikelihood_payload(client):
    """lm-evaluation-harness's local-completions loglikelihood request: token-id prompts in a
    batch, max_tokens 1, logprobs 1, echo; it reads token_logprobs[ctxlen:-1] and whether
    each is the top one."""
    from tests.helpers import make_tokenizer

    tokenizer = make_tokenizer()
    context = tokenizer.encode("Question: what colour is the sky? Answer:",
                               add_special_tokens=False)
    answers = [tokenizer.encode(a, add_special_tokens=False) for a in (" blue", " green")]
    r = client.completions.create(model=MODEL, prompt=[context + a for a in answers],
                                  max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1234)
    assert [c.index for c in r.choices] == [0, 1]
    for choice, answer in zip(r.choices, answers, strict=True):
        lp = choice.logprobs
        scores = lp.token_logprobs[len(context):-1]
        assert len(scores) == len(answer) and all(isinstance(s, float) and s <= 0
                                                 for s in scores)
        for s, top in zip(scores, lp.top_logprobs[len(context):-1], strict=True):
            assert max(top.values()) >= s  # the greedy check reads the top entry


def test_max_tokens_zero_with_echo_gives_the_prompt_scored_and_nothing_more(client):
    """Scoring scripts of the davinci days (and vLLM) send max_tokens 0 with echo."""
    kw = dict(model=MODEL, prompt="count the sheep", echo=True, logprobs=1, temperature=0)
    scored, one = (client.completions.create(max_tokens=m, **kw) for m in (0, 1))
    choice = scored.choices[0]
    assert choice.text == "count the sheep" and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs[:-1]
    assert (scored.usage.completion_tokens, scored.usage.prompt_tokens) == (
        0, one.usage.prompt_tokens)
    streamed = list(client.completions.create(max_tokens=0, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "count the sheep"
    with pytest.raises(openai.BadRequestError, match="only with 'echo'"):
        client.completions.create(model=MODEL, prompt="count", max_tokens=0)
