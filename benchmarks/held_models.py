"""Two models from one server (server/api/held.py): what a load costs a request, and what two
busy models make of the cores against one alone.

    python benchmarks/held_models.py FIRST SECOND [--clients 8] [--seconds 20]

Starts `localserve serve FIRST` (SECOND stored beside it), then prints
- SECOND's time to first token when its request must load it: cold (its files dropped from the
  page cache first, posix_fadvise) and warm (let go, then asked again), against a loaded one's;
- output tokens/s of --clients/2 streams on each model alone, then on both at once: the total
  against one model's alone (their mean; 1.0: sharing the cores through the step lock loses
  nothing). Each model's steps read its own weights, so two models at once cannot batch
  together: the total is one model's, not two.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def drop_cached(folder: Path) -> None:
    """Ask the kernel to drop the folder's files from the page cache (a cold load)."""
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def ttft(url: str, model: str) -> float:
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=600, json={
            "model": model, "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": "Hello"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token")


def tokens_per_second(url: str, models: list[str], seconds: float) -> float:
    """Output tokens/s of closed-loop streams, one per entry of `models`, for `seconds`."""
    counts = [0] * len(models)
    stop = time.monotonic() + seconds

    def client(i: int) -> None:
        while time.monotonic() < stop:
            got = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                "model": models[i], "max_tokens": 32, "ignore_eos": True, "temperature": 0,
                "messages": [{"role": "user", "content": f"Tell me a story, {i}."}]}).json()
            counts[i] += got["usage"]["completion_tokens"]
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(models))]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - start)


def serve(args: list[str]) -> tuple[subprocess.Popen, str]:
    """`localserve serve ARGS` on a free port, once /health says it is ready; its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", *args, "--port",
                               str(port)], cwd=ROOT, stderr=subprocess.DEVNULL)
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    from storage.models import ModelStore

    second = ModelStore().resolve(args.second)
    server, url = serve([args.first, "--keep-alive", "-1"])
    try:
        ttft(url, args.first)
        loaded = min(ttft(url, args.first) for _ in range(3))
        drop_cached(second.path)
        cold = ttft(url, second.name)
        while httpx.post(f"{url}/v1/models/{second.name}/unload").status_code == 409:
            time.sleep(0.1)  # its request is still finishing
        warm = ttft(url, second.name)
        print(f"TTFT: loaded {loaded * 1e3:.0f} ms; {second.name} loaded by the request: "
              f"cold {cold * 1e3:.0f} ms, warm {warm * 1e3:.0f} ms")
        half = args.clients // 2
        first = tokens_per_second(url, [args.first] * half, args.seconds)
        other = tokens_per_second(url, [second.name] * half, args.seconds)
        both = tokens_per_second(url, [args.first] * half + [second.name] * half, args.seconds)
        alone = (first + other) / 2
        print(f"{half} streams on one model alone: {args.first} {first:.1f}, {second.name} "
              f"{other:.1f} tok/s; {half} on each at once: {both:.1f} tok/s in all, "
              f"{both / alone:.2f}x one model's alone (their mean)")
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
