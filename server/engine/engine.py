"""Engine: the synchronous step (schedule, run, update), its configuration and counters.

AsyncEngine (async_engine.py) runs it in a thread for asyncio callers."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from server.engine.block_manager import BlockManager
from server.engine.model_runner import ModelRunner, kv_bytes_per_block
from server.engine.pacing import MIN_PREFILL_CHUNK, PrefillPacer
from server.engine.recache import PRIORITY_RECACHE, ReplyRecache
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.sequence import SamplingParams, Sequence, SequenceStatus
from server.engine.window_blocks import WindowBlocks
from server.models.device import pick_kv_dtype


class ConfigError(ValueError):
    """A configuration field out of range; `field` names it (the CLI maps it to its flag)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field, self.message = field, message


def at_least(obj: object, minimum: float, *names: str) -> None:
    """Raise ConfigError unless each named field of obj (None allowed) is >= minimum."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and not value >= minimum:  # `not >=`: NaN fails too
            raise ConfigError(name, f"must be at least {minimum}, got {value}")


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # default: from kv_cache_bytes
    kv_cache_bytes: int | None = None  # KV pool budget; default: default_kv_cache_bytes()
    # Storage dtype of the KV pool (None: device.pick_kv_dtype: bf16 on CPUs without native bf16,
    # else the compute dtype). bf16 under fp32 compute halves the pool's memory and the bytes
    # attention reads; values are rounded to bf16 once, when written.
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
    # Memory: the pool is reserved, resident only where written (block_manager.py). Cached
    # blocks kept beyond running sequences before fresh memory is preferred to them; at 256 MB
    # the shared-prompt hit rate of the soak is today's (benchmarks/memory_soak.py).
    prefix_cache_bytes: int = 256 << 20
    # Idle this long (None: never), the server hands back all KV memory but this much cache
    # (five minutes, as Ollama keeps a model; short pauses keep the whole cache).
    idle_release_seconds: float | None = 300.0
    idle_cache_bytes: int = 0
    # Idle this long (None: never), compute finished interactive replies as prompt for the
    # next turn (recache.py).
    recache_replies_after: float | None = None

    def __post_init__(self) -> None:
        at_least(self, 1, "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len", "max_num_shared_seqs", "long_prompt_tokens")
        at_least(self, 0, "prefix_cache_bytes", "idle_release_seconds", "idle_cache_bytes")
        budget = self.kv_cache_bytes
        if budget is not None and not budget >= 1 << 20:
            raise ConfigError("kv_cache_bytes", f"must be at least 1 MiB, got {budget}")
        stretch = self.max_itl_stretch
        if stretch is not None and not 1 <= stretch <= 1000:
            raise ConfigError("max_itl_stretch", f"must be within 1..1000 (or off), got {stretch}")


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


class Engine:
    """Synchronous engine: add requests, call step() until nothing is left."""

    def __init__(self, model, config: EngineConfig, device, dtype) -> None:
        model_len = model.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.kv_dtype = config.kv_cache_dtype or pick_kv_dtype(device, dtype)
        if hasattr(model, "serve_context"):  # longrope's factors follow it (rope.py)
            model.serve_context(self.max_model_len)
        sizes = PoolSizes.plan(model.config, config, self.max_model_len, self.kv_dtype,
                               config.kv_cache_bytes or default_kv_cache_bytes(device))
        self.block_bytes, self.window_block_bytes = sizes.block_bytes, sizes.window_block_bytes
        self.config = config
        self.runner = ModelRunner(model, sizes.num_blocks, config.block_size, device, dtype,
                                  self.kv_dtype, sizes.window_blocks, sizes.windowed)
        window = None
        if sizes.window_blocks:
            window = WindowBlocks(sizes.window_blocks, config.block_size, sizes.window,
                                  sizes.cache_blocks, partial(self.runner.copy_slots, pool=1))
        self.block_manager = BlockManager(sizes.num_blocks, config.block_size,
                                          config.enable_prefix_caching, sizes.cache_blocks,
                                          self.runner.copy_slots, window)
        self.pacer = PrefillPacer(config.max_itl_stretch, MIN_PREFILL_CHUNK)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.max_model_len,
                                   config.max_num_shared_seqs, config.long_prompt_tokens,
                                   self.pacer)
        self.metrics = Metrics()
        self.recache = ReplyRecache(config.block_size, config.recache_replies_after
                                    if config.enable_prefix_caching else None)

    def add(self, seq: Sequence) -> None:
        """Queue seq; raises RequestTooLargeError if it could never run."""
        self.scheduler.add(seq)

    def warm_up(self) -> None:
        """Run a short request of the engine's own (a 48-token prompt, then a decode step)
        before any real one, so that first calls (oneDNN's primitives, buffers' first pages,
        the GPU's libraries) fall on loading, not on the first user's time to first token. The
        pool, the prefix cache, the counters and the pacer's measurements are as new after it."""
        n = min(3 * self.config.block_size, self.max_request_tokens - 2)  # a small pool too
        if n < 1:
            return
        self.add(Sequence(list(range(n)), SamplingParams(max_tokens=2, temperature=0.0,
                                                         ignore_eos=True), internal=True))
        while self.has_unfinished:
            self.step()
        self._release_blocks(0)
        self.pacer.forget()
        self.metrics = Metrics()

    def step(self) -> StepOutput:
        out = self.scheduler.schedule(self.recache.before_step(self.scheduler, self.abort))
        result = None
        if not out.is_empty:
            t = time.perf_counter()
            result = self.runner.run(out)
            self._pace(out, time.perf_counter() - t)
        finished = self.scheduler.update(out, result.token_ids if result else [])
        self._record(out, result, finished)
        for seq in finished:
            self.recache.offer(seq)
        self.recache.after_step(self.scheduler)
        if not self.has_unfinished:  # idle: hand the step's freed temporaries back (~0.1 ms)
            release_freed_memory()
        return StepOutput(out, finished)

    def _pace(self, out: SchedulerOutput, seconds: float) -> None:
        # a decode's drafted rows (speculation.py) are decode rows too
        decodes = [n - d == 1 for n, d in zip(out.num_new_tokens, out.num_drafts, strict=True)]
        num_decodes = sum(n for n, d in zip(out.num_new_tokens, decodes, strict=True) if d)
        num_prompt = sum(n for n, d in zip(out.num_new_tokens, decodes, strict=True) if not d)
        self.pacer.observe(num_decodes, num_prompt, seconds)

    def _record(self, out: SchedulerOutput, result, finished: list[Sequence]) -> None:
        """Bookkeeping outside the four lines: logprobs, sampler state, counters."""
        m = self.metrics
        m.num_steps += 1
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            if seq.num_computed_tokens <= seq.num_prompt_tokens and not seq.internal:
                m.num_prompt_tokens[seq.priority] = m.num_prompt_tokens.get(seq.priority, 0) + n
        row = 0  # the sampled rows: a sequence's last token's, then one per draft
        for seq, num_rows, num_kept in zip(out.seqs, out.num_sampled_rows, out.num_kept,
                                           strict=True):
            first, row = row, row + num_rows
            if not num_rows or seq.internal:
                continue
            m.num_generation_tokens[seq.priority] = m.num_generation_tokens.get(seq.priority,
                                                                                0) + num_kept
            if result is None or result.logprobs is None or not seq.params.logprobs:
                continue
            for k in range(first, first + num_kept):  # the kept tokens are the first rows'
                tops = result.top_logprobs[k][: seq.params.top_logprobs] if result.top_logprobs \
                    else []
                seq.logprobs.append((result.logprobs[k], tops))
        if result is not None and result.embeddings:
            pooled = [s for s, f in zip(out.seqs, out.is_pooling, strict=True) if f]
            for seq, vector in zip(pooled, result.embeddings, strict=True):
                seq.embedding = vector
        for seq in finished:
            self.runner.release(seq)

    def release_idle(self) -> int:
        """Idle: hand back the KV memory the cache does not keep, and the allocator's free
        memory. Returns the KV bytes given back to the OS."""
        keep = self.config.idle_cache_bytes // (self.block_bytes + self.window_block_bytes
                                                 or 1)
        released = self._release_blocks(keep)
        release_freed_memory()
        return released

    def _release_blocks(self, keep_cached: int) -> int:
        """Hand back every pool's free memory but `keep_cached` cached blocks."""
        bm = self.block_manager
        released = self.runner.release_blocks(bm.release_idle(keep_cached))
        if bm.window is not None:
            released += self.runner.release_blocks(bm.window.release_idle(keep_cached), 1)
        return released

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters behind /metrics."""
        bm, sched, m = self.block_manager, self.scheduler, self.metrics
        return {
            "num_running": sum(not s.internal for s in sched.running),
            "num_waiting": sum(not s.internal for s in sched.waiting),
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": len(bm.blocks),
            "kv_blocks_resident": bm.num_resident_blocks,
            "kv_blocks_cached_free": bm.num_cached_free_blocks,
            "kv_block_bytes": self.block_bytes,
            **_window_stats(bm.window, self.window_block_bytes),
            "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
            "prefix_cache_queries": bm.num_cache_queries,
            "prefix_cache_hits": bm.num_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "prediction_draft_tokens": sched.num_draft_tokens,
            "prediction_accepted_tokens": sched.num_accepted_draft_tokens,
            "replies_recached": self.recache.num_done,
            "replies_to_recache": self.recache.num_pending,
            "prompt_tokens": dict(m.num_prompt_tokens),
            "generation_tokens": dict(m.num_generation_tokens),
            "num_steps": m.num_steps,
            "step_seconds": m.step_seconds,
        }

    def abort(self, seq: Sequence, status=SequenceStatus.FINISHED_ABORTED) -> None:
        self.scheduler.abort(seq, status)
        self.runner.release(seq)

    def drop_internal(self) -> None:
        """After a failed step: the engine's own work goes too (recache.py)."""
        self.recache.drop_running(self.abort)
        self.recache.pending.clear()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self.recache.ready(self.scheduler)

    @property
    def urgency(self) -> int | None:
        """The priority of its most urgent work (lower first): its sequences' (a reply
        recomputed among them, recache.py), or a recompute's that may start; None: idle."""
        seqs = self.scheduler.waiting + self.scheduler.running
        if seqs:
            return min(s.priority for s in seqs)
        return PRIORITY_RECACHE if self.recache.ready(self.scheduler) else None

    @property
    def vocab_size(self) -> int:
        return self.runner.model.config.vocab_size

    @property
    def max_request_tokens(self) -> int:
        """Prompt and completion tokens one sequence may hold: the context or the whole pool."""
        bm = self.block_manager
        return min(self.max_model_len, len(bm.blocks) * bm.block_size)


