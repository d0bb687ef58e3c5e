"""create_app: the route list, middleware and lifespan (the model loads in the background so
/health answers 503 until it is ready)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api import (
    anthropic_messages,
    background,
    batches,
    conversations,
    dashboard,
    embeddings,
    files,
    message_batches,
    metrics,
    responses,
    stored_completions,
    tokenize,
)
from server.api.anthropic_protocol import rfc3339
from server.api.auth import AuthMiddleware
from server.api.batch_worker import BatchWorker
from server.api.chat import create_chat_completion
from server.api.completions import create_completion
from server.api.errors import (
    APIError,
    api_error_handler,
    http_error_handler,
    unexpected_error_handler,
)
from server.api.files import page
from server.api.state import ServerSettings, ServerState
from server.api.usage import get_usage

log = logging.getLogger("localserve")


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


class DrainMiddleware:
    """Counts requests in flight; once draining (SIGTERM), new requests get 503."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ("/health", "/metrics"):
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            error = APIError(503, "The server is shutting down.", code="server_shutting_down",
                             headers={"Connection": "close"})
            await error.response(scope["path"])(scope, receive, send)
            return
        self.state.num_http_inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.num_http_inflight -= 1


# Pages served from this machine may call the API from a browser (as Ollama allows by default);
# others only when `serve --allow-origin` names them.
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def load_into(state: ServerState) -> None:
    """Resolve, verify and load the model (runs in a worker thread)."""
    from server.engine.async_engine import load_engine
    from storage.models import ModelStore

    s = state.settings
    if s.threads:
        import torch

        torch.set_num_threads(s.threads)
    stored = ModelStore().resolve(s.model)
    engine = load_engine(stored, s.engine, s.device, s.dtype)
    state.attach(engine, stored.name, stored.manifest)


def kv_summary(stats: dict, config, device) -> str:
    """What the KV pool may hold, said once at start (the README explains the defaults). On a
    CPU its pages become resident as they are written and idle ones go back to the OS; on a GPU
    the pool is allocated whole at start and kept."""
    import torch

    total = stats["kv_blocks_total"]
    block_tokens = config.block_size
    mb = total * stats["kv_block_bytes"] >> 20
    if torch.device(device).type != "cpu":
        held, idle = f"allocated on {device}", "kept while the server runs"
    else:
        held = "resident only as used"
        idle = (f"after {config.idle_release_seconds:g} s idle it keeps "
                f"{config.idle_cache_bytes >> 20} MB" if config.idle_release_seconds else
                "no idle release")
    return (f"KV cache: up to {total * block_tokens} tokens ({mb} MB, {stats['kv_dtype']}), "
            f"{held}; the prefix cache keeps up to {config.prefix_cache_bytes >> 20} MB beyond "
            f"running requests; {idle}")


