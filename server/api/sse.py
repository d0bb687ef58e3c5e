"""Server-sent events: JSON chunks, an error event if something fails mid-stream, and the end.

Three dialects: chat and completions send `data:` lines and end with `[DONE]` (OpenAI's
chunks); the Responses and Anthropic Messages APIs name each event by its `type`
(`event: response.output_text.delta`) and send no `[DONE]`, and write a failure as their own
error event. Ollama's native API streams newline-delimited JSON instead (ndjson_response).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.responses import StreamingResponse

from server.api.errors import APIError, log

DIALECTS = ("chat", "responses", "anthropic")


def sse_response(chunks: AsyncIterator[dict[str, Any]], on_close: Callable[[], None],
                 dialect: str = "chat") -> EventSourceResponse:
    """Stream `chunks` as events. Closing the generator (the client left) aborts the engine
    request inside it; `on_close` runs once whatever happens."""
    assert dialect in DIALECTS
    named = dialect != "chat"

    def event(chunk: dict[str, Any]) -> dict[str, str]:
        data = {"data": json.dumps(chunk, ensure_ascii=False)}
        return {"event": chunk["type"], **data} if named else data

    async def events() -> AsyncIterator[dict[str, str]]:
        try:
            async for chunk in chunks:
                yield event(chunk)
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
            if not isinstance(e, APIError):
                log.exception("stream failed")
                e = APIError(500, f"Internal server error: {type(e).__name__}: {e}")
            yield event(_error_event(e, dialect))
        finally:
            on_close()
            await chunks.aclose()  # type: ignore[attr-defined]
        if not named:
            yield {"data": "[DONE]"}

    return EventSourceResponse(events(), sep="\n", ping=15,
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def ndjson_response(chunks: AsyncIterator[dict[str, Any]], on_close: Callable[[], None]
                    ) -> StreamingResponse:
    """Stream `chunks` as newline-delimited JSON (Ollama's streams): a failure as its
    `{"error": ...}` line; closing aborts as sse_response does."""
    async def lines() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield json.dumps(chunk, ensure_ascii=False) + "\n"
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
            if not isinstance(e, APIError):
                log.exception("stream failed")
                e = APIError(500, f"Internal server error: {type(e).__name__}: {e}")
            yield json.dumps({"error": e.message}) + "\n"
        finally:
            on_close()
            await chunks.aclose()  # type: ignore[attr-defined]

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _error_event(error: APIError, dialect: str) -> dict[str, Any]:
    if dialect == "anthropic":
        return error.anthropic_body()
    if dialect == "responses":
        return {"type": "error", "code": error.code or error.type, "message": error.message,
                "param": error.param}
    return error.body()
