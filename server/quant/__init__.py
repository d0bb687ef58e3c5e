"""Weight-only quantization: pure quantize/pack functions and the modules that swap in.

Policy (measured, see README "Quantization"): every projection inside the decoder layers is
stored at the requested bits; the token embedding (and the LM head, tied or not) is stored at
int8 in both quantized modes; norms and biases stay bf16. A layer whose in_features is not a
multiple of the int4 group size falls back to int8.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from server.quant.int4 import Int4Linear, pack_int4, quantize_int4
from server.quant.int8 import Int8Embedding, Int8Linear, quantize_int8

DEFAULT_GROUP_SIZE = 32  # measured: g32 +0.07% bits per byte on smollm2-135m, g64 +11.6%
EMBEDDING_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def quantize_state_dict(
    state: dict[str, torch.Tensor],
    bits: int,
    group_size: int = DEFAULT_GROUP_SIZE,
    embedding_bits: int = 8,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Quantize a Hugging Face-named state dict; returns (tensors, {weight name: scheme})."""
    if bits not in (4, 8, 16) or embedding_bits not in (8, 16):
        raise ValueError(f"bits must be 4, 8 or 16 (embeddings 8 or 16), not {bits}")
    out: dict[str, torch.Tensor] = {}
    schemes: dict[str, dict[str, Any]] = {}
    for name, w in state.items():
        want = bits if is_projection(name) else (embedding_bits if name in EMBEDDING_NAMES else 16)
        if bits == 16 or want == 16:
            out[name] = w.to(torch.bfloat16) if w.is_floating_point() else w
            continue
        if want == 4 and w.shape[1] % group_size == 0:
            q, scale, zero = quantize_int4(w, group_size)
            out[name] = pack_int4(q)
            out[name + "_scale"], out[name + "_zero"] = scale, zero
            schemes[name] = {"bits": 4, "group_size": group_size}
        else:
            q, scale = quantize_int8(w)
            out[name], out[name + "_scale"] = q, scale.to(torch.bfloat16)
            schemes[name] = {"bits": 8}
    return out, schemes


def apply_quantization(model: nn.Module, schemes: dict[str, dict[str, Any]]) -> None:
    """Swap the modules named in `schemes` for their quantized versions (same shapes)."""
    for name, scheme in schemes.items():
        path = name.removesuffix(".weight")
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        if isinstance(old, nn.Embedding):
            new: nn.Module = Int8Embedding(old.num_embeddings, old.embedding_dim)
        elif scheme["bits"] == 4:
            new = Int4Linear(
                old.in_features, old.out_features, scheme["group_size"], old.bias is not None
            )
        else:
            new = Int8Linear(old.in_features, old.out_features, old.bias is not None)
        setattr(parent, attr, new)


def prepare_quantized(model: nn.Module, use_kernels: bool = True) -> None:
    """Let each quantized module pick its kernel for its final device. A tied embedding whose
    LM head moved to our kernels' layout (cpu_gemm.py) then reads its rows from that layout:
    one copy."""
    from server.kernels.cpu_gemm import int8_outputs_from

    embeddings = {id(m.weight): m for m in model.modules() if isinstance(m, Int8Embedding)}
    for name, module in model.named_modules():
        if isinstance(module, Int4Linear):
            module.int8_from = int8_outputs_from(name, module.out_features, module.group_size)
        if isinstance(module, Int4Linear | Int8Linear):
            tied = embeddings.get(id(module.weight)) if isinstance(module, Int8Linear) else None
            module.prepare(use_kernels)
            if tied is not None and module.q8 is not None:
                tied.read_from(module.q8)


def cpu_kernels(model: nn.Module) -> str | None:
    """What a CPU model's quantized layers run (after prepare_quantized), said once at load:
    our kernels (their source), or PyTorch's where ours did not build. None: none quantized."""
    from server.kernels.cpu_gemm import source_in_use

    layers = [m for m in model.modules() if isinstance(m, Int4Linear | Int8Linear)]
    if not layers:
        return None
    ours = sum((m.q4x32 if isinstance(m, Int4Linear) else m.q8) is not None for m in layers)
    if ours == len(layers):
        return f"{source_in_use()} for all {ours} int4/int8 layers"
    return f"PyTorch's kernels for {len(layers) - ours} of {len(layers)} int4/int8 layers"


def fuse_linears(mods: list[nn.Module]) -> nn.Module | None:
    """One module computing all of `mods` (same input, outputs concatenated): one kernel call
    instead of several. None when they differ in kind. Call before prepare_quantized."""
    first = mods[0]
    kind = type(first)
    if any(type(m) is not kind or m.in_features != first.in_features for m in mods):
        return None
    if kind is Int4Linear and any(m.group_size != first.group_size for m in mods):
        return None
    if not issubclass(kind, nn.Linear | Int8Linear | Int4Linear):
        return None
    has_bias = first.bias is not None
    if any((m.bias is not None) != has_bias for m in mods):
        return None
    out_features = sum(m.out_features for m in mods)
    if issubclass(kind, nn.Linear):  # the model's dense Linear (server/models/linear.py)
        fused: nn.Module = kind(first.in_features, out_features, bias=has_bias,
                                     device=first.weight.device, dtype=first.weight.dtype)
    elif kind is Int8Linear:
        fused = Int8Linear(first.in_features, out_features, has_bias)
    else:
        fused = Int4Linear(first.in_features, out_features, first.group_size, has_bias)
    with torch.no_grad():
        for name, _ in list(first.named_parameters(recurse=False)) + list(
                first.named_buffers(recurse=False)):
            value = torch.cat([getattr(m, name) for m in mods], dim=0)
            if isinstance(getattr(first, name), nn.Parameter):
                setattr(fused, name, nn.Parameter(value, requires_grad=False))
            else:
                setattr(fused, name, value)
    return fused
