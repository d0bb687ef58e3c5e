"""Chunked prefill on a real server: inter-token latency of running streams while a long
prompt arrives.

    python benchmarks/chunked_prefill_itl.py [--model smollm2-135m:int4] [--streams 16]

For each --max-itl-stretch setting (default: 1.5, the server's default, and 0: no pacing, prompt
chunks bounded by --max-num-batched-tokens only), starts `localserve serve` on a copy of
$LOCALSERVE_HOME's models, opens --streams streamed chats with long outputs, measures their
inter-token latency for --window seconds, then sends one --prompt-tokens prompt and measures
the streams' inter-token latency until that prompt's first token is back. Prints a markdown
table (the one in benchmarks/RESULTS.md): ITL p50/p95 before and during, and the long prompt's TTFT.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
from batch_vs_interactive import pct, start_server

from storage.models import home_dir


def stream(client: openai.OpenAI, model: str, i: int, stamps: list[float],
           stop: threading.Event) -> None:
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Tell me a long story ({i})."}],
        max_tokens=2000, temperature=0, stream=True, extra_body={"ignore_eos": True})
    with chunks:
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
            if stop.is_set():
                break


def itls(stamps: list[list[float]], start: float, end: float) -> list[float]:
    """Intervals between consecutive tokens of each stream that end within [start, end)."""
    return [b - a for s in stamps for a, b in zip(s, s[1:], strict=False) if start <= b < end]


def measure(url: str, model: str, streams: int, window: float, prompt_tokens: int) -> dict:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    stamps: list[list[float]] = [[] for _ in range(streams)]
    stop = threading.Event()
    threads = [threading.Thread(target=stream, args=(client, model, i, stamps[i], stop))
               for i in range(streams)]
    for t in threads:
        t.start()
    while min(len(s) for s in stamps) < 5:  # every stream is decoding
        time.sleep(0.1)
    time.sleep(window)
    sent = time.perf_counter()
    # Token ids 1000.. (no tokenization cost on the client or server side of the comparison).
    r = httpx.post(f"{url}/v1/completions", timeout=600, json={
        "model": model, "prompt": [1000 + i % 20000 for i in range(prompt_tokens)],
        "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    done = time.perf_counter()
    stop.set()
    for t in threads:
        t.join()
    before, during = itls(stamps, sent - window, sent), itls(stamps, sent, done)
    return {"before": before, "during": during, "ttft": done - sent}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m:int4")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--window", type=float, default=5.0)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--stretch", nargs="+", default=["1.5", "0"])
    args = ap.parse_args()
    rows = []
    for stretch in args.stretch:
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp)
            (home / "models").symlink_to(home_dir() / "models")
            proc, url = start_server(home, args.model, home / "server.log",
                                     ["--max-itl-stretch", stretch])
            try:
                r = measure(url, args.model, args.streams, args.window, args.prompt_tokens)
            finally:
                proc.terminate()
                proc.wait(60)
        b50, b95 = statistics.median(r["before"]), pct(r["before"], 95)
        d50, d95 = statistics.median(r["during"]), pct(r["during"], 95)
        rows.append(f"| {stretch if stretch != '0' else 'off'} | {b50 * 1000:.0f} / "
                    f"{b95 * 1000:.0f} ms | {d50 * 1000:.0f} / {d95 * 1000:.0f} ms | "
                    f"{d95 / b95:.2f}x | {r['ttft']:.1f} s |")
        print(rows[-1], flush=True)
    print(f"\n{args.streams} streams of {args.model}, one {args.prompt_tokens}-token prompt "
          "arriving:\n")
    print("| --max-itl-stretch | ITL p50 / p95 before | ITL p50 / p95 while it prefills | "
          "p95 during / before | its TTFT |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
