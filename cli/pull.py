"""`localserve pull MODEL [--bits 4|8|16] [--force]`: fetch, convert, quantize, store."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from storage.models import TAGS, ModelStore, StoredModel, write_manifest
from storage.sources import TOKENIZER_FILES, Checkpoint, SourceError, fetch, resolve


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download a model and store it pre-quantized")
    p.add_argument("model", help="catalogue alias, Hugging Face repo id, local folder or .gguf")
    p.add_argument("--bits", type=int, choices=(4, 8, 16), default=4)
    p.add_argument("--force", action="store_true", help="replace an existing copy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    store = ModelStore()
    name = store_name(args.model, args.bits)
    if store.exists(name) and not args.force:
        print(f"{name} is already pulled (use --force to pull again)")
        return 0
    model = pull(args.model, args.bits, store, force=args.force)
    print(f"pulled {model.name} ({model.size_bytes / 1e6:.1f} MB) -> {model.path}")
    return 0


def store_name(spec: str, bits: int) -> str:
    return f"{resolve(spec).alias}:{TAGS[bits]}"


def pull(spec: str, bits: int, store: ModelStore, force: bool = False) -> StoredModel:
    """Fetch `spec` and install it as `<alias>:<tag>`; a no-op if present and not `force`."""
    source = resolve(spec)
    name = f"{source.alias}:{TAGS[bits]}"
    if store.exists(name) and not force:
        return store.resolve(name)
    with store.scratch() as scratch, store.installing(name) as folder:
        checkpoint = fetch(source, scratch, store.cache_dir)
        build(checkpoint, bits, folder, name, source.alias)
    return store.resolve(name)


def build(checkpoint: Checkpoint, bits: int, folder: Path, name: str, alias: str) -> None:
    """Convert a checkpoint into a store folder: weights, tokenizer files, manifest."""
    # Heavy imports stay here so `localserve list` starts fast.
    from tqdm import tqdm

    from server.models.config import ModelConfig
    from server.quant import DEFAULT_GROUP_SIZE, quantize_state_dict
    from storage.tensor_file import TensorFileWriter, header_room

    config = ModelConfig.from_hf(checkpoint.hf_config)  # refuses unsupported models early
    schemes: dict[str, Any] = {}
    bar = tqdm(total=checkpoint.num_tensors, desc=f"converting to {TAGS[bits]}", unit="tensor",
               file=sys.stderr, disable=None)
    # Each converted tensor goes to disk as it comes: the model is never whole in memory.
    with TensorFileWriter(folder / "model.safetensors",
                          header_room(checkpoint.num_tensors)) as out_file:
        for tensor_name, w in checkpoint.tensors():
            bar.update(1)
            if tensor_name.startswith(BACKBONE_PREFIXES):  # a bare backbone's names (no head)
                tensor_name = f"model.{tensor_name}"
            if tensor_name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if "rotary_emb" in tensor_name:
                continue
            out, scheme = quantize_state_dict({tensor_name: w}, bits, DEFAULT_GROUP_SIZE)
            for key, t in out.items():
                out_file.add(key, t)
            schemes.update(scheme)
            del w, out
        bar.close()
        out_file.finish(metadata={"format": "pt"})
    copied = []
    for f in TOKENIZER_FILES:
        if (checkpoint.tokenizer_dir / f).is_file():
            shutil.copyfile(checkpoint.tokenizer_dir / f, folder / f)
            copied.append(f)
    write_manifest(folder, {
        "name": name,
        "alias": alias,
        "source": checkpoint.origin,
        "architecture": config.architecture,
        "config": checkpoint.hf_config,
        "num_parameters": config.num_parameters,
        "bits": bits,
        "group_size": DEFAULT_GROUP_SIZE if bits == 4 else None,
        "quantized": schemes,
        "pooling": _pooling(checkpoint.tokenizer_dir, checkpoint.hf_config),
        "tokenizer": {
            "files": copied,
            "chat_template": _chat_template(folder),
            "eos_token_ids": _eos_token_ids(folder, config.eos_token_ids),
        },
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    })


BACKBONE_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def _pooling(folder: Path, hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """An embedding model's pooling, from its sentence-transformers files (1_Pooling/config.json,
    modules.json); None for a chat model (served with mean pooling, see /v1/embeddings)."""
    pooling_file = folder / "1_Pooling" / "config.json"
    if not pooling_file.is_file():
        return None
    config = json.loads(pooling_file.read_text())
    if config.get("pooling_mode_lasttoken"):
        mode = "last"
    elif config.get("pooling_mode_mean_tokens"):
        mode = "mean"
    else:
        modes = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
        raise SourceError(f"unsupported pooling {modes} in {pooling_file} (supported: "
                          "last-token and mean)")
    modules = folder / "modules.json"
    normalize = modules.is_file() and any(
        str(m.get("type", "")).endswith(".Normalize") for m in json.loads(modules.read_text()))
    matryoshka = bool(hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"))
    return {"mode": mode, "normalize": normalize, "matryoshka": matryoshka}


def _chat_template(folder: Path) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "tokenizer_config.json").is_file():
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def _eos_token_ids(folder: Path, from_config: tuple[int, ...]) -> list[int]:
    """Every id that ends a turn: the config's, generation_config's and the tokenizer's."""
    ids = set(from_config)
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    tok = folder / "tokenizer.json"
    cfg = folder / "tokenizer_config.json"
    if tok.is_file() and cfg.is_file():
        eos_token = json.loads(cfg.read_text()).get("eos_token")
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        for added in json.loads(tok.read_text()).get("added_tokens", []):
            if added.get("content") == eos_token:
                ids.add(added["id"])
    return sorted(ids)
