"""Chat messages parsed: roles, content parts, an assistant's past tool calls, tool results.

The deprecated forms become the current ones: an assistant's `function_call` a tool call, a
`function` message (its `name` and `content`) that call's tool result."""

from __future__ import annotations

from typing import Any

from server.api.errors import invalid, unsupported

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def parse_messages(v: Any) -> list[dict[str, Any]]:
    """`messages`: [{role, content}, plus an assistant's tool_calls or a tool's tool_call_id]."""
    if v is None:
        raise invalid("messages", "Missing required parameter: 'messages'.")
    if not isinstance(v, list):
        raise invalid("messages", "Invalid type for 'messages': expected an array.")
    if not v:
        raise invalid("messages", "'messages' must contain at least one message.")
    out = []
    function_call_id = None  # the id given to the last deprecated `function_call`
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, f"Invalid type for '{where}': expected an object.")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise invalid(f"{where}.role", f"Invalid value for '{where}.role': {role!r}. "
                          f"Supported values are: {', '.join(map(repr, ROLES))}.")
        calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls", role)
        if m.get("function_call") is not None and role == "assistant":
            if calls:
                raise invalid(f"{where}.function_call", f"Set '{where}.tool_calls' or the "
                              f"deprecated '{where}.function_call', not both.")
            function_call_id = f"call_{i}"
            calls = [{"id": function_call_id, "type": "function",
                      "function": _function(m["function_call"], f"{where}.function_call")}]
        content = _content(m.get("content"), f"{where}.content", role,
                           may_be_null=bool(calls) or role == "function")
        refusal = m.get("refusal")
        if refusal is not None and not isinstance(refusal, str):
            raise invalid(f"{where}.refusal", f"Invalid type for '{where}.refusal': expected "
                          "a string.")
        if refusal and not content:  # what the assistant said was its refusal
            content = refusal
        allowed = MESSAGE_FIELDS[role]
        for key in m:
            if key not in allowed:
                raise invalid(f"{where}.{key}", f"Unrecognized message field: {key}")
        message: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                   "content": content}
        if calls:
            message["tool_calls"] = calls
        reasoning = _reasoning(m, where) if role == "assistant" else None
        if reasoning:
            message["reasoning_content"] = reasoning
        if role == "function":  # the result of the deprecated `function_call` before it
            if not isinstance(m.get("name"), str):
                raise invalid(f"{where}.name", f"Missing required parameter: '{where}.name'.")
            message |= {"role": "tool", "tool_call_id": function_call_id or f"call_{m['name']}"}
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{where}.tool_call_id", f"Missing required parameter: "
                              f"'{where}.tool_call_id'.")
            message["tool_call_id"] = call_id
        out.append(message)
    return out


MESSAGE_FIELDS = {
    "system": ("role", "content", "name"), "developer": ("role", "content", "name"),
    "user": ("role", "content", "name"), "tool": ("role", "content", "tool_call_id"),
    "function": ("role", "content", "name"),
    "assistant": ("role", "content", "name", "refusal", "tool_calls", "audio",
                  "function_call", "reasoning_content", "reasoning"),
}


def _reasoning(m: dict[str, Any], where: str) -> str | None:
    """An assistant turn's reasoning sent back, under either name (llama-server and SGLang
    write `reasoning_content`, vLLM and Ollama `reasoning`): the template decides whether it
    is shown to the model again."""
    values = {}
    for key in ("reasoning_content", "reasoning"):
        v = m.get(key)
        if v is not None and not isinstance(v, str):
            raise invalid(f"{where}.{key}", f"Invalid type for '{where}.{key}': expected a "
                          "string.")
        if v:
            values[key] = v
    if len(set(values.values())) > 1:
        raise invalid(f"{where}.reasoning", f"'{where}.reasoning_content' and "
                      f"'{where}.reasoning' differ: send one.")
    return next(iter(values.values()), None)


def _tool_calls(v: Any, where: str, role: str) -> list[dict[str, Any]]:
    """An assistant message's past calls: [{id, type, function: {name, arguments}}]."""
    if v is None or v == []:
        return []
    if role != "assistant":
        raise invalid(where, f"Only assistant messages carry '{where}'.")
    if not isinstance(v, list):
        raise invalid(where, f"Invalid type for '{where}': expected an array.")
    calls = []
    for j, c in enumerate(v):
        w = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(c.get("id"), str):
            raise invalid(w, f"Invalid '{w}': expected an object with 'id', 'type' and "
                          "'function'.")
        if c.get("type", "function") != "function":
            raise unsupported(f"{w}.type", f"tool calls of type {c.get('type')!r}")
        calls.append({"id": c["id"], "type": "function",
                      "function": _function(fn, f"{w}.function")})
    return calls


def _function(fn: Any, where: str) -> dict[str, str]:
    """A past call's {name, arguments}."""
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
            fn.get("arguments"), str):
        raise invalid(where, f"Invalid '{where}': expected 'name' and 'arguments' strings.")
    return {"name": fn["name"], "arguments": fn["arguments"]}


def _content(v: Any, where: str, role: str, may_be_null: bool = False) -> str:
    if isinstance(v, str):
        return v
    if v is None and (role == "assistant" or may_be_null):
        return ""
    if not isinstance(v, list):
        raise invalid(where, f"Invalid type for '{where}': expected a string or an array of "
                      "content parts.")
    texts = []
    for j, part in enumerate(v):
        p = f"{where}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(p, f"Invalid content part '{p}': expected an object with a 'type'.")
        # an assistant's past refusal is what it said, in its words
        field = "refusal" if part["type"] == "refusal" and role == "assistant" else "text"
        if part["type"] != field:
            raise unsupported(f"{p}.type", f"content parts of type {part['type']!r}")
        if not isinstance(part.get(field), str):
            raise invalid(f"{p}.{field}", f"Invalid type for '{p}.{field}': expected a string.")
        texts.append(part[field])
    return "\n".join(texts)
