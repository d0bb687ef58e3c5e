"""GET /health (public: loading, ready, draining), GET /metrics (Prometheus), GET /v1/models
and /v1/models/{model}: the served model."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from server.api import metrics
from server.api.pagination import page
from server.api.state import ServerState
from server.api.wire import rfc3339


async def health(request: Request) -> Response:
    """Public: the state, and whether /v1 needs a key (the dashboard asks for one first)."""
    state: ServerState = request.app.state.server
    auth = {"auth_required": bool(state.settings.api_keys)}
    if state.draining:
        return JSONResponse({"status": "draining"} | auth, status_code=503)
    if state.engine is None:
        status = {"status": "error", "error": state.load_error} if state.load_error else {
            "status": "loading"}
        return JSONResponse(status | auth, status_code=503)
    return JSONResponse({"status": "ok", "model": state.served_name} | auth)


async def prometheus(request: Request) -> Response:
    state: ServerState = request.app.state.server
    stats = state.engine.stats() if state.engine is not None else None
    return PlainTextResponse(metrics.render(state.served_name, state.metrics, stats),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


def _model_object(state: ServerState) -> dict:
    """The served model in OpenAI's fields and Anthropic's at once (`type`, `display_name`,
    `created_at` in RFC 3339), so that both SDKs' `models.list()` and `retrieve()` read every
    field they declare; each ignores the other's."""
    return {"id": state.served_name, "object": "model", "created": state.created,
            "owned_by": "localserve", "type": "model", "display_name": state.served_name,
            "created_at": rfc3339(state.created)}


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    # the cursor page (has_more, first_id, last_id) that Anthropic's SDK reads: one model
    return JSONResponse(page([_model_object(state)], has_more=False))


async def get_model(request: Request) -> Response:
    state: ServerState = request.app.state.server
    name = request.path_params["model"]
    state.check_model(name)
    return JSONResponse(_model_object(state))
