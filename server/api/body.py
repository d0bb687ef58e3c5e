"""Reading request bodies within the size limit."""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from server.api.errors import APIError, invalid


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


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or 400."""
    try:
        body = loads(raw)
    except ValueError as e:
        raise invalid(None, f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid(None, "The request body must be a JSON object.")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def loads(raw: bytes | str) -> Any:
    """JSON text as Python values; ValueError (with the reason) for what is not valid UTF-8
    JSON: also text nested past the parser's depth, and strings with an unpaired UTF-16
    surrogate escape ("\\ud800" alone), which Python's parser lets through but no UTF-8 text,
    tokenizer or response can hold."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    text = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if _SURROGATE_ESCAPE.search(text):
        try:  # rare: only text that escapes a surrogate at all pays for the check
            json.dumps(value, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ValueError("a string holds an unpaired UTF-16 surrogate escape "
                             "(\\ud800-\\udfff)") from None
        except RecursionError:
            raise ValueError("nested too deeply") from None
    return value
