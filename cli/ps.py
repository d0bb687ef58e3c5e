"""`localserve ps` (the models a running server holds: size, context, when each goes) and
`localserve stop NAME` (let one go now)."""

from __future__ import annotations

import argparse
import datetime as dt

from cli.http import ServerClient, add_server_flags


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ps", help="the models a running server holds")
    add_server_flags(p)
    p.set_defaults(func=ps)
    p = sub.add_parser("stop", help="let a model a running server holds go now")
    p.add_argument("name", help="the model (alias:tag or alias)")
    add_server_flags(p)
    p.set_defaults(func=stop)


def ps(args: argparse.Namespace) -> int:
    models = ServerClient(args).json("GET", "/api/ps")["models"]
    print(f"{'model':32}  {'size':>9}  {'context':>8}  until")
    for m in models:
        until = dt.datetime.fromisoformat(m["expires_at"])
        left = until - dt.datetime.now(dt.UTC)
        when = "kept" if left > dt.timedelta(days=365) else f"{max(0, int(left.total_seconds()))} s"
        print(f"{m['model'][:32]:32}  {m['size'] / 1e6:7.1f}MB  {m['context_length']:8}  {when}")
    return 0


def stop(args: argparse.Namespace) -> int:
    ServerClient(args).json("POST", f"/v1/models/{args.name}/unload")
    print(f"let go of {args.name}")
    return 0
