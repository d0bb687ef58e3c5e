"""Responses API request bodies parsed into the chat form every turn runs on.

`input` (a string, or items: messages, `function_call`, `function_call_output`) becomes chat
messages: a function call joins the assistant message before it as a tool call, an output
becomes a tool message. `instructions` is a system message in front (not carried on by
`previous_response_id`, as OpenAI does). `text.format` is the output schema; function `tools`
are flat ({"type": "function", "name", "parameters"}). Fields OpenAI defines that localserve
does not implement are refused when set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from server.api.errors import APIError, invalid, unsupported
from server.api.fields import Fields
from server.api.generation.protocol import (
    MAX_TOP_LOGPROBS,
    ChatRequest,
    cache_hints,
    left_out,
    parse_keep_alive,
)
from server.api.generation.reasoning import Thinking, parse_thinking
from server.api.generation.structured import parse_response_format
from server.api.generation.tools import parse_tools
from server.engine.sequence import SamplingParams

INPUT_ROLES = ("user", "system", "developer", "assistant")


@dataclass(slots=True)
class ResponsesRequest:
    chat: ChatRequest  # messages: this request's input only (no instructions, no history)
    instructions: str | None
    previous_response_id: str | None
    store: bool
    truncate: bool  # truncation "auto": the oldest items go until the rest fits the context
    background: bool = False  # answered at once, queued; generated after (background.py)
    conversation: str | None = None  # its items come first, its end adds to them
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response repeats

    @property
    def model(self) -> str:
        return self.chat.model

    @property
    def stream(self) -> bool:
        return self.chat.stream


def parse_responses_request(body: dict[str, Any], vocab_size: int) -> ResponsesRequest:
    f = Fields(body)
    model = f.str("model", required=True)
    messages = input_messages(f.raw("input"), "input")
    instructions = f.str("instructions")
    previous = f.str("previous_response_id")
    conversation = f.raw("conversation")
    if isinstance(conversation, dict) and set(conversation) == {"id"}:
        conversation = conversation["id"]
    if conversation is not None and not isinstance(conversation, str):
        raise invalid("conversation", "Invalid type for 'conversation': expected a "
                      "conversation id or an object with its 'id'.")
    if conversation is not None and previous is not None:
        raise invalid("conversation", "'conversation' and 'previous_response_id' cannot both "
                      "be set.")
    store = f.bool("store", True)
    stream = f.bool("stream")
    options = f.raw("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)
                                or set(options) - {"include_obfuscation"}):
        raise invalid("stream_options", "'stream_options' takes only 'include_obfuscation', "
                      "and only when 'stream' is true.")
    max_tokens = f.int("max_output_tokens", lo=1)
    raw_tools, choice = f.raw("tools"), f.raw("tool_choice")
    parallel = f.raw("parallel_tool_calls")
    try:
        tool_use = parse_tools(_chat_tools(raw_tools), _chat_choice(choice), parallel)
    except APIError as e:  # name the flat tool's fields, not the chat form's
        e.param = e.param and e.param.replace(".function.", ".")
        e.message = e.message.replace(".function.", ".")
        raise
    text = f.raw("text")
    output_schema, text_echo = _text(text)
    metadata = f.raw("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise invalid("metadata", "Invalid type for 'metadata': expected an object.")
    include = _include(f.raw("include"))
    top = f.int("top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
    logprobs = LOGPROBS in include  # top_logprobs alone: empty logprobs, as OpenAI gives
    params = SamplingParams(temperature=f.float("temperature", 1.0, 0.0, 2.0),
                            top_p=f.float("top_p", 1.0, 0.0, 1.0, lo_open=True),
                            logprobs=logprobs, top_logprobs=top if logprobs else 0)
    user = f.str("user")
    f.str("safety_identifier")
    cache_hints(f)
    f.str("service_tier")
    truncation = f.raw("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise invalid("truncation", f"Invalid value for 'truncation': {truncation!r}. "
                      "Supported values are: 'auto', 'disabled'.")
    background = f.bool("background")
    if background and not store:
        raise invalid("background", "A background response is stored: 'background' needs "
                      "'store' true.")
    thinking, keep_alive = _reasoning(f.raw("reasoning")), parse_keep_alive(f.raw("keep_alive"))
    f.refuse("prompt", (None,), "prompt templates")
    # calls to built-in tools, which localserve has none of: any bound holds (as on OpenAI
    # with function tools only)
    max_tool_calls = f.int("max_tool_calls", lo=1)
    f.refuse("moderation")
    f.refuse("context_management", (None,), "context management (compaction)")
    f.refuse("background_options", (None,), "background options")
    f.refuse("access_programs")
    f.refuse("image", (None,), "image generation")
    f.check_unknown()
    chat = ChatRequest(model=model, params=params, max_tokens=max_tokens, stream=stream,
                       user=user, messages=messages, output_schema=output_schema,
                       tool_use=tool_use, left_out=left_out(f, ("temperature", "top_p")),
                       thinking=thinking, keep_alive=keep_alive)
    echo = {"instructions": instructions, "max_output_tokens": max_tokens,
            "metadata": metadata or {}, "parallel_tool_calls": parallel is not False,
            "previous_response_id": previous, "store": store, "background": background,
            "conversation": {"id": conversation} if conversation else None,
            "max_tool_calls": max_tool_calls,
            "temperature": params.temperature, "top_p": params.top_p,
            "text": text_echo, "tool_choice": choice if choice is not None else "auto",
            "top_logprobs": top, "reasoning": {"effort": thinking.effort, "summary": None},
            "tools": raw_tools or [], "truncation": truncation or "disabled", "user": user}
    return ResponsesRequest(chat, instructions, previous, store, truncation == "auto",
                            background, conversation, echo)


# What `include` may name. Only the logprobs add anything here: the others belong to tools,
# image inputs and reasoning items that localserve's responses never hold.
LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = (LOGPROBS, "reasoning.encrypted_content", "message.input_image.image_url",
              "file_search_call.results", "web_search_call.action.sources",
              "code_interpreter_call.outputs", "computer_call_output.output.image_url")


def _reasoning(v: Any) -> Thinking:
    """`reasoning`: {effort, summary}; effort "none" turns thinking off. Summaries are not
    written (a reasoning item's `summary` stays empty), so asking for one changes nothing."""
    if v is None:
        return Thinking()
    if not isinstance(v, dict):
        raise invalid("reasoning", "Invalid type for 'reasoning': expected an object.")
    _keys(v, ("effort", "summary", "generate_summary"), "reasoning")
    for key in ("summary", "generate_summary"):
        if v.get(key) not in (None, "auto", "concise", "detailed"):
            raise invalid(f"reasoning.{key}", f"Invalid value for 'reasoning.{key}': "
                          f"{v[key]!r}. Supported values are: 'auto', 'concise', 'detailed'.")
    return parse_thinking(v.get("effort"), None, None, None, "reasoning.effort")


def _include(v: Any) -> set[str]:
    if v is None:
        return set()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise invalid("include", "Invalid type for 'include': expected an array of strings.")
    for x in v:
        if x not in INCLUDABLE:
            raise invalid("include", f"Invalid value for 'include': {x!r}. Supported values "
                          f"are: {', '.join(map(repr, INCLUDABLE))}.")
    return set(v)


def input_messages(v: Any, name: str) -> list[dict[str, Any]]:
    """Responses input (a string, or items) as chat messages; errors name the field `name`."""
    if isinstance(v, str):
        return [{"role": "user", "content": v}]
    if not isinstance(v, list) or not v:
        raise invalid(name, f"Invalid value for '{name}': expected a string or a non-empty "
                      "array of input items.")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(v):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, f"Invalid type for '{where}': expected an object.")
        kind = item.get("type", "message")
        if kind == "message":
            message = _message(item, where)
            last = out[-1] if out else {}
            if (message["role"] == "assistant" and last.get("reasoning_content")
                    and not last["content"] and not last.get("tool_calls")):
                last["content"] = message["content"]  # the answer after its reasoning
            else:
                out.append(message)
        elif kind == "reasoning":
            out.append({"role": "assistant", "content": "",
                        "reasoning_content": _reasoning_text(item, where)})
        elif kind == "function_call":
            call = _function_call(item, where)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            _keys(item, ("type", "call_id", "output", "id", "status"), where)
            if not isinstance(item.get("call_id"), str):
                raise invalid(f"{where}.call_id", f"Missing required parameter: "
                              f"'{where}.call_id'.")
            output = item.get("output")
            text = output if isinstance(output, str) else _parts(output, f"{where}.output",
                                                                 ("input_text",))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        else:
            raise unsupported(f"{where}.type", f"input items of type {kind!r}")
    return out


