"""Routes (`serve --route NAME=SMALL,LARGE[,CONFIDENCE]`, api/generation/cascade.py): how well
the small model's confidence picks the answers to escalate, and what a route costs a request.

    python benchmarks/routing.py SMALL LARGE [--parts rule,cost] [--max-tokens 48]

Starts `localserve serve SMALL` (LARGE stored beside it) and asks PROMPTS greedily.
- rule: each prompt on SMALL (its confidence: the geometric mean probability of its tokens,
  as the route computes it) and on LARGE. "Agrees": SMALL's answer is LARGE's, word for word.
  For each threshold: the share escalated, the share of routed replies that are LARGE's answer,
  and what escalating the same share at random would give (base + share * (1 - base)).
- cost: streamed requests of --max-tokens tokens each (ignore_eos) through a route that never
  escalates (CONFIDENCE 0) and one that always does (1), against SMALL and LARGE asked
  directly: median time to first token and to the last.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import httpx
from held_models import serve

PROMPTS = [
    "What is the capital of France?", "What is the capital of Japan?",
    "What is the capital of Canada?", "What is the capital of Australia?",
    "Who wrote Romeo and Juliet?", "Who painted the Mona Lisa?",
    "What is the largest planet in the solar system?", "How many days are in a leap year?",
    "What is 12 times 12?", "What is 17 plus 25?", "What is the square root of 81?",
    "What is the boiling point of water in Celsius?", "What gas do plants absorb?",
    "What is the chemical symbol for gold?", "How many continents are there?",
    "What is the longest river in the world?", "Translate 'good morning' into Spanish.",
    "Give me a synonym for 'happy'.", "What is the opposite of 'cold'?",
    "Name three primary colors.", "What language is spoken in Brazil?",
    "What is photosynthesis?", "Explain what a CPU does in one sentence.",
    "What is the freezing point of water in Fahrenheit?", "Who was the first person on the Moon?",
    "What is the tallest mountain on Earth?", "How many legs does a spider have?",
    "What is the main ingredient of guacamole?", "Write a haiku about autumn.",
    "Suggest a name for a pet cat.", "What does DNA stand for?",
    "What is the speed of light?", "Why is the sky blue?", "What is an atom?",
    "List the days of the week.", "What year did World War II end?",
    "Write one sentence about the ocean.", "What is the smallest prime number?",
    "What is the currency of the United Kingdom?",
    "Which animal is known as the king of the jungle?",
]
THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def chat(url: str, model: str, prompt: str, max_tokens: int, **kw) -> dict:
    return httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": model, "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": prompt}]} | kw).json()


def confidence(reply: dict) -> float:
    lps = [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]
    return math.exp(sum(lps) / len(lps)) if lps else 1.0


def rule(url: str, small: str, large: str, max_tokens: int) -> None:
    rows = []
    for prompt in PROMPTS:
        s = chat(url, small, prompt, max_tokens, logprobs=True)
        big = chat(url, large, prompt, max_tokens)
        rows.append((confidence(s), s["choices"][0]["message"]["content"]
                     == big["choices"][0]["message"]["content"]))
    base = sum(agree for _, agree in rows) / len(rows)
    agreeing = _mean(c for c, a in rows if a)
    other = _mean(c for c, a in rows if not a)
    print(f"{len(rows)} prompts: {small} gives {large}'s answer on {base:.0%}; confidence "
          f"median {statistics.median(c for c, _ in rows):.2f}, where it agrees {agreeing:.2f}, "
          f"where not {other:.2f}; AUROC {_auroc(rows):.2f}")
    print("threshold  escalated  routed = large's  random escalation")
    for t in THRESHOLDS:
        up = [c < t for c, _ in rows]
        share = sum(up) / len(rows)
        routed = sum(agree or esc for (_, agree), esc in zip(rows, up, strict=True)) / len(rows)
        print(f"{t:9.1f}  {share:9.0%}  {routed:16.0%}  {base + share * (1 - base):17.0%}")


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def _auroc(rows: list[tuple[float, bool]]) -> float:
    """The chance that an agreeing answer has the higher confidence than a disagreeing one."""
    yes = [c for c, a in rows if a]
    no = [c for c, a in rows if not a]
    if not yes or not no:
        return float("nan")
    return sum((y > n) + 0.5 * (y == n) for y in yes for n in no) / (len(yes) * len(no))


def timed(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=600, json={
            "model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "messages": [{"role": "user", "content": prompt}]}) as r:
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and '"content": "' in line \
                    and '"content": ""' not in line:
                first = time.perf_counter() - start
    return first or float("nan"), time.perf_counter() - start


def cost(url: str, names: dict[str, str], max_tokens: int) -> None:
    print(f"streamed, greedy, {max_tokens} tokens (ignore_eos): median TTFT / total (s)")
    for label, model in names.items():
        got = [timed(url, model, p, max_tokens) for p in PROMPTS[:12]]
        print(f"  {label:32s} {statistics.median(t for t, _ in got):6.2f} / "
              f"{statistics.median(t for _, t in got):6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("small")
    ap.add_argument("large")
    ap.add_argument("--parts", default="rule,cost")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    server, url = serve([args.small, args.large,
                         "--route", f"never={args.small},{args.large},0",
                         "--route", f"always={args.small},{args.large},1"])
    try:
        for model in (args.small, args.large):  # first calls paid before timing
            chat(url, model, "Hi", 4)
        if "rule" in args.parts:
            rule(url, args.small, args.large, args.max_tokens)
        if "cost" in args.parts:
            cost(url, {f"{args.small} directly": args.small,
                       f"{args.large} directly": args.large,
                       "route, not escalated": "never", "route, escalated": "always"},
                 args.max_tokens)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
