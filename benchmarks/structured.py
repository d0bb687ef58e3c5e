"""Structured outputs: grammar compile times (llguidance against xgrammar) and the throughput
cost of a schema on 16 streams.

    python benchmarks/structured.py compile      # needs `pip install xgrammar` for the side
    python benchmarks/structured.py throughput   # starts `localserve serve` on smollm2-135m:int4

compile: each schema compiled cold (caches off) against smollm2-135m's tokenizer, 5 times;
p50 / p99 over all, then the mask time per token along a valid instance. throughput: 16
concurrent streamed chats of 128 tokens each, with a json_schema (an array of at least 200
strings, so every answer is cut at 128 tokens) and without (ignore_eos), rounds interleaved
A B A B; tokens/s = completion tokens / wall time of the round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field

# -- real-world schemas (the shapes extraction and tool-use clients send) -------------------------


class Address(BaseModel):
    street: str
    city: str
    postal_code: Annotated[str, Field(pattern=r"^[0-9]{5}(-[0-9]{4})?$")]
    country: Literal["US", "CA", "MX", "FR", "DE"]


class LineItem(BaseModel):
    sku: str
    description: str
    quantity: Annotated[int, Field(ge=1, le=1000)]
    unit_price: float


class Invoice(BaseModel):
    number: str
    issued: str = Field(json_schema_extra={"format": "date"})
    customer: str
    billing: Address
    shipping: Address | None
    items: Annotated[list[LineItem], Field(min_length=1, max_length=50)]
    currency: Literal["USD", "EUR", "CAD"]
    paid: bool


class Severity(StrEnum):
    low = "low"
    medium = "medium"
    high = "high"
    critical = "critical"


class Issue(BaseModel):
    title: Annotated[str, Field(max_length=120)]
    severity: Severity
    labels: Annotated[list[str], Field(max_length=8)]
    assignees: list[str]
    steps_to_reproduce: list[str]
    affected_versions: list[Annotated[str, Field(pattern=r"^\d+\.\d+\.\d+$")]]


class Event(BaseModel):
    summary: str
    start: str = Field(json_schema_extra={"format": "date-time"})
    end: str = Field(json_schema_extra={"format": "date-time"})
    attendees: list[Annotated[str, Field(json_schema_extra={"format": "email"})]]
    recurrence: Literal["none", "daily", "weekly", "monthly"]
    reminders_minutes: Annotated[list[Annotated[int, Field(ge=0, le=10080)]],
                                 Field(max_length=5)]


class Ingredient(BaseModel):
    name: str
    amount: float
    unit: Literal["g", "kg", "ml", "l", "cup", "tbsp", "tsp", "piece"]


class Recipe(BaseModel):
    title: str
    servings: Annotated[int, Field(ge=1, le=20)]
    ingredients: list[Ingredient]
    steps: list[str]
    vegetarian: bool
    cuisine: str | None


class Node(BaseModel):
    name: str
    children: list[Node]


class Experience(BaseModel):
    company: str
    role: str
    start_year: Annotated[int, Field(ge=1950, le=2030)]
    end_year: Annotated[int, Field(ge=1950, le=2030)] | None
    highlights: list[str]


class Resume(BaseModel):
    name: str
    email: str = Field(json_schema_extra={"format": "email"})
    phone: str | None
    skills: list[str]
    experience: list[Experience]
    education: list[dict[str, str]]


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral", "mixed"]
    confidence: Annotated[float, Field(ge=0, le=1)]
    aspects: list[dict[str, Literal["positive", "negative", "neutral"]]]


def wide_schema(n: int = 60) -> dict:
    """A flat record of n typed fields (form and table extraction)."""
    kinds = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
             {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "string"}}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props),
            "additionalProperties": False}


def tool_schema() -> dict:
    """A function-calling union (four tools' argument objects)."""
    def fn(name: str, params: dict) -> dict:
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": {
            "type": "object", "properties": params, "required": list(params),
            "additionalProperties": False}}, "required": ["name", "arguments"],
            "additionalProperties": False}
    return {"anyOf": [
        fn("get_weather", {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}),
        fn("search", {"query": {"type": "string"}, "limit": {"type": "integer"}}),
        fn("send_email", {"to": {"type": "string", "format": "email"},
                          "subject": {"type": "string"}, "body": {"type": "string"}}),
        fn("create_event", Event.model_json_schema()["properties"])]}


def schemas() -> dict[str, dict]:
    out = {m.__name__.lower(): m.model_json_schema() for m in
           (Invoice, Issue, Event, Recipe, Node, Resume, Sentiment)}
    out["wide60"] = wide_schema()
    out["tools4"] = tool_schema()
    out["json_object"] = {"type": "object"}
    return out


INSTANCE = '{"title": "Crash on start", "severity": "high", "labels": ["bug"], "assignees": [' \
           '"ann"], "steps_to_reproduce": ["open", "click"], "affected_versions": ["1.2.3"]}'


