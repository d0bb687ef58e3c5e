"""ModelConfig: the one place that reads a Hugging Face config."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# Architecture name -> family flags. Llama is the base; Qwen2 adds q/k/v biases, Qwen3 adds
# per-head RMSNorm on q and k; Granite scales the embeddings, the attention, the residual
# branches and the logits by its config's multipliers; SmolLM3 leaves rotary out of some layers
# (`no_rope_layers`); Mistral is Llama with a sliding window; Phi-3 stores its projections
# fused, Phi-4-mini rotates part of each head (partial rotary) with longrope; Gemma 3 (below).
# The rest of what differs is read from the config (from_hf).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    # Qwen3-MoE: Qwen3's attention; its MLPs a mixture of experts (top-k of num_experts, the
    # weights renormalized where norm_topk_prob), but the layers mlp_only_layers names
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True},
    # gpt-oss: every MLP a mixture (a router with a bias, the softmax over the top k logits;
    # experts with biases and a clamped SwiGLU), attention with biases and a learned sink per
    # head, windowed and global layers, YaRN
    "GptOssForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "GraniteForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "SmolLM3ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    # Ministral 8B: windowed layers as layer_types say; Ministral 3 (and Mistral Small 3.x's
    # text model): YaRN rope and a query scale that grows with the position
    "MinistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Ministral3ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    # Phi-3: q/k/v and gate/up stored fused (qkv_proj, gate_up_proj), as the model holds them
    "Phi3ForCausalLM": {"qkv_bias": False, "qk_norm": False, "fused": True},
    # Gemma 3's text models: (1 + w) RMSNorms, q/k norm, a norm before and after each block,
    # GeGLU, scaled embeddings, local (windowed) and global layers with their own rope bases
    "Gemma3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    # Gemma 2: as Gemma 3 without q/k norms or a local rope base, its attention scores
    # soft-capped
    "Gemma2ForCausalLM": {"qkv_bias": False, "qk_norm": False},
    # The bare backbones (no LM head): how embedding checkpoints are often saved.
    "LlamaModel": {"qkv_bias": False, "qk_norm": False},
    "Qwen2Model": {"qkv_bias": True, "qk_norm": False},
    "Qwen3Model": {"qkv_bias": False, "qk_norm": True},
}


class UnsupportedModelError(ValueError):
    """The model's architecture or one of its settings is not implemented here."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes and hyper-parameters of a decoder-only transformer of the Llama family."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    o_bias: bool = False  # the attention output projection has a bias (attention_bias)
    # Per layer, whether it applies the rotary embedding (SmolLM3's no_rope_layers); () all do.
    rope_layers: tuple[bool, ...] = ()
    attention_scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    embedding_multiplier: float = 1.0  # Granite: the embeddings times this
    residual_multiplier: float = 1.0  # Granite: each residual branch times this
    logits_scaling: float = 1.0  # Granite: the logits divided by this
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj in the checkpoint
    # The attention window of windowed layers (Mistral, Phi-3, ...): a query attends over its
    # last `sliding_window` positions; which layers: window_layers (() all, if it is set).
    sliding_window: int | None = None
    window_layers: tuple[bool, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3: windowed layers' own rope base
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + weight)
    sandwich_norms: bool = False  # Gemma: a norm after attention and after the MLP too
    activation: str = "silu"  # the gated MLP's: silu, or gelu_pytorch_tanh (GeGLU)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # Gemma 2: attention scores so capped too
    # Partial rotary (Phi-4-mini): the first rotary_dim dims of each head rotate, the rest pass
    # through; None: all of them.
    rotary_dim: int | None = None
    # Ministral 3: queries times 1 + beta * log(1 + floor(position / period)), after rotary
    # (transformers' llama_4_scaling_beta); None: unscaled.
    query_position_scale: tuple[float, int] | None = None
    # Mixture of experts (Qwen3-MoE): per layer, whether its MLP is one (() none is)
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # gpt-oss: its experts' kind (silu: Qwen's; clamped: SwiGLU clamped at swiglu_limit, with
    # biases, the router's softmax over the top k) and its attention's sink logits
    expert_kind: str = "silu"
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict (transformers 4.x or 5.x layout)."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            name = archs[0] if archs else hf.get("model_type", "unknown")
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise UnsupportedModelError(
                f"unsupported architecture {name!r} (supported: {supported})"
            )
        flags = SUPPORTED_ARCHITECTURES[arch]
        rope_theta, rope_scaling, local_theta, partial = _rope(hf)
        beta = (rope_scaling or {}).pop("llama_4_scaling_beta", None)
        window = _sliding_window(hf)
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        qkv_bias = flags["qkv_bias"] or bool(hf.get("attention_bias", False))
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rotary_dim = _rotary_dim(partial, head_dim)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=flags["qk_norm"],
            rope_scaling=rope_scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            o_bias=bool(hf.get("attention_bias", False)),
            rope_layers=_rope_layers(hf),
            fused_projections=flags.get("fused", False),
            sliding_window=window,
            window_layers=_window_layers(hf) if window else (),
            local_rope_theta=local_theta,
            rotary_dim=rotary_dim,
            query_position_scale=None if beta is None else (
                float(beta), int(rope_scaling["original_max_position_embeddings"])),
            **(_granite(hf) if arch == "GraniteForCausalLM" else {}),
            **(_moe(hf) | (_gpt_oss(hf) if arch == "GptOssForCausalLM" else {})
               if arch in ("Qwen3MoeForCausalLM", "GptOssForCausalLM") else {}),
            **(_gemma(hf, head_dim) if arch.startswith("Gemma") else {}),
        )

    @property
    def scale(self) -> float:
        """The attention softmax's scale."""
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def layer_window(self, layer: int) -> int | None:
        """The attention window of `layer`, None where it attends over everything before."""
        if self.sliding_window is None or (self.window_layers and not self.window_layers[layer]):
            return None
        return self.sliding_window

    def is_moe(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    def uses_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    @property
    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.o_bias:
            attn += h
        norms = (4 if self.sandwich_norms else 2) * h + (2 * d if self.qk_norm else 0)
        layer = attn + norms
        num_moe = sum(self.moe_layers)
        mlps = (self.num_layers - num_moe) * 3 * h * i + num_moe * self.num_experts * (
            3 * h * self.moe_intermediate_size + h)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + mlps + embed + h

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """(rope base, scaling settings or None, windowed layers' own base or None, the part of
    each head that rotates).
    transformers 5 nests rope settings in rope_parameters (Gemma 3: one per layer type); 4.x
    used rope_theta / rope_scaling (Gemma 3's local base: rope_local_base_freq)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local_theta = hf.get("rope_local_base_freq")
    if "full_attention" in rope:
        local_theta = (rope.get("sliding_attention") or {}).get("rope_theta", local_theta)
        rope = dict(rope["full_attention"])
    rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear", "yarn", "longrope"):
        raise UnsupportedModelError(f"unsupported rope scaling {rope_type!r}")
    if rope_type in ("yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings",
                        hf.get("original_max_position_embeddings"))
        if rope["original_max_position_embeddings"] is None:
            raise UnsupportedModelError(f"{rope_type} rope scaling without "
                                        "original_max_position_embeddings")
    rope.pop("type", None)
    partial = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    scaling = rope | {"rope_type": rope_type}
    if rope_type == "default" and "llama_4_scaling_beta" not in rope:
        scaling = None
    return rope_theta, scaling, None if local_theta is None else float(local_theta), partial


def _rotary_dim(factor: float, head_dim: int) -> int | None:
    """The dims of each head that rotate (partial_rotary_factor), None where all do."""
    if factor == 1.0:
        return None
    dim = int(head_dim * factor)
    if dim <= 0 or dim % 2 or (head_dim - dim) % 2:
        raise UnsupportedModelError(f"partial rotary embedding over {dim} of {head_dim} dims "
                                    "is not supported (both parts must be even)")
    return dim


def _gemma(hf: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Gemma's settings: how its norms, embeddings, MLP, attention scale, attention scores
    (Gemma 2) and logits differ."""
    cap, attn_cap = hf.get("final_logit_softcapping"), hf.get("attn_logit_softcapping")
    activation = hf.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"unsupported activation {activation!r}")
    return {"norm_offset": 1.0, "sandwich_norms": True,
            "activation": activation,
            "embedding_multiplier": float(hf["hidden_size"]) ** 0.5,
            "attention_scale": float(hf.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            "final_logit_softcapping": None if cap is None else float(cap),
            "attn_logit_softcapping": None if attn_cap is None else float(attn_cap)}


def _sliding_window(hf: dict[str, Any]) -> int | None:
    """The window of the config's windowed layers, None where no layer is windowed: Mistral's
    and Phi-3's `sliding_window` covers every layer; where the config names `layer_types` or
    `use_sliding_window` (Qwen2/3, SmolLM3), only as they say."""
    window = hf.get("sliding_window")
    if not window:
        return None
    types = hf.get("layer_types")
    if types is not None:
        return window if "sliding_attention" in types else None
    if "use_sliding_window" in hf:
        return window if hf["use_sliding_window"] else None
    return int(window)


def _window_layers(hf: dict[str, Any]) -> tuple[bool, ...]:
    """Per layer, whether it is windowed (`layer_types`); () where every layer is."""
    types = hf.get("layer_types")
    if types is None:
        return ()
    if len(types) != hf["num_hidden_layers"]:
        raise UnsupportedModelError(f"layer_types must name each of the {hf['num_hidden_layers']}"
                                    f" layers, got {len(types)}")
    return tuple(kind == "sliding_attention" for kind in types)


def _rope_layers(hf: dict[str, Any]) -> tuple[bool, ...]:
    """SmolLM3's `no_rope_layers` (1: the layer applies rotary, 0: it does not), checked
    against the layer count; () where every layer does."""
    flags = hf.get("no_rope_layers")
    if not flags:
        return ()
    if len(flags) != hf["num_hidden_layers"] or any(f not in (0, 1) for f in flags):
        raise UnsupportedModelError(f"no_rope_layers must hold a 0 or 1 per layer, got {flags}")
    return tuple(bool(f) for f in flags)


def _moe(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's experts: which layers (every decoder_sparse_step-th, but mlp_only_layers),
    how many, how many a token, their width."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or ())
    layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                   for i in range(hf["num_hidden_layers"]))
    if experts and not hf.get("num_experts_per_tok"):
        raise UnsupportedModelError("a mixture of experts without num_experts_per_tok")
    return {"moe_layers": layers if any(layers) else (), "num_experts": experts,
            "num_experts_per_tok": int(hf.get("num_experts_per_tok") or 0),
            "moe_intermediate_size": int(hf.get("moe_intermediate_size") or 0),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


def _gpt_oss(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: every layer a mixture of experts as wide as intermediate_size, clamped."""
    return {"moe_layers": (True,) * hf["num_hidden_layers"],
            "moe_intermediate_size": int(hf["intermediate_size"]), "expert_kind": "clamped",
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)), "attention_sinks": True}


def _granite(hf: dict[str, Any]) -> dict[str, float]:
    """Granite's multipliers (transformers' defaults where the config leaves one out)."""
    return {"attention_scale": float(hf.get("attention_multiplier", 1.0)),
            "embedding_multiplier": float(hf.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(hf.get("residual_multiplier", 1.0)),
            "logits_scaling": float(hf.get("logits_scaling", 1.0))}