def message_items(message: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """A chat message as Responses items, their ids made from `key` (the inverse of
    input_messages)."""
    role = message["role"]
    if role == "tool":
        return [{"id": f"fco_{key}", "type": "function_call_output",
                 "call_id": message["tool_call_id"], "output": message["content"],
                 "status": "completed"}]
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(f"rs_{key}", message["reasoning_content"]))
    if message["content"] or not (message.get("tool_calls") or items):
        kind = "output_text" if role == "assistant" else "input_text"
        items.append({"id": f"msg_{key}", "type": "message", "role": role,
                      "status": "completed",
                      "content": [{"type": kind, "text": message["content"]}
                                  | ({"annotations": []} if role == "assistant" else {})]})
    items += [{"id": f"fc_{key}_{j}", "type": "function_call", "call_id": c["id"],
               "name": c["function"]["name"], "arguments": c["function"]["arguments"],
               "status": "completed"} for j, c in enumerate(message.get("tool_calls", []))]
    return items


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A `reasoning` output item: the thinking text as its content, no summary."""
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None,
            "status": status}


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    _keys(item, ("type", "role", "content", "id", "status"), where)
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise invalid(f"{where}.role", f"Invalid value for '{where}.role': {role!r}. "
                      f"Supported values are: {', '.join(map(repr, INPUT_ROLES))}.")
    content = item.get("content")
    kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    text = content if isinstance(content, str) else _parts(content, f"{where}.content", kinds)
    return {"role": "system" if role == "developer" else role, "content": text}


def _parts(v: Any, where: str, kinds: tuple[str, ...]) -> str:
    if not isinstance(v, list):
        raise invalid(where, f"Invalid type for '{where}': expected a string or an array of "
                      "content parts.")
    texts = []
    for j, part in enumerate(v):
        p = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            if kind in ("input_image", "input_file", "input_audio"):
                raise unsupported(f"{p}.type", f"content parts of type {kind!r}")
            raise invalid(f"{p}.type", f"Invalid value for '{p}.type': {kind!r}. Supported "
                          f"values are: {', '.join(map(repr, kinds))}.")
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise invalid(f"{p}.text", f"Invalid type for '{p}.text': expected a string.")
        texts.append(value)
    return "\n".join(texts)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item sent back: its text (content), else its summary's."""
    _keys(item, ("type", "id", "summary", "content", "encrypted_content", "status"), where)
    for key, kinds in (("content", ("reasoning_text",)), ("summary", ("summary_text",))):
        if item.get(key):
            return _parts(item[key], f"{where}.{key}", kinds)
    return ""


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    _keys(item, ("type", "call_id", "name", "arguments", "id", "status"), where)
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise invalid(f"{where}.{key}", f"Missing required parameter: '{where}.{key}'.")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _keys(item: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in item:
        if key not in allowed:
            raise invalid(f"{where}.{key}", f"Unrecognized parameter '{where}.{key}'.")


def _chat_tools(v: Any) -> Any:
    """Responses' flat function tools in chat's nested form (parse_tools checks the rest)."""
    if not isinstance(v, list):
        return v
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict):
            raise invalid(f"tools[{i}]", f"Invalid type for 'tools[{i}]': expected an object.")
        if t.get("type") != "function":
            raise unsupported(f"tools[{i}].type", f"tools of type {t.get('type')!r}; only "
                              "'function'")
        out.append({"type": "function", "function": {k: t[k] for k in t if k != "type"}})
    return out


def _chat_choice(v: Any) -> Any:
    if isinstance(v, dict) and v.get("type") == "function":
        return {"type": "function", "function": {"name": v.get("name")}}
    if isinstance(v, dict) and v.get("type") in ("none", "auto", "required"):
        return v["type"]
    return v


def _text(v: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(the output schema, the `text` the response repeats)."""
    if v is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(v, dict):
        raise invalid("text", "Invalid type for 'text': expected an object.")
    _keys(v, ("format", "verbosity"), "text")
    if v.get("verbosity") not in (None, "medium"):
        raise unsupported("text.verbosity")
    fmt = v.get("format")
    if fmt is None:
        return None, {"format": {"type": "text"}}
    return parse_response_format(fmt, "text.format", flat=True), {"format": fmt}
