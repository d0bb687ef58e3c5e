"""Stored chat completions: a `store: true` request's `chat.completion` (chat.py stores it
when it ends, streamed or not) is listed by GET /v1/chat/completions (oldest first unless
order=desc; `model`, `metadata[key]=value` filters; `after`, `limit`), read, given new
`metadata` and deleted by /v1/chat/completions/{id}, and its input messages are listed by
/v1/chat/completions/{id}/messages, as OpenAI's stored completions. Per API key.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.auth import tenant
from server.api.errors import APIError
from server.api.owned import delete_owned, owned, update_metadata
from server.api.pagination import cursor_page
from server.api.state import ServerState


async def list_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    q = request.query_params
    metadata: dict[str, str] = {}
    for key, value in q.multi_items():
        if m := re.fullmatch(r"metadata\[(.+)\]", key):
            metadata[m.group(1)] = value
    completions = await state.db.run(state.chat_completions.list, tenant(request),
                                     q.get("model"), metadata)
    return JSONResponse(cursor_page(completions, request, "your stored completions", "asc"))


async def get_completion(request: Request) -> Response:
    completion, _ = await _stored(request)
    return JSONResponse(completion)


async def update_completion(request: Request) -> Response:
    """POST /v1/chat/completions/{id}: `metadata` replaces the stored one."""
    return await update_metadata(request,
                                 request.app.state.server.chat_completions.set_metadata,
                                 "completion_id", _not_found)


async def delete_completion(request: Request) -> Response:
    return await delete_owned(request, request.app.state.server.chat_completions.delete,
                              "completion_id", "chat.completion", _not_found)


async def list_messages(request: Request) -> Response:
    """GET /v1/chat/completions/{id}/messages: the messages it answered, oldest first unless
    order=desc, each with an id."""
    completion, messages = await _stored(request)
    items = [{"id": f"{completion['id']}-{i}", "content_parts": None} | m
             for i, m in enumerate(messages)]
    return JSONResponse(cursor_page(items, request, f"completion {completion['id']!r}", "asc"))


async def _stored(request: Request) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    state: ServerState = request.app.state.server
    return await owned(state, state.chat_completions.get, tenant(request),
                       request.path_params["completion_id"], _not_found)


def _not_found(completion_id: str) -> APIError:
    return APIError(404, f"Chat completion with id '{completion_id}' not found.",
                    code="not_found")
