"""Reading request bodies within the size limit."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from server.api.errors import APIError
from server.api.protocol import parse_json


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or 413 as soon as it passes `limit` bytes (declared or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object (400 otherwise), within `limit` bytes (413 past it)."""
    return parse_json(await read_body(request, limit))


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than the limit of {limit} bytes.",
                    code="request_too_large")
