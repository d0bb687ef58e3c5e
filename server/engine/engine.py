"""Engine (the step) and AsyncEngine (the engine in its own thread, for asyncio callers)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from server.engine.block_manager import BlockManager
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.model_runner import ModelRunner, kv_bytes_per_block
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.sequence import (
    PRIORITY_INTERACTIVE,
    SamplingParams,
    Sequence,
    SequenceStatus,
)


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # default: from kv_cache_bytes
    kv_cache_bytes: int | None = None  # KV pool budget; default: default_kv_cache_bytes()
    # Storage dtype of the KV pool (None: the compute dtype). bf16 under fp32 compute halves
    # the pool's memory and the bytes attention gathers; values are rounded to bf16.
    kv_cache_dtype: torch.dtype | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's context
    enable_prefix_caching: bool = True
    # Batch sequences computed per step while interactive ones run or wait (short steps for
    # them); batch work alone uses all of max_num_seqs.
    max_num_shared_seqs: int = 8
    # Chunked prefill for inter-token latency: a step that also decodes may take at most this
    # multiple of a decode-only step because of the chunks of long prompts in it (measured
    # costs, see PrefillPacer). None: chunks are bounded by max_num_batched_tokens only.
    max_itl_stretch: float | None = 1.5
    long_prompt_tokens: int = 256  # only prompts longer than this are paced


@dataclass(slots=True)
class StepOutput:
    scheduled: SchedulerOutput
    finished: list[Sequence]


@dataclass(slots=True)
class Metrics:
    """Counters for /metrics; the engine thread writes, readers take snapshots."""

    num_prompt_tokens: dict[int, int] = field(default_factory=dict)  # computed, by priority
    num_generation_tokens: dict[int, int] = field(default_factory=dict)  # by priority
    num_steps: int = 0
    step_seconds: float = 0.0


# The smallest prompt chunk in a step that decodes, so a new prompt always advances. Measured
# (16 int4 streams, a 2,000-token prompt, stretch 1.75): with a floor of 4 the chunks sank to it
# and the prompt took 69-113 s for no better ITL: a chunk's cost is not only per token, its
# attention gathers the whole context so far (+22 ms at 16 tokens of context, +130 ms at 3,400).
# 32, not 16, since int4 prompt rows run a bf16 GEMM, memory-bound at a few rows (AVX-512 BF16
# machine, stretch 1.5): the same ITL (2.09-2.13x against 2.11x), the prompt in 5.0 s, not 9.2.
MIN_PREFILL_CHUNK = 32


class PrefillPacer:
    """Sizes prompt chunks in steps that decode, from measured step times.

    It keeps two running averages: the time of a decode-only step and the time per prompt
    token (a step's time beyond its decodes, over its prompt tokens). A step that decodes may
    then add (stretch - 1) decode steps' worth of prompt tokens, at least min_tokens so a new
    prompt always advances. Until both are measured, no cap.
    """

    ALPHA = 0.3  # weight of the newest step in the averages

    def __init__(self, stretch: float | None, min_tokens: int) -> None:
        self.stretch, self.min_tokens = stretch, min_tokens
        self.decode_seconds: float | None = None
        self.token_seconds: float | None = None

    def observe(self, num_decodes: int, num_prompt_tokens: int, seconds: float) -> None:
        if num_prompt_tokens == 0 and num_decodes:
            self.decode_seconds = self._mix(self.decode_seconds, seconds)
        elif num_prompt_tokens >= self.min_tokens:
            base = self.decode_seconds if num_decodes and self.decode_seconds else 0.0
            per_token = max(seconds - base, 0.0) / num_prompt_tokens
            self.token_seconds = self._mix(self.token_seconds, per_token)

    def cap(self) -> int | None:
        """Prompt tokens allowed in a step that decodes, or None for no cap."""
        if self.stretch is None or not self.decode_seconds or not self.token_seconds:
            return None
        extra = (self.stretch - 1.0) * self.decode_seconds
        return max(self.min_tokens, int(extra / self.token_seconds))

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ALPHA) * old + self.ALPHA * new


class Engine:
    """Synchronous engine: add requests, call step() until nothing is left."""

    def __init__(self, model, config: EngineConfig, device, dtype) -> None:
        model_len = model.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        budget = config.kv_cache_bytes or default_kv_cache_bytes(device)
        num_blocks = config.num_blocks or max(
            1, budget // kv_bytes_per_block(model.config, config.block_size,
                                            config.kv_cache_dtype or dtype))
        self.config = config
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   config.max_num_shared_seqs, config.long_prompt_tokens)
        self.runner = ModelRunner(model, num_blocks, config.block_size, device, dtype,
                                  config.kv_cache_dtype)
        self.metrics = Metrics()
        self.pacer = PrefillPacer(config.max_itl_stretch, MIN_PREFILL_CHUNK)

    def add(self, seq: Sequence) -> None:
        """Queue seq; raises RequestTooLargeError if it could never run."""
        self.scheduler.add(seq)

    def step(self) -> StepOutput:
        out = self.scheduler.schedule()
        result = None
        if not out.is_empty:
            t = time.perf_counter()
            result = self.runner.run(out)
            self._pace(out, time.perf_counter() - t)
        finished = self.scheduler.update(out, result.token_ids if result else [])
        self._record(out, result, finished)
        if not self.has_unfinished:  # idle: hand the step's freed temporaries back (~0.1 ms)
            _release_freed_memory()
        return StepOutput(out, finished)

    def _pace(self, out: SchedulerOutput, seconds: float) -> None:
        num_decodes = sum(1 for n in out.num_new_tokens if n == 1)
        num_prompt = sum(n for n in out.num_new_tokens if n > 1)
        self.pacer.observe(num_decodes, num_prompt, seconds)
        self.scheduler.prefill_tokens_with_decodes = self.pacer.cap()

    def _record(self, out: SchedulerOutput, result, finished: list[Sequence]) -> None:
        """Bookkeeping outside the four lines: logprobs, sampler state, counters."""
        m = self.metrics
        m.num_steps += 1
        sampling = [s for s, f in zip(out.seqs, out.is_sampling, strict=True) if f]
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                m.num_prompt_tokens[seq.priority] = m.num_prompt_tokens.get(seq.priority, 0) + n
        for k, seq in enumerate(sampling):
            m.num_generation_tokens[seq.priority] = m.num_generation_tokens.get(seq.priority,
                                                                                0) + 1
            if result is not None and result.logprobs is not None and seq.params.logprobs:
                tops = result.top_logprobs[k][: seq.params.top_logprobs] if result.top_logprobs \
                    else []
                seq.logprobs.append((result.logprobs[k], tops))
        for seq in finished:
            self.runner.sampler.release(seq)

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters behind /metrics."""
        bm, sched, m = self.block_manager, self.scheduler, self.metrics
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": len(bm.blocks),
            "prefix_cache_queries": bm.num_cache_queries,
            "prefix_cache_hits": bm.num_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "prompt_tokens": dict(m.num_prompt_tokens),
            "generation_tokens": dict(m.num_generation_tokens),
            "num_steps": m.num_steps,
            "step_seconds": m.step_seconds,
        }

    def abort(self, seq: Sequence, status=SequenceStatus.FINISHED_ABORTED) -> None:
        self.scheduler.abort(seq, status)
        self.runner.sampler.release(seq)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished


