"""`localserve bench`: load any OpenAI-compatible server and measure it (llama-server too).

Streams chat completions from N concurrent clients (closed loop: each sends its next request
when the last one ends; or Poisson arrivals at --rate), at each concurrency level in turn, and
reports tokens/s, TTFT, inter-token latency and end-to-end latency (p50/p95/p99). Writes JSON
and, with matplotlib installed, a PNG of throughput and latency against concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cli.http import DEFAULT_URL

WORDS = ("time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part",
         "child", "eye", "woman", "place", "work", "week", "case", "point", "number", "group",
         "problem", "fact", "river", "bread", "chess", "music", "train", "cloud", "bee",
         "garden", "window", "letter", "story", "market", "city", "road", "light", "water",
         "stone", "paper", "table")


@dataclass(slots=True)
class Result:
    ttft: float | None = None  # seconds to the first content
    itls: list[float] = field(default_factory=list)  # seconds between content events
    e2e: float = 0.0
    num_output_tokens: int = 0
    error: str | None = None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure a running OpenAI-compatible server")
    p.add_argument("--url", default=DEFAULT_URL, help=f"server root (default {DEFAULT_URL})")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    p.add_argument("--concurrency", default="1,4,16",
                   help="comma-separated client counts, one level each (default 1,4,16)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default: --per-client per client, at least 8)")
    p.add_argument("--per-client", type=int, default=4, help="requests per client (default 4)")
    p.add_argument("--arrival", choices=("closed", "poisson"), default="closed")
    p.add_argument("--rate", type=float, default=4.0, help="poisson: requests per second")
    p.add_argument("--prompt-tokens", type=int, default=128, help="about this many (words)")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    p.add_argument("--jitter", type=float, default=0.25,
                   help="prompt and output lengths vary uniformly by this fraction")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="words of system prompt shared by every request (prefix caching)")
    p.add_argument("--seed", type=int, default=0,
                   help="draws the prompts and lengths (default 0); a second run with the "
                        "same seed against one server finds its prompts in the prefix cache")
    p.add_argument("--warmup", type=int, default=1,
                   help="requests sent one at a time before the first level, not counted "
                        "(default 1: a fresh server's first request pays one-time costs)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG here (matplotlib)")
    p.add_argument("--label", default=None, help="name of this server in the outputs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    levels = _levels(args.concurrency)
    for flag in ("prompt_tokens", "output_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        raise ValueError("--warmup must be at least 0")
    if not 0 <= args.jitter < 1:
        raise ValueError("--jitter must be within 0..1")
    if not 0 <= args.temperature <= 2:
        raise ValueError("--temperature must be within 0..2")
    if not 0 < args.top_p <= 1:
        raise ValueError("--top-p must be above 0 and at most 1")
    report = asyncio.run(_bench(args, levels))
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot([report], args.plot)
    return 0


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency expects numbers like 1,4,16, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError("--concurrency needs counts of at least 1")
    return levels


async def _bench(args: argparse.Namespace, levels: list[int]) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(levels) + 4)
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(600, connect=10)) as http:
        model = args.model or await _first_model(http, args.url)
        rng = random.Random(args.seed)
        prefix = " ".join(rng.choice(WORDS) for _ in range(args.shared_prefix))
        out = {"url": args.url, "label": args.label or args.url, "model": model,
               "arrival": args.arrival, "prompt_tokens": args.prompt_tokens,
               "output_tokens": args.output_tokens, "sampling": _sampling(args),
               "levels": []}
        if args.warmup:  # prompts of their own: the measured ones stay out of the cache
            warm_rng = random.Random(f"warmup-{args.seed}")
            results = [await _one(http, model, *_job(warm_rng, args, prefix))
                       for _ in range(args.warmup)]
            out["warmup"] = {"requests": len(results),
                             "errors": sum(r.error is not None for r in results)}
        for c in levels:
            n = args.requests or max(8, args.per_client * c)
            jobs = [_job(rng, args, prefix) for _ in range(n)]
            bar = tqdm(total=n, desc=f"{c} clients", unit="req", file=sys.stderr, disable=None)
            start = time.perf_counter()
            results = await _level(http, model, jobs, c, args, bar)
            wall = time.perf_counter() - start
            bar.close()
            out["levels"].append(_summary(c, results, wall))
    return out


async def _first_model(http, url: str) -> str:
    import httpx

    try:
        r = await http.get("/v1/models")
    except httpx.HTTPError as e:
        from cli.http import ServerError

        raise ServerError(f"no server at {url} ({e})") from None
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _sampling(args: argparse.Namespace) -> dict[str, float]:
    """The requests' sampling fields: greedy by default, as most comparisons want."""
    fields = {"temperature": args.temperature}
    if args.top_p < 1:
        fields["top_p"] = args.top_p
    return fields


