"""`localserve batch submit|list|status|cancel|results`: the Batch APIs of a running server.

A file of OpenAI batch lines (`custom_id`, `method`, `url`, `body`) goes to /v1/batches through
/v1/files; one of Anthropic's (`custom_id`, `params`) to /v1/messages/batches. The other
commands take either kind's id (`batch_...` or `msgbatch_...`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from pathlib import Path

from cli.http import ServerClient, ServerError, add_server_flags

FINAL = ("completed", "failed", "expired", "cancelled")
MESSAGE_BATCH = "msgbatch_"  # Anthropic's ids: /v1/messages/batches


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="submit and follow offline batch jobs (server API)")
    cmds = p.add_subparsers(dest="batch_command", required=True)
    s = cmds.add_parser("submit", help="start a batch from a .jsonl of requests (OpenAI batch "
                        "lines, or Anthropic's custom_id and params)")
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
    first = _first_line(args.file)
    if "url" not in first and "params" in first:
        return _submit_messages(args)
    endpoint = args.endpoint or _url(first, args.file)
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


def _submit_messages(args: argparse.Namespace) -> int:
    """An Anthropic file: its requests in one POST /v1/messages/batches."""
    if args.endpoint or args.metadata:
        raise ValueError("--endpoint and --metadata are for OpenAI batch files; this one holds "
                         "Anthropic message requests")
    requests = []
    with args.file.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                try:
                    requests.append(json.loads(raw))
                except ValueError:
                    raise ValueError(f"{args.file}: line {number} is not JSON") from None
    client = ServerClient(args)
    batch = client.json("POST", "/v1/messages/batches", json={"requests": requests})
    print(batch["id"])
    if not args.wait:
        return 0
    c = _follow(client, batch["id"])["request_counts"]
    print(f"ended: {c['succeeded']} succeeded, {c['errored']} errored, {c['canceled']} "
          f"canceled, {c['expired']} expired of {sum(c.values())}", file=sys.stderr)
    return 0


def _first_line(path: Path) -> dict:
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    line = json.loads(raw)
                except ValueError:
                    line = None
                if not isinstance(line, dict):
                    raise ValueError(f"{path}: the first line is not a JSON object")
                return line
    raise ValueError(f"{path}: the file is empty")


def _url(line: dict, path: Path) -> str:
    if not isinstance(line.get("url"), str):
        raise ValueError(f"{path}: the first line is not a request with a 'url' (or pass "
                         "--endpoint)")
    return line["url"]


def _path(batch_id: str) -> str:
    kind = "messages/batches" if batch_id.startswith(MESSAGE_BATCH) else "batches"
    return f"/v1/{kind}/{batch_id}"


def _progress(batch: dict) -> tuple[str, int, int, bool]:
    """(status, requests done, requests in all, ended) of either kind of batch."""
    c = batch["request_counts"]
    if batch["id"].startswith(MESSAGE_BATCH):
        total = sum(c.values())
        status = batch["processing_status"]
        return status, total - c["processing"], total, status == "ended"
    return batch["status"], c["completed"] + c["failed"], c["total"], batch["status"] in FINAL


def _follow(client: ServerClient, batch_id: str) -> dict:
    from tqdm import tqdm

    bar = tqdm(total=0, unit="req", desc="batch", file=sys.stderr, disable=None)
    try:
        while True:
            batch = client.json("GET", _path(batch_id))
            status, done, total, ended = _progress(batch)
            bar.total, bar.n = total, done
            bar.set_postfix_str(status)
            if ended:
                return batch
            time.sleep(0.5)
    finally:
        bar.close()


def list_batches(args: argparse.Namespace) -> int:
    """Both kinds, newest first."""
    client = ServerClient(args)
    page = client.json("GET", "/v1/batches", params={"limit": args.limit})["data"]
    for b in client.json("GET", "/v1/messages/batches", params={"limit": args.limit})["data"]:
        created = datetime.fromisoformat(b["created_at"].replace("Z", "+00:00"))
        page.append(b | {"created_at": created.timestamp()})
    page.sort(key=lambda b: b["created_at"], reverse=True)
    print(f"{'id':40} {'status':11} {'done':>7} {'failed':>6} {'total':>6}  created")
    for b in page[:args.limit]:
        status, done, total, _ = _progress(b)
        c = b["request_counts"]
        failed = c.get("failed", 0) + c.get("errored", 0) + c.get("expired", 0)
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(b["created_at"]))
        print(f"{b['id']:40} {status:11} {done - failed:7} {failed:6} {total:6}  {created}")
    return 0


def status(args: argparse.Namespace) -> int:
    print(json.dumps(ServerClient(args).json("GET", _path(args.id)), indent=2))
    return 0


def cancel(args: argparse.Namespace) -> int:
    batch = ServerClient(args).json("POST", f"{_path(args.id)}/cancel")
    print(f"{batch['id']} {_progress(batch)[0]}")
    return 0


def results(args: argparse.Namespace) -> int:
    client = ServerClient(args)
    batch = client.json("GET", _path(args.id))
    status, _, _, ended = _progress(batch)
    if not ended:
        raise ServerError(f"batch {args.id} is {status}; results come when it ends")
    if args.id.startswith(MESSAGE_BATCH):  # one file of every result; --errors: the others
        content = client.request("GET", f"{_path(args.id)}/results").content
        if args.errors:
            content = b"".join(line + b"\n" for line in content.splitlines()
                               if json.loads(line)["result"]["type"] != "succeeded")
        return _write(content, args.output)
    file_id = batch["error_file_id" if args.errors else "output_file_id"]
    if file_id is None:
        raise ServerError(f"batch {args.id} has no {'error' if args.errors else 'output'} "
                          "file")
    return _write(client.request("GET", f"/v1/files/{file_id}/content").content, args.output)


def _write(content: bytes, output: Path | None) -> int:
    if output is None:
        sys.stdout.buffer.write(content)
        return 0
    tmp = output.with_name(f".{output.name}.part")
    tmp.write_bytes(content)
    tmp.replace(output)  # never a half-written results file
    num_lines = content.count(b"\n")
    print(f"{num_lines} lines -> {output}", file=sys.stderr)
    return 0
