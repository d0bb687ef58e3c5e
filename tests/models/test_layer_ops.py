"""layer_ops.c (RMSNorm, rotary embedding + cache write, paged decode attention) against the
PyTorch code it replaces, and batch invariance: a row gives the same bits alone or batched."""

from __future__ import annotations

import pytest
import torch

import server.kernels.layer_ops as layer_ops
import server.kernels.loader as native
from server.models import attention
from server.models.attention import build_metadata
from server.models.simple import greedy_generate, prompt_logits
from tests.helpers import hf_model
from tests.models.test_forward import CPU, ours_from_hf, prompt

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture
def pytorch_only(monkeypatch):
    """layer_ops unavailable (what a machine without a C compiler gets)."""
    monkeypatch.setattr(layer_ops, "_lib", lambda: None)


def test_built_and_checked_here():
    # The project's machines and CI have a C compiler; without one everything falls back
    # (test_model_without_layer_ops_matches_transformers).
    assert layer_ops.enabled()


def paged_caches(num_kv_heads, head_dim, dtype, slots=600, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(num_kv_heads, slots + 1, head_dim, generator=g).to(dtype)
            for _ in range(2)]


BLOCK = 16


def block_tables(lens, seed=0):
    """Each sequence's scattered blocks (of 36 in the caches)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(36, generator=g)[: -(-n // BLOCK)].tolist() for n in lens]


def decode_group(lens, tables):
    """The decode group of these sequences, as the engine builds it."""
    meta = build_metadata([1] * len(lens), lens, tables, BLOCK, CPU, torch.bfloat16)
    assert len(meta.groups) == 1
    return meta.groups[0]


@pytest.mark.parametrize("head_dim", [64, 48, 80])  # every split of a row into vectors
@pytest.mark.parametrize("cache_dtype", DTYPES, ids=["fp32-cache", "bf16-cache"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1), (32, 2)])
def test_paged_decode_matches_pytorch_and_is_batch_invariant(dtype, cache_dtype, heads,
                                                             head_dim, monkeypatch):
    hq, hkv, d = *heads, head_dim
    lens = [1, 63, 64, 65, 300, 17]
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    k, v = paged_caches(hkv, d, cache_dtype)
    tables = block_tables(lens)
    g = decode_group(lens, tables)
    got = layer_ops.paged_decode(q, k, v, g.context_slots, g.lens, d**-0.5)
    assert got is not None and got.dtype == dtype and got.shape == (len(lens), hq * d)
    for i, n in enumerate(lens):
        one = decode_group([n], tables[i:i + 1])
        alone = layer_ops.paged_decode(q[i:i + 1].contiguous(), k, v, one.context_slots,
                                       one.lens, d**-0.5)
        assert torch.equal(alone[0], got[i])  # the batch and its padding change nothing
    monkeypatch.setattr(layer_ops, "_lib", lambda: None)
    g.fp32 = True
    want = attention._decodes(q, k, v, g, d**-0.5, hkv, hq // hkv)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("cache_dtype", DTYPES, ids=["fp32-cache", "bf16-cache"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1), (10, 2)])
def test_paged_prompt_matches_pytorch_and_chunks_change_nothing(dtype, cache_dtype, heads):
    """A prompt's queries over their causal context in scattered blocks: within rounding of
    PyTorch, and computed whole, in chunks (every cut, jobs of 12 rows split anywhere) or from
    a later start the same bits."""
    hq, hkv, n = *heads, 300
    q = torch.randn(n, hq, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    k, v = paged_caches(hkv, 64, cache_dtype)
    table = torch.tensor(block_tables([n])[0])
    pos = torch.arange(n)
    slots = table[pos // BLOCK] * BLOCK + pos % BLOCK
    whole = layer_ops.paged_prompt(q, k, v, slots, 0, 0.125)
    assert whole is not None and whole.dtype == dtype and whole.shape == (n, hq * 64)
    for cut in (1, 5, 64, 131, 299):
        for start, end in ((0, cut), (cut, n)):
            part = layer_ops.paged_prompt(q[start:end].contiguous(), k, v, slots, start, 0.125)
            assert torch.equal(part, whole[start:end]), (cut, start)
    # into the rows of a step's output (attention.py), and nothing written where out misfits
    step = torch.zeros(n + 7, hq * 64, dtype=dtype)
    into = layer_ops.paged_prompt(q[131:], k, v, slots, 131, 0.125, out=step[5:5 + n - 131])
    assert into is not None and into.data_ptr() == step[5].data_ptr()
    assert torch.equal(step[5:5 + n - 131], whole[131:]) and not step[:5].any()
    assert not step[5 + n - 131:].any()
    assert layer_ops.paged_prompt(q[131:], k, v, slots, 131, 0.125, out=step[:n - 130]) is None
    keys, values = (c[:, slots].float().repeat_interleave(hq // hkv, 0) for c in (k, v))
    scores = q.float().transpose(0, 1) @ keys.transpose(1, 2) * 0.125
    scores += torch.full((n, n), float("-inf")).triu(1)
    want = (torch.softmax(scores, -1) @ values).transpose(0, 1).reshape(n, -1)
    torch.testing.assert_close(whole.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_reference_and_rows_are_independent(dtype):
    from server.models.llama import RMSNorm

    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(37, 576).to(dtype)
    got = norm(x)
    h = x.float()
    want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert all(torch.equal(got[i], norm(x[i:i + 1])[0]) for i in range(37))


def test_argmax_is_pytorch_s_max_indices():
    """The sampler's greedy pick on CPU logits (sampler.py): x.max(dim=-1).indices exactly, the
    first of equal values, the first NaN where a row has one, on a vocabulary's width."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-5, 6, (9, 49152), generator=g).float()  # many ties at the top
    x[4, 30000], x[4, 12], x[6] = float("nan"), float("nan"), float("-inf")
    for rows in (x, x[:, :7].contiguous(), x[:1]):
        assert torch.equal(layer_ops.argmax(rows), rows.max(dim=-1).indices)
    assert layer_ops.argmax(x.bfloat16()) is None  # fp32 logits only: PyTorch's otherwise


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", sorted(layer_ops.ACTIVATIONS))
def test_the_gated_activation_matches_pytorch_and_rows_are_independent(dtype, activation):
    """act_mul (decode_step.c) on the halves of fused gate|up rows, as the MLP module calls it
    on the CPU: within rounding of PyTorch's act(gate) * up over the range where the
    exponentials saturate (to +-30), every row alone the bits it gets in a batch, and a width
    that is no multiple of the vector (1000)."""
    from server.models.mlp import ACTIVATIONS

    fused = (torch.randn(13, 2000) * 8).clamp(-30, 30).to(dtype)
    gate, up = fused.chunk(2, dim=-1)
    got = layer_ops.act_mul(gate, up, activation)
    want = ACTIVATIONS[activation](gate.float()) * up.float()
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])
    assert all(torch.equal(got[i], layer_ops.act_mul(gate[i:i + 1], up[i:i + 1],
                                                     activation)[0]) for i in range(13))
    assert layer_ops.act_mul(gate, up, "relu") is None  # a kind it does not have: PyTorch's


