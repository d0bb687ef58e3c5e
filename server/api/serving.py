"""The server's state and what chat and completions share: admission, tokenization off the
event loop, streaming from the engine with latency metrics, and aborting on disconnect."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from server.api.auth import tenant
from server.api.body import read_json
from server.api.errors import APIError, invalid, model_not_found
from server.api.metrics import ApiMetrics
from server.api.sse import sse_response
from server.api.usage import Prices, TokenCount, UsageMeter
from server.engine.async_engine import AsyncEngine, CompletionChunk
from server.engine.engine import ConfigError, EngineConfig, at_least
from server.engine.scheduler import RequestTooLargeError
from server.engine.sequence import PRIORITY_INTERACTIVE, SamplingParams
from server.models.tokenizer import byte_to_unicode
from storage.batches import BatchStore, add_usage
from storage.db import Database
from storage.files import FileStore
from storage.models import home_dir

log = logging.getLogger("localserve")


@dataclass(slots=True)
class ServerSettings:
    model: str  # a stored model name, e.g. "smollm2-135m:int4"
    api_keys: tuple[str, ...] = ()
    max_pending: int = 256  # requests admitted at once; beyond: 429
    max_body_bytes: int = 16 << 20
    drain_timeout: float = 30.0  # SIGTERM: how long in-flight requests may take
    engine: EngineConfig = field(default_factory=EngineConfig)
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None  # torch intra-op threads (default: torch's)
    home: Path | None = None  # default: $LOCALSERVE_HOME
    prices: Prices = field(default_factory=Prices)
    batch_window_seconds: int = 24 * 3600  # completion_window "24h"
    batch_max_running: int = 16  # batch lines in the engine at once
    max_file_bytes: int = 200 << 20
    max_batch_lines: int = 50_000

    def __post_init__(self) -> None:
        at_least(self, 1, "max_pending", "max_body_bytes", "threads", "batch_window_seconds",
                 "batch_max_running", "max_file_bytes", "max_batch_lines")
        at_least(self, 0, "drain_timeout")
        if any(not key.strip() for key in self.api_keys):
            raise ConfigError("api_keys", "must not be empty")


class ServerState:
    """Everything handlers need; `engine` is None until the model has loaded."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: AsyncEngine | None = None
        self.tokenizer: Any = None
        self.served_name = settings.model
        self.load_error: str | None = None
        self.draining = False
        self.num_http_inflight = 0  # requests inside the app (SIGTERM waits for 0)
        self.num_pending = 0  # generation requests admitted and not finished
        self.metrics = ApiMetrics()
        self.usage = UsageMeter()
        self._usage_writer: asyncio.Task | None = None
        self.created = int(time.time())
        self.vocab_size = 0
        self.max_request_tokens = 0  # prompt + completion tokens one sequence may hold
        home = settings.home or home_dir()
        self.db = Database(home / "localserve.db")
        self.files = FileStore(self.db, home / "files")
        self.batches = BatchStore(self.db, self.files)
        self.worker: Any = None  # the BatchWorker, once the model is loaded

    def wake_batches(self) -> None:
        if self.worker is not None:
            self.worker.wake.set()

    async def flush_usage(self) -> None:
        """Write the interactive usage counted in memory (put back if the write fails)."""
        rows = self.usage.take()
        if rows:
            try:
                await self.db.run(_add_usage_rows, self.db, rows)
            except BaseException:
                self.usage.restore(rows)
                raise

    def usage_added(self) -> None:
        """A request's usage was counted: write it now, together with whatever else finishes
        meanwhile (one transaction per round, never more than one round at a time), so a
        crash loses at most the requests of the round being written."""
        if self._usage_writer is None or self._usage_writer.done():
            self._usage_writer = asyncio.get_running_loop().create_task(self._write_usage())

    async def _write_usage(self) -> None:
        try:
            while self.usage.pending:
                await self.flush_usage()
        except Exception:  # noqa: BLE001 - kept in memory; the batch worker retries every 2 s
            log.exception("writing usage failed")

    def attach(self, engine: AsyncEngine, served_name: str) -> None:
        self.engine, self.tokenizer, self.served_name = engine, engine.tokenizer, served_name
        self.vocab_size = engine.vocab_size
        self.max_request_tokens = engine.max_request_tokens

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None:
            message = (f"The model failed to load: {self.load_error}" if self.load_error
                       else "The model is still loading; retry shortly.")
            raise APIError(503, message, code="model_not_ready", headers={"Retry-After": "2"})
        return self.engine

    def serves(self, name: object) -> bool:
        """`name` is the served model: its full name or its bare alias."""
        return name in (self.served_name, self.served_name.split(":")[0])

    def check_model(self, name: str) -> None:
        if not self.serves(name):
            raise model_not_found(name)

    def acquire(self) -> None:
        """Take a place in the bounded queue, or 429 now (before any tokenizing)."""
        if self.num_pending >= self.settings.max_pending:
            self.metrics.num_rejected += 1
            raise APIError(429, f"The server is at capacity ({self.settings.max_pending} "
                           "requests in progress); retry shortly.", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        self.num_pending += 1

    def release(self) -> None:
        self.num_pending -= 1


@dataclass(slots=True)
class Generation:
    """A started request of either endpoint, answered whole or as a stream of chunks."""

    collect: Callable[[], Awaitable[dict[str, Any]]]
    stream: Callable[[], AsyncIterator[dict[str, Any]]]


Starter = Callable[[ServerState, Any, str, int], Awaitable[Generation]]


async def respond(request: Request, parse: Callable[[dict, int], Any], start: Starter
                  ) -> Response:
    """What the two generation endpoints do: parse, take a place in the queue (or 429),
    start, then answer whole (aborted if the client leaves) or stream."""
    state: ServerState = request.app.state.server
    body = await read_json(request, state)
    state.ready_engine()
    req = parse(body, state.vocab_size)
    state.check_model(req.model)
    state.acquire()
    handed_to_stream = False  # a stream releases its place when it ends
    try:
        generation = await start(state, req, tenant(request), PRIORITY_INTERACTIVE)
        if req.stream:
            handed_to_stream = True
            return sse_response(generation.stream(), state.release)
        return JSONResponse(await until_disconnect(request, generation.collect()))
    finally:
        if not handed_to_stream:
            state.release()


async def answer_for_batch(state: ServerState, body: dict[str, Any], salt: str, priority: int,
                           parse: Callable[[dict, int], Any], start: Starter
                           ) -> dict[str, Any]:
    """The body a plain request would get (the batch queue's way in); raises APIError as the
    endpoint would answer."""
    req = parse(body, state.vocab_size)
    state.check_model(req.model)
    if req.stream:
        raise invalid("stream", "Batch requests cannot stream.")
    return await (await start(state, req, salt, priority)).collect()


def _add_usage_rows(db: Database, rows: list[dict[str, Any]]) -> None:
    with db.transaction() as conn:
        for row in rows:
            add_usage(conn, row)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def off_loop(fn: Callable, *args) -> Any:
    """Tokenization and templating run in a worker thread, never on the event loop."""
    return await asyncio.to_thread(fn, *args)


def with_max_tokens(state: ServerState, params: SamplingParams, max_tokens: int | None,
                    num_prompt_tokens: int, param: str) -> SamplingParams:
    """Fill in max_tokens (default: the rest of the context) and refuse what cannot fit."""
    limit = state.max_request_tokens
    if num_prompt_tokens == 0:
        raise invalid(param, "The prompt is empty.")
    if max_tokens is None:
        max_tokens = limit - num_prompt_tokens
        if max_tokens < 1:
            raise invalid(param, f"This model's maximum context length is {limit} tokens. "
                          f"However, your messages resulted in {num_prompt_tokens} tokens.",
                          code="context_length_exceeded")
    params = replace(params, max_tokens=max_tokens)
    try:
        state.ready_engine().check(num_prompt_tokens, params)
    except RequestTooLargeError as e:
        raise invalid(param, str(e), code="context_length_exceeded") from None
    return params


async def stream_engine(
    state: ServerState, prompt_ids: list[int], params: SamplingParams, request_id: str,
    salt: str, priority: int = PRIORITY_INTERACTIVE,
) -> AsyncIterator[CompletionChunk]:
    """engine.generate with TTFT / inter-token / end-to-end metrics and finish counts."""
    engine = state.ready_engine()
    start = last = time.perf_counter()
    first = True
    m = state.metrics
    num_open = params.n
    count = TokenCount(len(prompt_ids))  # what the request used so far, even if abandoned
    try:
        async for chunk in engine.generate(prompt_ids, params, priority, salt, request_id):
            now = time.perf_counter()
            (m.ttft if first else m.itl).observe(now - last)
            first, last = False, now
            count.add(chunk)
            if chunk.finish_reason is not None:
                m.finished[chunk.finish_reason] += 1
                num_open -= 1
            yield chunk
        m.e2e.observe(time.perf_counter() - start)
    finally:
        m.finished["abort"] += num_open  # the client left (or the request failed)
        if priority == PRIORITY_INTERACTIVE:  # batch lines count when their result is stored
            state.usage.add(salt, "interactive", state.served_name, count.num_prompt,
                            count.num_output, count.num_cached)
            state.usage_added()


async def merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async iterators as they come, tagged with the iterator's index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    out: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[Any]) -> None:
        try:
            async for item in it:
                await out.put((i, item))
            await out.put((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            await out.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await out.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client goes away first, cancel it (its requests are aborted)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise APIError(499, "The client closed the request.", code="client_closed_request")
    return task.result()


class TokenText:
    """Token strings and bytes for logprobs (byte-level BPE tokens map back to raw bytes; a
    token that is not whole UTF-8 reads `bytes:\\xe2\\x80`, as OpenAI writes it)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder = {c: b for b, c in byte_to_unicode().items()}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
            if piece and all(c in self._byte_decoder for c in piece):
                raw = bytes(self._byte_decoder[c] for c in piece)
            else:
                raw = self.tokenizer.decode([token_id]).encode()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: OpenAI's escaped form
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, list(raw))
        return hit

