"""POST /v1/chat/completions/render, /v1/completions/render and /v1/responses/render, as vLLM
serves them: the prompt's token ids a request would run, without running it. vLLM's router
(vllm-router --policy cache_aware) asks a replica for them and routes on the ids, so requests
sharing a prefix of tokens meet on the replica that has it cached (docs/fleet.md)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.admission import read_request
from server.api.generation.pipeline import off_loop
from server.api.generation.protocol import parse_chat, parse_completion
from server.api.generation.turn import prompt_token_ids
from server.api.openai.completions import tokenize_prompts
from server.api.openai.responses import input_token_ids


async def render_chat(request: Request) -> Response:
    state, req = await read_request(request, parse_chat)
    state.check_model(req.model)
    ids = await prompt_token_ids(state, req, "messages")
    return JSONResponse({"token_ids": ids, "features": None})


async def render_completion(request: Request) -> Response:
    """One entry per prompt, as the request's prompts run."""
    state, req = await read_request(request, parse_completion)
    state.check_model(req.model)
    prompts = await off_loop(tokenize_prompts, state.tokenizer, req.prompts)
    return JSONResponse([{"token_ids": ids, "features": None} for ids in prompts])


async def render_response(request: Request) -> Response:
    """A Responses body's prompt (its instructions, tools and previous_response_id's
    conversation, read from the store every replica shares)."""
    return JSONResponse({"token_ids": await input_token_ids(request), "features": None})
