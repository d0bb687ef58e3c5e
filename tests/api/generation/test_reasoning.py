"""The thinking block split from the answer, the settings that control it, the grammar that
follows it and the engine's budget: units, no server."""

from __future__ import annotations

import pytest

from server.api.errors import APIError
from server.api.generation.reasoning import (
    ReasoningParser,
    opened_by,
    parse_thinking,
    with_reasoning,
)
from server.engine.thinking import ThinkingBudget
from server.models.tokenizer import REASONING_FORMATS as FORMATS
from server.models.tokenizer import reasoning_format as detect
from tests.helpers import QWEN3_ADDED, make_tokenizer

THINK = FORMATS["think"]
TEXT = "<think>\nFirst, 2 + 2.\nIt is 4.\n</think>\n\nThe answer is 4."


def split(text: str, cuts: list[int], inside: bool = False, fmt=THINK) -> tuple[str, str]:
    """The text fed in pieces cut at `cuts`: (reasoning, content)."""
    parser = ReasoningParser(fmt, inside)
    reasoning = content = ""
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, c = parser.feed(text[a:b])
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    assert parser.reasoning == reasoning + r
    return reasoning + r, content + c


@pytest.mark.parametrize("text,inside,expected", [
    (TEXT, False, ("First, 2 + 2.\nIt is 4.", "The answer is 4.")),
    ("\n<think>a</think>b", False, ("a", "b")),  # blanks before the tag
    ("No block here.", False, ("", "No block here.")),
    ("<think></think>\n\nJust this.", False, ("", "Just this.")),  # thinking off (Qwen3)
    ("I thought.\n</think>\n\nSaid.", True, ("I thought.", "Said.")),  # the prompt opened it
    ("Cut off while thinking\n", True, ("Cut off while thinking", "")),
    ("<think>cut off", False, ("cut off", "")),
    ("<thi", False, ("", "<thi")),  # a tag's start and no more: text
    ("a <think> b", False, ("", "a <think> b")),  # not at the start: text
    ("<think>x</think>y </think> z", False, ("x", "y </think> z")),  # once
    ("<think>a </thinking> b</think>c", False, ("a </thinking> b", "c")),
])
def test_split_alike_at_every_cut(text, inside, expected):
    assert split(text, [], inside) == expected
    for i in range(1, len(text)):  # every two-piece stream
        assert split(text, [i], inside) == expected, i
    assert split(text, list(range(1, len(text))), inside) == expected  # a character a feed


def test_touched_marks_the_block_pieces():
    parser = ReasoningParser(THINK, False)
    marks = []
    for piece in ["<think>", "\nhm", "</think>", "\n\n", "Yes"]:
        parser.feed(piece)
        marks.append(parser.touched)
    assert marks == [True, True, True, False, False]


def test_mistral_brackets():
    fmt = FORMATS["mistral"]
    assert split("[THINK]plan[/THINK]done", [5, 12], fmt=fmt) == ("plan", "done")


@pytest.mark.parametrize("template,choice,name", [
    ("{{ '<think>' }}...{{ '</think>' }}", "auto", "think"),
    ("[THINK] [/THINK]", "auto", "mistral"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "auto", None),
    ("<think></think>", "none", None),
    ("plain", "think", "think"),
])
def test_detect(template, choice, name):
    fmt = detect(template, choice)
    assert (fmt.name if fmt else None) == name


@pytest.mark.parametrize("stem,name,on,off", [
    # a real template's block, and where its generation prompt leaves it with thinking on and
    # off (True: open, the output starts inside; None: an empty block, closed; False: not begun)
    ("Qwen-Qwen3-0.6B", "think", False, None),
    ("HuggingFaceTB-SmolLM3-3B", "think", False, None),
    ("Qwen3.5-4B", "think", True, None),
    ("Qwen-QwQ-32B", "think", True, None),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "think", True, True),  # off: the budget's 0
    ("NVIDIA-Nemotron-Nano-v2", "think", True, True),
    ("mistralai-Ministral-3-14B-Reasoning-2512", "mistral", False, False),
    ("google-gemma-4-31B-it", "gemma", False, None),
    ("openai-gpt-oss-120b", "harmony", False, False),
    ("meta-llama-Llama-3.2-3B-Instruct", None, None, None),
])
def test_real_templates_blocks(real_template, stem, name, on, off):
    from server.models.tokenizer import compile_chat_template

    source = real_template(stem)
    fmt = detect(source)
    assert (fmt.name if fmt else None) == name
    if fmt is None:
        return
    template = compile_chat_template(source)
    for enabled, want in ((True, on), (False, off)):
        text = template.render(messages=[{"role": "user", "content": "hi"}],
                               add_generation_prompt=True, enable_thinking=enabled, tools=None,
                               bos_token="<s>", eos_token="</s>")
        assert opened_by(fmt, text) is want, (enabled, text[-60:])


