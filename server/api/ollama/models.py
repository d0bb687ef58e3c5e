"""Ollama's model routes: GET /api/tags (the store), GET /api/ps (what is loaded), POST
/api/show (one model's details and template), GET /api/version, and POST /api/embed (and the
older /api/embeddings) over the embeddings path."""

from __future__ import annotations

import datetime as dt
import hashlib
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.admission import admit, read_request
from server.api.auth import tenant
from server.api.body import read_json
from server.api.errors import APIError, invalid
from server.api.fields import Fields
from server.api.generation.embedding import embed
from server.api.generation.protocol import parse_keep_alive
from server.api.state import ServerState
from storage.models import ModelStore, StoredModel

VERSION = "0.12.0"  # the Ollama API version whose shapes these follow (clients check it)


def _details(manifest: dict[str, Any]) -> dict[str, Any]:
    bits = manifest.get("bits")
    params = manifest.get("num_parameters") or 0
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    family = str(manifest.get("config", {}).get("model_type") or manifest.get("architecture"))
    return {"parent_model": "", "format": "safetensors", "family": family,
            "families": [family], "parameter_size": size,
            "quantization_level": {4: "Q4", 8: "Q8"}.get(bits, "BF16")}


def _entry(model: StoredModel) -> dict[str, Any]:
    digest = hashlib.sha256("".join(sorted(model.manifest["files"].values())).encode())
    return {"name": model.name, "model": model.name,
            "modified_at": model.manifest.get("created_at"), "size": model.size_bytes,
            "digest": digest.hexdigest(), "details": _details(model.manifest)}


async def tags(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return JSONResponse({"models": [_entry(m) for m in ModelStore(state.home).list()]})


async def ps(request: Request) -> Response:
    """The loaded models: the first (held for good), then those loaded on demand (their expiry:
    their last request plus the keep-alive)."""
    state: ServerState = request.app.state.server
    if state.engine is None:
        return JSONResponse({"models": []})
    store = ModelStore(state.home)
    far = dt.datetime(2262, 1, 1, tzinfo=dt.UTC)
    now, keep = time.monotonic(), state.settings.keep_alive
    models = []
    for view in [state, *state.held.views.values()]:
        expires = far if view is state or keep is None else dt.datetime.now(dt.UTC) + \
            dt.timedelta(seconds=max(0.0, view.last_used + keep - now))
        try:
            entry = _entry(store.resolve(view.served_name))
        except Exception:  # noqa: BLE001 - served from a folder outside the store
            entry = {"name": view.served_name, "model": view.served_name, "size": 0,
                     "digest": "", "details": {}}
        models.append(entry | {"expires_at": expires.isoformat(), "size_vram": 0,
                               "context_length": view.max_request_tokens})
    return JSONResponse({"models": models})


async def show(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, state.settings.max_body_bytes)
    name = body.get("model") or body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str):
        raise invalid("model", "model is required")
    try:
        model = ModelStore(state.home).resolve(name)
    except Exception:  # noqa: BLE001 - any name the store does not hold
        raise APIError(404, f"model '{name}' not found") from None
    template = model.manifest.get("tokenizer", {}).get("chat_template") or ""
    if state.tokenizer is not None and state.serves(name):
        template = getattr(state.tokenizer, "chat_template", None) or template
    capabilities = ["completion"] + (["tools"] if "tools" in template else []) + (
        ["thinking"] if state.reasoning is not None and state.serves(name) else [])
    config = model.manifest.get("config", {})
    return JSONResponse({
        "modelfile": f"FROM {model.name}\n", "parameters": "", "template": template,
        "details": _details(model.manifest), "capabilities": capabilities,
        "model_info": {"general.architecture": model.manifest.get("architecture"),
                       "general.parameter_count": model.manifest.get("num_parameters"),
                       "context_length": config.get("max_position_embeddings")},
        "modified_at": model.manifest.get("created_at")})


async def version(request: Request) -> Response:
    return JSONResponse({"version": VERSION})


@dataclass(slots=True)
class EmbedRequest:
    model: str
    inputs: list[str | list[int]]
    dimensions: int | None
    legacy: bool  # /api/embeddings: `prompt` in, one `embedding` out
    stream: bool = False


def parse_embed(body: dict[str, Any], vocab_size: int, legacy: bool = False) -> EmbedRequest:
    f = Fields(body)
    model = f.str("model", required=True)
    name = "prompt" if legacy else "input"
    value = f.raw(name)
    inputs = [value] if isinstance(value, str) else value
    if not isinstance(inputs, list) or not inputs or not all(
            isinstance(x, str) and x for x in inputs):
        raise invalid(name, f"{name}: expected a non-empty string or list of strings")
    dimensions = f.int("dimensions", lo=1)
    f.bool("truncate", True)  # inputs longer than the context are refused, never cut
    parse_keep_alive(f.raw("keep_alive"))
    if f.raw("options") is not None and not isinstance(f.raw("options"), dict):
        raise invalid("options", "options: expected an object")
    f.check_unknown()
    return EmbedRequest(model, inputs, dimensions, legacy)


async def embed_inputs(request: Request) -> Response:
    """POST /api/embed ({"embeddings": [...]}) and /api/embeddings ({"embedding": [...]})."""
    legacy = request.url.path.endswith("/embeddings")
    state, req = await read_request(request, partial(parse_embed, legacy=legacy))
    async with admit(state, req, tenant(request), generates=False) as place:
        started = time.monotonic()

        async def work() -> dict[str, Any]:
            got = await embed(state, req.inputs, req.dimensions, place.owner, place.priority,
                              "prompt" if legacy else "input")
            if legacy:
                return {"embedding": got.vectors[0]}
            return {"model": state.served_name, "embeddings": got.vectors,
                    "total_duration": int((time.monotonic() - started) * 1e9),
                    "load_duration": 0, "prompt_eval_count": got.num_tokens}
        return await place.answer(request, work())
