"""Pure quantize/pack functions: exact round trips and error bounds."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from server.kernels.loader import cpu_flags, cpu_vendor
from server.quant import apply_quantization, quantize_state_dict
from server.quant.int4 import (
    Int4Linear,
    cuda_inner_k_tiles,
    dequantize_int4,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from server.quant.int8 import Int8Embedding, Int8Linear, dequantize_int8, quantize_int8
from server.quant.rows import tiled_linear
from tests.quant.conftest import FLAGS, KERNEL_KINDS


def test_pack_unpack_int4_round_trip():
    q = torch.randint(0, 16, (6, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (6, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)


def test_pack_int4_layout():
    # Even column in the low nibble, odd column in the high nibble: [1, 2] -> 0x21.
    assert pack_int4(torch.tensor([[1, 2, 15, 0]])).tolist() == [[0x21, 0x0F]]


def test_int4_error_at_most_half_a_step():
    w = torch.randn(32, 128) * 0.1
    q, scale, zero = quantize_int4(w, 32)
    assert scale.shape == zero.shape == (32, 4) and q.max() <= 15
    err = (dequantize_int4(q, scale, zero, 32) - w).abs().reshape(32, 4, 32)
    # Rounding to the nearest of 16 levels spaced `scale` apart; bf16 scale/zero add a hair.
    assert (err <= scale.float()[..., None] * 0.5 + 1e-3).all()


def test_int4_exact_on_representable_values():
    scale, zero = 0.25, 1.0  # levels: (q - 8) * 0.25 + 1.0 for q in 0..15 -> -1.0 .. 2.75
    q = torch.arange(16).repeat(4, 4)  # [4, 64]: every level in every group of 32
    w = (q - 8) * scale + zero
    q2, s2, z2 = quantize_int4(w.float(), 32)
    assert torch.equal(dequantize_int4(q2, s2, z2, 32), w.float())


def test_int4_rejects_bad_group():
    with pytest.raises(ValueError, match="multiple of group size"):
        quantize_int4(torch.randn(4, 48), 32)


def test_cuda_int4_kernel_takes_the_shapes_it_can():
    """Which weights CUDA's tinygemm takes (K tiles packed to a word); the rest dequantize per
    call. Checked here without a GPU: a wrong count fails there only at load."""
    assert cuda_inner_k_tiles(1536, 576, 32) == 4  # smollm2-135m's q/gate/up projections
    assert cuda_inner_k_tiles(576, 1536, 32) == 8  # its down projection
    assert cuda_inner_k_tiles(8, 96, 32) == 2
    assert cuda_inner_k_tiles(12, 576, 32) is None  # N not whole tiles of 8
    assert cuda_inner_k_tiles(8, 40, 32) is None
    assert cuda_inner_k_tiles(8, 576, 16) is None  # a group size the kernel has no code for


def test_tiled_linear_gives_a_row_the_same_bits_whatever_shares_the_call():
    """What a GPU's quantized layers without a kernel run (rows.dequantized_linear): calls of
    a fixed number of rows, so a row's numbers do not follow the batch; checked here on the CPU,
    whose GEMM libraries pick kernels by shape too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 96, generator=g)
    w, b = torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    y = tiled_linear(x, w, b)
    assert y.shape == (2, 37, 40)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)
    flat = x.reshape(-1, 96)
    for m in (1, 3, 16, 17, 74):
        assert torch.equal(tiled_linear(flat[:m], w, b), y.reshape(-1, 40)[:m])


def test_int8_round_trip_bound():
    w = torch.randn(16, 64)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (16,)
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] * 0.5 + 1e-7).all()
    # The largest magnitude in each row maps to +-127 exactly.
    assert torch.equal(q.abs().amax(dim=1), torch.full((16,), 127, dtype=torch.int8))


def test_state_dict_policy():
    state = {
        "model.embed_tokens.weight": torch.randn(100, 64),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64),
        "model.layers.0.mlp.down_proj.weight": torch.randn(64, 96),  # 96 % 64 != 0 -> int8
        "model.layers.0.input_layernorm.weight": torch.ones(64),
    }
    tensors, schemes = quantize_state_dict(state, 4, 64)
    assert schemes == {
        "model.embed_tokens.weight": {"bits": 8},
        "model.layers.0.self_attn.q_proj.weight": {"bits": 4, "group_size": 64},
        "model.layers.0.mlp.down_proj.weight": {"bits": 8},
    }
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (64, 32)
    assert tensors["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16
    bf16, none = quantize_state_dict(state, 16)
    assert none == {} and all(t.dtype == torch.bfloat16 for t in bf16.values())


def test_apply_quantization_swaps_modules():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 64)
    model.proj = torch.nn.Linear(64, 32, bias=True)
    model.head = torch.nn.Linear(64, 10)
    apply_quantization(model, {"embed.weight": {"bits": 8},
                               "proj.weight": {"bits": 4, "group_size": 32},
                               "head.weight": {"bits": 8}})
    assert isinstance(model.embed, Int8Embedding)
    assert isinstance(model.proj, Int4Linear) and model.proj.bias is not None
    assert isinstance(model.head, Int8Linear)


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int4_kernel_matches_reference(rows):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    q, scale, zero = quantize_int4(w, 64)
    layer = Int4Linear(128, 96, 64)
    layer.weight, layer.weight_scale, layer.weight_zero = pack_int4(q), scale, zero
    x = torch.randn(rows, 128)
    layer.prepare(use_kernel=False)
    ref = layer(x)
    torch.testing.assert_close(ref, x @ dequantize_int4(q, scale, zero, 64).t())
    layer.prepare(use_kernel=True)
    got = layer(x)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()


def test_our_kernels_serve_every_cpu_with_avx2_or_avx512_bf16():
    """With a C compiler (the project's machines and CI have one) the kernels of the CPU's kind
    are built and pass their check: amx_gemm.c with AMX, avx512_gemm.c with AVX-512 BF16,
    avx2_gemm.c with AVX2 + FMA only; PyTorch's elsewhere."""
    from server.kernels import cpu_gemm

    assert cpu_gemm.kinds_for(FLAGS, cpu_vendor()) == KERNEL_KINDS
    assert cpu_gemm._kinds() == cpu_gemm.KINDS  # the CPU's, unless LOCALSERVE_CPU_KERNELS says
    assert (cpu_gemm.checked() is not None) == (cpu_gemm.KIND is not None)
    assert all(cpu_gemm.of_kind(kind) is not None for kind in KERNEL_KINDS)
    layer = Int4Linear(64, 32, 32)
    q, scale, zero = quantize_int4(torch.randn(32, 64) * 0.05, 32)
    layer.weight, layer.weight_scale, layer.weight_zero = pack_int4(q), scale, zero
    layer.prepare(use_kernel=True)
    assert (layer.q4x32 is not None) == (cpu_gemm.KIND is not None)
    assert (layer.kernel_weight is not None) != (cpu_gemm.KIND is not None)


