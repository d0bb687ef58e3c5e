"""Prometheus text exposition, names in vLLM's style (`localserve:` instead of `vllm:`)."""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from typing import Any

from server.engine.sequence import PRIORITY_INTERACTIVE

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0)
FINISH_REASONS = ("stop", "length", "abort")
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


RECENT_SECONDS = 300.0  # the dashboard's percentiles: the last five minutes...
RECENT_SAMPLES = 4096  # ...or this many observations, whichever is fewer
THROUGHPUT_SAMPLES = 150  # the dashboard's tokens/s: five minutes of samples 2 s apart


class Histogram:
    """Prometheus buckets since start, and the recent observations themselves (for exact
    percentiles of the last minutes)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last is +Inf
        self.sum = 0.0
        self.recent: deque[tuple[float, float]] = deque(maxlen=RECENT_SAMPLES)  # (time, v)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.recent.append((time.monotonic(), v))

    def recent_percentiles(self, *qs: float) -> list[float | None]:
        """Percentiles (nearest rank) of the recent observations; None when there are none."""
        since = time.monotonic() - RECENT_SECONDS
        values = sorted(v for t, v in self.recent if t >= since)
        if not values:
            return [None] * len(qs)
        return [values[min(len(values) - 1, max(0, int(q * len(values) + 0.5) - 1))]
                for q in qs]

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for le, c in zip((*self.buckets, "+Inf"), self.counts, strict=True):
            total += c
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        out += [f"{name}_sum {self.sum}", f"{name}_count {total}"]
        return out


class ApiMetrics:
    """What the HTTP layer observes; the engine's own counters are read at scrape time."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.finished: Counter[str] = Counter()  # by finish reason
        self.num_rejected = 0  # 429s
        self.load_seconds: float | None = None  # how long its model took to load


class Throughput:
    """Generated and prompt tokens per second, interactive and batch, over the last minutes."""

    def __init__(self) -> None:
        self.samples: deque[dict[str, Any]] = deque(maxlen=THROUGHPUT_SAMPLES)
        self._last: tuple[float, dict[str, int]] | None = None

    def observe(self, now: float, stats: dict[str, Any]) -> None:
        """Turn the engine's running totals into rates since the previous observation."""
        generated = stats["generation_tokens"]
        totals = {"interactive": sum(n for p, n in generated.items()
                                     if p <= PRIORITY_INTERACTIVE),
                  "batch": sum(n for p, n in generated.items() if p > PRIORITY_INTERACTIVE),
                  "prompt": sum(stats["prompt_tokens"].values())}
        if self._last is not None:
            then, before = self._last
            dt = max(now - then, 1e-9)
            self.samples.append({"t": round(now, 3)} | {
                k: round((totals[k] - before[k]) / dt, 2) for k in totals})
        self._last = (now, totals)


def kind(priority: int) -> str:
    return "interactive" if priority <= PRIORITY_INTERACTIVE else "batch"


