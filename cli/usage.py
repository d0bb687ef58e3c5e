"""`localserve usage`: tokens and cost by day, interactive vs batch (a running server's)."""

from __future__ import annotations

import argparse
import json

from cli.http import ServerClient, add_server_flags


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("usage", help="tokens and cost by day, interactive vs batch")
    p.add_argument("--start", default=None, help="first day, YYYY-MM-DD")
    p.add_argument("--end", default=None, help="last day, YYYY-MM-DD")
    p.add_argument("--json", action="store_true", help="the raw /v1/usage answer")
    add_server_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = {k: v for k, v in (("start_date", args.start), ("end_date", args.end)) if v}
    usage = ServerClient(args).json("GET", "/v1/usage", params=params)
    if args.json:
        print(json.dumps(usage, indent=2))
        return 0
    print(f"{'date':10}  {'key':12}  {'kind':11}  {'model':24}  {'requests':>8}  "
          f"{'prompt':>9}  {'completion':>10}  {'cost $':>10}")
    for r in usage["data"]:
        print(f"{r['date']:10}  {(r['api_key_id'] or '-')[:12]:12}  {r['kind']:11}  "
              f"{r['model'][:24]:24}  {r['requests']:8}  {r['prompt_tokens']:9}  "
              f"{r['completion_tokens']:10}  {r['cost_usd']:10.6f}")
    t = usage["total"]
    if t:
        print(f"{'total':10}  {'':12}  {'':11}  {'':24}  {t['requests']:8}  "
              f"{t['prompt_tokens']:9}  {t['completion_tokens']:10}  {t['cost_usd']:10.6f}")
    p = usage["prices"]
    print(f"prices: ${p['input_per_million']}/M prompt, ${p['output_per_million']}/M "
          f"completion, batch {p['batch_discount']:.0%} off")
    return 0
