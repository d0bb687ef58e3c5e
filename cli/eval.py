"""`localserve eval NAME [--text FILE]`: bits per byte of a stored model on natural text."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

# Real prose that ships with every Debian-based system (and the Docker image): the GNU GPL v3.
DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
DEFAULT_BYTES = 16_000


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="bits per byte on natural text (lower is better)")
    p.add_argument("name")
    p.add_argument("--text", type=Path, default=None,
                   help=f"UTF-8 text file (default: the first {DEFAULT_BYTES} bytes of "
                        f"{DEFAULT_TEXT})")
    p.add_argument("--context", type=int, default=1024, help="window in tokens")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"))
    p.set_defaults(func=run)


def default_text() -> str:
    if not DEFAULT_TEXT.is_file():
        raise ValueError(f"{DEFAULT_TEXT} not found: pass --text FILE")
    text = DEFAULT_TEXT.read_bytes()[:DEFAULT_BYTES].decode("utf-8", errors="ignore")
    return text[: text.rfind("\n") + 1]


def bits_per_byte(model, tokenizer, text: str, context: int = 1024) -> float:
    """Total NLL in bits of every token but the first, over the bytes those tokens spell.

    Windows of `context` tokens advance by half a window; each token is scored once, with at
    least half a window of context (the usual strided-perplexity recipe).
    """
    import torch
    from torch.nn import functional as F

    from server.models.simple import prompt_logits

    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < 2:
        raise ValueError("text too short to evaluate")
    stride = max(1, context // 2)
    total_nats, scored_upto = 0.0, 1  # ids[0] has no context and is not scored
    for start in range(0, len(ids), stride):
        window = ids[start:start + context]
        logits = prompt_logits(model, window)  # [W, V]
        targets = torch.tensor(window[1:])
        nll = F.cross_entropy(logits[:-1], targets, reduction="none")  # nll[i] scores window[i+1]
        first_new = scored_upto - start - 1  # index into nll of the first unscored token
        total_nats += float(nll[first_new:].sum())
        scored_upto = start + len(window)
        if scored_upto >= len(ids):
            break
    num_bytes = len(text.encode()) - len(tokenizer.decode(ids[:1]).encode())
    return total_nats / math.log(2) / num_bytes


def run(args: argparse.Namespace) -> int:
    from server.models.device import pick_device, pick_dtype
    from server.models.loader import load_model
    from server.models.tokenizer import load_tokenizer
    from storage.models import ModelStore

    stored = ModelStore().resolve(args.name)
    text = args.text.read_text() if args.text else default_text()
    device = pick_device(args.device)
    loaded = load_model(stored, device, pick_dtype(device, args.dtype))
    bpb = bits_per_byte(loaded.model, load_tokenizer(stored), text, args.context)
    print(f"{stored.name}: {bpb:.4f} bits per byte ({len(text.encode())} bytes)")
    return 0
