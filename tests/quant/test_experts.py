"""experts.c: a mixture of experts' int4 experts in one call a layer, against SparseMoE's
modules on every kernel kind this CPU runs; a token's row the same bits alone or among others;
each chosen expert's weights read once a call, the others not at all."""

from __future__ import annotations

import ctypes

import pytest
import torch

import server.kernels.cpu_gemm as cpu_gemm
import server.kernels.experts as experts_c
from server.models.config import ModelConfig
from server.models.loader import build_model
from server.models.moe import SparseMoE
from server.quant import quantize_state_dict
from tests.engine.test_invariance import SMOLLM2_135M, random_state

CPU = torch.device("cpu")
SHAPE = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
             vocab_size=256, intermediate_size=128)
ARCHS = {
    "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      num_experts=12, num_experts_per_tok=4, moe_intermediate_size=96,
                      norm_topk_prob=True),
    "gpt-oss": dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                    num_local_experts=12, num_experts_per_tok=4, intermediate_size=96,
                    sliding_window=64, layer_types=["full_attention"]),
}


def moe_layer(arch: str, bits: int, dtype: torch.dtype) -> SparseMoE:
    config = ModelConfig.from_hf(SMOLLM2_135M | SHAPE | ARCHS[arch])
    state, schemes = quantize_state_dict(random_state(config), bits)
    layer = build_model(config, state, schemes, CPU, dtype).model.layers[0].mlp
    assert isinstance(layer, SparseMoE)
    return layer


def test_built_and_checked_here():
    # The project's machines and CI have a C compiler and one of our int4 kernels.
    assert experts_c._lib() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_the_experts_in_one_call_agree_with_the_modules(arch, dtype, kernel_kind, monkeypatch):
    """The layer through experts.c against SparseMoE's own modules (the same int4 kernel per
    expert, PyTorch's operators around it, rounded where they round): in bf16 the same bits but
    where the C library's exp and PyTorch's differ in the last place (none here, on Zen 4), in
    fp32 within those last places; each token's row the same bits alone as among others."""
    layer = moe_layer(arch, 4, dtype)
    assert layer.kernel() is not None
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = layer(x)
    rows = [layer(x[i:i + 1]) for i in range(x.shape[0])]
    assert all(torch.equal(got[i:i + 1], row) for i, row in enumerate(rows))
    monkeypatch.setattr(experts_c, "_lib", lambda: None)  # the modules, one expert a call
    assert layer.kernel() is None
    want = layer(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * want.float().std())
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() >= 0.99
    assert not torch.equal(got, torch.zeros_like(got))


def test_each_chosen_expert_is_read_once_and_no_other(kernel_kind):
    """The int4 kernel is called twice per chosen expert (gate|up, then down) over exactly the
    rows that chose it, in expert order, and never for an expert no token chose."""
    g = torch.Generator().manual_seed(0)
    num, h, inter, group = 8, 64, 96, 32
    packed, _ = experts_c._random_experts(num, h, inter, group, g)
    kernel = experts_c.ExpertKernel([p[0] for p in packed], [p[1] for p in packed],
                                    [None] * num, [None] * num, h, inter, group, "silu")
    lib, gemm = experts_c._lib(), cpu_gemm.checked()
    calls = []
    signature = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * 4, *[ctypes.c_int64] * 5)
    real = signature(ctypes.cast(gemm.int4_gemm, ctypes.c_void_p).value)

    @signature
    def counted(x, w, y, xsum, m, n, k, grp, int8_from):
        calls.append((w, m, n, k))
        return real(x, w, y, xsum, m, n, k, grp, int8_from)

    experts = torch.tensor([[3, 0], [3, 5], [0, 3], [6, 3]])  # 1, 2, 4 and 7: none
    x = torch.randn(4, h, generator=g).bfloat16()
    weights = torch.full((4, 2), 0.5, dtype=torch.bfloat16)
    pointer = ctypes.cast(counted, ctypes.c_void_p).value
    got = kernel.run(lib, pointer, True, x, experts, weights)
    want = kernel(x, experts, weights)
    assert got is not None and torch.equal(got, want)
    expected = []
    for e, rows in ((0, 2), (3, 4), (5, 1), (6, 1)):
        expected += [(packed[e][0].data_ptr(), rows, 2 * inter, h),
                     (packed[e][1].data_ptr(), rows, h, inter)]
    assert calls == expected


def test_experts_it_does_not_take_run_as_modules():
    """int8 experts (bits 8) are not in the int4 layout: the modules run them."""
    layer = moe_layer("qwen3-moe", 8, torch.float32)
    assert layer.kernel() is None
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    assert layer(x).shape == (5, 64)


def test_a_token_routed_outside_the_experts_is_refused():
    """An expert id out of range (a corrupt router) gets None from the kernel, not a read
    outside its tables."""
    g = torch.Generator().manual_seed(0)
    packed, _ = experts_c._random_experts(4, 64, 96, 32, g)
    kernel = experts_c.ExpertKernel([p[0] for p in packed], [p[1] for p in packed],
                                    [None] * 4, [None] * 4, 64, 96, 32, "silu")
    x = torch.randn(2, 64, generator=g).bfloat16()
    weights = torch.full((2, 2), 0.5, dtype=torch.bfloat16)
    assert kernel(x, torch.tensor([[0, 1], [2, 4]]), weights) is None
    assert kernel(x, torch.tensor([[0, 1], [2, -1]]), weights) is None
    assert kernel(x, torch.tensor([[0, 1], [2, 3]]), weights) is not None
