"""GET /health (public: loading, ready, draining), GET /metrics (Prometheus), GET /get_load (a
router's), GET /v1/models and /v1/models/{model}: the store's models, and whether each is
loaded."""

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


def _loaded(state: ServerState) -> list[ServerState]:
    """The loaded models' views (none while the first loads)."""
    return [state, *state.held.views.values()] if state.engine is not None else []


async def get_load(request: Request) -> Response:
    """GET /get_load, as SGLang's and vLLM's routers read it (`--policy power_of_two` sends a
    request to the less loaded of two replicas): sequences in the engines, running and
    waiting, over every loaded model."""
    stats = [view.engine.stats() for view in _loaded(request.app.state.server)]
    running = sum(s["num_running"] for s in stats)
    waiting = sum(s["num_waiting"] for s in stats)
    return JSONResponse({"load": running + waiting, "num_reqs": running,
                         "num_waiting_reqs": waiting})


async def prometheus(request: Request) -> Response:
    state: ServerState = request.app.state.server
    loaded = _loaded(state)
    engines = [(view.served_name, view.engine.stats()) for view in loaded]
    requests = [(view.served_name, view.metrics) for view in loaded] or [
        (state.served_name, state.metrics)]
    return PlainTextResponse(metrics.render(requests, engines, state.held.routed),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


def _model_object(state: ServerState, name: str, loaded: bool = True) -> dict:
    """A model in OpenAI's fields and Anthropic's at once (`type`, `display_name`,
    `created_at` in RFC 3339), so that both SDKs' `models.list()` and `retrieve()` read every
    field they declare; each ignores the other's. `loaded`: held now (llama-server's router
    says so too)."""
    return {"id": name, "object": "model", "created": state.created,
            "owned_by": "localserve", "type": "model", "display_name": name,
            "created_at": rfc3339(state.created), "loaded": loaded}


def _route_object(state: ServerState, name: str) -> dict:
    """A route (serve --route): its two models; loaded when both are."""
    small, large, confidence = state.settings.routes[name]
    loaded = state.engine is not None and all(state.held.find(m) is not None
                                              for m in (small, large))
    return _model_object(state, name, loaded) | {"route": {
        "small": small, "large": large, "confidence": confidence}}


async def list_models(request: Request) -> Response:
    """The model `serve` named first, those held beside it, then the rest of the store."""
    from storage.models import ModelStore

    state: ServerState = request.app.state.server
    held = [state.served_name, *state.held.views]
    rest = [m.name for m in ModelStore(state.home).list() if m.name not in held]
    models = [_model_object(state, n) for n in held] + [
        _model_object(state, n, loaded=False) for n in rest] + [
        _route_object(state, n) for n in state.settings.routes]
    return JSONResponse(page(models, has_more=False))  # the cursor page Anthropic's SDK reads


async def get_model(request: Request) -> Response:
    state: ServerState = request.app.state.server
    name = request.path_params["model"]
    if name in state.settings.routes:
        return JSONResponse(_route_object(state, name))
    found = state.held.find(name)
    if found is not None:
        return JSONResponse(_model_object(state, found.served_name))
    return JSONResponse(_model_object(state, state.held.stored(name).name, loaded=False))


async def load_model(request: Request) -> Response:
    """POST /v1/models/{model}/load: load it now (held beside the first, as a request would;
    a route's two models)."""
    state: ServerState = request.app.state.server
    state.ready_engine()
    name = request.path_params["model"]
    view = await state.held.view_for(name)  # both of a route's
    if name in state.settings.routes:
        return JSONResponse(_route_object(state, name))
    return JSONResponse(_model_object(state, view.served_name))


async def unload_model(request: Request) -> Response:
    """POST /v1/models/{model}/unload: let it go now."""
    state: ServerState = request.app.state.server
    name = request.path_params["model"]
    await state.held.unload(name)
    return JSONResponse(_model_object(state, state.held.stored(name).name, loaded=False))
