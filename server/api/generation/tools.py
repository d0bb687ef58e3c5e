"""Tool calling: `tools` / `tool_choice` parsed, tools and tool turns rendered into the prompt,
and the grammar that makes the model's calls well-formed.

A chat template that knows tools (it reads `tools`, `tool_calls`) gets them natively (past
calls written as the family writes them, tool_formats.py, where it does not read `tool_calls`).
Others (SmolLM2-135M's has no tools) get a Hermes-style default: the tools listed in the system
prompt, calls written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, results fed
back as `<tool_response>` turns. The grammar, in llguidance's Lark, in the model family's
markup (tool_formats.py: Hermes' `<tool_call>` blocks, Llama 3's bare object, Mistral's and
Granite's lists...; markup that is one special token named as that token):
- "required": one call (several when parallel_tool_calls), each object following its tool's
  parameter schema;
- a named tool: exactly one call of it (as vLLM and llama.cpp do: clients that name a tool,
  such as instructor and LangChain's structured output, read the first call; a small model
  left free to go on repeats the call until max_tokens cuts it);
- "auto": free text, but once the model writes the opening the call must be well-formed
  (a lazy lexeme: the text before the trigger is unconstrained; or text, which cannot hold
  an opening that is a special token, then the calls);
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

from server.api.errors import invalid, unsupported
from server.api.generation.structured import NAME
from server.api.generation.tool_formats import HERMES, ToolFormat, parsed_arguments
from server.api.generation.xml_calls import call_rules
from server.engine.grammar import lark_json, map_schemas, schemas_in

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

def tool_messages(messages: list[dict[str, Any]], use: ToolUse | None, template: str,
                  fmt: ToolFormat = HERMES
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: its own where it knows tools (past calls as
    the format writes them where it does not write `tool_calls`: Granite 3's), a Hermes-style
    system prompt and turns where it knows none."""
    offered = use is not None and use.is_active
    native_tools = "tools" in template
    if "tool_calls" in template:
        out = _native_turns(messages, fmt)
    elif native_tools:
        out = _text_turns(messages, fmt, results_as_user=False)
    else:
        out = _text_turns(messages, HERMES, results_as_user=True)
    if not offered:
        return out, None
    specs = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}} for t in use.tools]
    if fmt.tools_in_system:  # the system message's `tools`: a JSON list of the functions
        listed = json.dumps([s["function"] for s in specs], ensure_ascii=False)
        if out and out[0]["role"] == "system":
            return [dict(out[0], tools=listed), *out[1:]], None
        return [{"role": "system", "content": "", "tools": listed}, *out], None
    if native_tools:
        return out, specs
    return _with_system(out, hermes_system_prompt(specs)), None


