"""Rotary position embedding: the frequencies of each scaling the families use (linear, Llama 3,
YaRN, longrope), the model's fp32 cos/sin tables, partial rotary and position-scaled queries.

The tables are [max_pos, head_dim], applied as x * cos + rotate_half(x) * sin over the whole
head (layer_ops.rope_store and the PyTorch path alike). Partial rotary (Phi-4-mini) rotates
only the first `rotary_dim` dims of each head, pairing dim i with i + rotary_dim / 2. That is
the whole-head rotation of another order of the head's dims: the rotated halves at 0 and
head_dim / 2, the passed-through halves after each, those with cos 1 and sin 0 (exact: x * 1 +
y * 0 is x). So the q and k projections' rows are put in that order when the model is built
(`arrange_rows`); q . k is unchanged by ordering both alike, and the cache holds the keys in
that order.

Longrope (Phi-3-128k, Phi-4-mini) has short and long factors; transformers switches to the long
ones for a whole sequence once it is longer than the original context. Here the choice is the
served context's, fixed when the engine starts (as llama.cpp decides by its context size): up
to the original context the short factors, beyond it the long ones. A sequence's numbers so
never depend on its own length or on what it shares a step with.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from server.models.config import ModelConfig


def frequencies(config: ModelConfig, local: bool = False, context: int | None = None
                ) -> tuple[torch.Tensor, float]:
    """([rotary_dim // 2] inverse frequencies, the factor cos and sin are scaled by).
    `local`: windowed layers' own base, unscaled (Gemma 3); `context`: the served context
    (longrope's choice of factors; default the model's)."""
    d = config.rotary_dim or config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d
    inv_freq = 1.0 / (theta ** exponents)
    scaling = None if local else config.rope_scaling
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    if kind == "yarn":
        return _yarn(theta, d, factor, original, scaling)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = (context or config.max_position_embeddings) > original
    ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    return 1.0 / (ext * theta ** exponents), float(attention)


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, d: int, factor: float, original: int, scaling: dict[str, Any]
          ) -> tuple[torch.Tensor, float]:
    """YaRN: low frequencies interpolated by `factor`, high ones kept, a linear ramp between
    (by rotations over the original context, beta_fast..beta_slow); cos and sin scaled."""
    attention = scaling.get("attention_factor")
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2).float() / d)
    keep = 1 - ramp  # the extrapolated (unscaled) share of each frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


def tables(config: ModelConfig, local: bool = False, context: int | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (cos, sin) [max_pos, head_dim], in the dims' order `arrange_rows` gives."""
    inv_freq, attention = frequencies(config, local, context)
    half = config.head_dim // 2
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = torch.zeros(positions.numel(), half)
    freqs[:, :inv_freq.numel()] = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention != 1.0:  # the rotated dims only
        rotated = torch.zeros(half, dtype=torch.bool)
        rotated[:inv_freq.numel()] = True
        rotated = torch.cat((rotated, rotated))
        cos[:, rotated] *= attention
        sin[:, rotated] *= attention
    return cos, sin


def dim_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Partial rotary's order of a head's dims: the rotated first half, the passed-through
    first half, the rotated second half, the passed-through second half."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(0, r), torch.arange(2 * r, 2 * r + p),
                      torch.arange(r, 2 * r), torch.arange(2 * r + p, head_dim)])


def arrange_rows(config: ModelConfig, state: dict[str, torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
    """The q and k projections' rows (weights, their quantization scales, biases) and the q/k
    norms' weights in partial rotary's order; the state as it is without partial rotary."""
    if config.rotary_dim is None:
        return state
    d, hq, hkv = config.head_dim, config.num_heads, config.num_kv_heads
    order = dim_order(d, config.rotary_dim)

    def heads(n: int, first: int = 0) -> torch.Tensor:
        return (first + torch.arange(n)[:, None] * d + order[None]).flatten()

    q, k = heads(hq), heads(hkv, hq * d)
    rows = {"q_proj": q, "k_proj": heads(hkv), "q_norm": order, "k_norm": order,
            "qkv_proj": torch.cat([q, k, torch.arange((hq + hkv) * d, (hq + 2 * hkv) * d)])}
    out = dict(state)
    for name, t in state.items():
        parts = name.split(".")
        module = parts[-2] if len(parts) > 1 else ""
        if "self_attn" in parts and module in rows and t.dim() and t.shape[0] == len(
                rows[module]):
            out[name] = t.index_select(0, rows[module])
    return out


def query_scale(config: ModelConfig, positions: torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor | None:
    """[T, 1, 1] each query's scale (Ministral 3), in the compute dtype; None: unscaled."""
    if config.query_position_scale is None:
        return None
    beta, period = config.query_position_scale
    scale = 1 + beta * torch.log(1 + torch.floor(positions.float() / period))
    return scale.to(dtype)[:, None, None]