def test_opened_by_the_generation_prompt():
    assert opened_by(THINK, "<|im_start|>assistant\n<think>\n") is True
    assert opened_by(THINK, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is None
    assert opened_by(THINK, "<|im_start|>assistant\n") is False


def test_thinking_settings():
    t = parse_thinking(None, None, None, None)
    assert t.enabled and t.render_kwargs() == {"enable_thinking": True}
    t = parse_thinking("none", None, None, None)
    assert not t.enabled and t.render_kwargs() == {"enable_thinking": False}
    t = parse_thinking("high", {"enable_thinking": True, "x": 1}, None, 64)
    assert t.enabled and t.budget == 64
    assert t.render_kwargs() == {"enable_thinking": True, "x": 1, "reasoning_effort": "high"}
    t = parse_thinking(None, None, "low", None)  # Ollama's think with an effort
    assert t.enabled and t.effort == "low"
    assert not parse_thinking(None, {"enable_thinking": False}, False, None).enabled


@pytest.mark.parametrize("args,field", [
    (("none", None, True, None), "reasoning_effort"),  # disagree
    ((None, {"enable_thinking": False}, "high", None), "chat_template_kwargs.enable_thinking"),
    (("huge", None, None, None), "reasoning_effort"),
    ((None, [], None, None), "chat_template_kwargs"),
    ((None, {"messages": []}, None, None), "chat_template_kwargs.messages"),
    ((None, None, "max", None), "think"),
    ((None, None, None, -1), "max_reasoning_tokens"),
    ((None, None, None, True), "max_reasoning_tokens"),
])
def test_thinking_settings_refused(args, field):
    with pytest.raises(APIError) as e:
        parse_thinking(*args)
    assert e.value.status == 400 and e.value.param == field


@pytest.mark.parametrize("added", [(), QWEN3_ADDED])
def test_grammar_after_the_block(added):
    """A JSON answer behind the block: the block's text is free and ends at the closing tag
    (text, or Qwen3's token of its own), blanks may follow, then the answer must fit."""
    import llguidance

    from server.engine.grammar import lark_grammar, lark_json

    tok = make_tokenizer(added=added)
    llt = llguidance.LLTokenizer(tok.backend_tokenizer.to_str(), n_vocab=len(tok),
                                 eos_token=[tok.eos_token_id])
    ids = [tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")] if added else []
    tags = tuple(f"<[{i}]>" for i in ids) if added else (None, None)
    assert all(llt.is_special_token(i) for i in ids)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def grammar(opened: bool) -> str:
        return lark_grammar(with_reasoning(f"start: {lark_json(schema)}", THINK, opened, tags))

    for opened in (False, True):
        good = ("" if opened else "<think>") + 'any < text\n</think>\n\n{"a": 12}'
        bad = ("" if opened else "<think>") + 'x</think>{"b": 1}'
        assert _fits(llt, grammar(opened), tok.encode(good, add_special_tokens=False))
        assert not _fits(llt, grammar(opened), tok.encode(bad, add_special_tokens=False))
    assert not _fits(llt, grammar(False), tok.encode('{"a": 1}', add_special_tokens=False))


def _fits(llt, grammar: str, ids: list[int]) -> bool:
    import llguidance

    m = llguidance.LLMatcher(llt, grammar, log_level=0)
    for t in ids:
        m.consume_token(t)
        if m.is_error():
            return False
    return m.is_accepting()


def _run(spec: ThinkingBudget, sampled: list[int]) -> list[int]:
    """What the sequence writes when the model would sample `sampled` in turn."""
    state, out = spec.begin(), []
    for t in sampled:
        token = state.forced()
        token = t if token is None else token
        state.accept(token)
        out.append(token)
    return out


def test_budget_closes_the_block():
    spec = ThinkingBudget(start=(1,), end=(2,), budget=3)
    assert _run(spec, [1, 7, 7, 7, 7, 7, 8]) == [1, 7, 7, 7, 2, 7, 8]
    assert _run(spec, [1, 7, 2, 9, 9, 9, 9]) == [1, 7, 2, 9, 9, 9, 9]  # closed in time
    assert _run(spec, [5, 7, 7, 7, 7, 7]) == [5, 7, 7, 7, 7, 7]  # no block opened


def test_budget_zero_and_opened_by_the_prompt():
    assert _run(ThinkingBudget((), (2,), 0, opened=True), [7, 7, 7]) == [2, 7, 7]
    assert _run(ThinkingBudget((), (2,), 2, opened=True), [7, 7, 7, 7]) == [7, 7, 2, 7]
    assert _run(ThinkingBudget((1,), (2,), 0), [1, 7, 7]) == [1, 2, 7]


def test_budget_with_tags_of_several_tokens():
    spec = ThinkingBudget(start=(1, 3), end=(4, 5, 6), budget=2)
    assert _run(spec, [1, 3, 7, 7, 7, 7, 7, 9]) == [1, 3, 7, 7, 4, 5, 6, 9]
    # the model began the closing tag as the budget ran out: the tag is finished for it
    assert _run(spec, [1, 3, 7, 4, 7, 7, 9]) == [1, 3, 7, 4, 5, 6, 9]
    assert _run(spec, [1, 3, 4, 5, 6, 7, 7, 7]) == [1, 3, 4, 5, 6, 7, 7, 7]  # its own
    with pytest.raises(ValueError):
        ThinkingBudget(start=(), end=(4,), budget=1)
