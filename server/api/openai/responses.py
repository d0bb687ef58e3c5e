"""POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/input_tokens:
OpenAI's Responses API over the same turn as chat (turn.py); `background` ones (background.py)
also POST /v1/responses/{id}/cancel.

A response's output is its items in the order the model wrote them: a `message` with one
`output_text` part for text, a `function_call` per tool call. Stored responses (`store`,
default true) keep the conversation they end, so `previous_response_id` continues it: the
stored messages come before the new input, and their tokens are the prefix cache's (the same
text renders to the same tokens). The stream is OpenAI's event sequence, numbered.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.admission import Admission, admit, read_request
from server.api.auth import tenant
from server.api.errors import APIError, invalid
from server.api.generation.pipeline import with_max_tokens, with_model_defaults
from server.api.generation.turn import Turn, count_prompt_tokens, prompt_token_ids, start_turn
from server.api.openai import background, conversations
from server.api.openai.response_run import ResponseRun
from server.api.openai.responses_protocol import (
    ResponsesRequest,
    message_items,
    parse_responses_request,
)
from server.api.owned import owned
from server.api.pagination import cursor_page
from server.api.state import ServerState


async def create_response(request: Request) -> Response:
    state, req = await read_request(request, parse_responses_request)
    async with admit(state, req, tenant(request)) as place:
        run = await start_response(state, req, place)
        if req.background:  # answered queued; a task writes it (background.py)
            run = await background.start(state, run, place.owner)
        return await place.reply(request, run, req.stream, "responses")


def parse_response_line(body: dict[str, Any], vocab_size: int) -> ResponsesRequest:
    """A batch line's body: a plain request's, but never in the background."""
    req = parse_responses_request(body, vocab_size)
    if req.background:
        raise invalid("background", "Batch requests cannot run in the background.")
    return req


async def compact(request: Request) -> Response:
    """POST /v1/responses/compact: OpenAI's compaction of a conversation into an opaque item.
    Not served: a clear 404, not the 405 of the `{response_id}` routes beside it."""
    raise APIError(404, "POST /v1/responses/compact (conversation compaction) is not supported "
                   "by localserve: send the conversation, or previous_response_id, as it is.",
                   code="unsupported_route")


async def count_input_tokens(request: Request) -> Response:
    """POST /v1/responses/input_tokens: the input tokens a response to this body would take
    (instructions, previous_response_id's conversation and tools included), without running
    it. `model` may be left out, as OpenAI allows."""
    count = len(await input_token_ids(request))
    return JSONResponse({"object": "response.input_tokens", "input_tokens": count})


async def input_token_ids(request: Request) -> list[int]:
    """The prompt a response to the request's body would run (`model` may be left out)."""
    def parse(body: Any, vocab_size: int) -> ResponsesRequest:
        if isinstance(body, dict) and body.get("model") is None:
            body = body | {"model": state.served_name}
        return parse_responses_request(body, vocab_size)

    state: ServerState = request.app.state.server
    state, req = await read_request(request, parse)
    state.check_model(req.model)
    system, conversation = await _conversation(state, req, tenant(request))
    chat = replace(req.chat, messages=system + conversation)
    return await prompt_token_ids(state, chat, "input")


async def get_response(request: Request) -> Response:
    """The stored response; with `stream=true`, a background one's events (background.py)."""
    state: ServerState = request.app.state.server
    stored = await _stored(state, tenant(request), request.path_params["response_id"], None)
    stream = request.query_params.get("stream", "false")
    if stream not in ("true", "false"):
        raise invalid("stream", f"'stream' must be true or false, got {stream!r}.")
    if stream == "true":
        return background.follow_stream(request, state, stored[0])
    return JSONResponse(stored[0])


async def cancel_response(request: Request) -> Response:
    """POST /v1/responses/{id}/cancel: a background response that has not ended stops and is
    stored `cancelled` (by the replica generating it, on a fleet); one that ended comes back
    as it is; other responses cannot be."""
    state: ServerState = request.app.state.server
    owner, response_id = tenant(request), request.path_params["response_id"]
    response, _ = await _stored(state, owner, response_id, None)
    if not response.get("background"):
        raise invalid(None, "Only responses created with background=true can be cancelled.")
    if response["status"] in background.UNFINISHED and response_id in state.background:
        await background.stop(state, response_id)
        response, _ = await _stored(state, owner, response_id, None)
    elif response["status"] in background.UNFINISHED and state.db.postgres:  # another
        # replica of the fleet generates it: asked through the store, it stores it cancelled
        await state.db.run(state.responses.request_cancel, owner, response_id)
        response = await background.wait_ended(state, owner, response_id) or response
    return JSONResponse(response)


async def list_input_items(request: Request) -> Response:
    """GET /v1/responses/{id}/input_items: the items the response was generated from (its
    conversation, previous responses' included), newest first unless order=asc."""
    state: ServerState = request.app.state.server
    response_id = request.path_params["response_id"]
    _, conversation = await _stored(state, tenant(request), response_id, None)
    items = [item for i, m in enumerate(conversation[:-1])  # the last is the output
             for item in message_items(m, f"{response_id.removeprefix('resp_')}_{i}")]
    return JSONResponse(cursor_page(items, request, f"response {response_id!r}"))


async def delete_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    response_id = request.path_params["response_id"]
    await _stored(state, tenant(request), response_id, None)  # another tenant's stays
    await background.stop(state, response_id)  # one running stops first
    if not await state.db.run(state.responses.delete, tenant(request), response_id):
        raise _not_found(response_id, None)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _stored(state: ServerState, owner: str, response_id: str, param: str | None
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return await owned(state, state.responses.get, owner, response_id,
                       lambda i: _not_found(i, param))


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param,
                    code="response_not_found" if param is None else "previous_response_not_found")


async def start_response(state: ServerState, req: ResponsesRequest, place: Admission
                         ) -> ResponseRun:
    """The turn started on the conversation (the previous response's or the stored one, then
    the input), its oldest items dropped to fit where truncation is "auto"."""
    owner = place.owner
    system, conversation = await _conversation(state, req, owner)
    sampling = with_model_defaults(state, req.chat.params, req.chat.left_out)
    req.echo |= {"temperature": sampling.temperature, "top_p": sampling.top_p}  # as it runs
    base = replace(req.chat, params=sampling, left_out=frozenset())  # defaults applied once

    async def start(messages: list[dict[str, Any]]) -> Turn:
        chat = replace(base, messages=system + messages)
        return await start_turn(state, chat, owner, place.priority, f"resp_{uuid.uuid4().hex}",
                                "input", "text.format")

    try:
        turn = await start(conversation)
    except APIError as e:
        if not req.truncate or e.code != "context_length_exceeded" or len(conversation) < 2:
            raise
        turn = await start(await _fitting_tail(state, req, system, conversation))
    return ResponseRun(state, req, turn, conversation, owner)  # stored whole: only this turn is cut


async def _conversation(state: ServerState, req: ResponsesRequest, salt: str
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the instructions as a system message or nothing, the conversation: the previous
    response's stored one, then the input)."""
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        previous, history = await _stored(state, salt, req.previous_response_id,
                                          "previous_response_id")
        if previous["status"] in background.UNFINISHED:  # its reply is not there yet
            raise invalid("previous_response_id", f"Response '{req.previous_response_id}' "
                          f"is {previous['status']}; continue from it once it has finished.")
    elif req.conversation is not None:
        _, items = await conversations.stored(state, salt, req.conversation, "conversation")
        history = conversations.history(items)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return system, history + req.chat.messages


async def _fitting_tail(state: ServerState, req: ResponsesRequest,
                        system: list[dict[str, Any]], conversation: list[dict[str, Any]]
                        ) -> list[dict[str, Any]]:
    """truncation "auto", for a conversation that does not fit: the longest tail left by
    dropping its oldest items one at a time (_cuts) that fits the context with the answer's
    max_output_tokens, or the last one (whose start then says it does not fit). Fewer items
    never take more tokens, so a binary search finds it, rendering and tokenizing log2 of the
    tails instead of one per dropped item (a 1,000-message conversation, its kept tail in the
    prefix cache, smollm2-135m:int4 on 2 cores of an "Intel(R) Xeon(R) Processor", AVX-512 BF16
    no, AMX no: 1.0 s to the answer instead of 69)."""
    async def fits(start: int) -> bool:
        chat = replace(req.chat, messages=system + conversation[start:])
        try:
            count = await count_prompt_tokens(state, chat, "input")
            with_max_tokens(state, chat.params, chat.max_tokens, count, "input")
        except APIError as e:
            if e.code != "context_length_exceeded":
                raise
            return False
        return True

    starts = _cuts(conversation)  # starts[0], the whole, is known not to fit
    lo, hi = 1, len(starts) - 1  # the first that fits is in [lo, hi], or none does
    while lo < hi:
        mid = (lo + hi) // 2
        if await fits(starts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return conversation[starts[lo]:]


def _cuts(messages: list[dict[str, Any]]) -> list[int]:
    """Where the conversation starts after each drop of its oldest message, with the tool
    results that answered calls in it (a result without its call would not render); the
    last item always stays. [0, ...]."""
    starts, at = [0], 0
    while len(messages) - at >= 2:
        at += 1
        while len(messages) - at > 1 and messages[at]["role"] == "tool":
            at += 1
        starts.append(at)
    return starts
