"""The model's text split into content and tool calls, incrementally, for streams and whole
answers alike (a whole answer is the stream fed at once, so both give the same calls).

A block of calls is the format's (tool_formats.py): `<tool_call>...</tool_call>` by default, or
`[TOOL_CALLS]` to the end of the reply, or a reply that is a bare call object... Its body is one
call object or a list of them. A call that starts `{"name": "...", "arguments":` (what the
grammar makes the model write; "parameters" where the format says so) streams: its id and name
as soon as the name is complete, then its arguments text as it comes, scanned character by
character so the end of the arguments is found whatever the chunking. A body in any other shape
(keys in another order) waits for the block's end and is read with json; a body that is not
JSON at all stays content, so nothing is lost.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from server.api.generation.tool_formats import HERMES, ToolFormat


def _head(args_key: str) -> re.Pattern:
    """A call's start: first in the block, first of a list, or the next one of a list."""
    return re.compile(r'\s*(?:[\[,;]\s*)?\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"'
                      + args_key + r'"\s*:')


@dataclass(slots=True)
class CallDelta:
    """A piece of call `index`: its id and name first, then arguments text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class Call:
    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    """What one feed produced: content text and call pieces, in order of the text."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class StepParser(ABC):
    """Text fed in pieces, decided a step at a time (`_step`: False when it needs more)."""

    _text: str

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._text += text
        while self._step(out):
            pass
        return out

    @abstractmethod
    def _step(self, out: Parsed) -> bool:
        """Decide what the text so far allows into `out`; True to go on."""


class ToolCallParser(StepParser):
    def __init__(self, fmt: ToolFormat = HERMES) -> None:
        self.fmt = fmt
        self._head_re = _head(fmt.args_key)
        self._at_start = fmt.bare  # a bare call may still open the reply
        self.calls: list[Call] = []
        self._text = ""  # not yet decided
        self._in_tag = False
        self._head_done = False  # inside a tag: the current call's name was read
        self._args = _ArgsScanner()
        self._body = ""  # the tag's text so far (for the json fallback)
        self._streamed = False  # this tag's calls stream (the grammar's shape)
        self._gap = ""  # the blanks before the open tag
        self._opening = ""  # the open tag as written ("" for a bare call)

    def finish(self) -> Parsed:
        """The end of the output: whatever was held back (a block that ends with the reply
        ends here)."""
        out = self.feed("")
        if self._in_tag and not self._streamed and self.fmt.args_marker is not None:
            pass  # a call cut before its arguments: no call, and no markup
        elif self._in_tag and not self._streamed:
            body = self._body + self._text
            calls = _read_calls(body) if self.fmt.close is None else None
            if calls:
                self._add(out, calls)
            elif body.strip() and not body.lstrip().startswith(("{", "[")):  # never a call
                out.content += self._gap + self._opening + body  # the text as written
            # else a call cut (max_tokens, a stop) before its name: no call, and no markup
        elif not self._in_tag:
            out.content += self._text if not self.calls else self._text.rstrip()
        self._text = ""
        return out

    # -- one decision at a time; False when more text is needed -------------------------------

    def _step(self, out: Parsed) -> bool:
        if not self._in_tag:
            return self._outside(out)
        if self._streamed and self._head_done:
            return self._arguments(out)
        return self._head(out)

    def _outside(self, out: Parsed) -> bool:
        if self._at_start:  # a bare call opens the reply, or the reply is text
            head = self._text.lstrip()
            if not head:
                return False
            self._at_start = False
            if head.startswith("{"):
                self._open_block(self._text[:len(self._text) - len(head)], head, "")
                return True
        opening = self.fmt.open
        i = self._text.find(opening)
        if i >= 0:
            before = self._text[:i].rstrip()  # blanks before a call only separate it
            out.content += before
            self._open_block(self._text[len(before):i], self._text[i + len(opening):], opening)
            return True
        keep = tag_start(self._text, opening)  # a tail that may be the start of the opening
        ready = self._text[:len(self._text) - keep]
        stripped = ready.rstrip()  # whitespace waits: it may only separate calls
        if stripped:
            out.content += stripped
            self._text = self._text[len(stripped):]
        return False

    def _open_block(self, gap: str, rest: str, opening: str) -> None:
        self._gap = gap  # given back if the block holds no call
        self._opening = opening  # its markup, given back alike
        self._text = rest
        self._in_tag, self._body, self._streamed, self._head_done = True, "", False, False

    def _head(self, out: Parsed) -> bool:
        if self.fmt.args_marker is not None:
            return self._named_head(out)
        closing = self.fmt.close
        close = self._text.find(closing) if closing else -1
        m = self._head_re.match(self._text)
        if m and (close < 0 or m.end() <= close):
            name = json.loads(f'"{m.group(1)}"')
            call = Call(self.fmt.call_id(), name)
            self.calls.append(call)
            out.calls.append(CallDelta(len(self.calls) - 1, "", call.id, name))
            self._body += self._text[:m.end()]
            self._text = self._text[m.end():]
            self._streamed, self._head_done, self._args = True, True, _ArgsScanner()
            return True
        if close < 0:
            return False
        body, self._text = self._text[:close], self._text[close + len(closing):]
        self._in_tag = False
        if self._streamed:  # after a streamed call: its closing brackets
            return True
        calls = _read_calls(self._body + body)
        if calls is None:  # not a call: the text as the model wrote it
            out.content += self._gap + self._opening + self._body + body + closing
            return True
        self._add(out, calls)
        return True

    def _named_head(self, out: Parsed) -> bool:
        """Mistral's `name[ARGS]` (or `name[CALL_ID]id[ARGS]`): the call starts once its
        arguments do; the next call opens again."""
        fmt, text = self.fmt, self._text
        if text.startswith(fmt.open):
            text = text[len(fmt.open):]
        elif fmt.open.startswith(text):
            return False  # the next opening, maybe
        j = text.find(fmt.args_marker)
        if j < 0:
            return False
        name, call_id = text[:j], None
        if fmt.id_marker is not None and fmt.id_marker in name:
            name, call_id = name.split(fmt.id_marker, 1)
        call = Call(call_id or fmt.call_id(), name.strip())
        self.calls.append(call)
        out.calls.append(CallDelta(len(self.calls) - 1, "", call.id, call.name))
        self._text = text[j + len(fmt.args_marker):]
        self._streamed, self._head_done, self._args = True, True, _ArgsScanner()
        return True

    def _add(self, out: Parsed, calls: list[tuple[str, str]]) -> None:
        for name, arguments in calls:
            call = Call(self.fmt.call_id(), name, arguments)
            self.calls.append(call)
            out.calls.append(CallDelta(len(self.calls) - 1, arguments, call.id, name))

    def _arguments(self, out: Parsed) -> bool:
        if not self._args.started:
            self._text = self._text.lstrip()  # the blank after "arguments":
        n = self._args.scan(self._text)
        piece, self._text = self._text[:n], self._text[n:]
        if piece:
            self.calls[-1].arguments += piece
            out.calls.append(CallDelta(len(self.calls) - 1, piece))
        if not self._args.done:
            return False
        # The arguments ended: this object closes; another may follow in a list.
        tail = self._text.lstrip()
        if not tail:
            return False
        if tail[0] == "}":
            self._text = tail[1:]  # the call's object closed; the next call's head may follow
        self._head_done = False
        return True