def test_the_kernel_kind_follows_the_cpu_and_can_be_forced_to_another_it_runs(
        monkeypatch, caplog):
    from server.kernels import cpu_gemm
    from server.kernels import loader as native

    avx512 = {"avx2", "fma", "f16c", "avx512_bf16", "avx512bw", "avx512_vnni"}
    amx = avx512 | {"amx_bf16", "amx_tile"}
    assert cpu_gemm.kinds_for(amx, "GenuineIntel") == ["amx", "avx2", "avx512_bf16"]
    assert cpu_gemm.kinds_for(amx, "") == ["amx", "avx512_bf16", "avx2"]
    for vendor in ("GenuineIntel", "AuthenticAMD", ""):
        assert cpu_gemm.kinds_for({"avx2", "fma", "f16c"}, vendor) == ["avx2"]
        assert cpu_gemm.kinds_for({"avx", "sse4_2"}, vendor) == []
    # AVX-512 BF16 without AMX: avx2_gemm.c's VNNI path first on Intel, avx512_gemm.c on AMD
    assert cpu_gemm.kinds_for(avx512, "GenuineIntel") == ["avx2", "avx512_bf16"]
    assert cpu_gemm.kinds_for(avx512, "AuthenticAMD") == ["avx512_bf16", "avx2"]
    assert cpu_gemm.kinds_for(avx512 - {"avx512_vnni"}, "GenuineIntel") == [
        "avx512_bf16", "avx2"]
    monkeypatch.setattr(native, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(native, "cpu_flags", lambda: avx512)
    for asked, kinds in (("", ["avx512_bf16", "avx2"]), ("avx2", ["avx2"]), ("torch", [])):
        monkeypatch.setenv("LOCALSERVE_CPU_KERNELS", asked)
        assert cpu_gemm._kinds() == kinds
    monkeypatch.setattr(native, "cpu_vendor", lambda: "GenuineIntel")
    for asked, kinds in (("", ["avx2", "avx512_bf16"]), ("avx512_bf16", ["avx512_bf16"])):
        monkeypatch.setenv("LOCALSERVE_CPU_KERNELS", asked)
        assert cpu_gemm._kinds() == kinds
    monkeypatch.setattr(native, "cpu_flags", lambda: amx)
    for asked, kinds in (("", ["amx", "avx2", "avx512_bf16"]),
                         ("avx512_bf16", ["avx512_bf16"]), ("avx2", ["avx2", "avx512_bf16"])):
        monkeypatch.setenv("LOCALSERVE_CPU_KERNELS", asked)
        assert cpu_gemm._kinds() == kinds
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv("LOCALSERVE_CPU_KERNELS", "avx512_bf16")
    assert cpu_gemm._kinds() == ["avx2"]  # the CPU cannot: ignored
    assert "ignored" in caplog.text


def test_a_call_of_no_rows_gives_no_rows(kernel_kind):
    """Every kind takes an empty batch (amx_gemm.c crashed: a tile of 0 rows is invalid)."""
    from server.kernels import cpu_gemm

    q = torch.randint(0, 16, (64, 64), dtype=torch.uint8)
    layout = cpu_gemm.pack_int4(q, torch.ones(64, 2).half(), torch.zeros(64, 2).half(), 32)
    q8 = cpu_gemm.pack_int8(torch.randint(-5, 5, (64, 64), dtype=torch.int8))
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    assert cpu_gemm.gemm(x, layout, 32).shape == (0, 64)
    assert cpu_gemm.gemm_int8(x, q8, torch.ones(64), out_dtype=torch.float32).shape == (0, 64)


@pytest.mark.skipif("amx" not in KERNEL_KINDS, reason="needs AMX")
def test_amx_rows_get_the_same_bits_alone_and_among_others():
    """amx_gemm.c pads rows to whole tiles and sets the tiles to a call's row count below 16: a
    row alone, in a pair or among 40 gets the same bits, for int4 (groups of 32 and 64; the
    layer's kernel and prompt rows' kernel, the latter within bf16 rounding of the exact
    products of the unpacked weight) and int8 (bf16 out and fp32 logits), activations spanning 2^-130 to 2^20 (denormals and zeros
    included)."""
    from server.kernels import cpu_gemm

    lib = cpu_gemm.of_kind("amx")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 384, generator=g) * torch.exp2(torch.randint(-130, 20, (40, 384),
                                                                       generator=g).float())
    x[3, :100] = 0
    x[7] = torch.randn(384, generator=g) * 2.0**-128  # a row of denormals and tiny values
    x = x.bfloat16()
    assert (x.float().abs() < 2.0**-126).logical_and(x != 0).any()  # denormals are in there

    def check(fn):
        batched = fn(x)
        for lo, hi in ((0, 1), (1, 3), (6, 8), (7, 8), (5, 9), (9, 13), (20, 37)):
            assert torch.equal(fn(x[lo:hi]), batched[lo:hi])

    for group in (32, 64):
        q = torch.randint(0, 16, (96, 384), generator=g, dtype=torch.uint8)
        scale = (torch.rand(96, 384 // group, generator=g) / 8).half()
        zero = (torch.randn(96, 384 // group, generator=g) / 4).half()
        layout = cpu_gemm.pack_int4(q, scale, zero, group)
        check(lambda rows, layout=layout, group=group: cpu_gemm.gemm(rows, layout, group, lib))
        # prompt rows' kernel: the unpacked bf16 weight's products, summed in fp32
        check(lambda rows, layout=layout, group=group: cpu_gemm.gemm_prompt(rows, layout, group,
                                                                            lib))
        w = cpu_gemm.unpack_t(layout, group, torch.empty(384, 96, dtype=torch.bfloat16), lib)
        xd = x.double().where(x.double().abs() >= 2.0**-126, 0)  # the tiles read denormals as 0
        for m in (1, 15, 16, 17, 32, 33, 40):
            got = cpu_gemm.gemm_prompt(x[:m], layout, group, lib).double()
            exact = xd[:m] @ w.double()
            assert ((got - exact).abs() <= 2.0**-8 * exact.abs() + 2.0**-20 * (
                xd[:m].abs() @ w.double().abs()) + 2.0**-110).all()
    q8 = cpu_gemm.pack_int8(torch.randint(-127, 128, (160, 384), generator=g, dtype=torch.int8))
    s8 = torch.rand(160, generator=g) / 100
    for dtype in (torch.bfloat16, torch.float32):
        check(lambda rows, dtype=dtype: cpu_gemm.gemm_int8(rows, q8, s8, lib, dtype))


@pytest.mark.skipif("amx" not in KERNEL_KINDS, reason="needs AMX")
def test_one_row_takes_fmas_with_the_tiles_bits():
    """amx_gemm.c's one-row calls (int8: the LM head; int4: the outputs that keep bf16 inputs,
    q/k/v) take AVX-512 FMAs in TDPBF16PS's order, each path on only where its check at load
    found the tiles' bits on this CPU (both on the Intel Xeon with AMX these were measured on),
    else the tiles: either way a one-row call equals that row of a 3-row call (tiles) bit for
    bit, logits in fp32 included."""
    from server.kernels import cpu_gemm

    lib = cpu_gemm.of_kind("amx")
    assert {lib.int8_row_path(), lib.int4_row_path()} <= {0, 1}
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(3, 576, generator=g) * 3).bfloat16()
    q = torch.randint(0, 16, (192, 576), generator=g, dtype=torch.uint8)
    scale, zero = (torch.rand(192, 18, generator=g) / 8).half(), (torch.randn(192, 18) / 4).half()
    layout = cpu_gemm.pack_int4(q, scale, zero, 32)
    three = cpu_gemm.gemm(x, layout, 32, lib)
    assert all(torch.equal(cpu_gemm.gemm(x[i:i + 1], layout, 32, lib).view(torch.int16),
                           three[i:i + 1].view(torch.int16)) for i in range(3))
    q8 = cpu_gemm.pack_int8(torch.randint(-127, 128, (4096, 576), generator=g, dtype=torch.int8))
    s8 = torch.rand(4096, generator=g) / 100
    logits = cpu_gemm.gemm_int8(x, q8, s8, lib, torch.float32)
    assert all(torch.equal(cpu_gemm.gemm_int8(x[i:i + 1], q8, s8, lib, torch.float32).view(
        torch.int32), logits[i:i + 1].view(torch.int32)) for i in range(3))


@pytest.mark.skipif(len(KERNEL_KINDS) < 2, reason="needs a CPU that runs two kinds")
def test_a_kind_whose_library_is_refused_hands_over_to_the_next(monkeypatch):
    """amx_gemm.c where the OS refuses AMX state (or any kind whose build or check fails):
    layers take the next kind down this CPU's list, not PyTorch's kernels."""
    from server.kernels import cpu_gemm

    first, second = KERNEL_KINDS[:2]
    monkeypatch.setattr(cpu_gemm, "KINDS", KERNEL_KINDS)
    monkeypatch.setattr(cpu_gemm, "_state", [])
    monkeypatch.setitem(cpu_gemm._by_kind, first, None)
    assert cpu_gemm.checked() is cpu_gemm.of_kind(second) is not None


def build_avx2_gemm(tmp_path: Path, *march: str):
    """avx2_gemm.c compiled for the given -march flags, typed, and its disassembly ("" without
    objdump)."""
    import shutil
    import subprocess

    from server.kernels import cpu_gemm

    cc = shutil.which("cc") or shutil.which("gcc")
    out = tmp_path / f"avx2_gemm{len(list(tmp_path.iterdir()))}.so"
    subprocess.run([cc, "-O3", *march, "-ffp-contract=off", "-shared", "-fPIC", "-std=c11",
                    "-fopenmp", "-o", str(out), str(cpu_gemm.SOURCES["avx2"]), "-lm"],
                   check=True, capture_output=True)
    disassembly = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True)
    return cpu_gemm.typed(ctypes.CDLL(str(out))), out, (
        disassembly.stdout if disassembly.returncode == 0 else "")


def largest_sums():
    """An int4 layer (groups of 256, every nibble 15) and rows whose every input is its group's
    largest: the int32 sums at their largest (avx2_gemm.c's high-nibble sums are 16x these, just
    under 2^31). With y = x * sum_k ((15 - 8) * scale + zero) within fp16 rounding."""
    from server.kernels import cpu_gemm

    torch.manual_seed(6)
    scale, zero = torch.rand(32, 2) / 100, torch.randn(32, 2) / 100
    layout = cpu_gemm.pack_int4(torch.full((32, 512), 15), scale, zero, 256)
    x = torch.tensor([1.0, -1.0, 3.0]).repeat_interleave(512).view(3, 512)
    return layout, x, x[:, :1].double() * 256 * (7 * scale + zero).double().sum(1)


def test_int4_sums_at_their_largest_do_not_wrap_around(kernel_kind):
    from server.kernels import cpu_gemm

    layout, x, want = largest_sums()
    computed = 0
    for dtype in (torch.float32, torch.bfloat16):
        y = cpu_gemm.gemm(x.to(dtype), layout, 256)
        if y is None:  # the kinds that take bf16 only
            assert dtype == torch.float32 and not cpu_gemm.takes_fp32(cpu_gemm.checked())
            continue
        assert torch.allclose(y.double(), want, rtol=1e-2, atol=1e-3), (dtype, y, want)
        computed += 1
    assert computed


def assert_same_bits(lib, other) -> None:
    """int4 and int8, bf16 and fp32 in and out, at every row count around the AVX2 path's
    passes (6 rows) and its AVX-VNNI split sums (up to 3), the AVX-512 VNNI path's (12) and its
    split sums (up to 6)."""
    from server.kernels import cpu_gemm

    torch.manual_seed(5)
    q, scale, zero = quantize_int4(torch.randn(96, 192) * 0.05, 64)
    layout = cpu_gemm.pack_int4(q, scale, zero, 64)
    s8 = torch.rand(64) / 100
    x = torch.randn(26, 192)
    for m in (1, 2, 3, 4, 5, 6, 7, 12, 13, 26):
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(cpu_gemm.gemm(x[:m].to(dtype), layout, 64, lib),
                               cpu_gemm.gemm(x[:m].to(dtype), layout, 64, other)), (m, dtype)
    layout, x, _ = largest_sums()
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(cpu_gemm.gemm(x.to(dtype), layout, 256, lib),
                           cpu_gemm.gemm(x.to(dtype), layout, 256, other)), dtype
    for k in (200, 202):  # x's int16 groups of 8 inputs (4 pairs), and of 2 (one pair)
        q8 = cpu_gemm.pack_int8(torch.randint(-127, 128, (64, k), dtype=torch.int8))
        x8 = torch.randn(26, k)
        for m in (1, 2, 3, 4, 5, 6, 7, 12, 13, 26):
            for dtype, out in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                               (torch.bfloat16, torch.bfloat16)):
                assert torch.equal(cpu_gemm.gemm_int8(x8[:m].to(dtype), q8, s8, lib, out),
                                   cpu_gemm.gemm_int8(x8[:m].to(dtype), q8, s8, other, out))


@pytest.mark.skipif("avx2" not in KERNEL_KINDS, reason="needs AVX2, FMA and F16C")
def test_the_avx2_kernels_build_for_haswell_and_pass_their_check(tmp_path):
    """avx2_gemm.c compiled for an AVX2-only CPU (-march=haswell: no AVX-512 registers or
    instructions) passes the same check as the library the server loads, and where that one has
    the AVX-512 VNNI path, gives its bits."""
    from server.kernels import cpu_gemm

    lib, _, disassembly = build_avx2_gemm(tmp_path, "-march=haswell")
    assert "zmm" not in disassembly and "vpdpwssd" not in disassembly
    assert lib.avx2_gemm_available() == 1
    assert cpu_gemm._self_check(lib) is None
    assert cpu_gemm.vnni_path(lib) is None
    native = cpu_gemm.of_kind("avx2")
    if cpu_gemm.wide(native):
        assert_same_bits(lib, native)


def int8_activation_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                              zero: torch.Tensor) -> torch.Tensor:
    """What avx2_gemm.c computes with int8 activations (groups of 32), in float64: each group's
    inputs rounded to X = round(x * 127 / max |x|) (in fp32, halves to even), the integer sums
    of the nibbles 0..15 times X, then per group a * scale * sum + (zero - 8 * scale) * a *
    sum(X)."""
    m, k = x.shape
    g = x.view(m, k // 32, 32)
    peak = g.abs().amax(-1, keepdim=True)
    inv = torch.where(peak > 0, 127.0 / peak, torch.zeros_like(peak))  # fp32, as the C
    big_x = torch.round(g * inv).clamp(-127, 127).double()  # [m, G, 32]
    a = (peak / 127.0).double()  # [m, G, 1]
    sums = torch.einsum("mgj,ngj->mng", big_x, q.view(-1, k // 32, 32).double())
    s, z = scale.half().double(), zero.half().double()  # [n, G], fp16 in the layout
    xs = (a * big_x.sum(-1, keepdim=True)).squeeze(-1)  # [m, G]
    return (sums * a.squeeze(-1)[:, None, :] * s[None] + xs[:, None, :] * (z - 8 * s)[None]).sum(-1)


@pytest.mark.skipif("avx2" not in KERNEL_KINDS, reason="needs AVX2, FMA and F16C")
def test_plain_avx2_takes_int8_activations_for_the_outputs_asked(tmp_path):
    """avx2_gemm.c built for Haswell: the outputs from int8_from on (a multiple of 32) of an int4
    layer of groups of 32 compute what the int8 scheme says (the reference above, to fp32
    rounding), ~0.5% from the fp32 product (over 10x int16's error); the outputs before it keep
    int16's bits; each row's numbers its own; bf16 inputs the same way. Groups of 64 keep int16,
    as do the VNNI builds, which have no such path; other int8_from values are refused."""
    from server.kernels import cpu_gemm

    lib, _, _ = build_avx2_gemm(tmp_path, "-march=haswell")
    torch.manual_seed(8)
    w = torch.randn(96, 192) * 0.05
    w[:, 7] *= 20  # an outlier input channel, as real layers have
    q, scale, zero = quantize_int4(w, 32)
    layout = cpu_gemm.pack_int4(q, scale, zero, 32)
    x = torch.randn(26, 192)
    x[:, 40] *= 30  # and an outlier activation
    assert cpu_gemm.int8_path(lib)
    exact = cpu_gemm.gemm(x, layout, 32, lib)
    assert torch.equal(exact, cpu_gemm.gemm(x, layout, 32, lib, int8_from=96))
    y = cpu_gemm.gemm(x, layout, 32, lib, int8_from=0)
    want = int8_activation_reference(x, q, scale, zero)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())
    fp32 = x.double() @ dequantize_int4(q, scale.half(), zero.half(), 32).double().t()
    err = ((y.double() - fp32).norm() / fp32.norm()).item()
    exact_err = ((exact.double() - fp32).norm() / fp32.norm()).item()
    assert 10 * exact_err < err < 2e-2, (err, exact_err)
    for start in (32, 64):
        mixed = cpu_gemm.gemm(x, layout, 32, lib, int8_from=start)
        assert torch.equal(mixed[:, :start], exact[:, :start]), start
        assert torch.equal(mixed[:, start:], y[:, start:]), start
    for m in (1, 5, 6, 7, 13, 26):
        for start in (0, 64):
            rows = cpu_gemm.gemm(x[:m], layout, 32, lib, int8_from=start)
            assert all(torch.equal(rows[i:i + 1], cpu_gemm.gemm(x[i:i + 1], layout, 32, lib,
                                                                int8_from=start))
                       for i in range(m)), (m, start)
    bf16 = cpu_gemm.gemm(x.bfloat16(), layout, 32, lib, int8_from=0)
    assert torch.allclose(bf16.double(), int8_activation_reference(x.bfloat16().float(), q,
                                                                   scale, zero),
                          rtol=1e-2, atol=1e-2 * want.abs().max())
    assert not torch.equal(bf16, cpu_gemm.gemm(x.bfloat16(), layout, 32, lib))
    for bad in (16, -32, 128):
        assert cpu_gemm.gemm(x, layout, 32, lib, int8_from=bad) is None, bad
    q64, s64, z64 = quantize_int4(w, 64)
    layout64 = cpu_gemm.pack_int4(q64, s64, z64, 64)
    assert torch.equal(cpu_gemm.gemm(x, layout64, 64, lib, int8_from=0),
                       cpu_gemm.gemm(x, layout64, 64, lib))  # groups of 64 keep int16
    vex, _, _ = build_avx2_gemm(tmp_path, "-march=haswell", "-mavxvnni")
    assert not cpu_gemm.int8_path(vex)


@pytest.mark.skipif(not {"avx512_bf16", "avx512bw", "avx512_vnni", "avx2", "fma",
                          "f16c"} <= FLAGS, reason="needs AVX-512 BF16 and VNNI")
def test_avx512_int8_activations_give_the_avx2_schemes_bits(tmp_path):
    """avx512_gemm.c's int8-activation path (vpdpbusd, passes of 6 rows) gives bit for bit what
    avx2_gemm.c's plain-AVX2 path (built for Haswell) gives for the same bf16 inputs and
    int8_from: the same int8 rounding, exact int32 sums and fp32 steps. The outputs before
    int8_from keep its bf16-activation bits; each row's numbers are its own; groups of 64 keep
    bf16 activations; other int8_from values are refused. The AMX library hands those outputs
    to this path (the same bits) and keeps its tiles' bits for the outputs before."""
    from server.kernels import cpu_gemm

    lib, haswell = cpu_gemm.of_kind("avx512_bf16"), build_avx2_gemm(tmp_path, "-march=haswell")[0]
    assert cpu_gemm.int8_path(lib) and cpu_gemm.int8_path(haswell)
    torch.manual_seed(9)
    w = torch.randn(128, 256) * 0.05
    w[:, 7] *= 20
    q, scale, zero = quantize_int4(w, 32)
    layout = cpu_gemm.pack_int4(q, scale, zero, 32)
    x = torch.randn(26, 256)
    x[:, 40] *= 30
    x = x.bfloat16()
    exact = cpu_gemm.gemm(x, layout, 32, lib)
    assert torch.equal(exact, cpu_gemm.gemm(x, layout, 32, lib, int8_from=128))
    for m in (1, 5, 6, 7, 12, 13, 26):
        for start in (0, 32, 96):
            y = cpu_gemm.gemm(x[:m], layout, 32, lib, int8_from=start)
            assert torch.equal(y[:, start:], cpu_gemm.gemm(x[:m], layout, 32, haswell,
                                                           int8_from=start)[:, start:]), (m, start)
            assert torch.equal(y[:, :start], exact[:m, :start]), (m, start)
            assert all(torch.equal(y[i:i + 1], cpu_gemm.gemm(x[i:i + 1], layout, 32, lib,
                                                              int8_from=start))
                       for i in range(m)), (m, start)
    want = int8_activation_reference(x.float(), q, scale, zero)
    y = cpu_gemm.gemm(x, layout, 32, lib, int8_from=0)
    assert torch.allclose(y.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max())
    assert not torch.equal(y, exact)
    for bad in (16, -32, 160):
        assert cpu_gemm.gemm(x, layout, 32, lib, int8_from=bad) is None, bad
    q64, s64, z64 = quantize_int4(w, 64)
    layout64 = cpu_gemm.pack_int4(q64, s64, z64, 64)
    assert torch.equal(cpu_gemm.gemm(x, layout64, 64, lib, int8_from=0),
                       cpu_gemm.gemm(x, layout64, 64, lib))
    if "amx" in KERNEL_KINDS:
        amx = cpu_gemm.of_kind("amx")
        tiles = cpu_gemm.gemm(x, layout, 32, amx)
        assert cpu_gemm.int8_path(amx)
        for start in (0, 32, 96):
            y = cpu_gemm.gemm(x, layout, 32, amx, int8_from=start)
            assert torch.equal(y[:, start:], cpu_gemm.gemm(x, layout, 32, lib,
                                                           int8_from=start)[:, start:]), start
            assert torch.equal(y[:, :start], tiles[:, :start]), start
        for bad in (16, -32, 160):
            assert cpu_gemm.gemm(x, layout, 32, amx, int8_from=bad) is None, bad


def test_which_layers_take_int8_activations(monkeypatch, caplog):
    """LOCALSERVE_ACTIVATIONS: "mixed" by default (q/k/v int16, the rest int8), "int16" or
    "int8" for all; a bad value is said once and gives the default. Groups other than 32 never
    take int8."""
    from server.kernels import cpu_gemm

    monkeypatch.delenv("LOCALSERVE_ACTIVATIONS", raising=False)
    assert cpu_gemm.activations_asked() == "mixed"
    names = ("model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj",
             "model.layers.3.mlp.gate_up_proj", "model.layers.3.mlp.up_proj",
             "model.layers.3.mlp.gate_proj", "model.layers.3.mlp.down_proj",
             "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
             "model.layers.0.self_attn.v_proj")
    starts = [cpu_gemm.int8_outputs_from(name, 96, 32) for name in names]
    assert starts == [96, 0, 0, 0, 0, 0, 96, 96, 96]
    assert cpu_gemm.int8_outputs_from("mlp.down_proj", 576, 64) == 576
    monkeypatch.setenv("LOCALSERVE_ACTIVATIONS", "int8")
    assert [cpu_gemm.int8_outputs_from(name, 96, 32) for name in names] == [0] * len(names)
    monkeypatch.setenv("LOCALSERVE_ACTIVATIONS", "int16")
    assert [cpu_gemm.int8_outputs_from(name, 96, 32) for name in names] == [96] * len(names)
    monkeypatch.setenv("LOCALSERVE_ACTIVATIONS", "fp8")
    assert cpu_gemm.activations_asked() == cpu_gemm.activations_asked() == "mixed"
    assert caplog.text.count("LOCALSERVE_ACTIVATIONS='fp8' ignored") == 1


@pytest.mark.skipif("avx2" not in KERNEL_KINDS, reason="needs AVX2, FMA and F16C")
def test_a_loaded_model_gives_each_layer_its_activations(monkeypatch, tmp_path):
    """prepare_quantized gives each int4 layer its activations (by its name), and on the plain
    AVX2 library (built for Haswell) the layer then computes that way: with "mixed" the q/k/v
    layer's outputs as with int16 everywhere, the others' as with int8 everywhere."""
    from server.kernels import cpu_gemm
    from server.models.loader import build_model
    from tests.helpers import hf_model, our_config

    lib, _, _ = build_avx2_gemm(tmp_path, "-march=haswell")
    monkeypatch.setattr(cpu_gemm, "_state", [lib])
    hf = hf_model("llama")
    state, schemes = quantize_state_dict(dict(hf.state_dict()), 4, 32)
    outputs = {}
    for asked in ("mixed", "int16", "int8"):
        monkeypatch.setenv("LOCALSERVE_ACTIVATIONS", asked)
        model = build_model(our_config(hf), dict(state), schemes, torch.device("cpu"),
                            torch.float32)
        starts = {n: m.int8_from for n, m in model.named_modules()
                  if isinstance(m, Int4Linear)}
        assert starts and all(m.q4x32 is not None for m in model.modules()
                              if isinstance(m, Int4Linear))
        outputs[asked] = {n: m(torch.randn(5, m.in_features,
                                           generator=torch.Generator().manual_seed(1)))
                          for n, m in model.named_modules() if isinstance(m, Int4Linear)}
        if asked == "mixed":
            assert {name.rpartition(".")[2] for name, start in starts.items()
                    if start} == {"qkv_proj"}
            assert not any(starts[name] for name in starts if "qkv" not in name)
    for name, y in outputs["mixed"].items():
        same = "int16" if name.endswith("qkv_proj") else "int8"
        assert torch.equal(y, outputs[same][name]), name
        assert not torch.equal(outputs["int8"][name], outputs["int16"][name]), name


@pytest.mark.skipif("avx2" not in KERNEL_KINDS, reason="needs AVX2, FMA and F16C")
def test_the_avx_vnni_path_gives_the_haswell_bits(tmp_path):
    """Built for an AVX2 CPU with AVX-VNNI (Alder Lake on, Xeon 6 E-cores), the AVX2 path's
    sums come from VEX vpdpwssd (it says so, and its loop has them) and, where this CPU runs the
    instruction, equal the Haswell build's bit for bit. Its check runs in a child process first:
    a CPU without AVX-VNNI stops there with SIGILL, which proves the instruction is on the
    kernels' path (such a CPU never builds the path itself: -march=native leaves it out)."""
    import signal
    import subprocess
    import sys

    from server.kernels import cpu_gemm

    haswell, _, _ = build_avx2_gemm(tmp_path, "-march=haswell")
    vex, path, disassembly = build_avx2_gemm(tmp_path, "-march=haswell", "-mavxvnni")
    assert cpu_gemm.vnni_path(vex) == "AVX-VNNI" and cpu_gemm.vnni_path(haswell) is None
    assert "zmm" not in disassembly
    assert not disassembly or "{vex} vpdpwssd" in disassembly
    probe = subprocess.run([sys.executable, "-c", (
        "import ctypes, sys; from server.kernels import cpu_gemm; "
        f"sys.exit(cpu_gemm._self_check(cpu_gemm.typed(ctypes.CDLL({str(path)!r}))) is not None)")],
        capture_output=True, cwd=Path(__file__).parents[2])
    if probe.returncode == -signal.SIGILL:
        assert "avx_vnni" not in cpu_flags()  # a CPU that says it has AVX-VNNI must run it
        return
    assert probe.returncode == 0, probe.stderr.decode()[-2000:]
    assert_same_bits(vex, haswell)


@pytest.fixture(params=[*KERNEL_KINDS, "tinygemm"])
def int4_layout(request, monkeypatch):
    """Each CPU int4 layout this machine has: our kernels' (each kind it runs) and PyTorch's
    tinygemm pack (everywhere)."""
    from server.kernels import cpu_gemm

    lib = None if request.param == "tinygemm" else cpu_gemm.of_kind(request.param)
    monkeypatch.setattr(cpu_gemm, "_state", [lib])
    return "tinygemm" if lib is None else "q4x32"


@pytest.mark.parametrize("rows", [64, 200])
def test_int4_rows_past_the_threshold_run_unpacked_bf16_gemm(rows, int4_layout, tmp_path,
                                                             monkeypatch):
    """From UNPACK_MIN_ROWS rows the CPU layer unpacks its int4 layout to bf16 with a compiled
    helper and multiplies in bf16: the same numbers as a bf16 GEMM on the reference
    dequantization (tinygemm rounds scales to bf16 first), close to the packed kernel's.
    (Our kernels' layout does so where prompts take the unpacked weights: AMX machines held to
    avx512_gemm.c.)"""
    from server.kernels import cpu_gemm
    from server.kernels import loader as native
    from server.quant import int4

    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_gemm, "PROMPTS_UNPACKED", True)
    # The project's machines and CI have a C compiler (the helper is built, not skipped);
    # without one the packed kernel serves every row: test_native_helper_falls_back.
    assert native._load() is not None and int4.checked_unpack() is not None
    assert rows >= int4.UNPACK_MIN_ROWS
    torch.manual_seed(0)
    w = torch.randn(192, 128) * 0.05
    q, scale, zero = quantize_int4(w, 32)
    layer = Int4Linear(128, 192, 32, bias=True)
    layer.weight, layer.weight_scale, layer.weight_zero = pack_int4(q), scale, zero
    layer.bias = torch.nn.Parameter(torch.randn(192).bfloat16(), requires_grad=False)
    layer.prepare(use_kernel=True)
    assert (layer.q4x32 is not None) == (int4_layout == "q4x32")
    x = torch.randn(rows, 128).bfloat16()
    if int4_layout == "tinygemm":
        scale, zero = scale.bfloat16(), zero.bfloat16()
    w_bf16 = dequantize_int4(q, scale, zero, 32).bfloat16()
    got = layer(x)
    torch.testing.assert_close(got, torch.mm(x, w_bf16.t().contiguous()) + layer.bias, rtol=0,
                               atol=0)
    packed = layer._packed_mm(x) + layer.bias
    assert (got.float() - packed.float()).abs().max() < 0.02 * packed.float().abs().max()


def test_int4_gemm_takes_every_row_where_prompts_are_not_unpacked(kernel_kind, monkeypatch):
    """Where prompts are not unpacked (every machine but AMX ones held to avx512_gemm.c), our
    kernels serve prompt rows too: no unpacked copy, inside an engine step or outside, and each
    row the same as alone. In a step, prompt rows take the library's prompt kernel where it has
    one (amx_gemm.c's, AMX machines only) and generated rows the layer's kernel, each row the
    same as alone, and prompt rows within bf16 rounding of the unpacked weight's products."""
    from server.kernels import cpu_gemm
    from server.quant import rows

    monkeypatch.setattr(cpu_gemm, "PROMPTS_UNPACKED", False)
    assert cpu_gemm.prompt_path() == (kernel_kind == "amx")
    q, scale, zero = quantize_int4(torch.randn(128, 64) * 0.05, 32)
    layer = Int4Linear(64, 128, 32)
    layer.weight, layer.weight_scale, layer.weight_zero = pack_int4(q), scale, zero
    layer.prepare(use_kernel=True)
    assert layer.unpacked_numel() == 0
    x = torch.randn(80, 64).bfloat16()
    alone = torch.cat([layer(x[i:i + 1]) for i in range(80)])
    assert torch.equal(layer(x), alone)
    prompt_alone = alone
    if kernel_kind == "amx":
        prompt_alone = torch.cat([layer._prompt_kernel(x[i:i + 1]) for i in range(80)])
        exact = x.float() @ dequantize_int4(q, scale, zero, 32).bfloat16().float().t()
        torch.testing.assert_close(prompt_alone.float(), exact, rtol=8e-3, atol=1e-3)
        assert not torch.equal(prompt_alone, alone)  # another kernel: other bits
    for prompt_rows in (list(range(40)), list(range(40, 80)), list(range(0, 80, 3)),
                        list(range(80))):
        split = rows.split_rows(prompt_rows, 80, torch.device("cpu"),
                                rows.UnpackedWeights(layer))
        y = layer(x, split)
        for i in range(80):
            assert torch.equal(y[i], prompt_alone[i] if i in prompt_rows else alone[i])


def test_int8_layer_on_our_kernels_rows_are_independent_and_close_to_the_reference(
        kernel_kind):
    """An int8 layer on our kernels (an LM head's shape, scaled down): each row the same bits
    as alone, within bf16 rounding of the fp32 reference; its unpacked weight (prompt rows) the
    reference's bf16 weight exactly."""

    torch.manual_seed(5)
    q, scale = quantize_int8(torch.randn(4096, 576))
    layer = Int8Linear(576, 4096)
    layer.weight, layer.weight_scale = q, scale
    layer.prepare(use_kernel=True)
    assert layer.q8 is not None and layer.weight is None
    x = torch.randn(37, 576).bfloat16()
    alone = torch.cat([layer(x[i:i + 1]) for i in range(37)])
    for m in (2, 3, 4, 5, 16, 37):
        assert torch.equal(layer(x[:m]), alone[:m]), m
    want = x.float() @ dequantize_int8(q, scale).t()
    assert (alone.float() - want).abs().max() < 0.01 * want.abs().max()
    flat = torch.empty(4096 * 576, dtype=torch.bfloat16)
    assert torch.equal(layer.unpack_into(flat), (q.bfloat16() * scale.bfloat16()[:, None]).t())
    # As an LM head: fp32 logits, not rounded to bf16 (their error is the accumulation's only).
    logits = layer.logits(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits.bfloat16(), alone)
    err, rounded = (logits - want).abs().max(), (alone.float() - want).abs().max()
    assert err < rounded / 4
    assert all(torch.equal(layer.logits(x[i:i + 1])[0], logits[i]) for i in range(37))


def test_a_tied_embedding_reads_its_heads_layout(kernel_kind):
    """With our kernels the LM head gets its own layout; the tied embedding then looks its
    rows up there (one copy of the table, not two) and gives the same vectors."""
    from server.quant import prepare_quantized

    torch.manual_seed(6)
    q, scale = quantize_int8(torch.randn(320, 64))
    model = torch.nn.Module()
    model.embed = Int8Embedding(320, 64)
    model.embed.weight, model.embed.weight_scale = q, scale
    model.head = model.embed.as_linear()
    ids = torch.tensor([[0, 31, 32, 319], [5, 5, 100, 200]])
    before = model.embed(ids)
    prepare_quantized(model)
    assert model.embed.weight is None and model.embed.q8 is model.head.q8
    assert torch.equal(model.embed(ids), before)
    assert torch.equal(before, q[ids].float() * scale[ids].unsqueeze(-1))


def test_the_kernels_a_model_runs_are_named(monkeypatch):
    """Said once at load (async_engine.load_engine): ours, with their source, or PyTorch's
    where ours are not built (no compiler, LOCALSERVE_NO_NATIVE)."""
    from server.kernels import cpu_gemm
    from server.quant import cpu_kernels, prepare_quantized

    def model() -> torch.nn.Module:
        torch.manual_seed(7)
        m = torch.nn.Module()
        q, scale, zero = quantize_int4(torch.randn(64, 64) * 0.05, 32)
        m.proj = Int4Linear(64, 64, 32)
        m.proj.weight, m.proj.weight_scale, m.proj.weight_zero = pack_int4(q), scale, zero
        m.head = Int8Linear(64, 96)
        m.head.weight, m.head.weight_scale = quantize_int8(torch.randn(96, 64))
        return m

    assert cpu_kernels(torch.nn.Linear(4, 4)) is None
    built = model()
    prepare_quantized(built)
    if cpu_gemm.checked() is not None:  # this CPU's kind, or the next one down that built
        said = cpu_kernels(built)
        path = cpu_gemm.variant(cpu_gemm.checked())
        vnni = f" ({path})" if path else ""
        assert said in {f"{p.name}{vnni} for all 2 int4/int8 layers"
                        for p in cpu_gemm.SOURCES.values()}
        assert cpu_gemm.checked() is not cpu_gemm.of_kind(cpu_gemm.KIND) or \
            said.startswith(cpu_gemm.SOURCE.name)
    monkeypatch.setattr(cpu_gemm, "_state", [None])  # what checked() holds when none built
    built = model()
    prepare_quantized(built)
    assert cpu_kernels(built) == "PyTorch's kernels for 2 of 2 int4/int8 layers"


def test_fp32_activations_go_through_unrounded_where_the_kernels_take_them(kernel_kind):
    """avx2_gemm.c takes fp32 activations (CPUs without fast bf16 compute in fp32), never
    rounded to bf16: int4 and int8 results (an int8 layer and an int8 LM head) within their
    int16 activations' error (2^-16 of each
    group's largest; bf16's is 2^-9 of every value), more than ten times closer to the
    reference than with x rounded to bf16, rows independent (a layer of no name, so int16 on
    plain AVX2 too); avx512_gemm.c takes bf16 only (the layer rounds x,
    as PyTorch's kernels do)."""
    from server.kernels import cpu_gemm

    assert cpu_gemm.takes_fp32() == (kernel_kind == "avx2")
    torch.manual_seed(8)
    q, scale, zero = quantize_int4(torch.randn(256, 128) * 0.05, 32)
    layer = Int4Linear(128, 256, 32)
    layer.weight, layer.weight_scale, layer.weight_zero = pack_int4(q), scale, zero
    layer.prepare(use_kernel=True)
    x = torch.randn(9, 128)
    q8, s8 = quantize_int8(torch.randn(320, 128))
    head = Int8Linear(128, 320)
    head.weight, head.weight_scale = q8, s8
    head.prepare(use_kernel=True)
    tolerance = 2e-4 if kernel_kind == "avx2" else 1e-2  # int16 x, or bf16 in and out
    w8 = dequantize_int8(q8, s8)
    for fn, w in ((layer, dequantize_int4(q, scale, zero, 32)), (head.logits, w8), (head, w8)):
        got = fn(x)
        assert got.dtype == torch.float32
        want = x @ w.t()
        assert (got - want).abs().max() < tolerance * want.abs().max()
        rounded = x.bfloat16().float() @ w.t()
        if kernel_kind == "avx2":
            assert (got - want).abs().max() < (rounded - want).abs().max() / 10
        assert torch.equal(torch.cat([fn(x[i:i + 1]) for i in range(9)]), got)


def test_int4_gemm_rows_are_independent_and_close_to_the_reference(kernel_kind):
    """Our kernels at every row count up to past their blocks of 4, 6 and 12 rows, with the real
    model's group size and widths: each row the same bits as alone, within bf16 rounding of
    fp32."""
    from server.kernels import cpu_gemm

    torch.manual_seed(4)
    q, scale, zero = quantize_int4(torch.randn(1536, 576) * 0.05, 32)
    layout = cpu_gemm.pack_int4(q, scale, zero, 32)
    x = torch.randn(37, 576).bfloat16()
    alone = torch.cat([cpu_gemm.gemm(x[i:i + 1], layout, 32) for i in range(37)])
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 25, 33, 37):
        assert torch.equal(cpu_gemm.gemm(x[:m], layout, 32), alone[:m]), m
    want = x.float() @ dequantize_int4(q, scale, zero, 32).t()
    assert (alone.float() - want).abs().max() < 0.01 * want.abs().max()