def _job(rng: random.Random, args: argparse.Namespace, prefix: str) -> tuple[list, int, dict]:
    def vary(n: int) -> int:
        return max(1, round(n * rng.uniform(1 - args.jitter, 1 + args.jitter)))

    words = " ".join(rng.choice(WORDS) for _ in range(vary(args.prompt_tokens)))
    messages = [{"role": "user", "content": f"Continue this list of words: {words}"}]
    if prefix:
        messages.insert(0, {"role": "system", "content": prefix})
    return messages, vary(args.output_tokens), _sampling(args)


async def _level(http, model: str, jobs: list, concurrency: int, args, bar) -> list[Result]:
    results: list[Result] = []
    queue = list(reversed(jobs))

    async def client() -> None:
        while queue:
            results.append(await _one(http, model, *queue.pop()))
            bar.update(1)

    if args.arrival == "closed":
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results
    # Poisson arrivals, at most `concurrency` in flight.
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(args.seed + 1)

    async def one(job) -> None:
        async with gate:
            results.append(await _one(http, model, *job))
            bar.update(1)

    tasks = []
    for job in jobs:
        tasks.append(asyncio.create_task(one(job)))
        await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*tasks)
    return results


async def _one(http, model: str, messages: list, max_tokens: int, sampling: dict) -> Result:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **sampling}
    result = Result()
    start = last = time.perf_counter()
    counted = 0
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    break
                if event.get("usage"):
                    result.num_output_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if result.ttft is None:
                            result.ttft = now - start
                        else:
                            result.itls.append(now - last)
                        last = now
                        counted += 1
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        result.error = f"{type(e).__name__}: {e}"
    result.e2e = time.perf_counter() - start
    result.num_output_tokens = result.num_output_tokens or counted
    return result


def _pcts(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    xs = sorted(xs)

    def q(f: float) -> float:
        return xs[min(len(xs) - 1, round(f * (len(xs) - 1)))]

    return {"p50": q(0.5), "p95": q(0.95), "p99": q(0.99), "mean": statistics.fmean(xs)}


def _summary(concurrency: int, results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    tokens = sum(r.num_output_tokens for r in ok)
    return {"concurrency": concurrency, "requests": len(results), "errors": len(results) -
            len(ok), "first_error": next((r.error for r in results if r.error), None),
            "seconds": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft": _pcts([r.ttft for r in ok if r.ttft is not None]),
            "itl": _pcts([x for r in ok for x in r.itls]), "e2e": _pcts([r.e2e for r in ok]),
            "per_request_tokens_per_s": _pcts([r.num_output_tokens / r.e2e for r in ok
                                               if r.e2e > 0])}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _print(report: dict[str, Any]) -> None:
    warm = report.get("warmup")
    warmed = (f", after {warm['requests']} warm-up request{'s' * (warm['requests'] > 1)} "
              f"({warm['errors']} failed)" if warm else "")
    print(f"{report['label']} ({report['model']}), {report['prompt_tokens']} prompt / "
          f"{report['output_tokens']} output tokens, {report['arrival']} arrivals{warmed}")
    print("clients  requests  errors   tok/s   TTFT p50/p95/p99 ms     ITL p50/p95/p99 ms    "
          "e2e p50/p95/p99 ms")
    for lv in report["levels"]:
        t, i, e = lv["ttft"], lv["itl"], lv["e2e"]
        print(f"{lv['concurrency']:7}  {lv['requests']:8}  {lv['errors']:6}  "
              f"{lv['tokens_per_s']:6.1f}   {_ms(t['p50']):>5}/{_ms(t['p95']):>5}/"
              f"{_ms(t['p99']):>5}      {_ms(i['p50']):>4}/{_ms(i['p95']):>4}/"
              f"{_ms(i['p99']):>4}    {_ms(e['p50']):>6}/{_ms(e['p95']):>6}/{_ms(e['p99']):>6}")
        if lv["first_error"]:
            print(f"         first error: {lv['first_error']}")


def plot(reports: list[dict[str, Any]], path: Path) -> bool:
    """Throughput and latency against concurrency, one line per report; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("localserve: matplotlib is not installed; no plot written", file=sys.stderr)
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for report in reports:
        xs = [lv["concurrency"] for lv in report["levels"]]
        ax1.plot(xs, [lv["tokens_per_s"] for lv in report["levels"]], marker="o",
                 label=report["label"])
        ax2.plot(xs, [lv["ttft"]["p95"] or 0 for lv in report["levels"]], marker="o",
                 label=f"{report['label']} TTFT p95")
        ax2.plot(xs, [lv["itl"]["p50"] or 0 for lv in report["levels"]], marker="x",
                 linestyle="--", label=f"{report['label']} ITL p50")
    ax1.set(xlabel="concurrent clients", ylabel="output tokens/s", xscale="log",
            title="throughput")
    ax2.set(xlabel="concurrent clients", ylabel="seconds", xscale="log", yscale="log",
            title="latency")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True

