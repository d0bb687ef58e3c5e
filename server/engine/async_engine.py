"""AsyncEngine: the engine in its own thread, for asyncio callers. It only moves work between
threads: requests and aborts in through an inbox, each step's chunks (output.py makes them)
out to the requests' event loops."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.engine import Engine, EngineConfig, StepOutput, release_freed_memory, settle_heap
from server.engine.output import CompletionChunk, OutputProcessor, RequestOutput
from server.engine.sequence import (
    PRIORITY_INTERACTIVE,
    Pooling,
    SamplingParams,
    Sequence,
)
from server.engine.turns import StepTurns

log = logging.getLogger("localserve")


@dataclass(slots=True)
class _Request(RequestOutput):
    """A request in flight: its output state and where its chunks go."""

    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None


class AsyncEngine:
    """The model runs in its own thread; callers await generate() and may abort().

    Pass a function that builds the Engine to have the model loaded in that thread too: all
    torch work then happens in one thread. Measured here (2 cores): decode steps run from a
    thread other than the one that loaded the model took 61 ms instead of 36-41 ms (two
    OpenMP thread teams competing for the cores).
    """

    def __init__(self, engine: Engine | Callable[[], Engine], tokenizer: Any,
                 eos_token_ids: tuple[int, ...], turns: StepTurns | None = None) -> None:
        self.tokenizer = tokenizer
        self._turns = turns or StepTurns()  # shared with the other held models' engines
        self.eos_token_ids = eos_token_ids
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.output = OutputProcessor()
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._turns.join(self, self._wake)
        self._stopping = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(engine,), name="engine",
                                        daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise self._start_error

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = PRIORITY_INTERACTIVE,
        cache_salt: str = "",
        request_id: str | None = None,
    ) -> AsyncIterator[CompletionChunk]:
        """Stream chunks until every one of the n choices has finished. Raises
        RequestTooLargeError before the first chunk if the request can never run."""
        request_id = request_id or f"req-{next(self._ids)}"
        seqs = []
        for i in range(params.n):
            child = params if params.seed is None else _with_seed(params, params.seed + i)
            seq = Sequence(prompt_ids, child, priority, cache_salt, request_id,
                           eos_token_ids=self.eos_token_ids)
            seq.leader = seqs[0] if seqs else None
            seqs.append(seq)
        detokenizers = [IncrementalDetokenizer(self.tokenizer, params.stop,
                                               shown=params.shown_special) for _ in seqs]
        req = _Request(request_id, seqs, detokenizers, asyncio.get_running_loop(),
                       asyncio.Queue())
        for seq in seqs:  # refuse synchronously: too-large requests never reach the thread
            self.engine.scheduler.check(seq)
        self._inbox.put(("add", req))
        self._wake.set()
        remaining = len(seqs)
        try:
            while remaining:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            if remaining:
                self.abort(request_id)

    async def embed(self, prompt_ids: list[int], pooling: Pooling,
                    priority: int = PRIORITY_INTERACTIVE, cache_salt: str = "",
                    request_id: str | None = None) -> list[float]:
        """The prompt's pooled final hidden states: a prefill-only request through the same
        scheduler as generation (it batches with chats). Raises RequestTooLargeError if the
        prompt can never run."""
        request_id = request_id or f"emb-{next(self._ids)}"
        seq = Sequence(prompt_ids, SamplingParams(max_tokens=0), priority, cache_salt,
                       request_id, pooling=pooling)
        req = _Request(request_id, [seq], [], asyncio.get_running_loop(), asyncio.Queue())
        self.engine.scheduler.check(seq)
        self._inbox.put(("add", req))
        self._wake.set()
        done = False
        try:
            item = await req.queue.get()
            if isinstance(item, BaseException):
                raise item
            done = True
            return item.embedding
        finally:
            if not done:
                self.abort(request_id)

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def hidden_size(self) -> int:
        """The length of an embedding."""
        return self.engine.runner.model.config.hidden_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def device(self):
        return self.engine.runner.device

    @property
    def dtype(self):
        """The compute dtype (device.pick_dtype's, or --dtype's)."""
        return self.engine.runner.dtype

    @property
    def max_request_tokens(self) -> int:
        return self.engine.max_request_tokens

    def stats(self) -> dict[str, Any]:
        """A snapshot of the engine's counters (for /metrics)."""
        return self.engine.stats()

    def check(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise RequestTooLargeError if such a request could never run."""
        self.engine.scheduler.check_size(num_prompt_tokens, params.max_tokens)

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are free at the next step."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)
        self._turns.leave(self)

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self, engine: Engine | Callable[[], Engine]) -> None:
        try:
            self.engine = engine if isinstance(engine, Engine) else engine()
            self.output.engine = self.engine
            release_freed_memory()  # loading's temporaries (int32 unpacking, file reads)
        except BaseException as e:  # noqa: BLE001 - raised in the constructing thread
            self._start_error = e
            self._turns.leave(self)
            return
        finally:
            self._started.set()
        self._loop()

    def _loop(self) -> None:
        engine = self.engine
        idle_after = engine.config.idle_release_seconds
        idle_since: float | None = None  # None: busy, or idle memory already handed back
        while not self._stopping:
            self._drain_inbox()
            urgency = engine.urgency
            self._turns.mark(self, urgency)
            if urgency is None or self._turns.waits(self, urgency):  # idle, or others first
                idle_since = (idle_since or time.monotonic()) if urgency is None else None
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                if idle_since is not None and idle_after is not None \
                        and time.monotonic() - idle_since >= idle_after and not self._inbox.qsize():
                    engine.release_idle()
                    idle_since = float("inf")  # once per idle period
                continue
            idle_since = None
            t = time.perf_counter()
            try:
                with self._turns.lock:
                    step = engine.step()
            except Exception as e:  # a failed step fails its requests, never the thread
                self._fail_all(e)
                continue
            engine.metrics.step_seconds += time.perf_counter() - t
            self._deliver(step)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.output.requests[arg.request_id] = arg
                for seq in arg.seqs:
                    self.engine.add(seq)
            elif kind == "abort" and arg in self.output.requests:
                for seq in self.output.requests.pop(arg).seqs:
                    self.engine.abort(seq)

    def _deliver(self, step: StepOutput) -> None:
        """The step's chunks to their requests' queues: one wake-up of each event loop per
        step, not one per chunk."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for req, chunk in self.output.process(step):
            batches.setdefault(req.loop, []).append((req.queue, chunk))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)
        self.output.forget_finished(step)

    def _fail_all(self, error: Exception) -> None:
        for req in list(self.output.requests.values()):
            for seq in req.seqs:
                self.engine.abort(seq)
            req.loop.call_soon_threadsafe(req.queue.put_nowait, error)
        self.output.requests.clear()
        self.engine.drop_internal()  # or it would fail again, step after step


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)


def load_engine(
    stored, config: EngineConfig | None = None, device: str | None = None,
    dtype: str | None = None, turns: StepTurns | None = None,
) -> AsyncEngine:
    """Load a stored model and its tokenizer into an AsyncEngine (device/dtype by name or
    automatic; `turns`: what its steps share with other models' engines)."""
    from server.models.device import pick_device, pick_dtype
    from server.models.loader import load_model
    from server.models.tokenizer import load_tokenizer
    from server.quant import cpu_kernels

    device = pick_device(device)
    dtype = pick_dtype(device, dtype, stored.manifest["bits"])

    def build() -> Engine:  # runs in the engine thread: all torch work in one thread
        loaded = load_model(stored, device, dtype)
        kernels = cpu_kernels(loaded.model) if device.type == "cpu" else None
        if kernels:
            log.info("CPU kernels: %s", kernels)
        engine = Engine(loaded.model, config or EngineConfig(), device, dtype)
        engine.warm_up()
        return engine

    eos = tuple(stored.manifest["tokenizer"]["eos_token_ids"])
    engine = AsyncEngine(build, load_tokenizer(stored), eos, turns)
    settle_heap()  # the model's objects live as long as the engine: out of the collector's way
    return engine
