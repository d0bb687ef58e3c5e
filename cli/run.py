"""`localserve run NAME ["prompt"]`: a one-shot answer, or a chat in the terminal."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="answer a prompt (or chat) with a stored model")
    p.add_argument("name", help="stored model, e.g. smollm2-135m:int4")
    p.add_argument("prompt", nargs="?", help="one-shot prompt; omit for an interactive chat")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: auto)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="default: auto")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from server.models.device import pick_device, pick_dtype
    from server.models.loader import load_model
    from server.models.simple import greedy_generate
    from server.models.tokenizer import chat_prompt_ids, load_tokenizer
    from storage.models import ModelStore

    stored = ModelStore().resolve(args.name)
    device = pick_device(args.device)
    loaded = load_model(stored, device, pick_dtype(device, args.dtype))
    tokenizer = load_tokenizer(stored)
    eos = tuple(stored.manifest["tokenizer"]["eos_token_ids"])
    messages: list[dict[str, str]] = []

    def answer(prompt: str) -> str:
        messages.append({"role": "user", "content": prompt})
        ids = greedy_generate(loaded.model, chat_prompt_ids(tokenizer, messages),
                              args.max_tokens, eos)
        text = tokenizer.decode(ids, skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": text})
        return text

    if args.prompt is not None:
        print(answer(args.prompt))
        return 0
    while True:
        try:
            prompt = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if prompt.strip() in ("/bye", "/exit"):
            return 0
        if prompt.strip():
            print(answer(prompt))
