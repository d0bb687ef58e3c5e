"""/v1/messages/batches: Anthropic's Message Batches on the durable batch queue of /v1/batches
(storage/batches.py, batch/worker.py): create, retrieve, list, cancel, results, delete.

The requests come in the create body, not a file: the batch is stored 'in_progress' with its
lines in one transaction, so a crash never leaves half a batch. Each request's params are
checked when it runs, as Anthropic does: a bad one (a model not served, a stream, an unknown
field) is an `errored` result, not a refused batch. Results are read from the stored lines in
input order, whatever crashed in between; no output file is written.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from server.api.anthropic.protocol import UNKNOWN
from server.api.auth import tenant
from server.api.body import parse_json, read_body
from server.api.errors import APIError, invalid
from server.api.fields import Fields
from server.api.generation.pipeline import off_loop
from server.api.owned import owned_row
from server.api.pagination import int_param, page
from server.api.state import ServerState
from server.api.wire import rfc3339
from storage.batches import ENDED, MESSAGES

CUSTOM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
RESULTS_PAGE = 1000  # lines read from the database at a time while streaming results
# Line states (storage/batches.py) as Anthropic names them in request_counts and results.
COUNTS = {"pending": "processing", "done": "succeeded", "failed": "errored",
          "cancelled": "canceled", "expired": "expired"}


async def create_message_batch(request: Request) -> Response:
    state: ServerState = request.app.state.server
    raw = await read_body(request, state.settings.max_body_bytes)
    # up to 50,000 requests: parsed and checked off the event loop
    lines = await off_loop(_lines, raw, state.settings.max_batch_lines)
    fields = {"endpoint": MESSAGES, "completion_window": "24h", "model": state.served_name}
    row = await state.db.run(state.batches.create, tenant(request), fields,
                             state.settings.batch_window_seconds,
                             request.headers.get("idempotency-key"), lines)
    state.wake_batches()
    return JSONResponse(await _object(request, row))


def _lines(raw: bytes, max_lines: int) -> list[tuple[int, str, str]]:
    """The create body's requests as batch lines [(number, custom_id, params as JSON)]; a 400
    naming the first that is not {custom_id, params}."""
    f = Fields(parse_json(raw))
    requests = f.raw("requests")
    f.check_unknown(UNKNOWN)
    if not isinstance(requests, list) or not requests:
        raise invalid("requests", "requests: expected a non-empty list of {custom_id, params}.")
    if len(requests) > max_lines:
        raise invalid("requests", f"requests: at most {max_lines} requests a batch.")
    lines: list[tuple[int, str, str]] = []
    seen: set[str] = set()
    for i, item in enumerate(requests):
        where = f"requests.{i}"
        if not isinstance(item, dict):
            raise invalid(where, f"{where}: expected an object with custom_id and params.")
        extra = sorted(item.keys() - {"custom_id", "params"})
        if extra:
            raise invalid(f"{where}.{extra[0]}", UNKNOWN.format(f"{where}.{extra[0]}"))
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            raise invalid(f"{where}.custom_id", f"{where}.custom_id: 1 to 64 letters, digits, "
                          "underscores or hyphens.")
        if custom_id in seen:
            raise invalid(f"{where}.custom_id", f"{where}.custom_id: {custom_id!r} is used by "
                          "an earlier request of this batch.")
        seen.add(custom_id)
        params = item.get("params")
        if not isinstance(params, dict):
            raise invalid(f"{where}.params", f"{where}.params: expected an object.")
        lines.append((i + 1, custom_id, json.dumps(params, ensure_ascii=False)))
    return lines


async def get_message_batch(request: Request) -> Response:
    return JSONResponse(await _object(request, await _row(request)))


async def list_message_batches(request: Request) -> Response:
    state: ServerState = request.app.state.server
    q = request.query_params
    limit = int_param(q.get("limit"), "limit", 20, 1, 1000)
    rows, has_more = await state.db.run(partial(
        state.batches.list, tenant(request), limit, q.get("after_id"), q.get("before_id"),
        messages=True))
    # the cursor page of /v1/batches: Anthropic's fields and an `object` the SDK ignores
    return JSONResponse(page([await _object(request, r) for r in rows], has_more))


async def cancel_message_batch(request: Request) -> Response:
    state: ServerState = request.app.state.server
    row = await _row(request)
    if row["status"] in ENDED:
        raise APIError(409, f"Message batch {row['id']} has ended; there is nothing to cancel.")
    if await state.db.run(state.batches.set_status, row["id"], "cancelling", ("in_progress",)):
        state.wake_batches()
    return JSONResponse(await _object(request, await _row(request)))


async def delete_message_batch(request: Request) -> Response:
    state: ServerState = request.app.state.server
    row = await _ended_row(request, "cancel it, and delete it once it has ended")
    await state.db.run(state.batches.delete, tenant(request), row["id"])
    return JSONResponse({"id": row["id"], "type": "message_batch_deleted"})


async def message_batch_results(request: Request) -> Response:
    """The results as JSON lines, in the requests' order, read a page at a time."""
    state: ServerState = request.app.state.server
    row = await _ended_row(request, "its results are ready once processing_status is 'ended'")

    async def lines() -> AsyncIterator[bytes]:
        after = 0
        while rows := await state.db.run(state.batches.lines_after, row["id"], after,
                                         RESULTS_PAGE):
            yield "".join(json.dumps({"custom_id": r["custom_id"], "result": _result(r)},
                                     ensure_ascii=False) + "\n" for r in rows).encode()
            after = rows[-1]["line"]

    return StreamingResponse(lines(), media_type="application/x-jsonl")


def _result(line: dict[str, Any]) -> dict[str, Any]:
    kind = COUNTS[line["state"]]
    if kind == "succeeded":
        return {"type": kind, "message": json.loads(line["response"])}
    if kind == "errored":  # the answer's own error body, in Anthropic's envelope
        return {"type": kind, "error": json.loads(line["response"])}
    return {"type": kind}


async def _row(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.server
    return await owned_row(request, partial(state.batches.get, messages=True), "Message batch",
                           "message_batch_id")


async def _ended_row(request: Request, advice: str) -> dict[str, Any]:
    """The batch, if it has ended; 409 with `advice` if it is still processing."""
    row = await _row(request)
    if row["status"] not in ENDED:
        raise APIError(409, f"Message batch {row['id']} is still processing: {advice}.")
    return row


async def _object(request: Request, row: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's MessageBatch: `processing_status` in_progress, canceling or ended; the
    requests counted by their state now (the sum is always the batch's total)."""
    state: ServerState = request.app.state.server
    counts = await state.db.run(state.batches.line_counts, row["id"])
    status = row["status"]
    ended = status in ENDED
    return {
        "id": row["id"], "type": "message_batch",
        "processing_status": "ended" if ended else
        "canceling" if status == "cancelling" else "in_progress",
        "request_counts": {name: counts.get(state_, 0) for state_, name in COUNTS.items()},
        "created_at": rfc3339(row["created_at"]), "expires_at": rfc3339(row["expires_at"]),
        "ended_at": rfc3339(row[f"{status}_at"] if ended else None),
        "cancel_initiated_at": rfc3339(row["cancelling_at"]), "archived_at": None,
        "results_url": str(request.url_for("message_batch_results", message_batch_id=row["id"]))
        if ended else None,
    }