def test_native_helper_can_be_turned_off(monkeypatch):
    from server.kernels import loader as native

    monkeypatch.setenv("LOCALSERVE_NO_NATIVE", "1")
    assert native._load() is None


def test_a_helper_is_rebuilt_when_a_header_it_includes_changes(tmp_path, monkeypatch):
    """A source includes a header (the kernels include common.h): an edit there must not load
    the stale build."""
    from server.kernels import loader as native

    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "home"))
    (tmp_path / "part.h").write_text("int answer(void) { return 1; }\n")
    source = tmp_path / "whole.c"
    source.write_text('#include "part.h"\n')
    first = native._build(source)
    assert ctypes.CDLL(str(first)).answer() == 1
    (tmp_path / "part.h").write_text("int answer(void) { return 2; }\n")
    second = native._build(source)
    assert second != first and ctypes.CDLL(str(second)).answer() == 2


def test_a_helper_is_rebuilt_when_a_file_its_includes_include_changes(tmp_path, monkeypatch):
    """amx_gemm.c includes avx512_gemm.h, which includes common.h: two levels down counts."""
    from server.kernels import loader as native

    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "home"))
    (tmp_path / "inner.h").write_text("int answer(void) { return 1; }\n")
    (tmp_path / "outer.c").write_text('#include "inner.h"\n')
    source = tmp_path / "whole.c"
    source.write_text('#include "outer.c"\n')
    first = native._build(source)
    (tmp_path / "inner.h").write_text("int answer(void) { return 2; }\n")
    second = native._build(source)
    assert second != first and ctypes.CDLL(str(second)).answer() == 2
    assert len(native._sources(source)) == 3


