"""Request bodies parsed into dataclasses; every bad field is a 400 that names it.

Fields OpenAI defines that localserve does not implement are refused when set (never silently
ignored); fields nobody defines are refused as OpenAI does ("Unrecognized request argument").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from server.api.errors import invalid, unsupported
from server.api.fields import Fields, parse_metadata
from server.api.generation.messages import parse_messages
from server.api.generation.reasoning import Thinking, parse_thinking
from server.api.generation.structured import parse_response_format
from server.api.generation.tools import ToolUse, parse_functions, parse_tools
from server.engine.sequence import SamplingParams

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16
# Fields vLLM's router (and SGLang's, whose design it shares) adds to every body it forwards,
# at these values, which change nothing here: accepted at them, refused at any other.
ROUTER_FIELDS = {"no_stop_trim": False, "skip_special_tokens": True,
                 "return_hidden_states": False}
ROUTER_CHAT_FIELDS = {"separate_reasoning": True, "stream_reasoning": True,
                      "include_reasoning": True}
# The sampling fields a model's recommended settings (storage/sampling.py) fill in where a
# request leaves them out.
MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(slots=True)
class GenerateRequest:
    """What chat and completions share: the model, sampling and how to answer."""

    model: str
    params: SamplingParams  # max_tokens filled in once the prompt length is known
    max_tokens: int | None  # None: as many as the context allows
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    # The sampling fields the request left out: the model's defaults apply to these
    # (pipeline.with_model_defaults); empty: the request's params are used as they are.
    left_out: frozenset[str] = frozenset()
    # Seconds its model stays loaded after this request (Ollama's keep_alive, an extra field
    # on every generating API; negative: for good; None: the server's)
    keep_alive: float | None = None


def left_out(f: Fields, settable: tuple[str, ...] = MODEL_DEFAULTED) -> frozenset[str]:
    """The MODEL_DEFAULTED fields a body leaves out (absent or null), and those its API has no
    field for (`settable` names the ones it has)."""
    return frozenset(name for name in MODEL_DEFAULTED
                     if name not in settable or f.body.get(name) is None)


@dataclass(slots=True)
class ChatRequest(GenerateRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    output_schema: dict[str, Any] | None = None  # response_format beyond text
    tool_use: ToolUse | None = None  # tools offered, and how they may be called
    continue_final: bool = False  # the reply continues the final (assistant) message's text
    prediction: str | None = None  # predicted outputs: the reply's expected text
    store: bool = False  # kept for GET /v1/chat/completions (stored_completions.py)
    metadata: dict[str, str] | None = None  # stored with it, to filter the list by
    thinking: Thinking = field(default_factory=Thinking)  # how much the model may think
    # Anthropic's message threads: ("create" or "continue", the previous message's id, the
    # fields the thread keeps)
    thread: tuple[str, str | None, dict[str, Any]] | None = None


@dataclass(slots=True)
class CompletionRequest(GenerateRequest):
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False
    logprobs: int | None = None  # legacy: how many top tokens per position


def _common(f: Fields, vocab_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Sampling and streaming fields of both endpoints: (SamplingParams kwargs, other)."""
    model = f.str("model", required=True)
    stream = f.bool("stream")
    options = f.raw("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options",
                          "The 'stream_options' parameter is only allowed when 'stream' is "
                          "enabled.")
        if not isinstance(options, dict):
            raise invalid("stream_options", "Invalid type for 'stream_options': expected an "
                          "object.")
        sub = Fields(options)
        include_usage = sub.bool("include_usage")
        sub.bool("continuous_usage_stats")  # accepted: vLLM clients send it
        sub.bool("include_obfuscation")  # OpenAI's padding against side channels: none here
        for name in options:
            if name not in sub.seen:
                raise invalid(f"stream_options.{name}",
                              f"Unrecognized stream option: {name}")
    top_k = f.int("top_k", 0, lo=-1)
    kw = dict(
        temperature=f.float("temperature", 1.0, 0.0, 2.0),
        top_p=f.float("top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),
        min_p=f.float("min_p", 0.0, 0.0, 1.0),
        seed=f.int("seed"),
        presence_penalty=f.float("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=f.float("frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=f.float("repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        logit_bias=_logit_bias(f.raw("logit_bias"), vocab_size),
        stop=_stop(f.raw("stop")),
        stop_token_ids=tuple(_token_ids(f.raw("stop_token_ids") or [], "stop_token_ids",
                                         vocab_size)),
        ignore_eos=f.bool("ignore_eos"),
        n=f.int("n", 1, lo=1, hi=MAX_N),
    )
    best_of = f.int("best_of")
    if best_of is not None and best_of != kw["n"]:
        raise unsupported("best_of", "only best_of equal to n")
    other = dict(model=model, stream=stream, include_usage=include_usage,
                 user=f.str("user"), left_out=left_out(f),
                 keep_alive=parse_keep_alive(f.raw("keep_alive")))
    f.str("service_tier")
    f.str("safety_identifier")
    cache_hints(f)
    router_fields(f, ROUTER_FIELDS)
    return kw, other


def router_fields(f: Fields, fields: dict[str, bool]) -> None:
    for name, value in fields.items():
        f.refuse(name, (None, value), f"only {str(value).lower()}")


KEEP_ALIVE = re.compile(r"^(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)?$")
UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600}


def parse_keep_alive(v: Any) -> float | None:
    """`keep_alive`: seconds, or a duration as Ollama writes one ("5m", "1h", "-1")."""
    if v is None:
        return None
    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    m = KEEP_ALIVE.match(v.strip()) if isinstance(v, str) else None
    if m is None:
        raise invalid("keep_alive", f"Invalid value for 'keep_alive': {v!r}: expected seconds "
                      "or a duration such as \"5m\".")
    return float(m.group(1)) * UNITS[m.group(2) or "s"]


def cache_hints(f: Fields) -> None:
    """OpenAI's prompt caching settings, checked and let be: the prefix cache here reuses
    every shared prefix it still holds, and a hit never changes a result."""
    f.str("prompt_cache_key")
    retention = f.raw("prompt_cache_retention")
    if retention not in (None, "in_memory", "24h"):
        raise invalid("prompt_cache_retention", f"Invalid value for 'prompt_cache_retention': "
                      f"{retention!r}. Supported values are: 'in_memory', '24h'.")
    options = f.raw("prompt_cache_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise invalid("prompt_cache_options", "Invalid type for 'prompt_cache_options': "
                      "expected an object.")
    for key, value in options.items():
        where = f"prompt_cache_options.{key}"
        if key not in ("mode", "ttl"):
            raise invalid(where, f"Unrecognized parameter '{where}'.")
        if key == "mode" and value not in ("implicit", "explicit"):
            raise invalid(where, f"Invalid value for '{where}': {value!r}. Supported values "
                          "are: 'implicit', 'explicit'.")
        if key == "ttl" and not isinstance(value, str):
            raise invalid(where, f"Invalid type for '{where}': expected a string.")


def _max_tokens(f: Fields) -> int | None:
    a = f.int("max_tokens", lo=1)
    b = f.int("max_completion_tokens", lo=1)
    if a is not None and b is not None and a != b:
        raise invalid("max_tokens", "Set 'max_tokens' or 'max_completion_tokens', not both.")
    return a if a is not None else b


def _tool_use(f: Fields) -> ToolUse | None:
    """`tools` and `tool_choice`, or the deprecated `functions` and `function_call`."""
    tool_use = parse_tools(f.raw("tools"), f.raw("tool_choice"), f.raw("parallel_tool_calls"))
    functions = parse_functions(f.raw("functions"), f.raw("function_call"))
    if functions is None:
        return tool_use
    for new, old in (("tools", "functions"), ("tool_choice", "function_call")):
        if f.raw(new) is not None and f.raw(old) is not None:
            raise invalid(old, f"Set '{new}' or the deprecated '{old}', not both.")
    return functions


def parse_chat(body: dict[str, Any], vocab_size: int) -> ChatRequest:
    f = Fields(body)
    messages = parse_messages(f.raw("messages"))
    kw, other = _common(f, vocab_size)
    logprobs = f.bool("logprobs")
    top = f.int("top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise invalid("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
    max_tokens = _max_tokens(f)
    tool_use = _tool_use(f)
    output = parse_response_format(f.raw("response_format"))
    f.refuse("audio")
    f.refuse("modalities", (None, ["text"]))
    prediction = _prediction(f.raw("prediction"), kw, tool_use)
    f.refuse("web_search_options")
    thinking = chat_thinking(f)
    f.refuse("verbosity")
    store = f.bool("store")
    f.refuse("moderation")
    metadata = parse_metadata(f.raw("metadata"))
    continue_final = _continue_final(f, messages)
    router_fields(f, ROUTER_CHAT_FIELDS)
    f.check_unknown()
    params = SamplingParams(logprobs=logprobs, top_logprobs=top or 0, **kw)
    return ChatRequest(params=params, max_tokens=max_tokens, messages=messages,
                       output_schema=output, tool_use=tool_use, continue_final=continue_final,
                       prediction=prediction, store=store, metadata=metadata,
                       thinking=thinking, **other)


def chat_thinking(f: Fields) -> Thinking:
    """reasoning_effort, chat_template_kwargs, Ollama's think, max_reasoning_tokens."""
    return parse_thinking(f.raw("reasoning_effort"), f.raw("chat_template_kwargs"),
                          f.raw("think"), f.raw("max_reasoning_tokens"))


def _prediction(v: Any, kw: dict[str, Any], tool_use: ToolUse | None) -> str | None:
    """Predicted outputs: `{"type": "content", "content": text or text parts}`, the reply's
    expected text. Refused with what OpenAI refuses it with and a penalty (a drafted token's
    penalties would need its own history): several choices, tools, penalties."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("prediction", "Invalid type for 'prediction': expected an object.")
    unknown = sorted(set(v) - {"type", "content"})
    if unknown:
        raise invalid(f"prediction.{unknown[0]}",
                      f"Unrecognized parameter 'prediction.{unknown[0]}'.")
    if v.get("type") != "content":
        raise invalid("prediction.type", f"Invalid value for 'prediction.type': "
                      f"{v.get('type')!r}. Supported values are: 'content'.")
    content = v.get("content")
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            and set(p) == {"type", "text"} for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise invalid("prediction.content", "Invalid type for 'prediction.content': expected "
                      "a string or an array of text parts.")
    if kw["n"] > 1:
        raise invalid("n", "Predicted outputs do not support 'n' greater than 1.")
    if tool_use is not None and tool_use.is_active:
        raise invalid("functions" if tool_use.legacy else "tools",
                      "Predicted outputs do not support tools (function calling).")
    for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                      ("repetition_penalty", 1.0)):
        if kw[name] != off:
            raise invalid(name, f"Predicted outputs do not support '{name}'.")
    return content


def _continue_final(f: Fields, messages: list[dict[str, Any]]) -> bool:
    """vLLM's `continue_final_message` (with `add_generation_prompt` false): the reply
    continues the final message's text, as Anthropic's prefill does (and so does a grammar
    from tools or a response_format)."""
    cont = f.bool("continue_final_message")
    generation_prompt = f.bool("add_generation_prompt", True)
    if cont and generation_prompt and f.raw("add_generation_prompt") is not None:
        raise invalid("continue_final_message", "Cannot set both `continue_final_message` and "
                      "`add_generation_prompt` to True.")
    if not cont and not generation_prompt:
        raise unsupported("add_generation_prompt", "a prompt that ends after the last turn")
    if not cont:
        return False
    if not isinstance(messages[-1].get("content"), str) or not messages[-1]["content"].strip():
        raise invalid("continue_final_message", "`continue_final_message` needs a final message "
                      "with text to continue.")
    return True


def parse_completion(body: dict[str, Any], vocab_size: int) -> CompletionRequest:
    f = Fields(body)
    prompts = _prompts(f.raw("prompt"), vocab_size)
    kw, other = _common(f, vocab_size)
    logprobs = f.int("logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    max_tokens = f.int("max_tokens", 16, lo=0)
    echo = f.bool("echo")
    if max_tokens == 0 and not echo:
        raise invalid("max_tokens", "'max_tokens' must be at least 1 (0 only with 'echo': the "
                      "prompt back, scored with 'logprobs', nothing generated).")
    suffix = f.raw("suffix")
    if suffix not in (None, ""):
        raise unsupported("suffix", "insertion")
    f.check_unknown()
    # echo with logprobs: the prompt's tokens come back with theirs (lm-evaluation-harness
    # scores answers so)
    params = SamplingParams(logprobs=logprobs is not None, top_logprobs=logprobs or 0,
                            prompt_logprobs=logprobs if echo else None, **kw)
    return CompletionRequest(params=params, max_tokens=max_tokens, prompts=prompts, echo=echo,
                             logprobs=logprobs, **other)


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid("stop", "Invalid type for 'stop': expected a string or an array of "
                      "strings.")
    if len(v) > MAX_STOP:
        raise invalid("stop", f"'stop' holds at most {MAX_STOP} sequences.")
    return tuple(s for s in v if s)


def _logit_bias(v: Any, vocab_size: int) -> dict[int, float]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise invalid("logit_bias", "Invalid type for 'logit_bias': expected an object.")
    out = {}
    for k, bias in v.items():
        try:
            token = int(k)
        except ValueError:
            raise invalid("logit_bias", f"Invalid key in 'logit_bias': {k!r} is not a token "
                          "id.") from None
        if not 0 <= token < vocab_size:
            raise invalid("logit_bias", f"Invalid key in 'logit_bias': token id {token} is "
                          f"outside the vocabulary (0..{vocab_size - 1}).")
        if not isinstance(bias, int | float) or isinstance(bias, bool) or not -100 <= bias \
                <= 100:
            raise invalid("logit_bias", f"Invalid value in 'logit_bias' for {k}: expected a "
                          "number from -100 to 100.")
        out[token] = float(bias)
    return out


def _token_ids(v: Any, where: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in v):
        raise invalid(where, f"Invalid type for '{where}': expected an array of token ids.")
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        raise invalid(where, f"Token id {bad[0]} in '{where}' is outside the vocabulary "
                      f"(0..{vocab_size - 1}).")
    return v


def _prompts(v: Any, vocab_size: int) -> list[str | list[int]]:
    """`prompt`: a string, strings, token ids, or lists of token ids."""
    if v is None:
        raise invalid("prompt", "Missing required parameter: 'prompt'.")
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        if all(isinstance(p, str) for p in v):
            return list(v)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in v):
            return [_token_ids(v, "prompt", vocab_size)]
        if all(isinstance(p, list) and p for p in v):
            return [_token_ids(p, "prompt", vocab_size) for p in v]
    raise invalid("prompt", "Invalid value for 'prompt': expected a non-empty string, array of "
                  "strings, array of token ids or array of token id arrays.")

