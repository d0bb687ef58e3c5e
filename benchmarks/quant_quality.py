"""Bits per byte of one stored bf16 model re-quantized several ways (the quantization policy).

    python benchmarks/quant_quality.py smollm2-135m:bf16

Prints one row per variant: weights bits, int4 group size, embedding bits, bits per byte, and
the change against bf16. Used to choose the group size and what stays unquantized.
"""

from __future__ import annotations

import sys
import time

import torch
from safetensors.torch import load_file

from cli.eval import bits_per_byte, default_text
from server.models.config import ModelConfig
from server.models.loader import build_model
from server.models.tokenizer import load_tokenizer
from server.quant import quantize_state_dict
from storage.models import ModelStore

VARIANTS = [  # (bits, group size, embedding bits)
    (16, None, 16),
    (8, None, 16),
    (8, None, 8),
    (4, 32, 8),
    (4, 64, 16),
    (4, 64, 8),
]


def main(name: str) -> None:
    stored = ModelStore().resolve(name)
    assert stored.manifest["bits"] == 16, "start from a bf16 model"
    config = ModelConfig.from_hf(stored.manifest["config"])
    state = load_file(str(stored.path / "model.safetensors"))
    tokenizer = load_tokenizer(stored)
    text = default_text()
    base = None
    print(f"{'bits':>4} {'group':>5} {'embed':>5} {'bpb':>7} {'vs bf16':>8} {'secs':>5}")
    for bits, group, embed_bits in VARIANTS:
        t = time.time()
        tensors, schemes = quantize_state_dict(state, bits, group or 64, embed_bits)
        model = build_model(config, tensors, schemes, torch.device("cpu"), torch.float32)
        bpb = bits_per_byte(model, tokenizer, text)
        base = base or bpb
        print(f"{bits:>4} {group or '-':>5} {embed_bits:>5} {bpb:7.4f} "
              f"{(bpb / base - 1) * 100:+7.2f}% {time.time() - t:5.0f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m:bf16")