def test_homes_share_the_folder_native_cache_names(tmp_path, monkeypatch):
    """$LOCALSERVE_NATIVE_CACHE: every home loads the one build there (none in the homes);
    without it the build goes to the home's cache/native."""
    from server.kernels import loader as native

    (tmp_path / "whole.c").write_text("int answer(void) { return 7; }\n")
    monkeypatch.setenv("LOCALSERVE_NATIVE_CACHE", str(tmp_path / "shared"))
    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "one"))
    first = native._build(tmp_path / "whole.c")
    assert first.parent == tmp_path / "shared" and ctypes.CDLL(str(first)).answer() == 7
    built = first.stat().st_mtime_ns
    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path / "two"))
    assert native._build(tmp_path / "whole.c") == first and first.stat().st_mtime_ns == built
    assert not (tmp_path / "one").exists() and not (tmp_path / "two").exists()
    monkeypatch.delenv("LOCALSERVE_NATIVE_CACHE")
    own = native._build(tmp_path / "whole.c")
    assert own.parent == tmp_path / "two" / "cache" / "native" and own.name == first.name


def test_a_librarys_sources_compile_side_by_side(tmp_path, monkeypatch):
    """Each source of a library by its own `cc`, all at once, then linked (layer_ops' four took
    12 s one after another): a compiler that waits for the other source's to have started
    could never finish one at a time. Nothing but the library stays in the folder, and a
    source that does not compile is said by name."""
    import shutil

    from server.kernels import loader as native

    marks = tmp_path / "started"
    marks.mkdir()
    cc = tmp_path / "cc"
    cc.write_text(f"""#!/bin/sh
case " $* " in *" -c "*)
  touch "{marks}/$$"
  for i in $(seq 300); do [ "$(ls "{marks}" | wc -l)" -ge 2 ] && break; sleep 0.1; done
  [ "$(ls "{marks}" | wc -l)" -ge 2 ] || exit 3;;
esac
exec {shutil.which("cc") or shutil.which("gcc")} "$@"
""")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("LOCALSERVE_NATIVE_CACHE", str(tmp_path / "cache"))
    sources = (tmp_path / "one.c", tmp_path / "two.c")
    sources[0].write_text("int one(void) { return 1; }\n")
    sources[1].write_text("int two(void) { return 2; }\n")
    built = native._build(sources)
    library = ctypes.CDLL(str(built))
    assert (library.one(), library.two()) == (1, 2)
    assert len(list(marks.iterdir())) == 2  # one compiler a source
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [built.name]
    sources[1].write_text("int two(void) { return }\n")
    with pytest.raises(OSError, match="two.c"):
        native._build(sources)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [built.name]


