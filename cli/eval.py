"""`localserve eval NAME [--reference REF] [--text FILE] [--json]`: bits per byte of a stored
model on natural text and, against a reference model, how far its next-token distributions are
from the reference's (KL divergence, mean and p99, and top-1 agreement, as llama.cpp's
`perplexity --kl-divergence` reports)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path

# Real prose that ships with every Debian-based system (and the Docker image): the GNU GPL v3.
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
DEFAULT_BYTES = 16_000


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="bits per byte on natural text (lower is better); KL "
                       "divergence from a reference model")
    p.add_argument("name")
    p.add_argument("--reference", default=None, metavar="REF",
                   help="stored model to compare with (e.g. smollm2-135m:bf16)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.add_argument("--text", type=Path, default=None,
                   help=f"UTF-8 text file (default: the first {DEFAULT_BYTES} bytes of "
                        f"{DEFAULT_TEXT})")
    p.add_argument("--context", type=int, default=1024,
                   help="window in tokens (at most the model's context)")
    p.add_argument("--rows", default="generated", choices=("generated", "prompt"),
                   help="which kernels score the text: those of rows outside an engine step, "
                        "which generated tokens share (default), or those of a step's prompt "
                        "rows (on AMX machines int4 prompt rows take a kernel of their own)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"))
    p.add_argument("--kv-cache-dtype", default=None, choices=("bf16", "fp32"),
                   help="NAME's KV cache (default: as `serve` keeps it); the reference keeps "
                        "its cache in the compute dtype")
    p.set_defaults(func=run)


def default_text() -> str:
    if not DEFAULT_TEXT.is_file():
        raise ValueError(f"{DEFAULT_TEXT} not found: pass --text FILE")
    text = DEFAULT_TEXT.read_bytes()[:DEFAULT_BYTES].decode("utf-8", errors="ignore")
    return text[: text.rfind("\n") + 1]


def scored_logits(model, ids: list[int], context: int = 1024, kv_dtype=None,
                  as_prompt: bool = False) -> Iterator[tuple]:
    """(logits [n, V] fp32, targets [n]) for every token but the first, window by window.

    Windows of `context` tokens advance by half a window; each token is scored once, with at
    least half a window of context (the usual strided-perplexity recipe).
    """
    import torch

    from server.models.simple import prompt_logits

    if len(ids) < 2:
        raise ValueError("text too short to evaluate")
    stride = max(1, context // 2)
    scored_upto = 1  # ids[0] has no context and is not scored
    for start in range(0, len(ids), stride):
        window = ids[start:start + context]
        # [W, V]; logits[i] predicts window[i + 1]
        logits = prompt_logits(model, window, kv_dtype=kv_dtype, as_prompt=as_prompt)
        first_new = scored_upto - start - 1  # the first position not scored yet
        yield logits[first_new:-1], torch.tensor(window[first_new + 1:], device=logits.device)
        scored_upto = start + len(window)
        if scored_upto >= len(ids):
            break


def _num_bytes(tokenizer, text: str, ids: list[int]) -> int:
    """The bytes the scored tokens spell: all but the first token's."""
    return len(text.encode()) - len(tokenizer.decode(ids[:1]).encode())


def bits_per_byte(model, tokenizer, text: str, context: int = 1024, kv_dtype=None,
                  as_prompt: bool = False) -> float:
    """Total NLL in bits of every token but the first, over the bytes those tokens spell."""
    from torch.nn import functional as F

    ids = tokenizer.encode(text, add_special_tokens=False)
    total_nats = sum(float(F.cross_entropy(logits, targets, reduction="sum"))
                     for logits, targets in scored_logits(model, ids, context, kv_dtype,
                                                          as_prompt))
    return total_nats / math.log(2) / _num_bytes(tokenizer, text, ids)