def tokenizer_path() -> Path:
    from storage.models import home_dir

    for name in ("smollm2-135m:int4", "smollm2-135m:bf16", "smollm2-135m:int8"):
        p = home_dir() / "models" / name / "tokenizer.json"
        if p.is_file():
            return p
    raise SystemExit("pull smollm2-135m first (localserve pull smollm2-135m)")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def bench_compile(repeat: int) -> None:
    import llguidance
    import torch

    from server.engine.grammar import JSON_OPTIONS

    path = tokenizer_path()
    llg_tok = llguidance.LLTokenizer(path.read_text(), n_vocab=49152, eos_token=[2])
    rows = {"llguidance": [], "xgrammar": []}
    masks = {"llguidance": [], "xgrammar": []}
    words = torch.empty(1536, dtype=torch.int32)
    ids = llg_tok.tokenize_str(INSTANCE)
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        info = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_file=str(path)), vocab_size=49152,
            stop_token_ids=[2])
        xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    except ImportError:
        xgr = None
        print("xgrammar not installed: llguidance only")
    for name, schema in schemas().items():
        line = [name]
        for _ in range(repeat):
            t = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                    overrides=JSON_OPTIONS)
            m = llguidance.LLMatcher(llg_tok, grammar, log_level=0)
            m.deep_copy().unsafe_compute_mask_ptr(words.data_ptr(), 6144)  # first mask too
            rows["llguidance"].append(time.perf_counter() - t)
            assert not m.is_error(), (name, m.get_error())
        line.append(f"llguidance {statistics.median(rows['llguidance'][-repeat:]) * 1e3:.2f} ms")
        if xgr is not None:
            for _ in range(repeat):
                t = time.perf_counter()
                cg = xgr_compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                      separators=(", ", ": "))
                rows["xgrammar"].append(time.perf_counter() - t)
            line.append(f"xgrammar {statistics.median(rows['xgrammar'][-repeat:]) * 1e3:.2f} ms")
        print("  ".join(line))
        if name == "issue":  # masks along a valid instance
            m = llguidance.LLMatcher(llg_tok, grammar, log_level=0)
            for tok in ids:
                t = time.perf_counter()
                m.unsafe_compute_mask_ptr(words.data_ptr(), 6144)
                masks["llguidance"].append(time.perf_counter() - t)
                m.consume_token(tok)
            if xgr is not None:
                xm, bm = xgr.GrammarMatcher(cg), xgr.allocate_token_bitmask(1, 49152)
                for tok in ids:
                    t = time.perf_counter()
                    xm.fill_next_token_bitmask(bm)
                    masks["xgrammar"].append(time.perf_counter() - t)
                    assert xm.accept_token(tok)
    for lib, xs in rows.items():
        if xs:
            print(f"{lib}: compile p50 {pct(xs, .5) * 1e3:.2f} ms, p99 {pct(xs, .99) * 1e3:.2f} "
                  f"ms over {len(xs)}; mask per token p50 {pct(masks[lib], .5) * 1e6:.0f} us, "
                  f"p99 {pct(masks[lib], .99) * 1e6:.0f} us")


# -- throughput ------------------------------------------------------------------------------------

LONG = {"type": "object", "properties": {"notes": {
    "type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 200}},
    "required": ["notes"], "additionalProperties": False}


async def round_(url: str, constrained: bool, streams: int, tokens: int) -> float:
    import httpx

    body = {"model": "smollm2-135m", "max_tokens": tokens, "temperature": 0.7, "stream": True,
            "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "notes", "schema": LONG}}
    else:
        body["ignore_eos"] = True
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i: int) -> int:
            msg = [{"role": "user", "content": f"Write notes about topic {i} as JSON."}]
            used = 0
            async with client.stream("POST", f"{url}/v1/chat/completions",
                                     json=body | {"messages": msg, "seed": i}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        used = usage["completion_tokens"] if usage else used
            return used

        t = time.perf_counter()
        counts = await asyncio.gather(*[one(i) for i in range(streams)])
        wall = time.perf_counter() - t
    assert all(c == tokens for c in counts), counts  # every stream ran to max_tokens
    return sum(counts) / wall


def bench_throughput(rounds: int, streams: int, tokens: int, model: str) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from compare_llama_server import free_port, wait_ready

    port = free_port()
    log = Path(tempfile.mkdtemp()) / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", model, "--port",
                             str(port)], stderr=log.open("w"), stdout=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        asyncio.run(round_(url, True, 2, 16))  # warm: compile the schema once, load kernels
        results = {True: [], False: []}
        for _ in range(rounds):
            for constrained in (False, True):
                results[constrained].append(asyncio.run(round_(url, constrained, streams,
                                                               tokens)))
                print(f"{'schema' if constrained else 'free  '} {results[constrained][-1]:.1f} "
                      "tok/s", flush=True)
        free, schema = (statistics.median(results[k]) for k in (False, True))
        ratios = [s / f for f, s in zip(results[False], results[True], strict=True)]
        print(f"{streams} streams x {tokens} tokens, {model}: free {free:.1f} tok/s, schema "
              f"{schema:.1f} tok/s, ratio {schema / free:.3f} (per round: "
              f"{', '.join(f'{r:.3f}' for r in ratios)})")
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--repeat", type=int, default=5)
    t = sub.add_parser("throughput")
    t.add_argument("--rounds", type=int, default=3)
    t.add_argument("--streams", type=int, default=16)
    t.add_argument("--tokens", type=int, default=128)
    t.add_argument("--model", default="smollm2-135m:int4")
    args = p.parse_args()
    if args.what == "compile":
        bench_compile(args.repeat)
    else:
        bench_throughput(args.rounds, args.streams, args.tokens, args.model)


if __name__ == "__main__":
    main()
