"""The dashboard at `/`: a static page from the package (server/api/static, no build step, no
CDN) that polls GET /v1/dashboard/state for the live serving state, and reads /v1/batches and
/v1/usage like any client. The page is public; what it shows needs the key like every /v1
route (it asks for one when the server has keys, and sends it as Bearer).

Tokens/s over the last minutes come from a sampler that reads the engine's counters every few
seconds (a ring of samples, kept whether or not anyone looks).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from server.api.errors import APIError
from server.api.state import ServerState

STATIC = Path(__file__).parent / "static"
FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
SAMPLE_SECONDS = 2.0


async def sample_throughput(state: ServerState) -> None:
    """Feed the throughput ring until cancelled (runs for the server's life)."""
    while True:
        if state.engine is not None:
            state.throughput.observe(time.time(), state.engine.stats())
        await asyncio.sleep(SAMPLE_SECONDS)


async def index(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html",
                        headers={"Cache-Control": "no-cache"})


async def static_file(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in FILES:
        raise APIError(404, f"Unknown route: GET {request.url.path}")
    return FileResponse(STATIC / name, media_type=FILES[name],
                        headers={"Cache-Control": "no-cache"})


async def dashboard_state(request: Request) -> Response:
    state: ServerState = request.app.state.server
    out: dict[str, Any] = {"model": state.served_name, "bits": state.manifest.get("bits"),
                           "architecture": state.manifest.get("architecture"),
                           "embedding_model": state.pooling is not None,
                           "status": "ok" if state.engine is not None else (
                               "error" if state.load_error else "loading"),
                           "error": state.load_error, "prices": state.settings.prices.as_dict()}
    if state.engine is None:
        return JSONResponse(out)
    stats = state.engine.stats()
    queries = stats["prefix_cache_queries"]
    m = state.metrics
    ttft, itl = m.ttft.recent_percentiles(0.5, 0.95), m.itl.recent_percentiles(0.5, 0.95)
    out |= {
        "requests": {"running": stats["num_running"], "waiting": stats["num_waiting"],
                     "in_flight": state.num_pending},
        "kv": {"blocks_used": stats["kv_blocks_used"], "blocks_total": stats["kv_blocks_total"],
               "block_bytes": stats["kv_block_bytes"],
               "resident_bytes": stats["kv_blocks_resident"] * stats["kv_block_bytes"]},
        "prefix_cache": {"queried_tokens": queries, "hit_tokens": stats["prefix_cache_hits"],
                         "hit_rate": stats["prefix_cache_hits"] / queries if queries else None},
        "preemptions": stats["num_preemptions"],
        "latency": {"ttft_p50": ttft[0], "ttft_p95": ttft[1], "itl_p50": itl[0],
                    "itl_p95": itl[1]},
        "throughput": list(state.throughput.samples),
        "models": _loaded_models(state),
    }
    return JSONResponse(out)


def _loaded_models(state: ServerState) -> list[dict[str, Any]]:
    """Each loaded model: the memory it holds (weights and KV pool), its requests, how long it
    took to load, its recent median time to first token, and when it goes (None: kept)."""
    now, keep = time.monotonic(), state.settings.keep_alive
    out = []
    for view in [state, *state.held.views.values()]:
        stats = view.engine.stats()
        kept = view is state or view.served_name in state.settings.pinned or keep is None
        own = view.keep_alive if view is not state else None
        stay = own if own is not None else keep
        out.append({"name": view.served_name, "bytes": state.held.footprint(view),
                    "running": stats["num_running"] + stats["num_waiting"],
                    "load_seconds": view.metrics.load_seconds,
                    "ttft_p50": view.metrics.ttft.recent_percentiles(0.5)[0],
                    "goes_in": None if kept or (stay is not None and stay < 0) else max(
                        0.0, view.last_used + (stay or 0.0) - now)})
    return out
