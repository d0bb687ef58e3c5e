"""This CPU's kernel kinds against each other: decode tokens/s and greedy fidelity of each, in
the dtype each picks. The numbers behind cpu_gemm.kinds_for's order: on Intel CPUs with
AVX-512 VNNI avx2_gemm.c's VNNI path comes first; on AMD's Zen 4 / 5 avx512_gemm.c does (Zen 5:
1.1-1.2x the VNNI path at 32 sequences, 2026-12-05; Zen 4 not measured).

    python benchmarks/kernel_kinds.py smollm2-135m:int4 --rounds 2
    python benchmarks/kernel_kinds.py smollm2-135m:int4 --kinds avx512_bf16 \
        --activations int16,mixed,int8   # int4 layers' activations (LOCALSERVE_ACTIVATIONS)

Each round runs engine_throughput.py once per kind and activations setting
(LOCALSERVE_CPU_KERNELS=KIND, LOCALSERVE_ACTIVATIONS=SETTING, a process each), in turn, so
that the host's drift meets every one alike; then greedy_fidelity.py once per each. Prints a
markdown table: each round's tok/s per batch size, and the fidelity line.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROW = re.compile(r"^\| (?P<name>[^|]+) \| (?P<dtype>\w+) \| (?P<cells>.*) \| [^|]* \|$")


def kinds() -> list[str]:
    """The kinds this CPU runs, in the order layers try them."""
    from server.kernels import cpu_gemm
    from server.kernels import loader as native

    return cpu_gemm.kinds_for(native.cpu_flags(), native.cpu_vendor())


def run(variant: tuple[str, str], *args: str) -> str:
    """A benchmark's output under LOCALSERVE_CPU_KERNELS and LOCALSERVE_ACTIVATIONS = variant."""
    kind, activations = variant
    env = dict(os.environ, LOCALSERVE_CPU_KERNELS=kind, LOCALSERVE_ACTIVATIONS=activations)
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          check=True)
    return proc.stdout


def throughput_row(output: str) -> tuple[str, list[float]]:
    """engine_throughput.py's table row: the compute dtype and tok/s per batch size."""
    for line in output.splitlines():
        m = ROW.match(line.strip())
        if m and m["name"].strip() not in ("model", "---"):
            cells = [float(c.split()[0]) for c in m["cells"].split(" | ")]
            return m["dtype"], cells
    raise ValueError(f"no table row in engine_throughput.py's output:\n{output}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kinds", default=None, help="comma-separated (default: all this CPU runs)")
    ap.add_argument("--activations", default="mixed",
                    help="comma-separated LOCALSERVE_ACTIVATIONS settings (default: mixed)")
    args = ap.parse_args()
    batch = [str(b) for b in args.batch]
    order, asked = kinds(), args.activations.split(",")
    if args.kinds:
        if not set(args.kinds.split(",")) <= set(order):
            sys.exit(f"--kinds {args.kinds}: this CPU runs {', '.join(order)}")
        order = [k for k in order if k in args.kinds.split(",")]
    if not set(asked) <= {"mixed", "int16", "int8"}:
        sys.exit(f"--activations {args.activations}: mixed, int16 or int8")
    variants = [(k, a) for k in order for a in asked]
    rates: dict[tuple[str, str], list[list[float]]] = {v: [] for v in variants}
    dtypes: dict[tuple[str, str], str] = {}
    for _ in range(args.rounds):
        for v in variants:
            out = run(v, str(HERE / "engine_throughput.py"), args.model, "--batch", *batch,
                      "--tokens", str(args.tokens), "--repeat", "1")
            dtypes[v], cells = throughput_row(out)
            rates[v].append(cells)
            print(f"{' '.join(v)}: {dtypes[v]}, " + ", ".join(f"{c:.0f}" for c in cells),
                  flush=True)
    short = {"float32": "fp32", "bfloat16": "bf16"}
    fidelity = {v: run(v, str(HERE / "greedy_fidelity.py"), args.model, "--dtype",
                       short[dtypes[v]]).strip().splitlines()[-1] for v in variants}
    print(f"\n{args.model}, kinds in this CPU's order: {', '.join(order)}\n")
    print("| kind | activations | compute | " + " | ".join(f"{b} seqs tok/s" for b in batch)
          + " | greedy fidelity |")
    print("| --- | --- | --- |" + " --- |" * (len(batch) + 1))
    for v in variants:
        cells = [", ".join(f"{r[i]:.0f}" for r in rates[v]) for i in range(len(batch))]
        answer = fidelity[v].split(": ", 1)[-1]
        print(f"| {v[0]} | {v[1]} | {dtypes[v]} | " + " | ".join(cells) + f" | {answer} |")


if __name__ == "__main__":
    main()
