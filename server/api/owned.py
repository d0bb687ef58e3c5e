"""Objects a key owns (files, batches, responses, conversations, stored completions): found,
updated and deleted for the caller only; another key's are a 404, never revealed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.auth import tenant
from server.api.body import read_json
from server.api.errors import APIError, invalid
from server.api.fields import Fields, parse_metadata
from server.api.state import ServerState


def not_found(kind: str, object_id: str) -> APIError:
    return APIError(404, f"No such {kind} object: {object_id}", param="id")


async def owned_row(request: Request, get, kind: str, id_param: str) -> dict[str, Any]:
    """The caller's object named by the path parameter `id_param`, or 404."""
    return await owned(request.app.state.server, get, tenant(request),
                       request.path_params[id_param], lambda i: not_found(kind, i))


async def owned(state: ServerState, get, owner: str, object_id: str,
                missing: Callable[[str], APIError]) -> Any:
    """What `get` finds of `owner`'s on the database thread, or `missing(object_id)` (also
    when it belongs to another key: its existence is not revealed)."""
    found = await state.db.run(get, owner, object_id)
    if found is None:
        raise missing(object_id)
    return found


async def update_metadata(request: Request, set_metadata, id_param: str,
                          missing: Callable[[str], APIError]) -> Response:
    """POST with `metadata` to the caller's object named by `id_param` (conversations, stored
    chat completions): the new metadata replaces the old; answers the object, or `missing`."""
    state: ServerState = request.app.state.server
    f = Fields(await read_json(request, state.settings.max_body_bytes))
    metadata = parse_metadata(f.raw("metadata"))
    if metadata is None:
        raise invalid("metadata", "Missing required parameter: 'metadata'.")
    f.check_unknown()
    object_id = request.path_params[id_param]
    updated = await state.db.run(set_metadata, tenant(request), object_id, metadata)
    if updated is None:
        raise missing(object_id)
    return JSONResponse(updated)


async def delete_owned(request: Request, delete, id_param: str, kind: str,
                       missing: Callable[[str], APIError]) -> Response:
    """DELETE the caller's object named by `id_param`: `{id, object: "KIND.deleted", deleted}`,
    or `missing`."""
    state: ServerState = request.app.state.server
    object_id = request.path_params[id_param]
    if not await state.db.run(delete, tenant(request), object_id):
        raise missing(object_id)
    return JSONResponse({"id": object_id, "object": f"{kind}.deleted", "deleted": True})
