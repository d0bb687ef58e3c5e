"""Server-sent events: JSON chunks, an error chunk if something fails mid-stream, `[DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette import EventSourceResponse

from server.api.errors import APIError, log


def sse_response(chunks: AsyncIterator[dict[str, Any]], on_close: Callable[[], None]
                 ) -> EventSourceResponse:
    """Stream `chunks` as `data:` events. Closing the generator (the client left) aborts the
    engine request inside it; `on_close` runs once whatever happens."""

    async def events() -> AsyncIterator[dict[str, str]]:
        try:
            async for chunk in chunks:
                yield {"data": json.dumps(chunk, ensure_ascii=False)}
        except APIError as e:
            yield {"data": json.dumps(e.body(), ensure_ascii=False)}
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
            log.exception("stream failed")
            body = APIError(500, f"Internal server error: {type(e).__name__}: {e}").body()
            yield {"data": json.dumps(body)}
        finally:
            on_close()
            await chunks.aclose()  # type: ignore[attr-defined]
        yield {"data": "[DONE]"}

    return EventSourceResponse(events(), sep="\n", ping=15,
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