def hermes_system_prompt(specs: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in specs)
    opening, closing = HERMES.open, HERMES.close
    return ("You can call functions to help with the user's request. The functions you can "
            f"call are listed in <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "To call a function, write its name and arguments as a JSON object within "
            f"{opening}{closing} tags:\n{opening}\n"
            '{"name": <function-name>, "arguments": <arguments-object>}\n'
            f"{closing}")


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _native_turns(messages: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    """Calls as Hugging Face templates take them: arguments as an object, ids as the family's
    template takes them."""
    out = []
    for m in messages:
        if fmt.harmony and m.get("reasoning_content") and not (
                m.get("tool_calls") and m["content"]):  # gpt-oss's template reads `thinking`
            m = dict(m, thinking=m["reasoning_content"])
        if m.get("tool_calls"):
            calls = [{"type": "function", "id": fmt.template_id(c["id"]), "function": {
                "name": c["function"]["name"],
                "arguments": parsed_arguments(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
            m = dict(m, tool_calls=calls)
        elif m["role"] == "tool":
            m = dict(m, tool_call_id=fmt.template_id(m["tool_call_id"]))
        out.append(m)
    return out


def _text_turns(messages: list[dict[str, Any]], fmt: ToolFormat, results_as_user: bool
                ) -> list[dict[str, Any]]:
    """Assistant tool calls written into the content as the format writes them; with
    `results_as_user` (a template that knows no tools), tool results as <tool_response> turns
    of the user (consecutive results in one turn)."""
    out: list[dict[str, Any]] = []
    previous = None  # the role of the message before m
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = fmt.call_text(m["tool_calls"])
            text = f"{m['content']}\n{calls}" if m["content"] else calls
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool" and results_as_user:
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif m["role"] == "tool":
            out.append(dict(m))
        else:
            out.append({"role": m["role"], "content": m["content"]})
        previous = m["role"]
    return out


# -- the grammar ---------------------------------------------------------------------------------

def tool_grammar(use: ToolUse, output_schema: dict[str, Any] | None, fmt: ToolFormat = HERMES,
                 atoms: dict[str, str] | None = None) -> str | None:
    """The Lark grammar the output follows in `fmt`'s markup, or None (no constraint);
    `output_schema`: the response format's, which an "auto" answer that calls no tool follows;
    `atoms`: markup that is one special token, as the grammar names it (`<[id]>`)."""
    if not use.is_active:
        return None
    atoms = atoms or {}
    tools = [t for t in use.tools if use.choice != "named" or t.name == use.name]
    schema = _calls_schema(tools, fmt.args_key)
    forced_several = use.forced and use.parallel and use.choice == "required"
    several = (forced_several or (not use.forced and use.parallel)) and not fmt.one_call
    lines = ["%llguidance {}"]
    if fmt.xml:  # Qwen3-Coder: a block a call, XML inside
        lines += call_rules(tools, lark_json)
        one = _block(fmt, atoms, '"\\n" call_body')
        calls = f'{one} ("\\n" {one})*' if several else one
    elif fmt.args_marker is not None:  # Mistral's name[ARGS]{...}, one opening a call
        lines += _named_calls(tools, fmt, atoms)
        one = "call_body"
        calls = "call_body+" if several else one
    elif fmt.listed:  # one block: the opening, a list of calls, the closing if any
        defs = schema.pop("$defs")
        array = {"type": "array", "items": schema, "minItems": 1, "$defs": defs}
        lines.append(f"call_body: {lark_json(array | ({} if several else {'maxItems': 1}))}")
        calls = one = _block(fmt, atoms, "call_body")
    elif fmt.bare:  # the reply is the call (calls: "; " between them)
        lines.append(f"call_body: {lark_json(schema)}")
        one = "call_body"
        calls = 'call_body ("; " call_body)*' if several else one
    else:  # a block a call
        lines.append(f"call_body: {lark_json(schema)}")
        one = _block(fmt, atoms, '"\\n" call_body "\\n"')
        calls = f'{one} ("\\n" {one})*' if several else one
    if use.forced:
        lines.append(f"start: {calls}")
    elif output_schema is not None:  # auto with a response format: the JSON answer or calls
        lines += [f"answer: {lark_json(output_schema)}", f"start: answer | {calls}"]
    elif fmt.bare:  # auto: text that is not a call, or the call
        lines += ["TEXT: /[^{](.|\\n)*/", f"start: TEXT | {calls}"]
    elif fmt.open in atoms:  # auto: free text, which can never hold the opening token
        lines += [f"tool_call: {one}", "TEXT: /(.|\\n)*/"]
        ends_reply = fmt.close is None  # nothing may follow the calls
        lines.append(("start: TEXT tool_call*" if several else "start: TEXT tool_call?")
                     if ends_reply else "start: TEXT (tool_call TEXT)*" if several
                     else "start: TEXT (tool_call TEXT)?")
    else:  # auto: free text; once the model writes the opening, well-formed calls
        opening = _atom(fmt.open, atoms)
        rest = one[len(opening):]
        lines += [f"call_head[lazy]: TEXT {opening}", f"tool_call: call_head {rest}",
                  "TEXT: /(.|\\n)*/"]
        lines.append("start: tool_call* TEXT" if several and not fmt.listed
                     else "start: TEXT | tool_call")
    return "\n".join(lines)


def _named_calls(tools: list[Tool], fmt: ToolFormat, atoms: dict[str, str]) -> list[str]:
    """The rules of one call in Mistral's named form: the opening, a tool's name (its id), the
    arguments marker, its parameters."""
    opening, marker = _atom(fmt.open, atoms), _atom(fmt.args_marker, atoms)
    call_id = f" {_atom(fmt.id_marker, atoms)} CALL_ID" if fmt.id_marker else ""
    lines = [f"call_body: {' | '.join(f'tool{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        lines.append(f"tool{i}: {opening} {json.dumps(tool.name)}{call_id} {marker} "
                     f"{lark_json(tool.parameters)}")
    if fmt.id_marker:
        lines.append(f"CALL_ID: /[a-zA-Z0-9]{{{fmt.id_length}}}/")
    return lines


def _atom(marker: str, atoms: dict[str, str]) -> str:
    """Markup in a grammar: its special token, or its text."""
    return atoms.get(marker) or json.dumps(marker)


def _block(fmt: ToolFormat, atoms: dict[str, str], inner: str) -> str:
    closing = f" {_atom(fmt.close, atoms)}" if fmt.close else ""
    return f"{_atom(fmt.open, atoms)} {inner}{closing}"


def _calls_schema(tools: list[Tool], args_key: str = "arguments") -> dict[str, Any]:
    """One call of any of `tools`: {"name": its name, args_key: per its parameters}. Each
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
                                                       args_key: {"$ref": at}},
                      "required": ["name", args_key], "additionalProperties": False})
    return (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"$defs": defs}


def _rebased(schema: dict[str, Any], at: str) -> dict[str, Any]:
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        return schema | {"$ref": at + ref[1:]}
    return schema
