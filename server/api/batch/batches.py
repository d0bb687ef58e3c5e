"""/v1/batches: create, retrieve, list, cancel (the queue itself is worker.py)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.auth import tenant
from server.api.batch.files import expires_after
from server.api.batch.lines import ENDPOINTS as LINE_ENDPOINTS
from server.api.body import read_json
from server.api.errors import APIError, invalid, unsupported
from server.api.fields import Fields, parse_metadata
from server.api.owned import owned_row
from server.api.pagination import int_param, page
from server.api.state import ServerState
from storage.batches import MESSAGES, batch_object

ENDPOINTS = tuple(e for e in LINE_ENDPOINTS if e != MESSAGES)  # Anthropic: message_batches
OPENAI_ONLY_ENDPOINTS = ("/v1/moderations",)


async def create_batch(request: Request) -> Response:
    state: ServerState = request.app.state.server
    f = Fields(await read_json(request, state.settings.max_body_bytes))
    input_file_id = f.str("input_file_id", required=True)
    endpoint = f.str("endpoint", required=True)
    window = f.str("completion_window", required=True)
    metadata = parse_metadata(f.raw("metadata"))
    output_expires = expires_after(f.raw("output_expires_after"), "output_expires_after")
    f.check_unknown()
    if endpoint in OPENAI_ONLY_ENDPOINTS:
        raise unsupported("endpoint", f"{endpoint} is not served")
    if endpoint not in ENDPOINTS:
        raise invalid("endpoint", f"Invalid endpoint {endpoint!r}: use one of "
                      f"{', '.join(ENDPOINTS)}.")
    if window != "24h":
        raise invalid("completion_window", "Invalid 'completion_window': only '24h' is "
                      "supported.")
    owner = tenant(request)
    file = await state.db.run(state.files.get, owner, input_file_id)
    if file is None:
        raise invalid("input_file_id", f"No such File object: {input_file_id}")
    if file["purpose"] != "batch":
        raise invalid("input_file_id", f"File {input_file_id} has purpose "
                      f"{file['purpose']!r}; a batch needs purpose 'batch'.")
    row = await state.db.run(
        state.batches.create, owner,
        {"input_file_id": input_file_id, "endpoint": endpoint, "completion_window": window,
         "metadata": metadata, "output_expires_after": output_expires},
        state.settings.batch_window_seconds, request.headers.get("idempotency-key"))
    state.wake_batches()
    return JSONResponse(await _object(state, row))


async def get_batch(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse(await _object(state, await _row(request)))


async def list_batches(request: Request) -> Response:
    state: ServerState = request.app.state.server
    q = request.query_params
    limit = int_param(q.get("limit"), "limit", 20, 1, 100)
    rows, has_more = await state.db.run(state.batches.list, tenant(request), limit,
                                        q.get("after"))
    return JSONResponse(page([await _object(state, r) for r in rows], has_more))


async def cancel_batch(request: Request) -> Response:
    state: ServerState = request.app.state.server
    row = await _row(request)
    if row["status"] in ("validating", "in_progress"):
        await state.db.run(state.batches.set_status, row["id"], "cancelling",
                           ("validating", "in_progress"))
        state.wake_batches()
    elif row["status"] != "cancelling":
        raise APIError(409, f"Cannot cancel a batch with status {row['status']!r}.",
                       param="batch_id", code="batch_not_cancellable")
    return JSONResponse(await _object(state, await _row(request)))


async def _row(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    return await owned_row(request, state.batches.get, "Batch", "batch_id")


async def _object(state: ServerState, row: dict[str, Any]) -> dict[str, Any]:
    usage = await state.db.run(state.batches.usage, row["id"])
    return batch_object(row, usage)
