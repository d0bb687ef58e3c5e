"""Read a GGUF file into Hugging Face form: config dict, tensors by HF name, tokenizer files.

Tensors are dequantized to fp32 with the gguf package. llama.cpp's converter permutes the rows
of Llama-layout q/k projections (interleaved rotary halves); `unpermute` restores HF's layout.
Config, tokenizer and chat template come from the file's metadata through transformers, which
reads the architectures it knows; for the others of the Llama layout (OWN_ARCHITECTURES) the
config is read here from llama.cpp's keys and the tokenizer through transformers' converter.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where tensors are read: CLI commands start fast
    import torch

MODEL_TYPE_TO_ARCHITECTURE = {"llama": "LlamaForCausalLM"}
# Architectures read here from llama.cpp's own keys (_own_config): transformers' GGUF reader
# knows none of them, or leaves out what they need (Qwen3's head_dim, Gemma 3's layer kinds).
OWN_ARCHITECTURES = {"granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                     "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                     "phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                     "qwen3moe": "Qwen3MoeForCausalLM", "gpt-oss": "GptOssForCausalLM"}
# llama.cpp's converter permutes the q/k rows of the Llama layout only
PERMUTED_QK = ("llama", "granite", "smollm3")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where a family names a layer's tensors otherwise: Phi-3's ffn_up holds gate and up fused;
# Gemma 3's four norms (ffn_norm is the one before its MLP).
_FAMILY_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm",
               "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
                "attn_sinks": "self_attn.sinks"},
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope
# A mixture's experts, stacked [experts, out, in] in one tensor each: HF keeps one per expert
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFError(ValueError):
    pass


def hf_name(gguf_name: str, model_type: str = "llama") -> str:
    """GGUF tensor name -> Hugging Face name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    names = _LAYER_NAMES | _FAMILY_NAMES.get(model_type, {})
    if not m or m.group(2) not in names:
        raise GGUFError(f"unknown GGUF tensor {gguf_name!r}")
    name = f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return name if name.endswith(".sinks") else f"{name}.{m.group(3)}"  # sinks: a parameter


def unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (2, D/2) <- (D/2, 2)."""
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def read_config(path: Path) -> dict[str, Any]:
    """The file's model config as a Hugging Face config dict."""
    from transformers import AutoConfig

    architecture = _architecture(path)
    if architecture in OWN_ARCHITECTURES:
        return _own_config(path, architecture)
    if architecture not in MODEL_TYPE_TO_ARCHITECTURE:
        known = ", ".join([*MODEL_TYPE_TO_ARCHITECTURE, *OWN_ARCHITECTURES])
        raise GGUFError(f"{path.name}: unsupported GGUF architecture {architecture!r} "
                        f"(supported: {known})")
    try:
        with _transformers_reads_ours(path):
            config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    except ValueError as e:
        raise GGUFError(f"{path.name}: {e}") from e
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPE_TO_ARCHITECTURE:
        raise GGUFError(f"unsupported GGUF architecture {model_type!r}")
    config["architectures"] = [MODEL_TYPE_TO_ARCHITECTURE[model_type]]
    return config


