"""The server's settings (checked when built) and state: the engine once loaded, the database
and stores, admission counts, interactive usage waiting to be written."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from server.api.errors import APIError, invalid, model_not_found
from server.api.held import HeldModels, Route
from server.api.metrics import ApiMetrics, Throughput
from server.api.usage import Prices, UsageMeter
from server.engine.async_engine import AsyncEngine
from server.engine.engine import ConfigError, EngineConfig, at_least
from server.engine.grammar import GrammarCompiler
from server.models.tokenizer import REASONING_CHOICES, ReasoningFormat, reasoning_format
from storage.batches import BatchStore, add_usage
from storage.chat_completions import ChatCompletionStore
from storage.conversations import ConversationStore
from storage.db import Database, is_url
from storage.files import FileStore
from storage.models import home_dir
from storage.replicas import STALE_SECONDS, ReplicaStore, new_replica_id
from storage.responses import ResponseStore
from storage.threads import ThreadStore

GENERATION_CONFIGS = ("auto", "vllm", "none")
ROUTE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$")


class Wakeable(Protocol):
    wake: asyncio.Event  # set: there is batch work to look at (the BatchWorker)

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
    # The store: None, the SQLite file in the home; a postgresql:// URL (a fleet's, shared)
    store: str | None = None
    stale_seconds: float = STALE_SECONDS  # a replica silent this long is gone (fleet.py)
    prices: Prices = field(default_factory=Prices)
    batch_window_seconds: int = 24 * 3600  # completion_window "24h"
    batch_max_running: int = 16  # batch lines in the engine at once
    max_file_bytes: int = 200 << 20
    max_batch_lines: int = 50_000
    grammar_timeout: float = 10.0  # seconds a response format or tools grammar may compile
    # "auto": the model's recommended sampling fills what a request leaves out (its
    # generation_config.json, or the catalogue's); "vllm" / "none": the API's own defaults.
    generation_config: str = "auto"
    # Web pages (origins) that may call the API from a browser, besides those on this machine
    # (http(s)://localhost, 127.0.0.1 or [::1], any port); "*": any page.
    cors_origins: tuple[str, ...] = ()
    # The thinking block's tags: "auto" (from the chat template), "none" or a format's name
    # (api/generation/reasoning.py); the most tokens a block may take (None: no limit)
    reasoning_format: str = "auto"
    max_reasoning_tokens: int | None = None
    # Seconds a model loaded on demand is kept after its last request (None: for good)
    keep_alive: float | None = 300.0
    pinned: tuple[str, ...] = ()  # models never let go (serve --pin)
    preload: tuple[str, ...] = ()  # more models `serve` names: loaded at start (and pinned)
    # Bytes the loaded models may hold together (weights and KV pools; None: no limit): a
    # load that would pass it first lets idle models go (held.py)
    memory_limit: int | None = None
    # How tool calls are written: "auto" (from the chat template) or a format's name
    # (api/generation/tool_formats.py; the CLI checks the name)
    tool_format: str = "auto"
    # Names a request may put in `model` (`serve --route`): the route's small model answers,
    # its large one where the small one is not confident (api/generation/cascade.py)
    routes: dict[str, Route] = field(default_factory=dict)

    def __post_init__(self) -> None:
        at_least(self, 1, "max_pending", "max_body_bytes", "threads", "batch_window_seconds",
                 "batch_max_running", "max_file_bytes", "max_batch_lines")
        at_least(self, 0, "drain_timeout")
        at_least(self, 0.001, "grammar_timeout")
        at_least(self, 1, "stale_seconds")
        at_least(self, 0, "max_reasoning_tokens", "keep_alive")
        at_least(self, 1, "memory_limit")
        for name, route in self.routes.items():
            if not ROUTE_NAME.match(name) or route.small == route.large \
                    or not 0 <= route.confidence <= 1:
                raise ConfigError("routes", f"{name}={route.small},{route.large},"
                                  f"{route.confidence} is not a route: give NAME=SMALL,LARGE"
                                  "[,CONFIDENCE], two models, NAME without ':', CONFIDENCE "
                                  "0..1")
        if self.reasoning_format not in REASONING_CHOICES:
            raise ConfigError("reasoning_format",
                              f"must be one of {', '.join(REASONING_CHOICES)}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ConfigError("generation_config",
                              f"must be one of {', '.join(GENERATION_CONFIGS)}")
        if self.store is not None and not is_url(self.store):
            raise ConfigError("store", "must be a postgresql://USER@HOST:PORT/DATABASE URL")
        if any(not key.strip() for key in self.api_keys):
            raise ConfigError("api_keys", "must not be empty")
        for origin in self.cors_origins:  # what a browser sends: scheme://host[:port], no path
            if not re.fullmatch(r"\*|null|[a-z][a-z0-9+.-]*://[^/\s]+", origin):
                raise ConfigError("cors_origins", f"{origin!r} is not an origin: give one like "
                                  "https://app.example.com (no path), null or *")


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
        self.throughput = Throughput()  # tokens/s samples for the dashboard
        self.usage = UsageMeter()
        self._usage_writer: asyncio.Task | None = None
        self.created = int(time.time())
        self.vocab_size = 0
        self.max_request_tokens = 0  # prompt + completion tokens one sequence may hold
        self.pooling: dict[str, Any] | None = None  # an embedding model's pooling
        # The model's recommended sampling where a request leaves it out (storage/sampling.py)
        self.sampling_defaults: dict[str, Any] = {}
        self.reasoning: ReasoningFormat | None = None  # the model's thinking block's tags
        self.manifest: dict[str, Any] = {}  # the loaded model's (bits, architecture...)
        home = self.home = settings.home or home_dir()
        self._signing_key: bytes | None = None
        self.db = Database(settings.store or home / "localserve.db")
        self.files = FileStore(self.db, home / "files")
        self.batches = BatchStore(self.db, self.files)
        self.replica = ReplicaStore(self.db, new_replica_id(), settings.stale_seconds)
        self.responses = ResponseStore(self.db, self.replica)
        self.conversations = ConversationStore(self.db)
        self.chat_completions = ChatCompletionStore(self.db)
        self.threads = ThreadStore(self.db, self.replica)
        self.held = HeldModels(self)  # the models beside the first, loaded on demand
        self.background: dict[str, Any] = {}  # background responses by id (openai/background.py)
        self.worker: Wakeable | None = None  # the BatchWorker, once the model is loaded
        self.grammars: GrammarCompiler | None = None  # once the model is loaded
        # Grammars compile here: never on the event loop, never in the engine's thread, and
        # a slow one cannot hold up tokenizing (the default pool).
        self.grammar_pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")

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

    def attach(self, engine: AsyncEngine, served_name: str,
               manifest: dict[str, Any] | None = None,
               sampling_defaults: dict[str, Any] | None = None) -> None:
        """The loaded model, with its store manifest (bits, pooling...) when it has one, and
        its sampling defaults (none where `generation_config` is not "auto")."""
        self.engine, self.tokenizer, self.served_name = engine, engine.tokenizer, served_name
        self.sampling_defaults = dict(sampling_defaults or {})
        self.manifest = manifest or {}
        self.pooling = self.manifest.get("pooling")  # an embedding model's, else None
        self.vocab_size = engine.vocab_size
        self.max_request_tokens = engine.max_request_tokens
        self.grammars = GrammarCompiler(engine.tokenizer, engine.vocab_size,
                                        engine.eos_token_ids)
        template = getattr(engine.tokenizer, "chat_template", None) or ""
        self.reasoning = reasoning_format(template, self.settings.reasoning_format)

    def signing_key(self) -> bytes:
        """This home's secret for signing what comes back (Anthropic's thinking blocks): made
        once, readable by its owner only."""
        if self._signing_key is not None:
            return self._signing_key
        path = self.home / "signing.key"
        if not path.is_file():
            tmp = path.with_name(f".signing.key.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            try:
                os.link(tmp, path)  # the first writer's key wins
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        self._signing_key = path.read_bytes()
        return self._signing_key

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

    def check_generates(self) -> None:
        """Embedding models only embed (their head, if any, was never trained to write)."""
        if self.pooling is not None:
            raise invalid("model", f"The model `{self.served_name}` is an embedding model: it "
                          "serves /v1/embeddings only.", code="model_not_supported")

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

    def num_background_running(self) -> int:
        return sum(1 for run in self.background.values() if run.ended_at is None)

    def hand_on(self) -> None:
        """One more place, unchecked: an admitted request's work outlives it (a background
        response); released when that work ends."""
        self.num_pending += 1


def _add_usage_rows(db: Database, rows: list[dict[str, Any]]) -> None:
    with db.transaction() as conn:
        for row in rows:
            add_usage(conn, row)
