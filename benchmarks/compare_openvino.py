"""localserve's engine against OpenVINO GenAI's (int4, engine against engine, no HTTP), taking
turns, fresh processes each round.

    python benchmarks/compare_openvino.py --openvino ~/ov-venv/bin/python [--rounds 3]

OpenVINO GenAI lives in a venv of its own (`pip install torch==2.13.0 openvino-genai
"optimum-intel[openvino]"`; a torchvision built for another torch, if pip left one there,
uninstalled: transformers' model classes fail to import beside it, and the export with them): its
`optimum-cli` exports SmolLM2-135M (the bf16 Hugging Face folder
benchmarks/peers.py makes from the GGUF the other benchmarks run; `--vllm-python` names the
venv whose transformers makes it) at int4, group 32 (576 is not a multiple of 128),
asymmetric, every layer (`--ratio 1.0`), once. Its ContinuousBatchingPipeline then generates for
N distinct chat prompts twice, 1 token and 1 + --tokens with ignore_eos: the difference is the
decode time, N x --tokens tokens (the prefill timed apart, as benchmarks/engine_throughput.py
times only all-decode steps, which gives ours). Prints each side's decode tok/s per batch size
and ours over theirs, the median of the rounds.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

import peers  # beside this script
import random_gguf

from storage.models import home_dir

ROOT = Path(__file__).resolve().parent.parent

# Run by the OpenVINO venv's python: argv = model dir, batch sizes, tokens
OV_RUN = """
import sys, time
import openvino_genai as ov
model, sizes, tokens = sys.argv[1], [int(b) for b in sys.argv[2].split(",")], int(sys.argv[3])
scheduler = ov.SchedulerConfig()
scheduler.cache_size = 2
pipe = ov.ContinuousBatchingPipeline(model, scheduler, "CPU")
topics = ["rivers", "bread", "chess", "volcanoes", "bees", "trains", "clouds", "music"]
def timed(n, new):
    config = ov.GenerationConfig()
    config.max_new_tokens, config.ignore_eos, config.do_sample = new, True, False
    prompts = [f"Tell me about {topics[i % len(topics)]} (note {i})." for i in range(n)]
    start = time.perf_counter()
    pipe.generate(prompts, [config] * n)
    return time.perf_counter() - start
timed(2, 4)
for n in sizes:
    decode = timed(n, 1 + tokens) - timed(n, 1)
    print(f"openvino {n} {n * tokens / decode:.1f}", flush=True)
"""

EXPORT = ["-m", "optimum.commands.optimum_cli", "export", "openvino", "--task",
          "text-generation-with-past", "--weight-format", "int4", "--group-size", "32",
          "--ratio", "1.0"]


def exported(python: str, folder: Path) -> Path:
    out = folder.with_name(folder.name + "-ov-int4-g32")
    if not (out / "openvino_model.xml").is_file():
        subprocess.run([python, *EXPORT, "--model", str(folder), str(out)], check=True, cwd="/")
    return out


def ours(model: str, sizes: list[int], tokens: int) -> dict[int, float]:
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_throughput.py"),
                          model, "--batch", *map(str, sizes), "--tokens", str(tokens),
                          "--repeat", "1"], capture_output=True, text=True, check=True).stdout
    row = next(line for line in out.splitlines() if line.startswith(f"| {model} "))
    return dict(zip(sizes, (float(v) for v in re.findall(r"([\d.]+) tok/s", row)),
                    strict=True))


def theirs(python: str, model: Path, sizes: list[int], tokens: int) -> dict[int, float]:
    out = subprocess.run([python, "-c", OV_RUN, str(model), ",".join(map(str, sizes)),
                          str(tokens)], capture_output=True, text=True, check=True,
                         cwd="/").stdout
    return {int(n): float(v) for n, v in re.findall(r"^openvino (\d+) ([\d.]+)$", out, re.M)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--openvino", required=True, metavar="PYTHON",
                    help="the python of a venv with openvino-genai and optimum-intel")
    ap.add_argument("--vllm-python", default=None, metavar="PYTHON",
                    help="a python whose transformers has gguf and accelerate (default: "
                         "--openvino's)")
    ap.add_argument("--model", default="smollm2-135m:int4")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch.split(",")]
    gguf = random_gguf.real_gguf(home_dir() / "cache", home_dir() / "cache" / "gguf")
    folder = peers.hf_folder(args.vllm_python or args.openvino, gguf, home_dir() / "cache")
    ov_model = exported(args.openvino, folder)
    rounds = []
    for _ in range(args.rounds):
        rounds.append((ours(args.model, sizes, args.tokens),
                       theirs(args.openvino, ov_model, sizes, args.tokens)))
    print(f"decode tok/s, {args.tokens} tokens a sequence, median of {args.rounds} rounds:")
    print("| sequences | localserve " + args.model + " | OpenVINO GenAI int4 g32 | ratio |")
    print("| --- | --- | --- | --- |")
    for n in sizes:
        a = statistics.median(r[0][n] for r in rounds)
        b = statistics.median(r[1][n] for r in rounds)
        ratio = statistics.median(r[0][n] / r[1][n] for r in rounds)
        print(f"| {n} | {a:.0f} | {b:.0f} | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