class _ArgsScanner:
    """Finds where one JSON value ends, a character at a time (strings and escapes aware)."""

    __slots__ = ("depth", "in_string", "escaped", "started", "done")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False
        self.started = self.done = False

    def scan(self, text: str) -> int:
        """How many characters of text belong to the value (it starts at text[0])."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            self.started = True
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    self.done = self.depth == 0
            elif ch == '"':
                self.in_string = True
            elif ch == "<":  # never JSON outside a string: the tag closed mid-arguments
                self.done = True
                return i
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                if self.depth == 0:  # a scalar value ended at its object's close
                    self.done = True
                    return i
                self.depth -= 1
                self.done = self.depth == 0
            elif self.depth == 0 and ch == ",":
                self.done = True
                return i
        return len(text)


def _read_calls(body: str) -> list[tuple[str, str]] | None:
    """Calls in a tag body of any common shape, or None if it is no call."""
    try:  # not body.loads: a surrogate the model escaped keeps its call (_json_text)
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        calls.append((item["name"], args if isinstance(args, str) else _json_text(args)))
    return calls


def _json_text(value: Any) -> str:
    """value as JSON text, as UTF-8 as it can be: an unpaired surrogate the model escaped
    ("\\ud800") stays escaped, since no UTF-8 response can hold it."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def tag_start(text: str, tag: str) -> int:
    """The length of the tail of `text` that may be the start of `tag` (0: none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def open_tag_start(text: str, fmt: ToolFormat = HERMES) -> int:
    """The length of the tail of `text` that may be the start of a block's opening."""
    return tag_start(text, fmt.open)


def openai_deltas(pieces: list[CallDelta]) -> list[dict]:
    """Call pieces as OpenAI's `delta.tool_calls` entries (a call's consecutive pieces merged)."""
    out: list[dict] = []
    for p in pieces:
        if out and p.id is None and out[-1]["index"] == p.index:
            out[-1]["function"]["arguments"] += p.arguments
            continue
        entry: dict = {"index": p.index, "function": {"arguments": p.arguments}}
        if p.id is not None:
            entry = {"index": p.index, "id": p.id, "type": "function",
                     "function": {"name": p.name, "arguments": p.arguments}}
        out.append(entry)
    return out


def whole_calls(pieces: list[CallDelta]) -> list[Call]:
    """The calls that pieces streamed, each whole."""
    calls: list[Call] = []
    for p in pieces:
        if p.id is not None:
            calls.append(Call(p.id, p.name or "", p.arguments))
        else:
            calls[p.index].arguments += p.arguments
    return calls


def openai_calls(calls: list[Call]) -> list[dict]:
    """A message's `tool_calls`."""
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
