"""`localserve batch submit|list|status|cancel|results`: the Batch API of a running server."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cli.http import ServerClient, ServerError, add_server_flags

FINAL = ("completed", "failed", "expired", "cancelled")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="submit and follow offline batch jobs (server API)")
    cmds = p.add_subparsers(dest="batch_command", required=True)
    s = cmds.add_parser("submit", help="upload a .jsonl of requests and start a batch")
    s.add_argument("file", type=Path)
    s.add_argument("--endpoint", default=None,
                   help="default: the url of the first line (/v1/chat/completions or "
                   "/v1/completions)")
    s.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--wait", action="store_true", help="follow it to the end (progress bar)")
    s.set_defaults(func=submit)
    ls = cmds.add_parser("list", help="recent batches, newest first")
    ls.add_argument("--limit", type=int, default=20)
    ls.set_defaults(func=list_batches)
    st = cmds.add_parser("status", help="one batch, as JSON")
    st.add_argument("id")
    st.set_defaults(func=status)
    c = cmds.add_parser("cancel", help="cancel a batch (finished lines are kept)")
    c.add_argument("id")
    c.set_defaults(func=cancel)
    r = cmds.add_parser("results", help="write a finished batch's output lines")
    r.add_argument("id")
    r.add_argument("-o", "--output", type=Path, default=None, help="default: standard output")
    r.add_argument("--errors", action="store_true", help="the error file instead")
    r.set_defaults(func=results)
    for parser in (s, ls, st, c, r):
        add_server_flags(parser)


def submit(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        raise ValueError(f"{args.file}: no such file")
    endpoint = args.endpoint or _first_url(args.file)
    metadata = {}
    for pair in args.metadata:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--metadata expects KEY=VALUE, got {pair!r}")
        metadata[key] = value
    client = ServerClient(args)
    with args.file.open("rb") as f:
        uploaded = client.json("POST", "/v1/files", data={"purpose": "batch"},
                               files={"file": (args.file.name, f, "application/jsonl")})
    batch = client.json("POST", "/v1/batches", json={
        "input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h",
        "metadata": metadata or None})
    print(batch["id"])
    if not args.wait:
        return 0
    batch = _follow(client, batch["id"])
    counts = batch["request_counts"]
    print(f"{batch['status']}: {counts['completed']} completed, {counts['failed']} failed of "
          f"{counts['total']}", file=sys.stderr)
    if batch["status"] == "failed":
        for e in (batch.get("errors") or {}).get("data", [])[:5]:
            print(f"  line {e['line']}: {e['message']}", file=sys.stderr)
    return 0 if batch["status"] == "completed" else 1


def _first_url(path: Path) -> str:
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    return json.loads(raw)["url"]
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{path}: the first line is not a request with a 'url' "
                                     "(or pass --endpoint)") from None
    raise ValueError(f"{path}: the file is empty")


def _follow(client: ServerClient, batch_id: str) -> dict:
    from tqdm import tqdm

    bar = tqdm(total=0, unit="req", desc="batch", file=sys.stderr, disable=None)
    try:
        while True:
            batch = client.json("GET", f"/v1/batches/{batch_id}")
            counts = batch["request_counts"]
            bar.total = counts["total"]
            bar.n = counts["completed"] + counts["failed"]
            bar.set_postfix_str(batch["status"])
            if batch["status"] in FINAL:
                return batch
            time.sleep(0.5)
    finally:
        bar.close()


def list_batches(args: argparse.Namespace) -> int:
    page = ServerClient(args).json("GET", "/v1/batches", params={"limit": args.limit})
    print(f"{'id':40} {'status':11} {'done':>7} {'failed':>6} {'total':>6}  created")
    for b in page["data"]:
        c = b["request_counts"]
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(b["created_at"]))
        print(f"{b['id']:40} {b['status']:11} {c['completed']:7} {c['failed']:6} "
              f"{c['total']:6}  {created}")
    return 0


def status(args: argparse.Namespace) -> int:
    print(json.dumps(ServerClient(args).json("GET", f"/v1/batches/{args.id}"), indent=2))
    return 0


def cancel(args: argparse.Namespace) -> int:
    batch = ServerClient(args).json("POST", f"/v1/batches/{args.id}/cancel")
    print(f"{batch['id']} {batch['status']}")
    return 0


def results(args: argparse.Namespace) -> int:
    client = ServerClient(args)
    batch = client.json("GET", f"/v1/batches/{args.id}")
    if batch["status"] not in FINAL:
        raise ServerError(f"batch {args.id} is {batch['status']}; results come when it ends")
    file_id = batch["error_file_id" if args.errors else "output_file_id"]
    if file_id is None:
        raise ServerError(f"batch {args.id} has no {'error' if args.errors else 'output'} "
                          "file")
    content = client.request("GET", f"/v1/files/{file_id}/content").content
    if args.output is None:
        sys.stdout.buffer.write(content)
        return 0
    tmp = args.output.with_name(f".{args.output.name}.part")
    tmp.write_bytes(content)
    tmp.replace(args.output)  # never a half-written results file
    num_lines = content.count(b"\n")
    print(f"{num_lines} lines -> {args.output}", file=sys.stderr)
    return 0
