"""/v1/conversations: OpenAI's Conversations API, the Responses API's stored conversations.

A conversation is items in order (messages, function calls, function call outputs), each with
its id; a response created with `conversation` reads them before its input, and at its end
adds its input and output items (responses.py). Items are kept as the Responses API writes
them: what a client adds is read as input (input_messages) and written back in that form, so
a string content becomes an `input_text` part. `include` (extra fields of tool and reasoning
items, none of which are here) is taken and adds nothing. Per API key, like stored responses.
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.auth import tenant
from server.api.body import read_json
from server.api.errors import APIError, invalid
from server.api.fields import Fields, parse_metadata
from server.api.openai.responses_protocol import input_messages, message_items
from server.api.owned import delete_owned, owned, update_metadata
from server.api.pagination import cursor_page, page
from server.api.state import ServerState

MAX_ITEMS_AT_ONCE = 20  # items one create or add takes, as OpenAI


def new_items(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as conversation items, with fresh ids."""
    key = uuid.uuid4().hex
    return [item for i, m in enumerate(messages) for item in message_items(m, f"{key}_{i}")]


def history(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation's items as the chat messages a response reads before its input."""
    return input_messages(items, "conversation") if items else []


async def create_conversation(request: Request) -> Response:
    state: ServerState = request.app.state.server
    f = Fields(await read_json(request, state.settings.max_body_bytes))
    items = _items(f.raw("items"), "items", required=False)
    metadata = parse_metadata(f.raw("metadata")) or {}
    f.str("safety_identifier")
    f.check_unknown()
    conversation = await state.db.run(state.conversations.create, tenant(request),
                                      f"conv_{uuid.uuid4().hex}", metadata, items)
    return JSONResponse(conversation)


async def get_conversation(request: Request) -> Response:
    state: ServerState = request.app.state.server
    conversation, _ = await stored(state, tenant(request), request.path_params["conversation_id"])
    return JSONResponse(conversation)


async def update_conversation(request: Request) -> Response:
    return await update_metadata(request, request.app.state.server.conversations.set_metadata,
                                 "conversation_id", not_found)


async def delete_conversation(request: Request) -> Response:
    return await delete_owned(request, request.app.state.server.conversations.delete,
                              "conversation_id", "conversation", not_found)


async def add_items(request: Request) -> Response:
    """POST /v1/conversations/{id}/items: up to 20 items at the end; answers the added ones."""
    state: ServerState = request.app.state.server
    owner, conversation_id = tenant(request), request.path_params["conversation_id"]
    f = Fields(await read_json(request, state.settings.max_body_bytes))
    items = _items(f.raw("items"), "items", required=True)
    f.check_unknown()
    if not await state.db.run(state.conversations.add_items, owner, conversation_id, items):
        raise not_found(conversation_id)
    return JSONResponse(page(items, False))


async def list_items(request: Request) -> Response:
    """GET /v1/conversations/{id}/items: newest first unless order=asc; `after` an item id."""
    state: ServerState = request.app.state.server
    _, items = await stored(state, tenant(request), request.path_params["conversation_id"])
    return JSONResponse(cursor_page(items, request, "this conversation"))


async def get_item(request: Request) -> Response:
    state: ServerState = request.app.state.server
    _, items = await stored(state, tenant(request), request.path_params["conversation_id"])
    item_id = request.path_params["item_id"]
    item = next((item for item in items if item["id"] == item_id), None)
    if item is None:
        raise _item_not_found(item_id)
    return JSONResponse(item)


async def delete_item(request: Request) -> Response:
    """DELETE /v1/conversations/{id}/items/{item_id}: answers the conversation."""
    state: ServerState = request.app.state.server
    owner, conversation_id = tenant(request), request.path_params["conversation_id"]
    await stored(state, owner, conversation_id)
    item_id = request.path_params["item_id"]
    if not await state.db.run(state.conversations.delete_item, owner, conversation_id,
                              item_id):
        raise _item_not_found(item_id)
    conversation, _ = await stored(state, owner, conversation_id)
    return JSONResponse(conversation)


async def stored(state: ServerState, owner: str, conversation_id: str, param: str | None = None
                 ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the conversation, its items oldest first), or 404 naming `param`."""
    return await owned(state, state.conversations.get, owner, conversation_id,
                       lambda i: not_found(i, param))


def not_found(conversation_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Conversation with id '{conversation_id}' not found.", param=param,
                    code="conversation_not_found")


def _item_not_found(item_id: str) -> APIError:
    return APIError(404, f"Item with id '{item_id}' not found.", code="item_not_found")


def _items(v: Any, name: str, required: bool) -> list[dict[str, Any]]:
    if v is None and not required:
        return []
    if not isinstance(v, list) or len(v) > MAX_ITEMS_AT_ONCE or required and not v:
        raise invalid(name, f"'{name}' must be an array of 1 to {MAX_ITEMS_AT_ONCE} items.")
    return new_items(input_messages(v, name)) if v else []