def render(requests: list[tuple[str, ApiMetrics]], engines: list[tuple[str, dict[str, Any]]],
           routed: Counter[tuple[str, str]] | None = None) -> str:
    """The /metrics page: each loaded model's engine (`engines`: name and stats) and requests
    (`requests`: name and what the HTTP layer observed), and the requests each route sent to
    each of its models (`routed`: by route and model)."""
    lines: list[str] = []

    def metric(name: str, kind_: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP localserve:{name} {help_}")
        lines.append(f"# TYPE localserve:{name} {kind_}")
        for labels, v in samples:
            lines.append(f"localserve:{name}{{{labels}}} {v}")

    def per(value) -> list[tuple[str, float]]:  # each model's: a stat's key, or a function
        get = (lambda st: st[value]) if isinstance(value, str) else value
        return [(f'model_name="{name}"', get(stats)) for name, stats in engines]

    if engines:
        metric("num_requests_running", "gauge", "Sequences in the running batch.",
               per("num_running"))
        metric("num_requests_waiting", "gauge", "Sequences waiting to be scheduled.",
               per("num_waiting"))
        metric("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (0-1).",
               per(lambda stats: stats["kv_blocks_used"] / max(1, stats["kv_blocks_total"])))
        metric("kv_cache_blocks_used", "gauge", "KV-cache blocks in use.",
               per("kv_blocks_used"))
        metric("kv_cache_blocks_total", "gauge", "KV-cache blocks in the pool.",
               per("kv_blocks_total"))
        metric("kv_cache_resident_bytes", "gauge", "KV-cache memory written and not handed "
               "back (blocks times block bytes).",
               per(lambda stats: stats["kv_blocks_resident"] * stats["kv_block_bytes"]
                   + stats["kv_window_blocks_resident"] * stats["kv_window_block_bytes"]))
        metric("kv_cache_window_blocks_used", "gauge", "Blocks in use in the sliding-window "
               "layers' own KV pool (0 without one).", per("kv_window_blocks_used"))
        metric("kv_cache_window_blocks_total", "gauge", "Blocks in the sliding-window layers' "
               "own KV pool (0 without one).", per("kv_window_blocks_total"))
        metric("kv_cache_blocks_cached_free", "gauge", "Free KV-cache blocks still holding "
               "prefix-cache content (evictable).", per("kv_blocks_cached_free"))
        metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the "
               "prefix cache.", per("prefix_cache_queries"))
        metric("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
               per("prefix_cache_hits"))
        metric("num_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.",
               per("num_preemptions"))
        metric("prediction_draft_tokens_total", "counter", "Predicted-output tokens drafted "
               "and checked.", per("prediction_draft_tokens"))
        metric("prediction_accepted_tokens_total", "counter", "Drafted predicted-output tokens "
               "the replies kept.", per("prediction_accepted_tokens"))
        metric("replies_recached_total", "counter", "Finished replies computed as prompt while "
               "idle, for the next turn.", per("replies_recached"))
        metric("replies_to_recache", "gauge", "Finished replies waiting to be computed as "
               "prompt (the server is idle for them).", per("replies_to_recache"))
        for key, name, help_ in (("prompt_tokens", "prompt_tokens_total",
                                  "Prompt tokens computed."),
                                 ("generation_tokens", "generation_tokens_total",
                                  "Tokens generated.")):
            samples = []
            for model_name, stats in engines:
                by_kind: Counter[str] = Counter()
                for priority, n in stats[key].items():
                    by_kind[kind(priority)] += n
                samples += [(f'model_name="{model_name}",kind="{k}"', by_kind[k])
                            for k in ("interactive", "batch")]
            metric(name, "counter", help_, samples)
        metric("engine_steps_total", "counter", "Engine steps run.", per("num_steps"))
        metric("engine_step_seconds_total", "counter", "Time spent in engine steps.",
               per("step_seconds"))
    _requests(metric, lines, requests, routed)
    return "\n".join(lines) + "\n"


def _requests(metric: Any, lines: list[str], requests: list[tuple[str, ApiMetrics]],
              routed: Counter[tuple[str, str]] | None) -> None:
    """The request-level samples of render(): each model's finishes, 429s and latencies, and
    the routes' choices."""
    metric("request_success_total", "counter", "Finished requests by finish reason.",
           [(f'model_name="{name}",finished_reason="{r}"', api.finished[r])
            for name, api in requests for r in FINISH_REASONS])
    metric("request_rejected_total", "counter", "Requests refused with 429 (queue full).",
           [(f'model_name="{name}"', api.num_rejected) for name, api in requests])
    metric("model_load_seconds", "gauge", "How long the model took to load (its weights read, "
           "its engine started).", [(f'model_name="{name}"', api.load_seconds)
                                    for name, api in requests if api.load_seconds is not None])
    if routed:
        metric("route_requests_total", "counter", "Requests naming a route, by the model that "
               "answered.", [(f'route="{route}",model_name="{name}"', n)
                             for (route, name), n in sorted(routed.items())])
    for name, attr, help_ in (
        ("time_to_first_token_seconds", "ttft", "Time to first token."),
        ("inter_token_latency_seconds", "itl", "Time between streamed tokens."),
        ("e2e_request_latency_seconds", "e2e", "Request latency, arrival to finish."),
    ):
        lines.append(f"# HELP localserve:{name} {help_}")
        lines.append(f"# TYPE localserve:{name} histogram")
        for model, api in requests:
            lines += [_label(line, f'model_name="{model}"')
                      for line in getattr(api, attr).lines(f"localserve:{name}")]


def _label(line: str, label: str) -> str:
    """Add the model label to one histogram sample line."""
    name, value = line.rsplit(" ", 1)
    if name.endswith("}"):
        return f"{name[:-1]},{label}}} {value}"
    return f"{name}{{{label}}} {value}"