def create_app(settings: ServerSettings, state: ServerState | None = None) -> Starlette:
    state = state or ServerState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async def load() -> None:
            try:
                if state.engine is None:
                    await asyncio.to_thread(load_into, state)
                log.info("model %s ready on %s, %s compute; %s", state.served_name,
                         state.engine.device, str(state.engine.dtype).removeprefix("torch."),
                         kv_summary(state.engine.stats(), settings.engine, state.engine.device))
            except Exception as e:  # noqa: BLE001 - reported by /health and every request
                state.load_error = f"{type(e).__name__}: {e}"
                log.error("loading %s failed: %s", settings.model, state.load_error)
                return
            state.worker = BatchWorker(state)  # resumes batches left unfinished
            state.worker.start()

        # left unfinished by a crash: nothing generates them any more
        await state.db.run(state.responses.fail_unfinished, background.SHUTDOWN)
        task = asyncio.create_task(load())
        sampler = asyncio.create_task(dashboard.sample_throughput(state))
        yield
        sampler.cancel()
        if not task.done():
            task.cancel()
        await background.stop_all(state)  # stored failed: they cannot finish now
        if state.worker is not None:
            await state.worker.stop()
        await state.flush_usage()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        state.db.close()

    routes = [
        Route("/", dashboard.index, methods=["GET"]),
        Route("/static/{name}", dashboard.static_file, methods=["GET"]),
        Route("/v1/dashboard/state", dashboard.dashboard_state, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/chat/completions", stored_completions.list_completions, methods=["GET"]),
        Route("/v1/chat/completions/{completion_id}", stored_completions.get_completion,
              methods=["GET"]),
        Route("/v1/chat/completions/{completion_id}", stored_completions.update_completion,
              methods=["POST"]),
        Route("/v1/chat/completions/{completion_id}", stored_completions.delete_completion,
              methods=["DELETE"]),
        Route("/v1/chat/completions/{completion_id}/messages",
              stored_completions.list_messages, methods=["GET"]),
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/responses", responses.create_response, methods=["POST"]),
        Route("/v1/responses/input_tokens", responses.count_input_tokens, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", responses.list_input_items,
              methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel_response,
              methods=["POST"]),
        Route("/v1/conversations", conversations.create_conversation, methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", conversations.get_conversation,
              methods=["GET"]),
        Route("/v1/conversations/{conversation_id}", conversations.update_conversation,
              methods=["POST"]),
        Route("/v1/conversations/{conversation_id}", conversations.delete_conversation,
              methods=["DELETE"]),
        Route("/v1/conversations/{conversation_id}/items", conversations.add_items,
              methods=["POST"]),
        Route("/v1/conversations/{conversation_id}/items", conversations.list_items,
              methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items/{item_id}", conversations.get_item,
              methods=["GET"]),
        Route("/v1/conversations/{conversation_id}/items/{item_id}",
              conversations.delete_item, methods=["DELETE"]),
        Route("/v1/embeddings", embeddings.create_embeddings, methods=["POST"]),
        Route("/v1/messages", anthropic_messages.create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_messages.count_tokens, methods=["POST"]),
        Route("/v1/messages/batches", message_batches.create_message_batch, methods=["POST"]),
        Route("/v1/messages/batches", message_batches.list_message_batches, methods=["GET"]),
        Route("/v1/messages/batches/{message_batch_id}", message_batches.get_message_batch,
              methods=["GET"]),
        Route("/v1/messages/batches/{message_batch_id}", message_batches.delete_message_batch,
              methods=["DELETE"]),
        Route("/v1/messages/batches/{message_batch_id}/cancel",
              message_batches.cancel_message_batch, methods=["POST"]),
        Route("/v1/messages/batches/{message_batch_id}/results",
              message_batches.message_batch_results, methods=["GET"]),
        Route("/v1/files", files.upload_file, methods=["POST"]),
        Route("/v1/files", files.list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", files.get_file, methods=["GET"]),
        Route("/v1/files/{file_id}", files.delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", files.file_content, methods=["GET"]),
        Route("/v1/batches", batches.create_batch, methods=["POST"]),
        Route("/v1/batches", batches.list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", batches.get_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", batches.cancel_batch, methods=["POST"]),
        Route("/v1/usage", get_usage, methods=["GET"]),
        Route("/tokenize", tokenize.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize.detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenize.tokenizer_info, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        # CORS outermost: a browser's preflight carries no key, and errors (401 included)
        # need the headers too, or the page cannot read them.
        middleware=[Middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                               allow_origin_regex=LOCAL_ORIGINS, allow_methods=["*"],
                               allow_headers=["*"]),
                    Middleware(AuthMiddleware, api_keys=settings.api_keys),
                    Middleware(DrainMiddleware, state=state)],
        exception_handlers={APIError: api_error_handler, HTTPException: http_error_handler,
                            Exception: unexpected_error_handler},
        lifespan=lifespan,
    )
    app.state.server = state
    return app