def limit_malloc_arenas(num_arenas: int = 2) -> None:
    """Cap glibc's malloc arenas (one per thread by default, up to 8 per core): memory freed in
    one thread's arena is not reused by another's, so the server's threads (engine, event loop,
    tokenizing, grammar) left ~25 MB more resident after load (measured: 450 against 425 MB
    after the soak's rounds, throughput unchanged). Call before threads start; Linux only."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-8, num_arenas)  # M_ARENA_MAX


def settle_heap() -> None:
    """Collect, then freeze what is left (gc.freeze): a loaded engine's objects and everything
    made before it leave the collector's generations, so a full collection while serving walks
    only what came since. Unfrozen, a full collection walked the ~216,000 objects of a server
    holding smollm2-135m: a pause of 60-110 ms for every stream, which came whenever a quarter
    as many objects again had outlived two collections (one within a 32-client run; none in
    another 78 s of load; Intel Xeon with AMX, 2026-12-06)."""
    gc.collect()
    gc.freeze()


def collect_everything() -> None:
    """A full collection of the frozen objects too (a model let go: its cycles go with it),
    what is left frozen again."""
    gc.unfreeze()
    settle_heap()


def release_freed_memory() -> None:
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


def _window_stats(window: WindowBlocks | None, block_bytes: int) -> dict[str, int]:
    """The sliding-window layers' pool, for /metrics (zeros without one)."""
    if window is None:
        return dict.fromkeys(("kv_window_blocks_used", "kv_window_blocks_total",
                              "kv_window_blocks_resident", "kv_window_block_bytes"), 0)
    return {"kv_window_blocks_used": window.num_used_blocks,
            "kv_window_blocks_total": len(window.blocks),
            "kv_window_blocks_resident": window.num_resident_blocks,
            "kv_window_block_bytes": block_bytes}


