"""`localserve run NAME ["prompt"]`: a one-shot answer, or a chat in the terminal, streamed."""

from __future__ import annotations

import argparse
import asyncio
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="answer a prompt (or chat) with a stored model")
    p.add_argument("name", help="stored model, e.g. smollm2-135m:int4")
    p.add_argument("prompt", nargs="?", help="one-shot prompt; omit for an interactive chat")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kv-cache-mb", type=int, default=None,
                   help="KV cache pool size (default: a fifth of available memory)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: auto)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="default: auto")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from server.engine.async_engine import load_engine
    from server.engine.engine import EngineConfig
    from server.engine.sequence import SamplingParams
    from server.models.device import pick_device
    from server.models.tokenizer import chat_prompt_ids
    from storage.models import ModelStore

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    pick_device(args.device)  # checked before anything loads
    stored = ModelStore().resolve(args.name)
    kv_bytes = args.kv_cache_mb << 20 if args.kv_cache_mb else None
    engine = load_engine(stored, EngineConfig(max_num_seqs=4, kv_cache_bytes=kv_bytes),
                         args.device, args.dtype)
    messages: list[dict[str, str]] = []
    context = engine.max_model_len

    async def answer(prompt: str) -> None:
        messages.append({"role": "user", "content": prompt})
        ids = await asyncio.to_thread(chat_prompt_ids, engine.tokenizer, messages)
        max_tokens = min(args.max_tokens, context - len(ids))
        if max_tokens < 1:
            raise ValueError(f"the conversation no longer fits the model's {context} tokens")
        params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature,
                                seed=args.seed)
        text = []
        async for chunk in engine.generate(ids, params):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            text.append(chunk.text)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(text).strip()})

    try:
        if args.prompt is not None:
            asyncio.run(answer(args.prompt))
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
                asyncio.run(answer(prompt))
    finally:
        engine.shutdown()

