"""Qwen3-Coder's tool calls, XML rather than JSON:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text: a string as it is, any other type as JSON. The parser reads the
markup as it streams (the call's id and name at `<function=...>`, then its arguments as a JSON
object, a parameter at a time, each value typed by its tool's schema), a whole answer being the
stream fed at once; the grammar writes the markup and, per parameter, the text up to the closing
tag (a string) or the schema's JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.api.generation.tool_calls import Call, CallDelta, Parsed, StepParser, tag_start
from server.api.generation.tool_formats import ToolFormat

FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?")
PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>\n?")
END_VALUE, END_FUNCTION = "</parameter>", "</function>"


class XmlCallParser(StepParser):
    def __init__(self, fmt: ToolFormat, schemas: dict[str, dict[str, Any]]) -> None:
        self.fmt = fmt
        self.schemas = schemas  # tool name -> its parameters' schema
        self.calls: list[Call] = []
        self._text = ""
        self._where = "out"  # out, block (after <tool_call>), call (inside <function=...>)
        self._num_params = 0

    def finish(self) -> Parsed:
        """The end: held-back text; a call cut before its end is dropped with its markup."""
        out = self.feed("")
        if self._where == "out":
            out.content += self._text if not self.calls else self._text.rstrip()
        self._text = ""
        return out

    def _step(self, out: Parsed) -> bool:
        text = self._text
        if self._where == "out":
            i = text.find(self.fmt.open)
            if i < 0:
                ready = text[:len(text) - tag_start(text, self.fmt.open)].rstrip()
                out.content += ready
                self._text = text[len(ready):]
                return False
            out.content += text[:i].rstrip()
            self._text, self._where = text[i + len(self.fmt.open):], "block"
            return True
        if self._where == "block":
            m = FUNCTION.match(text)
            closed = text.lstrip().startswith(self.fmt.close or "\0")
            if closed:
                self._text, self._where = text.lstrip()[len(self.fmt.close):], "out"
                return True
            if m is None:
                return False
            call = Call(self.fmt.call_id(), m.group(1).strip())
            self.calls.append(call)
            out.calls.append(CallDelta(len(self.calls) - 1, "", call.id, call.name))
            self._text, self._where, self._num_params = text[m.end():], "call", 0
            return True
        return self._parameter(out)

    def _parameter(self, out: Parsed) -> bool:
        text, call = self._text, self.calls[-1]
        if text.lstrip().startswith(END_FUNCTION):
            piece = "}" if self._num_params else "{}"
            self._emit(out, piece)
            self._text, self._where = text.lstrip()[len(END_FUNCTION):], "block"
            return True
        m = PARAMETER.match(text)
        end = text.find(END_VALUE, m.end()) if m else -1
        if end < 0:
            return False
        key, value = m.group(1).strip(), text[m.end():end]
        value = value[:-1] if value.endswith("\n") else value
        schema = self.schemas.get(call.name, {}).get("properties", {}).get(key, {})
        piece = f"{', ' if self._num_params else '{'}{json.dumps(key)}: {typed(value, schema)}"
        self._emit(out, piece)
        self._num_params += 1
        self._text = text[end + len(END_VALUE):]
        return True

    def _emit(self, out: Parsed, piece: str) -> None:
        self.calls[-1].arguments += piece
        out.calls.append(CallDelta(len(self.calls) - 1, piece))


def typed(value: str, schema: dict[str, Any]) -> str:
    """A parameter's raw text as a JSON value: a string where its schema says so (or where the
    text is no JSON), else the JSON it is."""
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if "string" in kinds or (kinds == [None] and all(
            isinstance(v, str) for v in schema.get("enum", [None]))):
        return json.dumps(value, ensure_ascii=False)
    try:
        return json.dumps(json.loads(value), ensure_ascii=False)
    except ValueError:
        return json.dumps(value, ensure_ascii=False)


def call_rules(tools: list[Any], lark_json) -> list[str]:
    """Lark rules for one call of any of `tools` (`call_body`): its function line, then each
    parameter in its schema's order (the required ones required), then the function's end."""
    rules = [f"call_body: {' | '.join(f'tool{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        props = tool.parameters.get("properties") or {}
        required = set(tool.parameters.get("required") or [])
        parts = []
        for j, (key, schema) in enumerate(props.items()):
            rules.append(f"p{i}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} "
                         f"{_value(schema, lark_json)} {json.dumps(chr(10))}")
            parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
        head = json.dumps(f"<function={tool.name}>\n")
        rules.append(f"tool{i}: {head} {' '.join(parts)} {json.dumps(END_FUNCTION + chr(10))}")
    rules.append('string_value[lazy]: /(.|\\n)*\\n<\\/parameter>/')
    return rules


def _value(schema: Any, lark_json) -> str:
    """A parameter's value and its closing tag: raw text for a string, JSON otherwise."""
    close = json.dumps("\n" + END_VALUE)
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and all(
            isinstance(v, str) for v in schema["enum"]):
        return f"({' | '.join(json.dumps(v) for v in schema['enum'])}) {close}"
    if isinstance(schema, dict) and schema.get("type") == "string":
        return "string_value"
    return f"{lark_json(schema if isinstance(schema, dict) else {})} {close}"
