"""Read a GGUF file into Hugging Face form: config dict, tensors by HF name, tokenizer files.

Tensors are dequantized to fp32 with the gguf package. llama.cpp's converter permutes the rows
of Llama's q/k projections (interleaved rotary halves); `unpermute` restores HF's layout.
Config, tokenizer and chat template come from the file's metadata through transformers.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where tensors are read: CLI commands start fast
    import torch

MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFError(ValueError):
    pass


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> Hugging Face name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (2, D/2) <- (D/2, 2)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def read_config(path: Path) -> dict[str, Any]:
    """The file's model config as a Hugging Face config dict."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    except ValueError as e:
        raise GGUFError(f"{path.name}: {e}") from e
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPE_TO_ARCHITECTURE:
        raise GGUFError(f"unsupported GGUF architecture {model_type!r}")
    config["architectures"] = [MODEL_TYPE_TO_ARCHITECTURE[model_type]]
    return config


def save_tokenizer(path: Path, out_dir: Path, model_type: str) -> None:
    """Write tokenizer.json, its config and the chat template from the file's metadata.

    The class is the one AutoTokenizer would pick for the model type (read_config's): named by
    `tokenizer_type`, else the generic fast tokenizer it falls back to. Left to find it
    itself, AutoTokenizer parses the whole file again for the config first: 4.1 s of its 4.4 s
    for smollm2-135m's GGUF, the same three files either way [Intel(R) Xeon(R) Processor,
    AVX-512 BF16 no, AMX no]."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    folder, kwargs = str(path.parent), {"gguf_file": path.name}
    if TOKENIZER_MAPPING_NAMES.get(model_type):
        tokenizer = AutoTokenizer.from_pretrained(folder, tokenizer_type=model_type, **kwargs)
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, **kwargs)
    tokenizer.save_pretrained(str(out_dir))


def open_reader(path: Path):
    """The file's tensors (gguf.GGUFReader): parsing its metadata takes seconds (the vocabulary
    and merges are ~100,000 strings), so a pull opens it once for the count and the tensors."""
    import gguf

    return gguf.GGUFReader(path)


def iter_tensors(reader, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every tensor in the file (open_reader)."""
    import gguf
    import numpy as np
    import torch

    permute_qk = config["model_type"] == "llama"
    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    for t in reader.tensors:
        name = hf_name(t.name)
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; numpy's shape is HF's [out, in].
        shape = tuple(int(d) for d in reversed(t.shape))
        w = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)  # owned copy
        if permute_qk and name.endswith("q_proj.weight"):
            w = unpermute(w, num_heads)
        elif permute_qk and name.endswith("k_proj.weight"):
            w = unpermute(w, num_kv_heads)
        yield name, w