def test_the_wheel_ships_every_file_of_the_packages(tmp_path):
    """`pip install .` (the Dockerfile's) compiles the kernels on first use from the installed
    files: a header (then prefetch.h) missing from the wheel made every kernel's build fail
    there, and the layers fell back to PyTorch's kernels. Built as the Dockerfile builds it, from
    a copy of its files; every file of the packages (the kernels' sources and headers, the
    dashboard's) is in it."""
    import shutil
    import subprocess
    import sys
    import zipfile

    root = Path(__file__).resolve().parents[2]
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, tree / name)
    for name in ("server", "cli", "storage"):
        shutil.copytree(root / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(tree)],
                   check=True, timeout=300, cwd=tmp_path)
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    files = {p.relative_to(tree).as_posix() for name in ("server", "cli", "storage")
             for p in (tree / name).rglob("*") if p.is_file()}
    assert {"server/kernels/common.h", "server/kernels/avx2_gemm.c"} <= files
    assert files - shipped == set()


@pytest.mark.skipif(not {"avx2", "fma"} <= FLAGS, reason="PyTorch's AVX2 kernels need AVX2")
def test_the_unpack_helper_reads_pytorchs_pack_on_avx2_cpus_too():
    """PyTorch packs int4 for its CPU kernels in blocks of 64 outputs under AVX-512 and of 32
    under AVX2 (an AVX2-only machine's layout); the helper passes its check with either: a
    second process held to AVX2 kernels, with the machine's own compiler."""
    import subprocess
    import sys

    code = ("import torch; from server.quant import int4; "
            "print(torch.backends.cpu.get_cpu_capability(), int4.checked_unpack() is not None)")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["AVX2", "True"]


