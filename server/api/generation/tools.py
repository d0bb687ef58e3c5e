"""Tool calling: `tools` / `tool_choice` parsed, tools and tool turns rendered into the prompt,
and the grammar that makes the model's calls well-formed.

A chat template that knows tools (it reads `tools`, `tool_calls`) gets them natively. Others
(SmolLM2-135M's has no tools) get a Hermes-style default: the tools listed in the system
prompt, calls written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, results fed
back as `<tool_response>` turns. The grammar, in llguidance's Lark:
- "required": one call (several when parallel_tool_calls), each object following its tool's
  parameter schema;
- a named tool: exactly one call of it (as vLLM and llama.cpp do: clients that name a tool,
  such as instructor and LangChain's structured output, read the first call; a small model
  left free to go on repeats the call until max_tokens cuts it);
- "auto": free text, but once the model writes `<tool_call>` the call must be well-formed
  (a lazy lexeme: the text before the trigger is unconstrained);
- "none": no tools in the prompt, no grammar, no parsing.
The deprecated `functions` / `function_call` (still served by OpenAI and sent by older code and
LangChain's function agents) are the same tools with one call at most, answered as the
message's `function_call` (chat.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.api.body import loads
from server.api.errors import invalid, unsupported
from server.api.generation.structured import NAME
from server.engine.grammar import lark_json, map_schemas, schemas_in

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(slots=True, frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema for the arguments object


@dataclass(slots=True, frozen=True)
class ToolUse:
    """The request's tools and how the model may use them."""

    tools: tuple[Tool, ...]
    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the tool of a named choice
    parallel: bool = True
    legacy: bool = False  # from `functions`: the call is answered as `function_call`

    @property
    def is_active(self) -> bool:
        """Tools are offered to the model (and its output parsed for calls)."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """The output is calls only ("required" or a named tool)."""
        return self.choice in ("required", "named")


def parse_tools(tools: Any, choice: Any, parallel: Any) -> ToolUse | None:
    """`tools`, `tool_choice`, `parallel_tool_calls` (400 naming the field at fault)."""
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "Invalid type for 'parallel_tool_calls': expected "
                      "a boolean.")
    parsed = _listed(tools, "tools", choice, "tool_choice", _tool, "tools[{}].function.name")
    if parsed is None:
        return None
    kind, name = _choice(choice, [t.name for t in parsed])
    return ToolUse(parsed, kind, name, parallel is not False)


def parse_functions(functions: Any, call: Any) -> ToolUse | None:
    """The deprecated `functions` ([{name, description, parameters}]) and `function_call`
    ("none", "auto" or {"name": ...}): tools of which the model calls one at most."""
    parsed = _listed(functions, "functions", call, "function_call", _function,
                     "functions[{}].name")
    if parsed is None:
        return None
    if call is None or call in ("none", "auto"):
        return ToolUse(parsed, call or "auto", None, parallel=False, legacy=True)
    name = call.get("name") if isinstance(call, dict) else None
    if not isinstance(call, dict) or set(call) != {"name"} or not isinstance(name, str):
        raise invalid("function_call", "Invalid value for 'function_call': expected 'none', "
                      "'auto' or {\"name\": ...}.")
    if name not in [f.name for f in parsed]:
        raise invalid("function_call", f"Invalid value for 'function_call': no function named "
                      f"{name!r} in 'functions'.")
    return ToolUse(parsed, "named", name, parallel=False, legacy=True)


def _listed(v: Any, field: str, choice: Any, choice_field: str, one: Callable[[Any, str], Tool],
            name_at: str) -> tuple[Tool, ...] | None:
    """The tools array `field`, each entry parsed by `one`, or None where it is absent or empty
    (then `choice_field` may only be absent or "none"); 400 at a name given twice (`name_at`:
    its field, {} the index)."""
    if v is None or v == []:
        if choice not in (None, "none"):
            raise invalid(choice_field, f"Invalid value for '{choice_field}': '{choice_field}' "
                          f"is only allowed when '{field}' are specified.")
        return None
    if not isinstance(v, list):
        raise invalid(field, f"Invalid type for '{field}': expected an array.")
    tools = tuple(one(t, f"{field}[{i}]") for i, t in enumerate(v))
    names = [t.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(name_at.format(i), f"Duplicate tool name: {name!r}.")
    return tools


def _tool(v: Any, where: str) -> Tool:
    if not isinstance(v, dict):
        raise invalid(where, f"Invalid type for '{where}': expected an object.")
    if v.get("type") != "function":
        raise unsupported(f"{where}.type", f"tools of type {v.get('type')!r}; only 'function'")
    for key in v:
        if key not in ("type", "function"):
            raise invalid(f"{where}.{key}", f"Unrecognized parameter '{where}.{key}'.")
    return _function(v.get("function"), f"{where}.function")


def _function(fn: Any, where: str) -> Tool:
    """A function's {name, description, parameters, strict} at `where` (a tool's `function`,
    or an entry of the deprecated `functions`)."""
    if not isinstance(fn, dict):
        raise invalid(where, f"Missing required parameter: '{where}'." if fn is None else
                      f"Invalid type for '{where}': expected an object.")
    for key in fn:
        if key not in ("name", "description", "parameters", "strict"):
            raise invalid(f"{where}.{key}", f"Unrecognized parameter '{where}.{key}'.")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid(f"{where}.name", f"Invalid '{where}.name': expected a string of letters, "
                      "digits, underscores and dashes, at most 64 long.")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise invalid(f"{where}.description",
                      f"Invalid type for '{where}.description': expected a string.")
    parameters = fn.get("parameters") or EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise invalid(f"{where}.parameters", f"Invalid type for '{where}.parameters': expected "
                      "a JSON schema object.")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise invalid(f"{where}.strict", f"Invalid type for '{where}.strict': expected a "
                      "boolean.")
    return Tool(name, description, parameters)


def _choice(v: Any, names: list[str]) -> tuple[str, str | None]:
    if v is None:
        return "auto", None
    if v in ("none", "auto", "required"):
        return v, None
    if isinstance(v, dict) and v.get("type") == "function":
        fn = v.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise invalid("tool_choice", f"Invalid value for 'tool_choice': no tool named "
                          f"{name!r} in 'tools'.")
        return "named", name
    if isinstance(v, dict) and isinstance(v.get("type"), str):
        raise unsupported("tool_choice", f"tool_choice of type {v['type']!r}")
    raise invalid("tool_choice", "Invalid value for 'tool_choice': expected 'none', 'auto', "
                  "'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}.")


# -- the prompt ----------------------------------------------------------------------------------

def tool_messages(messages: list[dict[str, Any]], use: ToolUse | None, template: str
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: native where the template knows tools, the
    Hermes-style default otherwise."""
    offered = use is not None and use.is_active
    native_tools = "tools" in template
    native_calls = "tool_calls" in template
    out = _native_turns(messages) if native_calls else _hermes_turns(messages)
    if not offered:
        return out, None
    specs = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}} for t in use.tools]
    if native_tools:
        return out, specs
    return _with_system(out, hermes_system_prompt(specs)), None