def _fields(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """The first value of each metadata key the file has, and its tensors' names."""
    from transformers.modeling_gguf_pytorch_utils import read_field

    reader = open_reader(path)
    values = {key: read_field(reader, key) for key in keys}
    values = {key: v[0] for key, v in values.items() if v}
    values["tensor names"] = {t.name for t in reader.tensors}
    return values


def _architecture(path: Path) -> str:
    return _fields(path, ("general.architecture",)).get("general.architecture", "")


def _own_config(path: Path, arch: str) -> dict[str, Any]:
    """An OWN_ARCHITECTURES file's config, from llama.cpp's keys. SmolLM3's layers without
    rotary embedding are every fourth, as llama.cpp fixes them (its n_no_rope_layer_step)."""
    keys = ("block_count", "context_length", "embedding_length", "feed_forward_length",
            "attention.head_count", "attention.head_count_kv", "attention.key_length",
            "attention.layer_norm_rms_epsilon", "rope.freq_base", "vocab_size",
            "attention.scale", "embedding_scale", "residual_scale", "logit_scale",
            "attention.sliding_window", "final_logit_softcapping", "rope.dimension_count",
            "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
            "expert_count", "expert_used_count", "expert_feed_forward_length",
            "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow")
    f = _fields(path, (*(f"{arch}.{k}" for k in keys), "tokenizer.ggml.bos_token_id",
                       "tokenizer.ggml.eos_token_id"))
    get = {k: f.get(f"{arch}.{k}") for k in keys}
    heads, hidden, layers = (get["attention.head_count"], get["embedding_length"],
                             get["block_count"])
    get["vocab_size"] = get["vocab_size"] or _rows(path, "token_embd.weight")
    if not heads or not hidden or not layers or not get["vocab_size"]:
        raise GGUFError(f"{path.name}: the {arch} metadata lacks its shapes")
    config = {
        "model_type": arch, "architectures": [OWN_ARCHITECTURES[arch]],
        "vocab_size": get["vocab_size"], "hidden_size": hidden,
        "intermediate_size": get["feed_forward_length"], "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": get["attention.head_count_kv"],
        "head_dim": get["attention.key_length"] or hidden // heads,
        "rms_norm_eps": get["attention.layer_norm_rms_epsilon"],
        "rope_theta": get["rope.freq_base"] or 10000.0,
        "max_position_embeddings": get["context_length"],
        "tie_word_embeddings": "output.weight" not in f["tensor names"],
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": f.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "granite":
        config |= {"attention_multiplier": get["attention.scale"],
                   "embedding_multiplier": get["embedding_scale"],
                   "residual_multiplier": get["residual_scale"],
                   "logits_scaling": get["logit_scale"]}
    if arch == "smollm3":
        config["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(layers)]
    if arch == "phi3":
        config |= _phi3(path, get, config["head_dim"])
    if arch == "gpt-oss":
        config |= _gpt_oss(get, layers)
    if arch == "qwen3moe":  # every layer a mixture; llama.cpp renormalizes the top k always
        config |= {"num_experts": get["expert_count"],
                   "num_experts_per_tok": get["expert_used_count"],
                   "moe_intermediate_size": get["expert_feed_forward_length"],
                   "norm_topk_prob": True}
    if arch == "gemma3":
        config |= _gemma3(get, layers, hidden, heads, config["head_dim"])
    return {k: v for k, v in config.items() if v is not None}


def _gpt_oss(get: dict[str, Any], layers: int) -> dict[str, Any]:
    """gpt-oss: what llama.cpp fixes in code (windowed layers first, then every other; the
    clamp 7.0) and YaRN as the model was trained with it (no truncation)."""
    return {"num_local_experts": get["expert_count"],
            "num_experts_per_tok": get["expert_used_count"],
            "intermediate_size": get["expert_feed_forward_length"],
            "sliding_window": get["attention.sliding_window"], "attention_bias": True,
            "swiglu_limit": 7.0, "layer_types": ["sliding_attention" if i % 2 == 0
                                                 else "full_attention" for i in range(layers)],
            "rope_scaling": {
                "rope_type": "yarn", "factor": get["rope.scaling.factor"], "truncate": False,
                "beta_fast": get["rope.scaling.yarn_beta_fast"] or 32.0,
                "beta_slow": get["rope.scaling.yarn_beta_slow"] or 1.0,
                "original_max_position_embeddings": get["rope.scaling.original_context_length"]}
            if get["rope.scaling.type"] == "yarn" else None}


def _rows(path: Path, name: str) -> int | None:
    """The first dimension (HF's) of a tensor of the file."""
    t = next((t for t in open_reader(path).tensors if t.name == name), None)
    return None if t is None else int(t.shape[-1])


def _phi3(path: Path, get: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Phi-3's window (0: none, Phi-4), partial rotary and longrope factors (tensors)."""
    import numpy as np

    out: dict[str, Any] = {"sliding_window": get["attention.sliding_window"] or None}
    dims = get["rope.dimension_count"]
    if dims and dims != head_dim:
        out["partial_rotary_factor"] = dims / head_dim
    factors = {t.name: np.array(t.data, dtype=np.float32).tolist()
               for t in open_reader(path).tensors if t.name in ROPE_FACTORS}
    if factors:
        out["rope_scaling"] = {
            "rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"],
            "original_max_position_embeddings": get["rope.scaling.original_context_length"]}
    return out


def _gemma3(get: dict[str, Any], layers: int, hidden: int, heads: int,
            head_dim: int) -> dict[str, Any]:
    """Gemma 3's layer kinds, local rope base and attention scale, fixed in llama.cpp rather
    than written: every sixth layer global, the others windowed with base 10,000; the scale
    head_dim^-0.5, but hidden / heads for the 27B (62 layers)."""
    window = get["attention.sliding_window"]
    out: dict[str, Any] = {
        "sliding_window": window, "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "final_logit_softcapping": get["final_logit_softcapping"]}
    if window:
        out["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                              for i in range(layers)]
    if get["rope.scaling.type"] == "linear" and get["rope.scaling.factor"]:
        out["rope_scaling"] = {"rope_type": "linear", "factor": get["rope.scaling.factor"]}
    return out


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
    if model_type in OWN_ARCHITECTURES:  # transformers' loader refuses the architecture
        _own_tokenizer(path).save_pretrained(str(out_dir))
        return
    if TOKENIZER_MAPPING_NAMES.get(model_type):
        tokenizer = AutoTokenizer.from_pretrained(folder, tokenizer_type=model_type, **kwargs)
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, **kwargs)
    tokenizer.save_pretrained(str(out_dir))


def _own_tokenizer(path: Path):
    """An OWN_ARCHITECTURES file's tokenizer and chat template, through transformers' GGUF
    tokenizer converter (which reads any architecture's tokenizer keys)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    template = _fields(path, ("tokenizer.chat_template",)).get("tokenizer.chat_template")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **(tokenizer_config | extra))
    if template:
        tokenizer.chat_template = template
    return tokenizer


def open_reader(path: Path):
    """The file (a gguf.GGUFReader), parsed once for a pull: parsing its metadata takes seconds
    (the vocabulary and merges are 100,000 strings and more), and the config, the tokenizer, its
    template and the tensors all read it (the last reader kept, for the same unchanged file)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if _last_reader.get("key") != key:
        _last_reader.update(key=key, reader=_reader_class()(path))
    return _last_reader["reader"]


_last_reader: dict[str, Any] = {}
_patch_lock = threading.Lock()


@functools.cache
def _reader_class() -> type:
    """gguf.GGUFReader over a plain array of the mapped file instead of its np.memmap: every
    field and string it parses is a view of that array, and a memmap's views run Python code
    each (np.memmap.__array_finalize__), 2 of 4.3 s for smollm2-135m's file. The same bytes,
    fields and tensors: 1.5 s against 4.3, and 7.5 s against 29 for Gemma's vocabulary of
    262,144 [Intel(R) Xeon(R) Processor, AVX-512 BF16 yes, AMX yes]."""
    import gguf
    import numpy as np

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._array

        @data.setter
        def data(self, mapped):
            self._array = mapped.view(np.ndarray)  # its base keeps the mapping open

    return Reader


@contextmanager
def _transformers_reads_ours(path: Path) -> Iterator[None]:
    """transformers' GGUF config loader parses the whole file itself (a gguf.GGUFReader of its
    own: a second parse a pull, 4.3 s for smollm2-135m's file, 29 s for a Gemma vocabulary's);
    meanwhile the reader it builds for this file is open_reader's. Other files get gguf's own.
    (Its tokenizer loader reads only the arrays it needs, with a reader of its own: 0.4 s.)"""
    import gguf

    target = path.resolve()
    real = gguf.GGUFReader

    def reader(file, *args, **kwargs):
        if not args and not kwargs and Path(file).resolve() == target:
            return open_reader(target)
        return real(file, *args, **kwargs)

    with _patch_lock:
        gguf.GGUFReader = reader
        try:
            yield
        finally:
            gguf.GGUFReader = real


def count_tensors(reader) -> int:
    """How many tensors iter_tensors yields: a stacked expert tensor is one per expert."""
    count = 0
    for t in reader.tensors:
        m = _LAYER_RE.fullmatch(t.name)
        count += (int(t.shape[-1]) if m and m.group(2) in _EXPERTS
                  else t.name not in ROPE_FACTORS)
    return count


def iter_tensors(reader, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every tensor in the file (open_reader)."""
    import gguf
    import numpy as np
    import torch

    model_type = config["model_type"]
    permute_qk = model_type in PERMUTED_QK
    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads") or num_heads
    for t in reader.tensors:
        if t.name in ROPE_FACTORS:  # in the config (_phi3)
            continue
        m = _LAYER_RE.fullmatch(t.name)
        if m and m.group(2) in _EXPERTS:
            stacked = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type),
                                                dtype=np.float32))
            stacked = stacked.reshape(tuple(int(d) for d in reversed(t.shape)))
            for e, w in enumerate(stacked):
                yield (f"model.layers.{m.group(1)}.mlp.experts.{e}."
                       f"{_EXPERTS[m.group(2)]}.{m.group(3)}", w.clone())
            continue
        name = hf_name(t.name, model_type)
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dims fastest-first; numpy's shape is HF's [out, in].
        shape = tuple(int(d) for d in reversed(t.shape))
        w = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)  # owned copy
        if permute_qk and name.endswith("q_proj.weight"):
            w = unpermute(w, num_heads)
        elif permute_qk and name.endswith("k_proj.weight"):
            w = unpermute(w, num_kv_heads)
        elif model_type == "gemma3" and name.endswith("norm.weight"):
            w -= 1.0  # the converter stores Gemma's (1 + w); the model adds the 1 itself
        yield name, w