@pytest.mark.parametrize("cc", ["/nonexistent/cc", "false"])
def test_native_helper_falls_back(cc, tmp_path, monkeypatch, caplog):
    """No compiler, or one that fails: no helper, said once as a warning, and an int4 layer
    still answers every row with the packed kernel (inside an engine step too)."""
    from server.kernels import cpu_gemm
    from server.kernels import loader as native
    from server.quant import int4, rows

    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", cc)
    monkeypatch.setattr(native, "_warned", set())
    assert native._open(cpu_gemm.SOURCE) is None
    assert native._load() is None
    said = [r for r in caplog.records if "PyTorch's kernels run instead" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    assert cpu_gemm.SOURCE.name in said[0].getMessage()
    monkeypatch.setattr(int4, "_checked", [None])  # what checked_unpack caches without one
    monkeypatch.setattr(cpu_gemm, "_state", [None])  # and cpu_gemm.checked
    torch.manual_seed(2)
    q, scale, zero = quantize_int4(torch.randn(128, 64) * 0.05, 32)
    layer = Int4Linear(64, 128, 32)
    layer.weight, layer.weight_scale, layer.weight_zero = pack_int4(q), scale, zero
    layer.prepare(use_kernel=True)
    assert layer.unpacked_numel() == 0 and layer.unpacked_t() is None
    x = torch.randn(80, 64).bfloat16()
    packed = layer._packed_mm(x)
    assert torch.equal(layer(x), packed)  # past UNPACK_MIN_ROWS, outside a step
    split = rows.split_rows(list(range(80)), 80, torch.device("cpu"), rows.UnpackedWeights(layer))
    assert torch.equal(layer(x, split), packed)  # all prompt rows, inside a step


@pytest.mark.parametrize("prompt_rows", [[0, 1, 2, 3], [5, 6, 7], [2, 3, 6], []])
def test_int4_rows_take_their_kinds_path_wherever_they_sit(prompt_rows, int4_layout, tmp_path,
                                                           monkeypatch):
    """In a step mixing kinds each row gets exactly what it would alone: prompt rows the bf16
    GEMM, generated rows the packed kernel (prompt rows first, last, scattered, none), with the
    engine's kept copies or without."""
    from server.kernels import cpu_gemm
    from server.quant import rows

    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_gemm, "PROMPTS_UNPACKED", True)
    torch.manual_seed(1)
    q, scale, zero = quantize_int4(torch.randn(128, 64) * 0.05, 32)
    layer = Int4Linear(64, 128, 32)
    layer.weight, layer.weight_scale, layer.weight_zero = pack_int4(q), scale, zero
    layer.prepare(use_kernel=True)
    x = torch.randn(8, 64).bfloat16()
    weight_t = layer.unpacked_t().clone()
    alone_prompt = torch.cat([rows.tiled_mm(x[i:i + 1], weight_t, rows.PROMPT_TILE)
                              for i in range(8)])
    alone_generated = torch.cat([layer._packed_mm(x[i:i + 1]) for i in range(8)])
    for cap, keep in ((rows.UNPACKED_MAX_BYTES, True), (rows.UNPACKED_MAX_BYTES, False),
                      (0, True)):  # kept between steps, or unpacked into the scratch buffer
        monkeypatch.setattr(rows, "UNPACKED_MAX_BYTES", cap)
        unpacked = rows.UnpackedWeights(layer)
        for _ in range(2):
            split = rows.split_rows(prompt_rows, 8, torch.device("cpu"), unpacked, keep)
            y = layer(x, split)
            rows.end_step(split)
            for i in range(8):
                want = alone_prompt[i] if i in prompt_rows else alone_generated[i]
                assert torch.equal(y[i], want), (cap, keep, i)
        assert (unpacked.block is not None) == (cap > 0 and keep and bool(prompt_rows))


