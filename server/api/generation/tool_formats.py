"""Tool-call formats: how each model family writes its calls. A model held to another family's
markup calls tools worse than it was trained to, so the format is the template's own, found in
the chat template (`serve --tool-format` names one instead):

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one call a block (Qwen2.5,
  Qwen3, Hermes, SmolLM3; and the default for templates that know no tools, tools.py);
- llama3: the reply is one bare object `{"name": ..., "parameters": {...}}` (Llama 3.1-3.3);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Nemo: ids
  of nine letters and digits, which their templates require);
- mistral-args: `[TOOL_CALLS]name[ARGS]{...}` a call (Devstral, Magistral, Ministral 3), and
  mistral-call-id: `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` (Mistral Small 3.2: the model
  writes the id);
- granite: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (Granite 3.x);
- phi4: `<|tool_call|>[...]<|/tool_call|>` (Phi-4-mini, whose template takes the tool list as
  the system message's `tools`, a JSON string);
- qwen3-coder: `<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>`,
  a value raw text (xml_calls.py);
- harmony: gpt-oss's channels, a call a message `<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...}` (harmony.py: its thinking and answer are channels too).

A format is data: what opens a block of calls, what closes it (or the end of the reply), whether
the block holds a list, the key of the arguments. tool_calls.py parses any of them, tools.py
builds any one's grammar and puts past calls to the template (as the format writes them where
the template does not write them).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from server.api.body import loads


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    open: str  # what starts a block of calls
    close: str | None  # what ends it; None: the end of the reply
    listed: bool = False  # a block holds a JSON list of calls (else one call object)
    args_key: str = "arguments"
    bare: bool = False  # a reply that starts with "{" is a call without `open` (Llama 3)
    id_length: int | None = None  # call ids of this many letters and digits (Mistral's)
    one_call: bool = False  # the family writes one call a turn (Llama 3's templates refuse more)
    args_marker: str | None = None  # the name is text up to it, the arguments follow (Mistral)
    id_marker: str | None = None  # the model writes the call's id between it and args_marker
    xml: bool = False  # Qwen3-Coder's XML calls (xml_calls.py)
    harmony: bool = False  # gpt-oss's channels (harmony.py)
    tools_in_system: bool = False  # the tool list goes in the system message (Phi-4-mini's)

    def call_id(self) -> str:
        """A new call's id, as the family's template takes it back."""
        if self.id_length is not None:
            return uuid.uuid4().hex[:self.id_length]
        return f"call_{uuid.uuid4().hex[:24]}"

    def template_id(self, call_id: str) -> str:
        """A call id as the template must see it: the client's own where the family takes any,
        else one derived from it (the same for a call and its result)."""
        if self.id_length is None or re.fullmatch(f"[a-zA-Z0-9]{{{self.id_length}}}", call_id):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:self.id_length]

    def call_text(self, calls: list[dict[str, Any]]) -> str:
        """Past calls as the model writes them (for templates that do not write them)."""
        if self.xml:
            return "\n".join(
                f"{self.open}\n<function={c['function']['name']}>\n" + "".join(
                    f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n"
                    "</parameter>\n" for k, v in _object(c).items())
                + f"</function>\n{self.close}" for c in calls)
        if self.args_marker is not None:
            return "".join(
                self.open + c["function"]["name"]
                + (f"{self.id_marker}{self.template_id(c['id'])}" if self.id_marker else "")
                + self.args_marker + json.dumps(parsed_arguments(c["function"]["arguments"]),
                                                ensure_ascii=False) for c in calls)
        objects = [{"name": c["function"]["name"],
                    self.args_key: parsed_arguments(c["function"]["arguments"])} for c in calls]
        if self.listed:
            return f"{self.open}{json.dumps(objects, ensure_ascii=False)}{self.close or ''}"
        if self.bare:
            return "; ".join(json.dumps(o, ensure_ascii=False) for o in objects)
        return "\n".join(f"{self.open}\n{json.dumps(o, ensure_ascii=False)}\n{self.close}"
                         for o in objects)

    @property
    def markers(self) -> tuple[str, ...]:
        """The strings of the format's markup (kept in the text where they are special tokens)."""
        if self.harmony:
            return HARMONY_MARKUP
        return tuple(m for m in (self.open, self.close, self.args_marker, self.id_marker) if m)


HARMONY_MARKUP = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>")
HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
QWEN3_CODER = ToolFormat("qwen3-coder", "<tool_call>", "</tool_call>", xml=True)
FORMATS = {f.name: f for f in (
    HERMES,
    ToolFormat("llama3", "<|python_tag|>", None, args_key="parameters", bare=True,
               one_call=True),
    ToolFormat("mistral", "[TOOL_CALLS]", None, listed=True, id_length=9),
    ToolFormat("mistral-args", "[TOOL_CALLS]", None, id_length=9, args_marker="[ARGS]"),
    ToolFormat("mistral-call-id", "[TOOL_CALLS]", None, id_length=9, args_marker="[ARGS]",
               id_marker="[CALL_ID]"),
    ToolFormat("granite", "<|tool_call|>", None, listed=True),
    ToolFormat("phi4", "<|tool_call|>", "<|/tool_call|>", listed=True, tools_in_system=True),
    QWEN3_CODER,
    ToolFormat("harmony", "<|channel|>", "<|end|>", harmony=True),
)}
CHOICES = ("auto", *FORMATS)  # serve --tool-format


def detect(template: str, choice: str = "auto") -> ToolFormat:
    """The tool-call format of a chat template (`choice`: auto, or a format's name)."""
    if choice != "auto":
        return FORMATS[choice]
    if "<|channel|>" in template:
        return FORMATS["harmony"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral-call-id" if "[CALL_ID]" in template else
                       "mistral-args" if "[ARGS]" in template else "mistral"]
    if "message['tools']" in template or "<|/tool_call|>" in template:
        return FORMATS["phi4"]
    if "<|tool_call|>" in template:
        return FORMATS["granite"]
    if "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return FORMATS["llama3"]
    return HERMES


def _object(call: dict[str, Any]) -> dict[str, Any]:
    value = parsed_arguments(call["function"]["arguments"])
    return value if isinstance(value, dict) else {}


def parsed_arguments(arguments: str) -> Any:
    """A call's `arguments` string as JSON where it parses (templates expect an object)."""
    try:
        return loads(arguments)
    except ValueError:
        return arguments
