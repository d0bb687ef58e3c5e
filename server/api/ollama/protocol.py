"""Ollama's native request bodies (`/api/chat`, `/api/generate`) parsed into the chat form every
turn runs on. Ollama's shapes: `options` (temperature, top_p, top_k, min_p, seed, num_predict,
stop, repeat_penalty, presence_penalty, frequency_penalty; its load-time options such as
num_ctx and num_thread are taken and change nothing), `format` ("json" or a JSON schema),
`think`, `tools` (calls come back with their arguments as objects), `keep_alive`, and `stream`
true unless it is false. Past calls carry no ids: each gets one, and a `tool` message answers
the oldest unanswered call of its `tool_name` (else the oldest unanswered).
"""

from __future__ import annotations

import json
from typing import Any

from server.api.errors import invalid, unsupported
from server.api.fields import Fields
from server.api.generation.messages import parse_messages
from server.api.generation.protocol import MODEL_DEFAULTED, ChatRequest, parse_keep_alive
from server.api.generation.reasoning import parse_thinking
from server.api.generation.structured import ANY_OBJECT
from server.api.generation.tools import parse_tools
from server.engine.sequence import SamplingParams

# option -> (SamplingParams field, kind); the others Ollama knows are taken and change nothing
OPTIONS = {"temperature": ("temperature", float), "top_p": ("top_p", float),
           "top_k": ("top_k", int), "min_p": ("min_p", float), "seed": ("seed", int),
           "repeat_penalty": ("repetition_penalty", float),
           "presence_penalty": ("presence_penalty", float),
           "frequency_penalty": ("frequency_penalty", float)}


def parse_ollama_chat(body: dict[str, Any], vocab_size: int) -> ChatRequest:
    f = Fields(body)
    messages = parse_messages(_messages(f.raw("messages")))
    return _request(f, messages, f.raw("tools"))


def parse_ollama_generate(body: dict[str, Any], vocab_size: int) -> ChatRequest:
    """/api/generate: `prompt` (and `system`) through the chat template; an empty prompt only
    loads the model (the request's `max_tokens` is 0 then)."""
    f = Fields(body)
    prompt = f.str("prompt") or ""
    system = f.str("system")
    for name, what in (("suffix", "fill-in-the-middle"), ("template", "a template per request"),
                       ("context", "context token ids"), ("raw", "raw prompts")):
        if f.raw(name) not in (None, "", False, []):
            raise unsupported(name, what)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    req = _request(f, parse_messages(messages), None)
    if not prompt:
        req.max_tokens = 0
    return req


def _request(f: Fields, messages: list[dict[str, Any]], tools: Any) -> ChatRequest:
    model = f.str("model", required=True)
    stream = f.raw("stream") is not False
    if f.raw("stream") is not None and not isinstance(f.raw("stream"), bool):
        raise invalid("stream", "stream: expected a boolean")
    if f.raw("images"):
        raise unsupported("images", "images")
    schema = _format(f.raw("format"))
    tool_use = parse_tools(tools, "auto" if tools else None, None) if tools else None
    thinking = parse_thinking(None, None, f.raw("think"), None)
    stay = parse_keep_alive(f.raw("keep_alive"))
    kw, max_tokens, given = _options(f.raw("options"))
    for name in ("logprobs", "top_logprobs", "truncate", "shift", "dimensions"):
        if f.raw(name):
            raise unsupported(name)
    f.check_unknown()
    return ChatRequest(model=model, params=SamplingParams(**kw), max_tokens=max_tokens,
                       stream=stream, messages=messages, output_schema=schema,
                       tool_use=tool_use, thinking=thinking, keep_alive=stay,
                       left_out=frozenset(n for n in MODEL_DEFAULTED if n not in given))


def _format(v: Any) -> dict[str, Any] | None:
    if v in (None, ""):
        return None
    if v == "json":
        return ANY_OBJECT
    if isinstance(v, dict):
        return v
    raise invalid("format", "format: expected \"json\" or a JSON schema object")


def _options(v: Any) -> tuple[dict[str, Any], int | None, set[str]]:
    """(SamplingParams fields, max_tokens, the sampling fields given) from `options`."""
    if v is None:
        return {}, None, set()
    if not isinstance(v, dict):
        raise invalid("options", "options: expected an object")
    o = Fields(v)
    kw, given = {}, set()
    for name, (field, kind) in OPTIONS.items():
        value = o.raw(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (
                kind is int and not float(value).is_integer()):
            raise invalid(f"options.{name}", f"options.{name}: expected a number")
        kw[field] = kind(value)
        given.add(field)
    stop = o.raw("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise invalid("options.stop", "options.stop: expected a list of strings")
        kw["stop"] = tuple(s for s in stop if s)
    predict = o.raw("num_predict")
    if predict is not None and (not isinstance(predict, int) or isinstance(predict, bool)):
        raise invalid("options.num_predict", "options.num_predict: expected an integer")
    return kw, predict if predict is not None and predict > 0 else None, given


def _messages(v: Any) -> Any:
    """Ollama's messages as OpenAI's: ids for past calls, their arguments as JSON text, tool
    results tied to the calls they answer, thinking as reasoning."""
    if not isinstance(v, list):
        return v  # parse_messages says what is wrong
    out, open_calls = [], []  # (id, name) of calls not answered yet
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            out.append(m)
            continue
        m = dict(m)
        if m.pop("images", None):
            raise unsupported(f"messages[{i}].images", "images")
        if m.get("thinking"):
            m["reasoning_content"] = m.pop("thinking")
        m.pop("thinking", None)
        if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise invalid(f"messages[{i}].tool_calls[{j}]", "a tool call needs a "
                                  "function with a name")
                args = fn.get("arguments", {})
                text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                calls.append({"id": f"call_{i}_{j}", "type": "function",
                              "function": {"name": fn["name"], "arguments": text}})
                open_calls.append((f"call_{i}_{j}", fn["name"]))
            m["tool_calls"] = calls
        if m.get("role") == "tool":
            name = m.pop("tool_name", None)
            match = next((c for c in open_calls if c[1] == name), None) or (
                open_calls[0] if open_calls else (f"call_{i}", name))
            if match in open_calls:
                open_calls.remove(match)
            m["tool_call_id"] = match[0]
        out.append(m)
    return out
