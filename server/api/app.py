"""create_app: each API family's routes joined, the middleware, and the lifespan (the model
loads in the background so /health answers 503 until it is ready; the batch worker starts
once it has)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api import anthropic, batch, fleet, ollama, openai, ops, rerank
from server.api.auth import AuthMiddleware
from server.api.batch.worker import BatchWorker
from server.api.errors import (
    APIError,
    api_error_handler,
    http_error_handler,
    unexpected_error_handler,
)
from server.api.fleet import ReplicaHeader
from server.api.openai import background
from server.api.ops import dashboard
from server.api.state import ServerSettings, ServerState

log = logging.getLogger("localserve")


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
    from storage.sampling import describe, sampling_defaults

    s = state.settings
    if s.threads:
        import torch

        torch.set_num_threads(s.threads)
    stored = ModelStore().resolve(s.model)
    engine = load_engine(stored, s.engine, s.device, s.dtype, state.held.turns)
    defaults, origin = {}, None
    if s.generation_config == "auto":
        defaults, origin = sampling_defaults(stored.path, stored.manifest.get("alias", ""))
    state.attach(engine, stored.name, stored.manifest, defaults)
    log.info("sampling defaults: %s", describe(defaults, origin))


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
                    started = time.monotonic()
                    await asyncio.to_thread(load_into, state)
                    state.metrics.load_seconds = time.monotonic() - started
                log.info("model %s ready on %s, %s compute; %s", state.served_name,
                         state.engine.device, str(state.engine.dtype).removeprefix("torch."),
                         kv_summary(state.engine.stats(), settings.engine, state.engine.device))
            except Exception as e:  # noqa: BLE001 - reported by /health and every request
                state.load_error = f"{type(e).__name__}: {e}"
                log.error("loading %s failed: %s", settings.model, state.load_error)
                return
            for name in settings.preload:  # the other models `serve` named
                await state.held.view_for(name)
            state.worker = BatchWorker(state)  # resumes batches left unfinished
            state.worker.start()

        await fleet.join(state)  # what a crash left unfinished: nothing generates it now
        beats = asyncio.create_task(fleet.heartbeat(state))
        cancels = asyncio.create_task(background.follow_cancels(state))
        task = asyncio.create_task(load())
        sampler = asyncio.create_task(dashboard.sample_throughput(state))
        reaper = asyncio.create_task(state.held.run_reaper())
        yield
        sampler.cancel()
        reaper.cancel()
        if not task.done():
            task.cancel()
        await background.stop_all(state)  # stored failed: they cannot finish now
        if state.worker is not None:
            await state.worker.stop()
        beats.cancel()
        cancels.cancel()
        await fleet.leave(state)
        await state.flush_usage()
        await state.held.close()
        if state.engine is not None:
            await asyncio.to_thread(state.engine.shutdown)
        state.db.close()

    app = Starlette(
        routes=[*ops.ROUTES, *openai.ROUTES, *anthropic.ROUTES, *ollama.ROUTES, *rerank.ROUTES,
                *batch.ROUTES],
        # CORS outermost: a browser's preflight carries no key, and errors (401 included)
        # need the headers too, or the page cannot read them.
        middleware=[Middleware(ReplicaHeader, replica_id=state.replica.id),
                    Middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
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

