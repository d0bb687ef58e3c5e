"""gpt-oss's harmony format: the reply is messages on channels, each a header and a body,

    <|channel|>analysis<|message|>Let me check.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}                                  (then <|call|>, an end of turn)
    ... or <|start|>assistant<|channel|>final<|message|>It is sunny.   (then <|return|>)

The analysis channel is the reasoning; final (and commentary to no one: a preamble) is the
content; commentary to `functions.NAME` is a call whose body is its JSON arguments (the
recipient may also stand before the channel, as the template writes past calls). The parser
splits a choice's text as it streams (the markup tokens kept in the text by the detokenizer),
a whole answer being the stream fed at once; the grammar lets the model think on the analysis
channel, then holds it to a call or a final answer in the schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.api.generation.tool_calls import Call, CallDelta, Parsed, tag_start
from server.api.generation.tool_formats import ToolFormat

START, END, MESSAGE, CHANNEL, CONSTRAIN = (
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")
MARKUP = (START, END, MESSAGE, CHANNEL, CONSTRAIN)
RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


class HarmonyParser:
    """One choice's text as reasoning, content and calls; `touched`: the last feed read
    analysis text (its tokens are reasoning)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls: list[Call] = []
        self.touched = False
        self._text = ""
        self._kind: str | None = None  # the open body's: analysis, content, call; None: header
        self._plain = False  # the reply is no harmony at all: content as it is
        self._begun = False

    def feed(self, text: str) -> tuple[str, Parsed]:
        out, thought = Parsed(), [""]
        self._text += text
        self.touched = self._kind == "analysis"
        while self._step(out, thought):
            pass
        return thought[0], out

    def finish(self) -> tuple[str, Parsed]:
        """The end: an open body ends with the reply; a header never finished is dropped."""
        thought, out = self.feed("")
        rest, self._text = self._text, ""
        if self._plain or not self._begun:
            out.content += rest
        elif self._kind is not None:
            box = [thought]
            self._body(rest, out, box)
            thought = box[0]
        return thought, out

    def _step(self, out: Parsed, thought: list[str]) -> bool:
        if self._plain:
            out.content += self._text
            self._text = ""
            return False
        if not self._begun:
            head = self._text.lstrip()
            if not head or any(m.startswith(head) for m in (CHANNEL, START)):
                return False
            self._begun = True
            self._plain = not head.startswith((CHANNEL, START))
            return True
        if self._kind is None:
            return self._header(out)
        i = self._text.find(END)
        if i < 0:
            ready = self._text[:len(self._text) - tag_start(self._text, END)]
            self._body(ready, out, thought)
            self._text = self._text[len(ready):]
            return False
        self._body(self._text[:i], out, thought)
        self._text, self._kind = self._text[i + len(END):], None
        return True

    def _header(self, out: Parsed) -> bool:
        i = self._text.find(MESSAGE)
        if i < 0:
            return False
        header, self._text = self._text[:i], self._text[i + len(MESSAGE):]
        channel = CHANNEL_NAME.search(header)
        recipient = RECIPIENT.search(header)
        if recipient is not None:
            call = Call(self.fmt.call_id(), recipient.group(1))
            self.calls.append(call)
            out.calls.append(CallDelta(len(self.calls) - 1, "", call.id, call.name))
            self._kind = "call"
        else:
            self._kind = "analysis" if channel and channel.group(1) == "analysis" else "content"
            self.touched |= self._kind == "analysis"
        return True

    def _body(self, text: str, out: Parsed, thought: list[str]) -> None:
        if not text:
            return
        if self._kind == "analysis":
            thought[0] += text
        elif self._kind == "call":
            self.calls[-1].arguments += text
            out.calls.append(CallDelta(len(self.calls) - 1, text))
        else:
            out.content += text


def harmony_grammar(tools: list[Any], forced: bool, answer: str | None, atoms: dict[str, str],
                    lark_json) -> str:
    """The reply's Lark grammar: analysis first (free text), then one of `tools`' calls (one a
    turn: the call ends it), or, unless calls are `forced`, a final answer (`answer`: a Lark
    rule body, a schema's JSON; None: free text)."""
    def atom(marker: str) -> str:
        return atoms.get(marker) or json.dumps(marker)

    lines = ["%llguidance {}", "TEXT: /(.|\\n)*/",
             f"analysis: {atom(CHANNEL)} \"analysis\" {atom(MESSAGE)} TEXT {atom(END)} "
             f"{atom(START)} \"assistant\"",
             f"final: {atom(CHANNEL)} \"final\" {atom(MESSAGE)} {answer or 'TEXT'}"]
    choices = [] if forced else ["final"]
    for i, tool in enumerate(tools):
        to = json.dumps(f"commentary to=functions.{tool.name} ")
        lines.append(f"call{i}: {atom(CHANNEL)} {to} {atom(CONSTRAIN)} \"json\" {atom(MESSAGE)} "
                     f"{lark_json(tool.parameters)}")
        choices.append(f"call{i}")
    lines.append(f"start: analysis? ({' | '.join(choices)})")
    return "\n".join(lines)