def compare(model, reference, tokenizer, text: str, context: int = 1024,
            kv_dtype=None, as_prompt: bool = False) -> dict[str, float]:
    """Bits per byte of both, and per scored token KL(reference || model) in nats: its mean
    and 99th percentile, and how often both put the same token first. The model's KV cache is
    in kv_dtype (None: its dtype), the reference's in its dtype."""
    import torch
    from torch.nn import functional as F

    ids = tokenizer.encode(text, add_special_tokens=False)
    nats, ref_nats, klds, same = 0.0, 0.0, [], 0
    for (logits, targets), (ref_logits, _) in zip(
            scored_logits(model, ids, context, kv_dtype, as_prompt),
            scored_logits(reference, ids, context, as_prompt=as_prompt), strict=True):
        logp, ref_logp = logits.log_softmax(-1), ref_logits.to(logits.device).log_softmax(-1)
        nats += float(F.nll_loss(logp, targets, reduction="sum"))
        ref_nats += float(F.nll_loss(ref_logp, targets, reduction="sum"))
        klds.append((ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp(min=0))
        same += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
    kld = torch.cat(klds).double()
    num_bytes = _num_bytes(tokenizer, text, ids) * math.log(2)
    return {"bits_per_byte": nats / num_bytes, "reference_bits_per_byte": ref_nats / num_bytes,
            "kld_mean": float(kld.mean()), "kld_p99": float(torch.quantile(kld, 0.99)),
            "top1_agreement": same / kld.numel(), "tokens": kld.numel()}


def run(args: argparse.Namespace) -> int:
    from server.models.device import DTYPES, pick_device, pick_dtype, pick_kv_dtype
    from server.models.loader import load_model
    from server.models.tokenizer import load_tokenizer
    from storage.models import ModelStore

    device = pick_device(args.device)  # checked before anything loads
    store = ModelStore()
    stored = store.resolve(args.name)
    ref = store.resolve(args.reference) if args.reference else None
    text = args.text.read_text() if args.text else default_text()
    if args.context < 2:
        raise ValueError(f"--context must be at least 2 tokens, got {args.context}")
    dtype = pick_dtype(device, args.dtype, stored.manifest["bits"])
    kv = DTYPES[args.kv_cache_dtype] if args.kv_cache_dtype else pick_kv_dtype(device, dtype)
    tokenizer = load_tokenizer(stored)
    model = load_model(stored, device, dtype).model
    context = min(args.context, model.config.max_position_embeddings)
    as_prompt = args.rows == "prompt"
    result: dict = {"model": stored.name, "rows": args.rows,
                    "dtype": str(dtype).removeprefix("torch."),
                    "kv_cache_dtype": str(kv).removeprefix("torch."), "bytes": len(text.encode())}
    if ref is None:
        result["bits_per_byte"] = bits_per_byte(model, tokenizer, text, context, kv,
                                                as_prompt)
        line = f"{stored.name}: {result['bits_per_byte']:.4f} bits per byte"
    else:
        if load_tokenizer(ref).encode(text, add_special_tokens=False) != tokenizer.encode(
                text, add_special_tokens=False):
            raise ValueError(f"{ref.name} does not share {stored.name}'s tokenizer")
        result["reference"] = ref.name
        result |= compare(model, load_model(ref, device, dtype).model, tokenizer, text,
                          context, kv, as_prompt)
        line = (f"{stored.name}: {result['bits_per_byte']:.4f} bits per byte "
                f"({ref.name}: {result['reference_bits_per_byte']:.4f}); KL divergence from "
                f"{ref.name}: mean {result['kld_mean']:.5f}, p99 {result['kld_p99']:.5f} nats; "
                f"top-1 agreement {result['top1_agreement']:.2%} over {result['tokens']} tokens")
    print(f"{line} ({result['bytes']} bytes, {result['dtype']} compute, "
          f"{result['kv_cache_dtype']} KV cache, {args.rows} rows' kernels)")
    if args.json:
        print(json.dumps(result))
    return 0