def test_bf16_results_below_the_normal_range_round_as_pytorch_rounds_them():
    """common.h's vector store (vcvtneps2bf16 flushes denormal inputs to zero) keeps bf16
    denormals as float_to_bf16 and PyTorch do: act_mul's products (30 * u, exact in fp32) and
    activations (silu(g) = g / 2 for tiny g) below 2^-126, in whole vectors and a tail."""
    tiny = torch.tensor([2.0 ** -130, -30 * 2.0 ** -133, 2.0 ** -127, 0.0] * 12 + [2.0 ** -131])
    n = tiny.numel()
    gate = torch.cat([torch.full((n,), 30.0), tiny]).to(torch.bfloat16)[None]
    up = torch.cat([tiny, torch.ones(n)]).to(torch.bfloat16)[None]
    got = layer_ops.act_mul(gate, up, "silu")
    assert got is not None
    want = torch.cat([30 * tiny, tiny / 2]).to(torch.bfloat16)[None]  # exact in fp32
    assert want.ne(0).sum() == 2 * (n - 12) and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_matches_pytorch(dtype, monkeypatch):
    """The fused path and the PyTorch path of the same Attention module: same queries, same
    cache contents."""
    from server.models.llama import Rotary

    model = ours_from_hf(hf_model("llama"), dtype=dtype)
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj is not None
    hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    t = 11
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    cos, sin = model._rope_tables(CPU)
    positions = torch.tensor([0, 5, 9, 100, 3, 7, 8, 1, 2, 60, 61])
    slots = torch.randperm(40)[:t]
    fused_caches = paged_caches(hkv, d, dtype, slots=40)
    torch_caches = [c.clone() for c in fused_caches]
    q = layer_ops.rope_store(qkv, hq, hkv, d, cos, sin, positions, slots, *fused_caches)
    nq, nkv = hq * d, hkv * d
    want = attn._rope_store(*qkv.split([nq, nkv, nkv], dim=-1), Rotary(cos, sin, positions, dtype),
                            *torch_caches, slots)
    torch.testing.assert_close(q.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    for a, b in zip(fused_caches, torch_caches, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32),
                                          (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16)])
