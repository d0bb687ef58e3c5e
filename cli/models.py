"""`localserve list`, `localserve show NAME`, `localserve rm NAME`."""

from __future__ import annotations

import argparse
import json

from storage.models import ModelStore
from storage.sampling import describe, sampling_defaults


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list stored models")
    p.set_defaults(func=list_models)
    p = sub.add_parser("show", help="show a stored model's details")
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="print the whole manifest")
    p.set_defaults(func=show)
    p = sub.add_parser("rm", help="remove a stored model")
    p.add_argument("name")
    p.set_defaults(func=remove)


def _describe_source(source: dict) -> str:
    return source.get("repo") or source.get("requirement") or source.get("path") or "?"


def list_models(args: argparse.Namespace) -> int:
    rows = [("NAME", "BITS", "SIZE", "SOURCE", "CREATED")]
    for m in ModelStore().list():
        mf = m.manifest
        rows.append((m.name, str(mf["bits"]), f"{m.size_bytes / 1e6:.1f} MB",
                     _describe_source(mf["source"]), mf["created_at"][:19].replace("T", " ")))
    if len(rows) == 1:
        print("no models yet: try `localserve pull smollm2-135m`")
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    return 0


def show(args: argparse.Namespace) -> int:
    m = ModelStore().resolve(args.name)
    mf = m.manifest
    if args.json:
        print(json.dumps(mf, indent=2))
        return 0
    cfg = mf["config"]
    quant = "none (bf16)" if mf["bits"] == 16 else (
        f"int{mf['bits']}" + (f", group size {mf['group_size']}" if mf.get("group_size") else "")
        + f", {len(mf['quantized'])} tensors quantized")
    lines = [
        ("name", m.name),
        ("architecture", mf["architecture"]),
        ("parameters", f"{mf['num_parameters'] / 1e6:.1f}M"),
        ("context length", str(cfg.get("max_position_embeddings"))),
        ("layers / hidden", f"{cfg['num_hidden_layers']} / {cfg['hidden_size']}"),
        ("quantization", quant),
        ("source", _describe_source(mf["source"])),
        ("path", str(m.path)),
        ("size", f"{m.size_bytes / 1e6:.1f} MB"),
        ("chat template", "yes" if mf["tokenizer"].get("chat_template") else "no"),
        ("sampling", describe(*sampling_defaults(m.path, mf.get("alias", "")))),
    ]
    lines += [("file", f"{f}  {d[:12]}") for f, d in mf["files"].items()]
    for k, v in lines:
        print(f"{k:<16}{v}")
    return 0


def remove(args: argparse.Namespace) -> int:
    m = ModelStore().remove(args.name)
    print(f"removed {m.name}")
    return 0
