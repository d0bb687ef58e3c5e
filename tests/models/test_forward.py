"""Our Llama-family forward (Llama, Qwen2, Qwen3, Granite, SmolLM3) against transformers'
reference, on tiny random models."""

from __future__ import annotations

import random

import pytest
import torch

from server.models.attention import build_metadata
from server.models.batch import ForwardBatch
from server.models.loader import build_model
from server.models.simple import allocate_kv, greedy_generate, prompt_logits
from server.quant import quantize_state_dict
from server.quant.int4 import dequantize_int4, unpack_int4
from server.quant.int8 import dequantize_int8
from tests.helpers import hf_model, our_config

ARCHS = ["llama", "qwen2", "qwen3", "granite", "smollm3", "mistral", "phi3", "gemma3"]
CPU = torch.device("cpu")


def ours_from_hf(hf, bits=16, dtype=torch.float32, use_kernels=True, group_size=64):
    state = {k: v for k, v in hf.state_dict().items()}
    tensors, schemes = quantize_state_dict(state, bits, group_size)
    return build_model(our_config(hf), tensors, schemes, CPU, dtype, use_kernels)


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 260, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logits_match_transformers(arch):
    hf = hf_model(arch)
    ours = ours_from_hf(hf)
    ids = prompt(37)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = prompt_logits(ours, ids)
    assert got.shape == ref.shape == (37, hf.config.vocab_size)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_equals_whole_prompt(arch):
    ours = ours_from_hf(hf_model(arch))
    ids = prompt(50)
    torch.testing.assert_close(prompt_logits(ours, ids, chunk=7), prompt_logits(ours, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_generate(arch):
    hf = hf_model(arch, seed=3)
    ours = ours_from_hf(hf)
    ids = prompt(12)
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, 12:].tolist()
    assert greedy_generate(ours, ids, 16) == ref


def test_mixed_batch_equals_each_sequence_alone():
    """Two decoding sequences and a prefill chunk in one step give each one's solo logits."""
    ours = ours_from_hf(hf_model("qwen2"))
    a, b, c = prompt(20, 1), prompt(9, 2), prompt(30, 3)
    solo = [prompt_logits(ours, s)[-1] for s in (a, b)] + [prompt_logits(ours, c[:25])[-5:]]
    block = 8
    # Paged: sequence i owns scattered blocks; a and b are fully cached but their last token,
    # c has its first 20 tokens cached and a 5-token chunk to compute.
    tables = [[5, 0, 7], [2, 9], [1, 3, 4, 6]]
    kv = allocate_kv(ours, 10 * block, CPU, torch.float32)
    for k, v in kv:  # the pool is uninitialized: no slot may be read before it is written
        k[:, :-1].fill_(float("nan"))
        v[:, :-1].fill_(float("nan"))
    for seq, table, upto in ((a, tables[0], 19), (b, tables[1], 8), (c, tables[2], 20)):
        meta = build_metadata([upto], [upto], [table], block, CPU)
        ours(ForwardBatch(torch.tensor(seq[:upto]), meta), kv)
    meta = build_metadata([1, 1, 5], [20, 9, 25], tables, block, CPU)
    step_ids = torch.tensor([a[19], b[8], *c[20:25]])
    logits = ours.compute_logits(ours(ForwardBatch(step_ids, meta), kv))  # [7, vocab]
    torch.testing.assert_close(logits[0], solo[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], solo[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[2:], solo[2], atol=1e-5, rtol=1e-5)


def test_a_decode_step_lays_out_its_decodes_as_a_mixed_step_does():
    """build_metadata's path for steps of decodes only gives the tensors the general path gives
    those decodes in a step with a prompt chunk after them: positions, cache slots (a window
    pool's dropped blocks, -1, read the zero slot), mask, lengths."""
    rng = random.Random(0)
    for _ in range(50):
        block, b = rng.choice([8, 16, 32]), rng.randint(1, 12)
        lens = [rng.randint(1, 300) for _ in range(b)]
        # each table a block longer than needed; some blocks before the last dropped (-1)
        tables = [[-1 if rng.random() < 0.3 and i < (n - 1) // block else blk
                   for i, blk in enumerate(rng.sample(range(500), -(-n // block) + 1))]
                  for n in lens]
        alone = build_metadata([1] * b, lens, tables, block, CPU)
        mixed = build_metadata([1] * b + [4], lens + [10], tables + [[7, 8]], block, CPU,
                               prompt_lens=[0] * b + [4])
        assert torch.equal(alone.positions, mixed.positions[:b])
        assert torch.equal(alone.slot_mapping, mixed.slot_mapping[:b])
        [ours], theirs = alone.groups, mixed.groups[0]
        assert ours.whole_step and not theirs.whole_step and ours.fp32 == theirs.fp32
        for name in ("token_index", "context_slots", "mask", "dest", "lens"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name


def dequantized_reference(hf, bits: int, group_size: int = 64):
    """transformers' model with every quantized weight replaced by its dequantized value."""
    tensors, schemes = quantize_state_dict(dict(hf.state_dict()), bits, group_size)
    state = dict(hf.state_dict())
    for name, scheme in schemes.items():
        if scheme["bits"] == 4:
            w = dequantize_int4(unpack_int4(tensors[name]), tensors[name + "_scale"],
                                tensors[name + "_zero"], scheme["group_size"])
        else:
            w = dequantize_int8(tensors[name], tensors[name + "_scale"])
        state[name] = w
    hf.load_state_dict(state)
    return hf


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_reference_path_matches_dequantized_transformers(arch, bits):
    hf = hf_model(arch)
    ours = ours_from_hf(hf, bits, use_kernels=False)
    ref_model = dequantized_reference(hf, bits)
    ids = prompt(21)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prompt_logits(ours, ids), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kernels_match_reference_path(bits):
    """The packed CPU kernels (bf16 activations) against the fp32 dequantizing path.

    Stated tolerance: the kernels round activations to bf16 (8 bits of mantissa), so logits
    agree to within 3% of their spread, and the argmax agrees at almost every position.
    """
    hf = hf_model("llama", seed=5)
    ids = prompt(40)
    ref = prompt_logits(ours_from_hf(hf, bits, use_kernels=False), ids)
    got = prompt_logits(ours_from_hf(hf, bits, use_kernels=True), ids)
    spread = ref.max() - ref.min()
    assert (got - ref).abs().max() < 0.03 * spread
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_model_close_to_transformers_in_fp32(arch):
    """bf16 compute (its layers in the packed bf16 kernel where this CPU has it: every one of
    them, checked) against transformers in fp32 on the same weights, within bf16's rounding:
    3% of the logits' spread."""
    import server.kernels.layer_ops as layer_ops
    from server.models.linear import Linear

    hf = hf_model(arch, seed=2)
    ids = prompt(30)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = ours_from_hf(hf, dtype=torch.bfloat16)
    layers = [m for m in ours.model.layers.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None for m in layers) == layer_ops.packs()
    got = prompt_logits(ours, ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.03 * (ref.max() - ref.min())