def test_dense_mm_matches_the_product_and_rows_are_independent(dtype, wdtype):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(80, 192, generator=g).to(wdtype)
    x = torch.randn(29, 192, generator=g).to(dtype)
    got = layer_ops.dense_mm(x, w)
    want = x.float() @ w.float().t()
    torch.testing.assert_close(got.float(), want, atol=TOL[dtype] * 10, rtol=TOL[dtype])
    assert got.dtype == dtype
    for m in (1, 2, 5, 6, 7, 13):  # every row-block size, and tails of each
        assert torch.equal(layer_ops.dense_mm(x[:m], w), got[:m])
    assert layer_ops.dense_mm(x[:, :184].contiguous(), w[:, :184].contiguous()) is None  # k
    assert layer_ops.dense_mm(x, w[:76].contiguous()) is None  # n: not whole vectors
    assert layer_ops.dense_mm(x, w.t().contiguous().t()) is None  # not row-major


PACKS = pytest.mark.skipif(not layer_ops.packs(), reason="the packed bf16 kernel needs "
                           "AVX-512 BF16 (on AMX CPUs, the OS's grant of AMX state)")


@PACKS
@pytest.mark.parametrize("n,k", [(16, 2), (48, 96), (80, 192), (1536, 576), (592, 2080)])
def test_packed_mm_matches_the_product_and_rows_are_independent(n, k):
    """Blocks of 48 outputs and the tails of 32 and 16, passes of 8 rows and every tail; with
    AMX tiles (k a multiple of 32) passes of 32 rows x 32 outputs, a tail of 16 outputs, tiles
    of fewer than 16 rows and padded tails of row tiles (k 2: the vdpbf16ps passes there); k
    2080 on tiles: calls of more than 32 rows in chunks of inputs (a short last one), 8 pairs
    of output blocks at a time and a part of 8, one pass's calls whole."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(41, k, generator=g).bfloat16()
    packed = layer_ops.pack_weight(w)
    wide = layer_ops.packed_mm(x, packed, fp32_out=True)
    torch.testing.assert_close(wide, x.float() @ w.float().t(), atol=1e-3, rtol=1e-4)
    got = layer_ops.packed_mm(x, packed)
    assert got.dtype == torch.bfloat16 and torch.equal(got, wide.bfloat16())
    for m in (0, 1, 2, 3, 5, 7, 8, 9, 13, 16, 17, 31, 32, 33, 40):
        assert torch.equal(layer_ops.packed_mm(x[:m], packed), got[:m])
        assert torch.equal(layer_ops.packed_mm(x[m:m + 1], packed), got[m:m + 1])


@PACKS
def test_the_packed_kernel_takes_only_what_it_can():
    w = torch.randn(80, 96).bfloat16()
    assert layer_ops.pack_weight(w[:72].contiguous()) is None  # n: not whole blocks of 16
    assert layer_ops.pack_weight(torch.randn(80, 95).bfloat16()) is None  # k: odd
    assert layer_ops.pack_weight(w.float()) is None  # not bf16
    packed = layer_ops.pack_weight(w)
    assert layer_ops.packed_mm(torch.randn(3, 96), packed) is None  # fp32 rows
    assert layer_ops.packed_mm(torch.randn(3, 94).bfloat16(), packed) is None  # k


@PACKS
def test_a_packed_layer_serves_every_row_and_lets_its_weight_go():
    from server.models.linear import Linear

    layer = Linear(192, 96, bias=True).to(torch.bfloat16)
    shared = Linear(192, 96, bias=False).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    layer.pack()
    shared.pack(keep=True)  # a tied LM head: the embedding keeps the weight
    assert layer.weight.numel() == 0 and shared.weight.shape == (96, 192)
    x = torch.randn(5, 192).bfloat16()
    want = layer_ops.packed_mm(x, layer_ops.pack_weight(weight)) + layer.bias
    assert torch.equal(layer(x), want) and torch.equal(layer(x[2:3]), want[2:3])
    logits = shared.logits(x)
    assert logits.dtype == torch.float32 and torch.equal(logits.bfloat16(), shared(x))


@PACKS
def test_a_bf16_model_packs_its_layers_and_its_tied_head_keeps_the_embedding():
    from server.models.linear import Linear

    hf = hf_model("llama", seed=2, tie_word_embeddings=True)
    ours = ours_from_hf(hf, dtype=torch.bfloat16)
    head, embed = ours.lm_head, ours.model.embed_tokens
    assert head.packed is not None and head.weight is embed.weight and embed.weight.numel()
    layers = [m for m in ours.model.layers.modules() if isinstance(m, Linear)]
    assert layers and all(m.packed is not None and m.weight.numel() == 0 for m in layers)
    reference = ours_from_hf(hf, dtype=torch.bfloat16, use_kernels=False)  # unpacked
    ids = prompt(12)
    torch.testing.assert_close(prompt_logits(ours, ids), prompt_logits(reference, ids),
                               atol=0.1, rtol=0.05)


def test_unquantized_layers_generated_rows_take_dense_mm():
    from server.models.linear import Linear

    layer = Linear(192, 96, bias=True).to(torch.bfloat16)
    x = torch.randn(3, 192).to(torch.bfloat16)
    want = layer_ops.dense_mm(x, layer.weight) + layer.bias
    assert torch.equal(layer(x), want)
    assert torch.equal(layer(x[1:2]), want[1:2])


def test_a_dense_lm_head_hands_over_fp32_logits():
    """Not rounded to bf16 (0.06-0.125 apart at a real model's magnitudes): the sums as fp32,
    which round to exactly the bf16 outputs, and the same for a row alone."""
    from server.models.linear import Linear

    head = Linear(192, 96, bias=False).to(torch.bfloat16)
    x = torch.randn(5, 192).to(torch.bfloat16)
    logits = head.logits(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits.to(torch.bfloat16), head(x))
    assert not torch.equal(logits, head(x).float())
    assert torch.equal(head.logits(x[2:3]), logits[2:3])


def test_model_with_and_without_layer_ops_agree(monkeypatch):
    """fp32, a tiny random Llama: prompt logits within 1e-5 and the same greedy tokens."""
    ours = ours_from_hf(hf_model("llama", seed=3))
    ids = prompt(40)
    fused_logits, fused_tokens = prompt_logits(ours, ids), greedy_generate(ours, ids, 24)
    monkeypatch.setattr(layer_ops, "_lib", lambda: None)
    torch.testing.assert_close(fused_logits, prompt_logits(ours, ids), atol=1e-5, rtol=1e-5)
    assert fused_tokens == greedy_generate(ours, ids, 24)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_without_layer_ops_matches_transformers(arch, pytorch_only):
    hf = hf_model(arch)
    assert layer_ops.rms_norm(torch.ones(1, 8), torch.ones(8), 1e-5) is None
    ids = prompt(37)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prompt_logits(ours_from_hf(hf), ids), ref, atol=2e-5, rtol=1e-4)


def test_no_compiler_means_pytorch(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert native._open(layer_ops.SOURCES) is None


@pytest.mark.skipif(not {"avx2", "fma"} <= native.cpu_flags(), reason="needs AVX2 and FMA")
def test_built_for_an_avx2_only_cpu_it_passes_its_check(tmp_path):
    """layer_ops.c compiled for an AVX2-only CPU (-march=haswell: 8-lane vectors, no AVX-512
    registers) passes the same check as the library the server loads."""
    import ctypes
    import shutil
    import subprocess

    out = tmp_path / "layer_ops.so"
    subprocess.run([shutil.which("cc") or shutil.which("gcc"), "-O3", "-march=haswell",
                    *native.FLAGS[2:], "-fopenmp", "-o", str(out),
                    *map(str, layer_ops.SOURCES), "-lm"], check=True, capture_output=True)
    disassembly = subprocess.run(["objdump", "-d", str(out)], capture_output=True, text=True)
    assert disassembly.returncode != 0 or "zmm" not in disassembly.stdout
    assert layer_ops._self_check(layer_ops.typed(ctypes.CDLL(str(out)))) is None