@dataclass(slots=True)
class PoolSizes:
    """How many KV blocks each pool gets: the main one (layers that attend over everything)
    and, where some layers attend over a window shorter than the context, theirs."""

    num_blocks: int
    block_bytes: int
    cache_blocks: int  # cached blocks each pool keeps before fresh memory (prefix_cache_bytes)
    window: int | None = None
    window_blocks: int = 0
    window_block_bytes: int = 0
    windowed: tuple[int, ...] = ()  # the layers whose caches the window pool holds

    @staticmethod
    def plan(model_config, config: EngineConfig, max_model_len: int, kv_dtype: torch.dtype,
             budget: int) -> PoolSizes:
        """By need (every sequence at the full context; the windowed layers' window, their
        chunks and the prefix cache's share), within the memory budget: the window pool first,
        up to half of it."""
        bs = config.block_size
        n = model_config.num_layers
        window = model_config.sliding_window
        windowed = [i for i in range(n) if model_config.layer_window(i) is not None] \
            if window is not None and window < max_model_len else []
        full = [i for i in range(n) if i not in windowed]
        block_bytes = kv_bytes_per_block(model_config, bs, kv_dtype, full)
        window_bytes = kv_bytes_per_block(model_config, bs, kv_dtype, windowed)
        cache_blocks = config.prefix_cache_bytes // (block_bytes + window_bytes)
        need = config.max_num_seqs * -(-max_model_len // bs)
        if not windowed:
            num = config.num_blocks or max(1, min(need, budget // block_bytes))
            return PoolSizes(num, block_bytes, cache_blocks)
        per_seq = -(-(window - 1) // bs) + 2  # a decoding sequence's window and next block
        need_w = min(need, config.max_num_seqs * per_seq + cache_blocks
                     + -(-config.max_num_batched_tokens // bs) + 1)
        if config.num_blocks:
            num, num_w = config.num_blocks, min(need_w, config.num_blocks)
        else:
            num_w = max(1, min(need_w, budget // (2 if full else 1) // window_bytes))
            num = need if not full else max(1, min(need, (budget - num_w * window_bytes)
                                                   // block_bytes))
        return PoolSizes(num, block_bytes, cache_blocks, window, num_w, window_bytes,
                         tuple(windowed))
