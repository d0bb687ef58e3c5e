"""Resident memory of `localserve serve` under hours-like load, then idle.

    python benchmarks/memory_soak.py --rounds 52 --idle-minutes 10 [--code DIR] [-- FLAGS]

Each round: 32 streamed chats at 16 concurrent (distinct prompts, 16-96 output tokens), then
16 chats sharing a long system prompt at 8 concurrent. After every round the server's VmRSS;
at the end the prefix-cache hit rate of the shared-prompt chats (cached / prompt tokens),
then VmRSS once a minute while idle. `--code DIR` runs another checkout's server (a git
worktree of the code before, for the same load on both). The server gets its own home with the
models of $LOCALSERVE_HOME.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from compare_llama_server import free_port, wait_ready  # noqa: E402

WORDS = ["river", "mountain", "code", "garden", "engine", "planet", "music", "window",
         "silver", "quiet", "market", "ocean", "paper", "winter", "lantern", "forest", "bridge",
         "signal", "harbor", "orbit", "copper", "meadow", "canyon"]
SYSTEM = ("You are the support assistant of a hardware store. " + " ".join(
    f"Rule {i}: answer questions about aisle {i}, where the {WORDS[i % len(WORDS)]} tools "
    f"and {WORDS[(i * 7) % len(WORDS)]} parts are kept, politely and briefly." for i in range(40)))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def chat(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int,
               errors: list[str]) -> dict:
    body = {"model": "smollm2-135m", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.8, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    usage: dict = {}
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                errors.append(f"{r.status_code} {(await r.aread())[:200]!r}")
                return usage
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
    except httpx.HTTPError as e:
        errors.append(repr(e))
    return usage


async def one_round(url: str, k: int, rng: random.Random, errors: list[str]) -> list[dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        gate = asyncio.Semaphore(16)

        async def distinct(i: int) -> None:
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
            async with gate:
                await chat(client, url, [{"role": "user", "content": f"Round {k}, question "
                                          f"{i}: tell me about {words}."}],
                           rng.randint(16, 96), errors)

        await asyncio.gather(*[distinct(i) for i in range(32)])
        gate = asyncio.Semaphore(8)

        async def shared(i: int) -> dict:
            async with gate:
                return await chat(client, url, [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Round {k}: where is the "
                     f"{rng.choice(WORDS)} in aisle {rng.randint(1, 40)}?"}],
                    rng.randint(16, 64), errors)

        return await asyncio.gather(*[shared(i) for i in range(16)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=52)
    p.add_argument("--idle-minutes", type=float, default=10)
    p.add_argument("--code", type=Path, default=Path(__file__).resolve().parents[1],
                   help="the checkout whose server runs (default: this one)")
    p.add_argument("--model", default="smollm2-135m:int4")
    p.add_argument("flags", nargs="*", help="more `localserve serve` flags (after --)")
    args = p.parse_args()

    from storage.models import home_dir

    home = Path(tempfile.mkdtemp(prefix="soak-"))
    (home / "models").symlink_to(home_dir() / "models", target_is_directory=True)
    port = free_port()
    env = dict(os.environ, LOCALSERVE_HOME=str(home), PYTHONPATH=str(args.code),
               PYTHONUNBUFFERED="1")
    log = (home / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", args.model, "--port",
                             str(port), *args.flags], stdout=subprocess.DEVNULL, stderr=log,
                            env=env, cwd=args.code)
    url = f"http://127.0.0.1:{port}"
    errors: list[str] = []
    rng = random.Random(0)
    try:
        wait_ready(url, proc)
        start_rss = rss_mb(proc.pid)
        print(f"{args.code.name} {' '.join(args.flags)}: ready, RSS {start_rss:.0f} MB",
              flush=True)
        cached = prompt = 0
        t0 = time.monotonic()
        series = []
        for k in range(args.rounds):
            for usage in asyncio.run(one_round(url, k, rng, errors)):
                if usage:
                    prompt += usage["prompt_tokens"]
                    cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            series.append(rss_mb(proc.pid))
            print(f"round {k + 1:3d} {time.monotonic() - t0:6.0f} s RSS {series[-1]:6.0f} MB "
                  f"errors {len(errors)}", flush=True)
        print(f"load: RSS after round 1 {series[0]:.0f} MB, max {max(series):.0f} MB, last "
              f"{series[-1]:.0f} MB; shared-prompt hit rate {cached / max(1, prompt):.3f}; "
              f"errors {len(errors)} {errors[:3]}", flush=True)
        idle = []
        for minute in range(int(args.idle_minutes)):
            time.sleep(60)
            idle.append(rss_mb(proc.pid))
            print(f"idle {minute + 1:2d} min RSS {idle[-1]:.0f} MB", flush=True)
        if idle:
            print(f"idle: RSS {idle[-1]:.0f} MB against {start_rss:.0f} MB at start "
                  f"({idle[-1] / start_rss:.2f}x)", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
