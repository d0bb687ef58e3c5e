"""The batch queue on a real server: throughput when idle, and what it does to interactive TTFT.

    python benchmarks/batch_vs_interactive.py [--model smollm2-135m:int4] [--lines 256]

Starts `localserve serve` on a copy of $LOCALSERVE_HOME's models (its own database), then:
1. interactive TTFT on the idle server: --probes sequential streamed chats;
2. a --lines batch (--tokens output tokens each) on the otherwise idle server: tokens/s from
   submit to completed, against the engine's peak (benchmarks/engine_throughput.py, same
   batch size, no HTTP);
3. the same interactive probes while a large batch is running.
Prints a markdown table (the one in benchmarks/RESULTS.md). `--batch-model NAME`: the batch's
lines name another stored model (loaded beside --model): interactive before batch across
models (their engines take turns, server/engine/async_engine.py's StepTurns).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from storage.models import home_dir


def start_server(home: Path, model: str, log: Path, extra: list[str]
                 ) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, LOCALSERVE_HOME=str(home), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", model, "--port", "0",
                             *extra],
                            stderr=log.open("w"), stdout=subprocess.DEVNULL, env=env)
    url = None
    while url is None:
        time.sleep(0.1)
        for line in log.read_text().splitlines():
            if " at http://" in line:
                url = line.split(" at ")[1].split("/v1")[0]
    while httpx.get(f"{url}/health").status_code != 200:
        time.sleep(0.2)
    return proc, url


def ttfts(client: openai.OpenAI, model: str, n: int, itls: list[float] | None = None
          ) -> list[float]:
    """TTFT of n streamed 8-token chats; their time between tokens added to `itls`."""
    out = []
    for i in range(n):
        t = time.perf_counter()
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Say something nice ({i})."}],
            max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
        first = last = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.perf_counter()
                if first is None:
                    first = now - t
                elif itls is not None:
                    itls.append(now - last)
                last = now
        out.append(first if first is not None else time.perf_counter() - t)
    return out


def submit(client: openai.OpenAI, model: str, lines: int, tokens: int) -> str:
    body = "\n".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                 "messages": [{"role": "user", "content": f"Write about topic number {i}."}]},
    }) for i in range(lines))
    f = client.files.create(file=("b.jsonl", io.BytesIO(body.encode())), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m:int4")
    ap.add_argument("--lines", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument("--serve-args", default="", help="extra `localserve serve` flags")
    ap.add_argument("--batch-model", default=None, help="the batch lines' model (default: "
                    "--model)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        (home / "models").symlink_to(home_dir() / "models")
        proc, url = start_server(home, args.model, home / "server.log",
                                 args.serve_args.split())
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0,
                                   timeout=600)
            ttfts(client, args.model, 3)  # warm up
            idle_itl: list[float] = []
            busy_itl: list[float] = []
            idle = ttfts(client, args.model, args.probes, idle_itl)
            batch_model = args.batch_model or args.model
            t = time.perf_counter()
            batch_id = submit(client, batch_model, args.lines, args.tokens)
            while (b := client.batches.retrieve(batch_id)).status not in (
                    "completed", "failed", "expired", "cancelled"):
                time.sleep(0.2)
            seconds = time.perf_counter() - t
            batch_tps = b.usage.output_tokens / seconds
            busy_id = submit(client, batch_model, 4 * args.lines, args.tokens)
            while client.batches.retrieve(busy_id).request_counts.completed < 8:
                time.sleep(0.2)
            busy = ttfts(client, args.model, args.probes, busy_itl)
            client.batches.cancel(busy_id)
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"| {batch_model} | batch of {args.lines} x {args.tokens} tokens, idle server | "
          f"{batch_tps:.1f} tok/s ({seconds:.1f} s) |")
    print(f"| TTFT idle | p50 {statistics.median(idle) * 1000:.0f} ms | "
          f"p95 {pct(idle, 95) * 1000:.0f} ms |")
    print(f"| TTFT while a batch runs | p50 {statistics.median(busy) * 1000:.0f} ms | "
          f"p95 {pct(busy, 95) * 1000:.0f} ms |")
    print(f"| ITL idle / while a batch runs | p50 {statistics.median(idle_itl) * 1000:.0f} / "
          f"{statistics.median(busy_itl) * 1000:.0f} ms | p95 {pct(idle_itl, 95) * 1000:.0f} / "
          f"{pct(busy_itl, 95) * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
