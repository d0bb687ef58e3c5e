"""Reasoning: the thinking block a model writes before its answer, kept out of the answer.

A template family's block is known by its tags, found in the chat template (a serve flag can
name it instead; models/tokenizer.py): `<think>...</think>` (Qwen3, SmolLM3, DeepSeek-R1 and
its distills, QwQ, Phi-4-reasoning), `[THINK]...[/THINK]` (Magistral) or Gemma 4's
`<|channel>thought...<channel|>`; gpt-oss's channels are harmony.py's. The output opens the
block itself, or the generation prompt already did (DeepSeek-R1 distills, Qwen3.5: the output
has no opening tag).
`ReasoningParser` splits one choice's text into reasoning and content as it streams; a whole
answer is the stream fed at once, so both are the same. Blanks at the block's edges only
separate it (the template writes them): they belong to neither side.

How much a request may think: `Thinking` (the fields of every protocol that can ask, resolved
to one setting); the budget itself is the engine's (engine/thinking.py), which writes the
closing tag when a block has taken its tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from server.api.errors import invalid
from server.api.generation.tool_calls import tag_start
from server.models.tokenizer import ReasoningFormat


def opened_by(fmt: ReasoningFormat, prompt: str) -> bool | None:
    """Where the generation prompt leaves the block: True, open (the output starts in it);
    None, closed (the template wrote an empty one: thinking is off); False, not begun."""
    end = prompt.rstrip()
    return True if end.endswith(fmt.start) else None if end.endswith(fmt.end) else False


def with_reasoning(lark: str, fmt: ReasoningFormat, opened: bool,
                   tokens: tuple[str | None, str | None] = (None, None)) -> str:
    """A Lark grammar (top rule `start`) behind the thinking block: the block (its opening tag
    unless the prompt wrote it; its text free, ended by the closing tag, the model's or the
    budget's), a line break or two, then what the grammar allows. So a model thinks before a
    JSON answer or a tool call as it would before any. `tokens`: the tags as the grammar names
    their special tokens (`<[id]>`), where they are such (Qwen3's); else the tags are text."""
    rules = [re.sub(r"^start:", "reply:", line) for line in lark.splitlines()
             if not line.startswith("%llguidance")]
    start, end = tokens
    opening = "" if opened else (start or json.dumps(fmt.start)) + " "
    tag = re.escape(fmt.end).replace("/", "\\/")
    if end is not None:  # text that never spells the tag, then its token
        block = [f"start: {opening}THOUGHT {end} gap? reply",
                 f"THOUGHT: /(.|\\n)*/ & ~/(.|\\n)*{tag}(.|\\n)*/"]
    else:  # text up to the tag's first appearance
        block = [f"start: {opening}thought gap? reply", f"thought[lazy]: /(.|\\n)*{tag}/"]
    # at most a blank line between: blanks the model may write are blanks it may write forever
    return "\n".join(["%llguidance {}", *block, "gap: /\\n\\n?/", *rules])


# -- the parser ----------------------------------------------------------------------------------

START, INSIDE, AFTER, CONTENT = range(4)


class ReasoningParser:
    """One choice's text as (reasoning, content) pieces; `inside`: the prompt opened the block.
    `touched` says whether the last feed read text of the block (its tokens are reasoning)."""

    def __init__(self, fmt: ReasoningFormat, inside: bool) -> None:
        self.fmt = fmt
        self.state = INSIDE if inside else START
        self.leading = True  # at the block's start: blanks there are dropped
        self.touched = False
        self.reasoning = ""  # all of it so far
        self._text = ""  # not yet decided

    def feed(self, text: str) -> tuple[str, str]:
        self._text += text
        self.touched = self.state == INSIDE
        out = ["", ""]
        while self._step(out):
            pass
        self.reasoning += out[0]
        return out[0], out[1]

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back (a block the output never closed is
        reasoning to its end)."""
        reasoning, content = self.feed("")
        rest, self._text = self._text, ""
        if self.state == INSIDE:
            self.touched = True
            more = rest.rstrip() if not self.leading else rest.strip()
            self.reasoning += more
            return reasoning + more, content
        return reasoning, content + (rest if self.state in (START, CONTENT) else "")

    def _step(self, out: list[str]) -> bool:
        start, end = self.fmt.start, self.fmt.end
        if self.state == START:
            head = self._text.lstrip()
            if head.startswith(start):
                self._text, self.state, self.touched = head[len(start):], INSIDE, True
                return True
            if start.startswith(head):  # blanks, or the start of the tag: wait
                return False
            self.state = CONTENT
            return True
        if self.state == INSIDE:
            if self.leading:
                self._text = self._text.lstrip()
                if not self._text:
                    return False
                self.leading = False
            i = self._text.find(end)
            if i >= 0:
                out[0] += self._text[:i].rstrip()
                self._text, self.state = self._text[i + len(end):], AFTER
                return True
            ready = self._text[:len(self._text) - tag_start(self._text, end)]
            said = ready.rstrip()  # blanks wait: they may end the block
            out[0] += said
            self._text = self._text[len(said):]
            return False
        if self.state == AFTER:
            self._text = self._text.lstrip()
            if not self._text:
                return False
            self.state = CONTENT
        out[1] += self._text
        self._text = ""
        return False


# -- how much a request may think ----------------------------------------------------------------

EFFORTS = ("none", "minimal", "low", "medium", "high")
# What a template is rendered with from the request itself (tokenizer.py)
RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
            "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True, slots=True)
class Thinking:
    """A request's thinking: off, or on (the default, as llama-server's) with an effort
    (passed to templates that read one, gpt-oss's) and at most `budget` tokens (None: the
    server's default)."""

    enabled: bool = True
    effort: str | None = None
    budget: int | None = None
    template_kwargs: tuple[tuple[str, Any], ...] = ()  # chat_template_kwargs, as given
    omitted: bool = False  # Anthropic's display "omitted": blocks shown without their text

    def render_kwargs(self) -> dict[str, Any]:
        """What the chat template is rendered with: the request's chat_template_kwargs, and
        enable_thinking / reasoning_effort where they did not set them (templates such as
        DeepSeek-R1's think only when told to)."""
        kw = dict(self.template_kwargs)
        kw.setdefault("enable_thinking", self.enabled)
        if self.effort is not None and self.effort != "none":
            kw.setdefault("reasoning_effort", self.effort)
        return kw


def parse_thinking(effort: Any, template_kwargs: Any, think: Any, budget: Any,
                   effort_field: str = "reasoning_effort") -> Thinking:
    """One setting from the fields that ask for it: `reasoning_effort` (none turns thinking
    off), `chat_template_kwargs` (its `enable_thinking`), Ollama's `think` (true, false or an
    effort) and `max_reasoning_tokens`; settings that disagree are a 400."""
    if effort is not None and effort not in EFFORTS:
        raise invalid(effort_field, f"Invalid value for '{effort_field}': {effort!r}. "
                      f"Supported values are: {', '.join(map(repr, EFFORTS))}.")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise invalid("chat_template_kwargs", "Invalid type for 'chat_template_kwargs': "
                      "expected an object.")
    kwargs = dict(template_kwargs or {})
    for key in kwargs:
        if key in RESERVED:
            raise invalid(f"chat_template_kwargs.{key}", f"'chat_template_kwargs' cannot set "
                          f"{key!r}: the request's own fields give it.")
    if think is not None and not isinstance(think, bool) and think not in EFFORTS[2:]:
        raise invalid("think", f"Invalid value for 'think': {think!r}. Supported values are: "
                      "true, false, 'low', 'medium', 'high'.")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                               or budget < 0):
        raise invalid("max_reasoning_tokens", "Invalid value for 'max_reasoning_tokens': "
                      "expected a non-negative integer.")
    says: dict[str, bool] = {}  # field -> thinking on
    if effort is not None:
        says[effort_field] = effort != "none"
    if "enable_thinking" in kwargs:
        says["chat_template_kwargs.enable_thinking"] = bool(kwargs["enable_thinking"])
    if think is not None:
        says["think"] = think is not False
        if isinstance(think, str):
            effort = effort or think
    if len(set(says.values())) > 1:
        names = " and ".join(f"'{k}'" for k in says)
        raise invalid(next(iter(says)), f"{names} disagree on whether the model thinks.")
    enabled = all(says.values())
    return Thinking(enabled, effort, budget, tuple(kwargs.items()))
