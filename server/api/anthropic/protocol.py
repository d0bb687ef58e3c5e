"""Anthropic Messages request bodies parsed into the chat form every turn runs on.

`system` becomes a system message; a user turn's `tool_result` blocks become tool messages
(before its text, in order), an assistant turn's `tool_use` blocks its tool calls; `tools` and
`tool_choice` (auto, any, tool, none) map onto the chat tools; `output_config.format` is the
output's JSON schema. temperature, top_p and top_k arrive in the body (the 2.x SDK passes them
through extra_body). Unknown fields are a 400, as Anthropic answers them.
"""

from __future__ import annotations

import json
from typing import Any

from server.api.errors import invalid, unsupported
from server.api.fields import Fields
from server.api.generation.protocol import MAX_STOP, ChatRequest, left_out, parse_keep_alive
from server.api.generation.reasoning import Thinking
from server.api.generation.structured import NAME
from server.api.generation.tools import EMPTY_PARAMETERS, Tool, ToolUse
from server.engine.sequence import SamplingParams

UNKNOWN = "{}: Extra inputs are not permitted"
IGNORED_BLOCK_KEYS = ("cache_control", "citations")  # prefix caching is automatic
# An assistant message's thinking blocks as sent back: [(thinking, signature, field)], for the
# route to check (and remove) before the message reaches the template
SIGNED = "_signed_thinking"
# What a thread keeps from the turn that created it: a turn that continues it leaves them out
THREAD_FIELDS = ("system", "tools")


