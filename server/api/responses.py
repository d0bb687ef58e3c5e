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

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api import background, conversations
from server.api.auth import tenant
from server.api.body import read_json
from server.api.errors import APIError, invalid
from server.api.files import cursor_page, owned
from server.api.responses_protocol import (
    ResponsesRequest,
    message_items,
    parse_responses_request,
)
from server.api.serving import Generation, TokenText, answer_for_batch, respond, with_max_tokens
from server.api.state import ServerState
from server.api.turn import Turn, count_prompt_tokens, pieces, start_turn
from server.api.usage import TokenCount


async def create_response(request: Request) -> Response:
    return await respond(request, parse_responses_request, _start, "responses")


async def responses_answer(state: ServerState, body: dict[str, Any], salt: str, priority: int
                           ) -> dict[str, Any]:
    """The response a plain request with this body gets (for the batch queue)."""
    def parse(body: dict[str, Any], vocab_size: int) -> ResponsesRequest:
        req = parse_responses_request(body, vocab_size)
        if req.background:
            raise invalid("background", "Batch requests cannot run in the background.")
        return req

    return await answer_for_batch(state, body, salt, priority, parse, _start)


async def count_input_tokens(request: Request) -> Response:
    """POST /v1/responses/input_tokens: the input tokens a response to this body would take
    (instructions, previous_response_id's conversation and tools included), without running
    it. `model` may be left out, as OpenAI allows."""
    state: ServerState = request.app.state.server
    body = await read_json(request, state.settings.max_body_bytes)
    state.ready_engine()
    if isinstance(body, dict) and body.get("model") is None:
        body = body | {"model": state.served_name}
    req = parse_responses_request(body, state.vocab_size)
    state.check_model(req.model)
    system, conversation = await _conversation(state, req, tenant(request))
    chat = replace(req.chat, messages=system + conversation)
    count = await count_prompt_tokens(state, chat, "input")
    return JSONResponse({"object": "response.input_tokens", "input_tokens": count})


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
    stored `cancelled`; one that ended comes back as it is; other responses cannot be."""
    state: ServerState = request.app.state.server
    owner, response_id = tenant(request), request.path_params["response_id"]
    response, _ = await _stored(state, owner, response_id, None)
    if not response.get("background"):
        raise invalid(None, "Only responses created with background=true can be cancelled.")
    if response["status"] in background.UNFINISHED:  # so running here (a start fails others)
        await background.stop(state, response_id)
        response, _ = await _stored(state, owner, response_id, None)
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


async def _start(state: ServerState, req: ResponsesRequest, salt: str, priority: int
                 ) -> Generation:
    system, conversation = await _conversation(state, req, salt)

    async def start(messages: list[dict[str, Any]]) -> Turn:
        chat = replace(req.chat, messages=system + messages)
        return await start_turn(state, chat, salt, priority, f"resp_{uuid.uuid4().hex}",
                                "input", "text.format")

    try:
        turn = await start(conversation)
    except APIError as e:
        if not req.truncate or e.code != "context_length_exceeded" or len(conversation) < 2:
            raise
        turn = await start(await _fitting_tail(state, req, system, conversation))
    run = ResponseRun(state, req, turn, conversation, salt)  # stored whole: only this turn is cut
    if req.background:
        return await background.start(state, run, salt)
    return Generation(run.collect, run.stream)


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


class _Output:
    """The output items as the pieces arrive: text goes to the open message item (a new one
    after a call), each call is an item of its own. Yields the stream events of each step."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._call_items: dict[int, dict[str, Any]] = {}  # the parser's call index -> item

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None
             ) -> list[dict[str, Any]]:
        """`logprobs`: the tokens' (with include message.output_text.logprobs), else none."""
        logprobs = logprobs or []
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self.close()
            self._open = {"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                          "status": "in_progress", "role": "assistant", "content": []}
            events.append(self._added())
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open["content"].append(part)
            events.append({"type": "response.content_part.added", **self._where(),
                           "content_index": 0, "part": dict(part, logprobs=[])})
        self._open["content"][0]["text"] += delta
        self._open["content"][0]["logprobs"] += logprobs
        events.append({"type": "response.output_text.delta", **self._where(),
                       "content_index": 0, "delta": delta, "logprobs": logprobs})
        return events

    def is_writing_text(self) -> bool:
        return self._open is not None and self._open["type"] == "message"

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str
             ) -> list[dict[str, Any]]:
        events = []
        if call_id is not None:
            events += self.close()
            self._open = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                          "status": "in_progress", "call_id": call_id, "name": name,
                          "arguments": ""}
            self._call_items[index] = self._open
            events.append(self._added())
        if arguments:
            self._call_items[index]["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta", **self._where(),
                           "delta": arguments})
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        item["status"] = status
        where = self._where()
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", **where, "content_index": 0,
                        "text": part["text"], "logprobs": list(part["logprobs"])},
                       {"type": "response.content_part.done", **where, "content_index": 0,
                        "part": dict(part, logprobs=list(part["logprobs"]))}]
        else:
            events.append({"type": "response.function_call_arguments.done", **where,
                           "name": item["name"], "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": where[
            "output_index"], "item": _copy(item)})
        self._open = None
        return events

    def _added(self) -> dict[str, Any]:
        self.items.append(self._open)
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": _copy(self._open)}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": self.items.index(self._open)}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p, logprobs=list(p["logprobs"])) if "logprobs" in p else dict(p)
                          for p in out["content"]]
    return out