@dataclass(slots=True)
class CompletionChunk:
    """What generate() yields: new text and tokens of one of the request's n choices."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | None = None  # the stop string that ended it, if any
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass(slots=True)
class _Request:
    request_id: str
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """The model runs in its own thread; callers await generate() and may abort().

    Pass a function that builds the Engine to have the model loaded in that thread too: all
    torch work then happens in one thread. Measured here (2 cores): decode steps run from a
    thread other than the one that loaded the model took 61 ms instead of 36-41 ms (two
    OpenMP thread teams competing for the cores).
    """

    def __init__(self, engine: Engine | Callable[[], Engine], tokenizer: Any,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
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
        req = _Request(request_id, seqs,
                       [IncrementalDetokenizer(self.tokenizer, params.stop) for _ in seqs],
                       asyncio.get_running_loop(), asyncio.Queue())
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

    # -- the engine thread ---------------------------------------------------------------------

    def _run(self, engine: Engine | Callable[[], Engine]) -> None:
        try:
            self.engine = engine if isinstance(engine, Engine) else engine()
            _release_freed_memory()  # loading's temporaries (int32 unpacking, file reads)
        except BaseException as e:  # noqa: BLE001 - raised in the constructing thread
            self._start_error = e
            return
        finally:
            self._started.set()
        self._loop()

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._drain_inbox()
            if not engine.has_unfinished:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            t = time.perf_counter()
            try:
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
                self._requests[arg.request_id] = arg
                for seq in arg.seqs:
                    self.engine.add(seq)
            elif kind == "abort" and arg in self._requests:
                for seq in self._requests.pop(arg).seqs:
                    self.engine.abort(seq)

    def _deliver(self, step: StepOutput) -> None:
        touched = [s for s, f in zip(step.scheduled.seqs, step.scheduled.is_sampling,
                                     strict=True) if f]
        # One wake-up of each event loop per step, not one per chunk.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for seq in touched:
            req = self._requests.get(seq.request_id)
            if req is None:
                continue
            index = req.seqs.index(seq)
            detok = req.detokenizers[index]
            token = seq.token_ids[-1]
            text = detok.add(token)
            status = seq.status
            if detok.stopped_by is not None and not status.is_finished:
                self.engine.abort(seq, SequenceStatus.FINISHED_STOPPED)
                status = seq.status
            if status.is_finished:
                text += detok.flush() if detok.stopped_by is None else ""
            logprobs = None
            if seq.params.logprobs:  # one entry per sampled token, this step's is the last
                lp, tops = seq.logprobs[-1]
                logprobs = [(token, lp, tops)]
            chunk = CompletionChunk(
                index, text, [token], seq.finish_reason, detok.stopped_by, logprobs,
                seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_output_tokens)
            batches.setdefault(req.loop, []).append((req.queue, chunk))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)
        # Only now: several of a request's n choices can finish in the same step.
        for seq in touched:
            req = self._requests.get(seq.request_id)
            if req is not None and all(s.status.is_finished for s in req.seqs):
                del self._requests[seq.request_id]

    def _fail_all(self, error: Exception) -> None:
        for req in list(self._requests.values()):
            for seq in req.seqs:
                self.engine.abort(seq)
            req.loop.call_soon_threadsafe(req.queue.put_nowait, error)
        self._requests.clear()


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _release_freed_memory() -> None:
    """Hand memory freed by glibc's allocator back to the OS (Linux; a no-op elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def default_kv_cache_bytes(device) -> int:
    """A fifth of the memory available now (CPU) or 80% of free GPU memory, within limits."""
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free * 0.8)
    available = 4 << 30
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return max(64 << 20, min(available // 5, 4 << 30))


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)


def load_engine(
    stored, config: EngineConfig | None = None, device: str | None = None,
    dtype: str | None = None,
) -> AsyncEngine:
    """Load a stored model and its tokenizer into an AsyncEngine (device/dtype by name or
    automatic)."""
    from server.models.device import pick_device, pick_dtype
    from server.models.loader import load_model
    from server.models.tokenizer import load_tokenizer

    device = pick_device(device)
    dtype = pick_dtype(device, dtype)

    def build() -> Engine:  # runs in the engine thread: all torch work in one thread
        loaded = load_model(stored, device, dtype)
        return Engine(loaded.model, config or EngineConfig(), device, dtype)

    eos = tuple(stored.manifest["tokenizer"]["eos_token_ids"])
    return AsyncEngine(build, load_tokenizer(stored), eos)
