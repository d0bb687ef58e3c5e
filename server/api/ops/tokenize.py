"""The tokenizer over HTTP, as vLLM serves it (lm-evaluation-harness's remote tokenizer reads
these three; llama.cpp's server has the first two, naming the text `content`):

- POST /tokenize: `prompt` (a string; `content` too) with `add_special_tokens` (default true),
  or a chat's `messages` (and `tools`, as /v1/chat/completions takes them) through the chat
  template -> {"count", "max_model_len", "tokens"};
- POST /detokenize: `tokens` -> {"prompt"} (and "content");
- GET /tokenizer_info: the special tokens, the chat template and the context length.

`model` (a query parameter of the third), where given, names the model whose tokenizer answers
(loaded if need be, as a generating request would); without it, the first model's. They need
the API key as /v1 does.
"""

from __future__ import annotations

from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.body import read_json
from server.api.errors import invalid
from server.api.fields import Fields
from server.api.generation.pipeline import off_loop
from server.api.generation.protocol import parse_chat
from server.api.generation.turn import prompt_token_ids
from server.api.state import ServerState


async def tokenize(request: Request) -> Response:
    state, f = await _fields(request)
    if f.raw("messages") is not None:
        given = {k: f.raw(k) for k in ("messages", "tools", "tool_choice")}
        chat = {k: v for k, v in given.items() if v is not None}
        f.check_unknown()
        req = parse_chat({"model": state.served_name} | chat, state.vocab_size)
        tokens = await prompt_token_ids(state, req, "messages")
    else:
        text = f.str("prompt")
        content = f.str("content")
        if (text is None) == (content is None):
            raise invalid("prompt", "Give the text to tokenize as 'prompt' (or 'content'), or "
                          "a chat as 'messages'.")
        special = f.bool("add_special_tokens", True)
        f.check_unknown()
        tokens = await off_loop(partial(state.tokenizer.encode, add_special_tokens=special),
                                text if text is not None else content)
    return JSONResponse({"count": len(tokens), "max_model_len": state.max_request_tokens,
                         "tokens": tokens})


async def detokenize(request: Request) -> Response:
    state, f = await _fields(request)
    tokens = f.raw("tokens")
    if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid("tokens", "'tokens' must be an array of token ids.")
    bad = next((t for t in tokens if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise invalid("tokens", f"Token id {bad} is outside the vocabulary "
                      f"(0..{state.vocab_size - 1}).")
    f.check_unknown()
    text = await off_loop(state.tokenizer.decode, tokens)
    return JSONResponse({"prompt": text, "content": text})


async def tokenizer_info(request: Request) -> Response:
    state: ServerState = request.app.state.server
    state.ready_engine()
    model = request.query_params.get("model")
    if model is not None:
        state = await state.held.view_for(model)
    t = state.tokenizer
    # by name: our tokenizer's from its config, transformers' special_tokens_map
    special = getattr(t, "special_tokens", None) or getattr(t, "special_tokens_map", {})
    return JSONResponse({
        "model": state.served_name, "tokenizer_class": type(t).__name__,
        **{name: special.get(name) for name in ("bos_token", "eos_token", "pad_token",
                                                "unk_token")},
        "chat_template": getattr(t, "chat_template", None),
        "model_max_length": state.max_request_tokens, "vocab_size": state.vocab_size})


async def _fields(request: Request) -> tuple[ServerState, Fields]:
    state: ServerState = request.app.state.server
    body = await read_json(request, state.settings.max_body_bytes)
    state.ready_engine()
    f = Fields(body)
    model = f.raw("model")
    if model is not None:
        state = await state.held.view_for(model)
        state.check_model(model)
    return state, f