def parse_messages_request(body: dict[str, Any], vocab_size: int, count_only: bool = False
                           ) -> ChatRequest:
    """A /v1/messages body (or /v1/messages/count_tokens' with `count_only`)."""
    f = Fields(body)
    model = f.str("model", required=True)
    messages = _system(f.raw("system")) + _turns(f.raw("messages"))
    tool_use = _tools(f.raw("tools"), f.raw("tool_choice"))
    output_schema = _output_config(f.raw("output_config"))
    continue_final = _prefill(messages)
    thinking = _thinking(f.raw("thinking"))
    thread = _thread(f.raw("thread"), {k: f.raw(k) for k in THREAD_FIELDS})
    keep_alive = parse_keep_alive(f.raw("keep_alive"))  # Ollama's, an extra field here
    budget = thinking.budget
    _settings(f)
    if count_only:
        f.check_unknown(UNKNOWN)
        return ChatRequest(model=model, params=SamplingParams(), max_tokens=None,
                           messages=messages, output_schema=output_schema, tool_use=tool_use,
                           continue_final=continue_final, thinking=thinking, thread=thread)
    max_tokens = f.int("max_tokens", lo=1)
    if max_tokens is None:
        raise invalid("max_tokens", "max_tokens: Field required")
    if budget is not None and budget >= max_tokens:
        raise invalid("thinking.budget_tokens", "`max_tokens` must be greater than "
                      "`thinking.budget_tokens`.")
    stream = f.bool("stream")
    params = SamplingParams(
        temperature=f.float("temperature", 1.0, 0.0, 1.0),
        top_p=f.float("top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=f.int("top_k", 0, lo=0),
        stop=_stop_sequences(f.raw("stop_sequences")),
    )
    metadata = f.raw("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata", "metadata: Input should be a valid dictionary")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    f.str("service_tier")
    f.check_unknown(UNKNOWN)
    return ChatRequest(model=model, params=params, max_tokens=max_tokens, stream=stream,
                       user=user if isinstance(user, str) else None, messages=messages,
                       output_schema=output_schema, tool_use=tool_use,
                       continue_final=continue_final, thinking=thinking, thread=thread,
                       keep_alive=keep_alive,
                       left_out=left_out(f, ("temperature", "top_p", "top_k")))


def _prefill(messages: list[dict[str, Any]]) -> bool:
    """A final assistant message is the start of the reply (Anthropic's prefill): True when the
    reply continues its text (and a grammar from tools or output_config goes on from it). An
    empty one is dropped (a plain reply); trailing whitespace is refused as Anthropic refuses
    it."""
    last = messages[-1]
    if last["role"] != "assistant":
        return False
    if last.get("tool_calls"):
        raise unsupported("messages", "a final assistant message with tool_use blocks")
    if not last["content"]:
        messages.pop()
        return False
    if last["content"] != last["content"].rstrip():
        raise invalid("messages", "messages: final assistant content cannot end with trailing "
                      "whitespace")
    return True


def _settings(f: Fields) -> None:
    """Request settings that change nothing here, checked; those that would, refused."""
    cache = f.raw("cache_control")  # the prefix cache reuses any shared prefix on its own
    if cache is not None and not (isinstance(cache, dict) and cache.get("type") == "ephemeral"):
        raise invalid("cache_control", "cache_control: Input should be an object with type "
                      "'ephemeral'")
    f.str("inference_geo")
    if f.raw("speed") not in (None, "standard", "fast"):  # one speed here: as fast as it can
        raise invalid("speed", "speed: Input should be 'standard' or 'fast'")
    f.refuse("container", (None,), "code execution containers")
    f.refuse("diagnostics", (None,), "request diagnostics")


def _system(v: Any) -> list[dict[str, Any]]:
    if v is None:
        return []
    text = v if isinstance(v, str) else _text_blocks(v, "system")
    return [{"role": "system", "content": text}] if text else []


def _turns(v: Any) -> list[dict[str, Any]]:
    if v is None:
        raise invalid("messages", "messages: Field required")
    if not isinstance(v, list) or not v:
        raise invalid("messages", "messages: Input should be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(v):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise invalid(where, f"{where}: Input should be a valid dictionary")
        for key in m:
            if key not in ("role", "content"):
                raise invalid(f"{where}.{key}", UNKNOWN.format(f"{where}.{key}"))
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role", f"{where}.role: Input should be 'user' or "
                          "'assistant'")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise invalid(f"{where}.content", f"{where}.content: Input should be a valid "
                          "string or list of content blocks")
        if not content and (role == "user" or i < len(v) - 1):
            raise invalid(where, f"{where}: all messages must have non-empty content except "
                          "for the optional final assistant message")
        out += _user_turn(blocks, where) if role == "user" else [_assistant_turn(blocks, where)]
    return out


def _user_turn(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Tool results first (they answer the previous turn's calls), then the text."""
    results, texts = [], []
    for j, b in enumerate(blocks):
        w = f"{where}.content.{j}"
        kind = _block_type(b, w)
        if kind == "text":
            texts.append(_text(b, w))
        elif kind == "tool_result":
            _only(b, ("type", "tool_use_id", "content", "is_error"), w)
            if not isinstance(b.get("tool_use_id"), str):
                raise invalid(f"{w}.tool_use_id", f"{w}.tool_use_id: Field required")
            content = b.get("content", "")
            text = content if isinstance(content, str) else _text_blocks(content, w)
            if b.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif kind == "document":
            texts.append(_document(b, w))
        else:
            raise unsupported(f"{w}.type", f"content blocks of type {kind!r} in user turns")
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant_turn(blocks: list[Any], where: str) -> dict[str, Any]:
    texts, calls, thoughts = [], [], []
    for j, b in enumerate(blocks):
        w = f"{where}.content.{j}"
        kind = _block_type(b, w)
        if kind == "text":
            texts.append(_text(b, w))
        elif kind == "tool_use":
            _only(b, ("type", "id", "name", "input"), w)
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise invalid(w, f"{w}: a tool_use block needs 'id' and 'name'")
            if not isinstance(b.get("input", {}), dict):
                raise invalid(f"{w}.input", f"{w}.input: Input should be a valid dictionary")
            calls.append({"id": b["id"], "type": "function", "function": {
                "name": b["name"], "arguments": json.dumps(b.get("input", {}),
                                                           ensure_ascii=False)}})
        elif kind in ("thinking", "redacted_thinking"):
            keys = ("thinking", "signature") if kind == "thinking" else ("data",)
            _only(b, ("type", *keys), w)
            for key in keys:
                if not isinstance(b.get(key), str):
                    raise invalid(f"{w}.{key}", f"{w}.{key}: Input should be a valid string")
            if kind == "thinking":  # checked by the route (messages.py), then the template's
                thoughts.append((b["thinking"], b["signature"], f"{w}.signature"))
            # redacted_thinking is dropped, as Anthropic drops it
        else:
            raise unsupported(f"{w}.type", f"content blocks of type {kind!r}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "".join(t for t, _, _ in thoughts)
        message[SIGNED] = thoughts
    return message


def _thread(v: Any, fields: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]] | None:
    """`thread` (beta): {"type": "create"}, or {"type": "continue", "previous_message_id"};
    with the fields the thread keeps (THREAD_FIELDS, as sent)."""
    if v is None:
        return None
    if not isinstance(v, dict) or v.get("type") not in ("create", "continue"):
        raise invalid("thread.type", "thread.type: Input should be 'create' or 'continue'")
    if v["type"] == "create":
        _only(v, ("type",), "thread")
        return "create", None, fields
    _only(v, ("type", "previous_message_id"), "thread")
    previous = v.get("previous_message_id")
    if not isinstance(previous, str) or not previous:
        raise invalid("thread.previous_message_id", "thread.previous_message_id: Field "
                      "required")
    return "continue", previous, fields


def _thinking(v: Any) -> Thinking:
    """`thinking`, checked as Anthropic checks it: "enabled" (with its budget), "disabled",
    "adaptive" (the model's own choice; so is leaving it out)."""
    if v is None:
        return Thinking()
    kinds = ("enabled", "disabled", "adaptive", "between_tools")
    if not isinstance(v, dict) or v.get("type") not in kinds:
        raise invalid("thinking.type", f"thinking.type: Input should be one of "
                      f"{', '.join(map(repr, kinds))}")
    _only(v, ("type", "budget_tokens", "display") if v["type"] == "enabled" else
          ("type", "display") if v["type"] == "adaptive" else ("type",), "thinking")
    if v.get("display") not in (None, "summarized", "omitted"):
        raise invalid("thinking.display", "thinking.display: Input should be 'summarized' or "
                      "'omitted'")
    omitted = v.get("display") == "omitted"
    if v["type"] == "disabled":
        return Thinking(enabled=False)
    if v["type"] != "enabled":
        return Thinking(omitted=omitted)
    budget = v.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
        raise invalid("thinking.budget_tokens", "thinking.budget_tokens: Input should be an "
                      "integer greater than or equal to 1024")
    return Thinking(enabled=True, budget=budget, omitted=omitted)


def _document(b: dict[str, Any], where: str) -> str:
    """A plain text document (source `text`, or `content` of text blocks) as the user's text,
    in <document> tags with its title and context; PDFs and files are refused."""
    _only(b, ("type", "source", "title", "context"), where)
    citations = b.get("citations")
    if citations is not None and not isinstance(citations, dict):
        raise invalid(f"{where}.citations", f"{where}.citations: Input should be a valid "
                      "dictionary")
    if citations and citations.get("enabled"):
        raise unsupported(f"{where}.citations", "citations")
    source = b.get("source")
    kind = _block_type(source, f"{where}.source")
    if kind == "text":
        _only(source, ("type", "media_type", "data"), f"{where}.source")
        if source.get("media_type", "text/plain") != "text/plain":
            raise invalid(f"{where}.source.media_type", f"{where}.source.media_type: Input "
                          "should be 'text/plain'")
        text = source.get("data")
        if not isinstance(text, str):
            raise invalid(f"{where}.source.data", f"{where}.source.data: Input should be a "
                          "valid string")
    elif kind == "content":
        _only(source, ("type", "content"), f"{where}.source")
        content = source.get("content")
        text = content if isinstance(content, str) else _text_blocks(content,
                                                                    f"{where}.source.content")
    else:
        raise unsupported(f"{where}.source.type", f"documents with a {kind!r} source (PDFs "
                          "and files; plain text ones work)")
    head = []
    for key in ("title", "context"):
        value = b.get(key)
        if value is not None and not isinstance(value, str):
            raise invalid(f"{where}.{key}", f"{where}.{key}: Input should be a valid string")
        if value:
            head.append(f"<{key}>{value}</{key}>\n")
    return f"<document>\n{''.join(head)}{text}\n</document>"


def _block_type(b: Any, where: str) -> str:
    if not isinstance(b, dict) or not isinstance(b.get("type"), str):
        raise invalid(where, f"{where}: Input should be a content block with a 'type'")
    return b["type"]


def _text(b: dict[str, Any], where: str) -> str:
    _only(b, ("type", "text"), where)
    if not isinstance(b.get("text"), str):
        raise invalid(f"{where}.text", f"{where}.text: Input should be a valid string")
    return b["text"]


def _text_blocks(v: Any, where: str) -> str:
    if not isinstance(v, list):
        raise invalid(where, f"{where}: Input should be a valid string or list of text blocks")
    texts = []
    for j, b in enumerate(v):
        w = f"{where}.{j}"
        if _block_type(b, w) != "text":
            raise unsupported(f"{w}.type", f"blocks of type {b['type']!r} here")
        texts.append(_text(b, w))
    return "\n".join(texts)


def _only(b: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    for key in b:
        if key not in keys and key not in IGNORED_BLOCK_KEYS:
            raise invalid(f"{where}.{key}", UNKNOWN.format(f"{where}.{key}"))


def _stop_sequences(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid("stop_sequences", "stop_sequences: Input should be a list of strings")
    if len(v) > MAX_STOP:
        raise invalid("stop_sequences", f"stop_sequences: at most {MAX_STOP} sequences")
    return tuple(s for s in v if s)


def _tools(tools: Any, choice: Any) -> ToolUse | None:
    if tools is None or tools == []:
        if choice is not None and not (isinstance(choice, dict) and choice.get("type") in
                                       ("auto", "none")):
            raise invalid("tool_choice", "tool_choice: a tool choice needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "tools: Input should be a valid list")
    parsed = []
    for i, t in enumerate(tools):
        w = f"tools.{i}"
        if not isinstance(t, dict):
            raise invalid(w, f"{w}: Input should be a valid dictionary")
        if t.get("type", "custom") != "custom":
            raise unsupported(f"{w}.type", f"server tools ({t.get('type')!r}); only custom tools")
        _only(t, ("type", "name", "description", "input_schema", "strict"), w)
        name = t.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise invalid(f"{w}.name", f"{w}.name: String should match pattern "
                          "'^[a-zA-Z0-9_-]{1,64}$'")
        if name in (p.name for p in parsed):
            raise invalid(f"{w}.name", f"{w}.name: tool names must be unique ({name!r})")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"{w}.input_schema", f"{w}.input_schema: Field required")
        description = t.get("description") or ""
        if not isinstance(description, str):
            raise invalid(f"{w}.description", f"{w}.description: Input should be a string")
        parsed.append(Tool(name, description, schema or EMPTY_PARAMETERS))
    kind, name, parallel = _choice(choice, [t.name for t in parsed])
    return ToolUse(tuple(parsed), kind, name, parallel)


def _choice(v: Any, names: list[str]) -> tuple[str, str | None, bool]:
    """(chat choice, tool name, parallel calls allowed)."""
    if v is None:
        return "auto", None, True
    if not isinstance(v, dict) or v.get("type") not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice", "tool_choice: Input should be an object whose 'type' is "
                      "'auto', 'any', 'tool' or 'none'")
    _only(v, ("type", "name", "disable_parallel_tool_use"), "tool_choice")
    parallel = v.get("disable_parallel_tool_use") is not True
    if v["type"] == "tool":
        if v.get("name") not in names:
            raise invalid("tool_choice.name", f"tool_choice.name: no tool named "
                          f"{v.get('name')!r} in 'tools'")
        return "named", v["name"], parallel
    return {"auto": "auto", "any": "required", "none": "none"}[v["type"]], None, parallel


def _output_config(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("output_config", "output_config: Input should be a valid dictionary")
    _only(v, ("format", "effort"), "output_config")
    if v.get("effort") is not None:
        raise unsupported("output_config.effort", "effort levels")
    fmt = v.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise invalid("output_config.format", "output_config.format: Input should be "
                      "{'type': 'json_schema', 'schema': {...}}")
    _only(fmt, ("type", "schema"), "output_config.format")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise invalid("output_config.format.schema", "output_config.format.schema: Field "
                      "required")
    return schema
