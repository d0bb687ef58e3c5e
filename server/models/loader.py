"""Load a stored model (any bits) onto a device, checksums verified."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

import server.kernels.layer_ops as layer_ops
from server.models import model_class
from server.models.config import ModelConfig
from server.models.linear import Linear
from server.models.rope import arrange_rows
from server.quant import apply_quantization, prepare_quantized
from server.quant.int4 import Int4Linear
from server.quant.int8 import Int8Embedding
from storage.models import StoredModel


@dataclass(slots=True)
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    stored: StoredModel
    device: torch.device
    dtype: torch.dtype


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    schemes: dict,
    device: torch.device,
    dtype: torch.dtype,
    use_kernels: bool = True,
) -> nn.Module:
    """Instantiate without allocating, swap quantized modules, then assign the tensors."""
    with torch.device("meta"), _without_random_init():
        model = model_class(config.architecture)(config)
    apply_quantization(model, schemes)
    # No head in the file (a bare backbone, as embedding models are saved): the embedding is.
    tied = config.tie_word_embeddings or not any(k.startswith("lm_head.") for k in state)
    if tied:
        state = {k: v for k, v in state.items() if not k.startswith("lm_head.")}
        del model.lm_head  # re-created below from the embedding
    state = arrange_rows(config, state)  # partial rotary's order of the q/k dims (rope.py)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"weights do not match the config: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    model.to(device=device)
    cast_floating(model, dtype)
    if hasattr(model, "prepare_weights"):
        model.prepare_weights()
    if tied:
        embed = model.model.embed_tokens
        if isinstance(embed, Int8Embedding):
            model.lm_head = embed.as_linear()
        else:
            model.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
            model.lm_head.weight = embed.weight
    for module in model.modules():  # fused q/k/v and gate/up: fewer kernel calls per step
        if hasattr(module, "fuse"):
            module.fuse()
    prepare_quantized(model, use_kernels)
    if use_kernels:  # unquantized bf16 layers in the packed kernel's layout, where it serves
        for module in model.modules():
            if isinstance(module, Linear):
                module.pack(keep=tied and module is getattr(model, "lm_head", None))
    return model.eval().requires_grad_(False)


@contextlib.contextmanager
def _without_random_init() -> Iterator[None]:
    """Module constructors skip their random init: meta tensors have nothing to fill, and
    `normal_` on a meta tensor imports torch._dynamo (sympy, mpmath...): 67 MB resident."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_",
             "zeros_", "ones_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating tensors take the compute dtype, except int4 scales and zeros, which keep the
    precision they were stored in (fp16)."""
    for module in model.modules():
        keep = ("weight_scale", "weight_zero") if isinstance(module, Int4Linear) else ()
        for name, t in module.named_parameters(recurse=False):
            if t.is_floating_point() and name not in keep:
                module._parameters[name] = nn.Parameter(t.to(dtype), requires_grad=False)
        for name, t in module.named_buffers(recurse=False):
            if t is not None and t.is_floating_point() and name not in keep:
                module._buffers[name] = t.to(dtype)


def load_model(
    stored: StoredModel,
    device: torch.device,
    dtype: torch.dtype,
    verify: bool = True,
    use_kernels: bool = True,
) -> LoadedModel:
    """Load a stored model; `use_kernels=False` gives the dequantizing reference path."""
    from safetensors.torch import load_file

    if verify:
        stored.verify()
    config = ModelConfig.from_hf(stored.manifest["config"])
    state = load_file(str(stored.path / "model.safetensors"))  # mapped, not read
    model = build_model(config, state, stored.manifest["quantized"], device, dtype,
                        use_kernels)
    detach_from(model, state)
    if device.type == "cpu" and use_kernels:
        layer_ops.enabled()  # build and check layer_ops.c now (~2 s once), not on a request
    return LoadedModel(model, config, stored, device, dtype)


def detach_from(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy the tensors the model kept as loaded (the int8 embedding and int8 weights, bf16
    ones on a bf16 device, kernel scales) out of the mapped file, so the mapping goes with
    `state`. Kept, it would hold the whole file resident, pages of converted tensors included:
    63 MB of the int4 smollm2-135m file at fp32, 90 MB at bf16, measured. Shared tensors (a tied
    head) stay shared."""
    mapped = {t.untyped_storage().data_ptr() for t in state.values() if t.device.type == "cpu"}
    copies: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or t.untyped_storage().data_ptr() not in mapped:
                    continue
                if id(t) not in copies:
                    c = t.detach().clone()
                    copies[id(t)] = nn.Parameter(c, requires_grad=False) if isinstance(
                        t, nn.Parameter) else c
                table[name] = copies[id(t)]
        # What prepare() derived and keeps as plain attributes (kernel layouts and scales) may
        # be the loaded tensor itself: `.bfloat16()` of a bf16 tensor is that tensor.
        for name, t in list(vars(module).items()):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in mapped:
                if id(t) not in copies:
                    copies[id(t)] = t.detach().clone()
                setattr(module, name, copies[id(t)])