class ResponseRun:
    def __init__(self, state: ServerState, req: ResponsesRequest, turn: Turn,
                 conversation: list[dict[str, Any]], owner: str) -> None:
        self.state, self.req, self.turn = state, req, turn
        self.conversation, self.owner = conversation, owner
        self.count = TokenCount(turn.num_prompt_tokens)
        self.created_at = int(time.time())
        self.token_text = TokenText(state.tokenizer)

    def response(self, status: str, output: list[dict[str, Any]], finish: str | None = None,
                 error: dict[str, str] | None = None) -> dict[str, Any]:
        c = self.count
        done = status in ("completed", "incomplete")
        usage = {"input_tokens": c.num_prompt,
                 "input_tokens_details": {"cached_tokens": c.num_cached},
                 "output_tokens": c.num_output,
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": c.num_prompt + c.num_output} if done else None
        return {"id": self.turn.request_id, "object": "response",
                "created_at": self.created_at, "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if finish == "length"
                else None, "model": self.state.served_name, "output": output,
                "usage": usage, **self.req.echo}

    async def _events(self) -> AsyncIterator[list[dict[str, Any]]]:
        """Each piece's stream events; the last list holds the finished response's event."""
        out = _Output()
        finish = None
        # logprobs of tokens not yet shown as text (a character's first bytes, a possible
        # call's opening) go with the next text, the last ones (the end of turn, bytes that
        # never made a character) in a last delta of no text: every token chat would give,
        # but a call's own
        pending: list[dict[str, Any]] = []
        async for piece in pieces(self.turn):
            self.count.add(piece.chunk)
            pending += self.token_text.entries(piece.chunk.logprobs or [])
            events = []
            if piece.content:
                events, pending = out.text(piece.content, pending), []
            if piece.calls:
                pending = []
            for d in piece.calls:
                events += out.call(d.index, d.id, d.name, d.arguments)
            if piece.finish_reason is not None:
                finish = piece.finish_reason
            yield events
        if not out.items or pending and out.is_writing_text():
            events = out.text("", pending)  # an empty answer is an empty message
            yield events if pending else events[:-1]
        status = "incomplete" if finish == "length" else "completed"
        events = out.close(status)
        response = self.response(status, [_copy(i) for i in out.items], finish)
        if self.req.conversation is not None:  # this turn's input and output go on the end
            items = conversations.new_items(self.req.chat.messages) + [
                _copy(i) for i in out.items]  # (first: who sees it finished sees them)
            await self.state.db.run(self.state.conversations.add_items, self.owner,
                                    self.req.conversation, items)
        if self.req.store:
            await self.state.db.run(self.state.responses.put, self.owner, response,
                                    self.conversation + [_assistant_message(out.items)])
        yield events + [{"type": f"response.{status}", "response": response}]

    async def collect(self) -> dict[str, Any]:
        last: list[dict[str, Any]] = []
        async for events in self._events():
            last = events
        return last[-1]["response"]

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        created = "queued" if self.req.background else "in_progress"
        numbered = 0
        for kind, status in (("response.created", created), ("response.in_progress",
                                                             "in_progress")):
            yield {"type": kind, "sequence_number": numbered,
                   "response": self.response(status, [])}
            numbered += 1
        async for events in self._events():
            for event in events:
                yield event | {"sequence_number": numbered}
                numbered += 1


def _assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The output as the chat message that continues the conversation."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    return {"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})