def test_a_packed_kernel_whose_rows_depend_on_each_other_is_called_in_tiles(monkeypatch):
    """The load-time check tells a row-independent kernel from one whose rows change with the
    row count, and tiles make the second one's rows independent too; an int8 layer whose kernel
    failed the check still gives every row what it gives alone."""
    from server.quant import rows

    torch.manual_seed(3)
    weight = torch.randn(64, 16).bfloat16()
    independent = lambda x: x @ weight  # noqa: E731
    dependent = lambda x: x @ weight + x.shape[0]  # noqa: E731 - the row count leaks in
    monkeypatch.setattr(rows, "_independent", {})
    assert rows.kernel_rows_independent("fake-good", independent, 64)
    assert not rows.kernel_rows_independent("fake-bad", dependent, 64)
    x = torch.randn(40, 64).bfloat16()
    alone = torch.cat([rows.tiled_rows(dependent, x[i:i + 1], rows.PACKED_TILE)
                       for i in range(40)])
    for m in (1, 5, 16, 17, 40):
        assert torch.equal(rows.tiled_rows(dependent, x[:m], rows.PACKED_TILE), alone[:m])
    monkeypatch.setattr(rows, "_independent", {"int8": False})
    from server.kernels import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "_state", [None])  # PyTorch's int8 kernel, then
    q, scale = quantize_int8(torch.randn(96, 64))
    layer = Int8Linear(64, 96)
    layer.weight, layer.weight_scale = q, scale
    layer.prepare(use_kernel=True)
    assert layer.tiled
    y = layer(x)
    assert all(torch.equal(y[i], layer(x[i:i + 1])[0]) for i in range(40))