def hermes_system_prompt(specs: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in specs)
    return ("You can call functions to help with the user's request. The functions you can "
            f"call are listed in <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "To call a function, write its name and arguments as a JSON object within "
            f"{CALL_OPEN}{CALL_CLOSE} tags:\n{CALL_OPEN}\n"
            '{"name": <function-name>, "arguments": <arguments-object>}\n'
            f"{CALL_CLOSE}")


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _native_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls as Hugging Face templates take them: arguments as an object."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"type": "function", "id": c["id"], "function": {
                "name": c["function"]["name"],
                "arguments": parsed_arguments(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
            m = dict(m, tool_calls=calls)
        out.append(m)
    return out


def _hermes_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls written as <tool_call> text, tool results as <tool_response>
    turns of the user (consecutive results in one turn), for templates without tools."""
    out: list[dict[str, Any]] = []
    previous = None  # the role of the message before m
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{CALL_OPEN}\n{call_json(c)}\n{CALL_CLOSE}"
                              for c in m["tool_calls"])
            text = f"{m['content']}\n{calls}" if m["content"] else calls
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            out.append({"role": m["role"], "content": m["content"]})
        previous = m["role"]
    return out


def call_json(call: dict[str, Any]) -> str:
    """A past call as the model writes one (arguments as an object where they parse)."""
    fn = call["function"]
    return json.dumps({"name": fn["name"], "arguments": parsed_arguments(fn["arguments"])},
                      ensure_ascii=False)


def parsed_arguments(arguments: str) -> Any:
    """A call's `arguments` string as JSON where it parses (templates expect an object)."""
    try:
        return loads(arguments)
    except ValueError:
        return arguments


# -- the grammar ---------------------------------------------------------------------------------

def tool_grammar(use: ToolUse, output_schema: dict[str, Any] | None) -> str | None:
    """The Lark grammar the output follows, or None (no constraint); `output_schema`: the
    response format's, which an "auto" answer that calls no tool follows."""
    if not use.is_active:
        return None
    tools = [t for t in use.tools if use.choice != "named" or t.name == use.name]
    body = lark_json(_calls_schema(tools))
    call = f'"\\n" call_body "\\n{CALL_CLOSE}"'
    one = f'"{CALL_OPEN}" {call}'
    lines = ["%llguidance {}", f"call_body: {body}"]
    if use.forced:
        several = use.parallel and use.choice == "required"
        lines.append(f'start: {one} ("\\n" {one})*' if several else f"start: {one}")
    elif output_schema is not None:  # auto with a response format: the JSON answer or calls
        answer = lark_json(output_schema)
        calls = f'{one} ("\\n" {one})*' if use.parallel else one
        lines += [f"answer: {answer}", f"start: answer | {calls}"]
    else:  # auto: free text; once the model writes the opening tag, a well-formed call
        lines += [f'call_head[lazy]: TEXT "{CALL_OPEN}"', f"tool_call: call_head {call}",
                  "TEXT: /(.|\\n)*/"]
        lines.append("start: tool_call* TEXT" if use.parallel else "start: TEXT | tool_call")
    return "\n".join(lines)


def _calls_schema(tools: list[Tool]) -> dict[str, Any]:
    """One call of any of `tools`: {"name": its name, "arguments": per its parameters}. Each
    tool's parameters go under the call schema's `$defs` with their own references ("#",
    "#/$defs/Address": pydantic writes them so for nested models and enums) rebased there, where
    they resolve as they did from the parameters' own root. Parameters that declare an `$id`
    are their own resource, whose references resolve within it: those stay as written."""
    defs, calls = {}, []
    for i, tool in enumerate(tools):
        at, params = f"#/$defs/tool{i}", tool.parameters
        own = any("$id" in s for s in schemas_in(params))
        defs[f"tool{i}"] = params if own else map_schemas(params, lambda s, at=at: _rebased(s, at))
        calls.append({"type": "object", "properties": {"name": {"const": tool.name},
                                                       "arguments": {"$ref": at}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"$defs": defs}


def _rebased(schema: dict[str, Any], at: str) -> dict[str, Any]:
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        return schema | {"$ref": at + ref[1:]}
    return schema
