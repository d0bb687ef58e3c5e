"""Batch invariance at the real model's shapes: a seeded request's tokens and logprobs are the
same bit for bit cold, from the prefix cache, in chunks, among others and after preemption.

Kernels switch by shape (an fp32 GEMM below 4 rows, a bf16 GEMM at 512 rows of a 1536-wide
input, a column in a tail block of scores: all measured), so tiny models cannot show it: this
uses SmolLM2-135M's config (576 wide, 9:3 heads, 49,152 tokens; 8 of its 30 layers where the
test says nothing of depth) with random weights, in the compute dtype this machine picks and in
fp32.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import server.kernels.layer_ops as layer_ops
import server.models.attention as attention
from server.engine.engine import Engine, EngineConfig
from server.engine.sequence import PRIORITY_BATCH, SamplingParams, Sequence
from server.models.config import ModelConfig
from server.models.device import pick_dtype
from server.models.loader import build_model
from server.quant import quantize_state_dict

CPU = torch.device("cpu")
SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576,
    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
DTYPES = sorted({pick_dtype(CPU, None, 16), torch.float32}, key=str)  # bf16 where native
# The invariance tests' model: SmolLM2-135M's widths and vocabulary with 8 of its 30 layers, as
# the mixtures' tests have (the layers are alike: a row's bits that hold through 8 hold through
# 30, at a quarter of the compute)
EIGHT_LAYERS = SMOLLM2_135M | {"num_hidden_layers": 8}


def random_state(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, d = config.hidden_size, config.head_dim

    def rnd(*shape, std=0.05):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    # RMSNorm weights at their neutral value: 1, or 0 where the norm scales by (1 + w) (Gemma)
    ones = torch.full((h,), 1.0 - config.norm_offset, dtype=torch.bfloat16)
    state = {"model.embed_tokens.weight": rnd(config.vocab_size, h, std=0.5),
             "model.norm.weight": ones}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": rnd(config.num_heads * d, h),
                  p + "self_attn.k_proj.weight": rnd(config.num_kv_heads * d, h),
                  p + "self_attn.v_proj.weight": rnd(config.num_kv_heads * d, h),
                  p + "self_attn.o_proj.weight": rnd(h, config.num_heads * d),
                  p + "input_layernorm.weight": ones, p + "post_attention_layernorm.weight": ones}
        if config.qkv_bias:
            state |= {p + f"self_attn.{n}_proj.bias": rnd(w * d) for n, w in (
                ("q", config.num_heads), ("k", config.num_kv_heads), ("v", config.num_kv_heads))}
        if config.o_bias:
            state[p + "self_attn.o_proj.bias"] = rnd(h)
        if config.attention_sinks:
            state[p + "self_attn.sinks"] = rnd(config.num_heads, std=1.0)
        state |= _mlp_state(config, i, p, rnd)
        if config.qk_norm:
            state |= {p + "self_attn.q_norm.weight": rnd(d, std=0.2) + 1 - config.norm_offset,
                      p + "self_attn.k_norm.weight": rnd(d, std=0.2) + 1 - config.norm_offset}
        if config.sandwich_norms:
            state |= {p + "pre_feedforward_layernorm.weight": ones,
                      p + "post_feedforward_layernorm.weight": ones}
    return state


def _mlp_state(config: ModelConfig, i: int, p: str, rnd) -> dict[str, torch.Tensor]:
    """Layer i's MLP, or its experts and router (spread enough that the router's choices are
    not near ties): Qwen3-MoE's gate/up/down, gpt-oss's with biases."""
    h = config.hidden_size
    if not config.is_moe(i):
        inter = config.intermediate_size
        return {p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                p + "mlp.down_proj.weight": rnd(h, inter)}
    width, state = config.moe_intermediate_size, {}
    for e in range(config.num_experts):
        q = p + f"mlp.experts.{e}."
        state |= {q + "gate_proj.weight": rnd(width, h), q + "up_proj.weight": rnd(width, h),
                  q + "down_proj.weight": rnd(h, width)}
        if config.expert_kind == "clamped":  # gpt-oss's biases
            state |= {q + "gate_proj.bias": rnd(width), q + "up_proj.bias": rnd(width),
                      q + "down_proj.bias": rnd(h)}
    router = p + ("mlp.router." if config.expert_kind == "clamped" else "mlp.gate.")
    state[router + "weight"] = rnd(config.num_experts, h, std=0.5)
    if config.expert_kind == "clamped":
        state[router + "bias"] = rnd(config.num_experts)
    return state


def model_weights(bits: int):
    config = ModelConfig.from_hf(EIGHT_LAYERS)
    state, schemes = random_state(config), {}
    if bits != 16:
        state, schemes = quantize_state_dict(state, bits)
    return config, state, schemes


@pytest.fixture(scope="module", params=[4, 8, 16], ids=["int4", "int8", "bf16-weights"])
def weights(request):
    return model_weights(request.param)


@pytest.fixture(scope="module")
def int4_weights():
    return model_weights(4)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def seeded(**kw) -> Sequence:
    # 150 prompt tokens: two prefix-cache blocks short of 10 full ones, a tail left to compute.
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=42, logprobs=True,
                            top_logprobs=2, ignore_eos=True)
    return Sequence(prompt(150, 1), params, **kw)


def others(n: int) -> list[Sequence]:
    """Sequences of other lengths (decoding while the seeded one prefills, and the reverse)."""
    return [Sequence(prompt(9 + 41 * i, 100 + i), SamplingParams(
        max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)) for i in range(n)]


def result(seq: Sequence):
    return seq.output_token_ids, seq.logprobs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_seeded_request_is_the_same_however_it_is_computed(weights, dtype):
    same_however_computed(build_model(*weights, CPU, dtype), dtype)


def test_a_sliding_window_model_gives_the_same_however_computed():
    """Mistral's shape of layers with a 64-token window, shorter than the seeded prompt (150):
    its decodes attend over shifted contexts (AttentionGroup.within) and its prompts in masked
    tiles, whether the request is alone, cached, chunked, batched or preempted."""
    config = ModelConfig.from_hf(EIGHT_LAYERS | dict(architectures=["MistralForCausalLM"],
                                                     model_type="mistral", sliding_window=64))
    assert [config.layer_window(i) for i in (0, 7)] == [64, 64]
    state, schemes = quantize_state_dict(random_state(config), 4)
    dtype = pick_dtype(CPU, None, 4)
    same_however_computed(build_model(config, state, schemes, CPU, dtype), dtype)


def test_a_mixture_of_experts_gives_the_same_however_computed():
    """Qwen3-MoE's layers (16 experts, 4 a token) on SmolLM2-135M's shape, 8 layers: a token's
    experts and their weighted sum do not depend on the other tokens of its step (moe.py)."""
    config = ModelConfig.from_hf(SMOLLM2_135M | dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=8,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True))
    assert config.is_moe(0) and config.num_experts == 16
    state, schemes = quantize_state_dict(random_state(config), 4)
    dtype = pick_dtype(CPU, None, 4)
    same_however_computed(build_model(config, state, schemes, CPU, dtype), dtype)


def test_gpt_oss_gives_the_same_however_computed():
    """gpt-oss's layers on SmolLM2-135M's shape, 8 layers: attention sinks and biases, windowed
    (64) and global layers, a router with a bias, 16 clamped experts, 4 a token."""
    config = ModelConfig.from_hf(SMOLLM2_135M | dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=8,
        num_local_experts=16, num_experts_per_tok=4, intermediate_size=256, sliding_window=64,
        attention_bias=True, layer_types=["sliding_attention", "full_attention"] * 4))
    assert config.attention_sinks and config.layer_window(0) == 64 and config.is_moe(7)
    state, schemes = quantize_state_dict(random_state(config), 4)
    dtype = pick_dtype(CPU, None, 4)
    same_however_computed(build_model(config, state, schemes, CPU, dtype), dtype)


@pytest.mark.parametrize("in_place", [0, 64], ids=["tiles-only", "tiles-from-64"])
def test_either_prompt_attention_gives_the_same_however_computed(int4_weights, in_place,
                                                                  monkeypatch):
    """Prompt positions below layer_ops.prompt_positions() attend in layer_ops.paged_prompt
    (all 150 of the seeded prompt's), the rest in tiles: here the tiles for every position, and
    for those from 64 on (chunks straddle the two), each mode the same however computed."""
    assert layer_ops.enabled()  # a C compiler, as on every machine of the project and CI
    calls = {"in place": 0, "tiles": 0}

    def counted(fn, key):
        def call(*args, **kw):
            calls[key] += 1
            return fn(*args, **kw)
        return call
    monkeypatch.setattr(layer_ops, "prompt_positions", lambda: in_place)
    monkeypatch.setattr(layer_ops, "paged_prompt", counted(layer_ops.paged_prompt, "in place"))
    monkeypatch.setattr(attention, "_prompt_tiles", counted(attention._prompt_tiles, "tiles"))
    dtype = pick_dtype(CPU, None, 4)
    same_however_computed(build_model(*int4_weights, CPU, dtype), dtype)
    assert calls["tiles"] and bool(calls["in place"]) == bool(in_place)


def test_plain_avx2_activations_keep_a_request_the_same_however_computed(int4_weights,
                                                                        monkeypatch, tmp_path):
    """On plain AVX2's default (int8 activations for every int4 layer but q/k/v; avx2_gemm.c
    built for Haswell, so on every AVX2 machine): a seeded request the same however computed."""
    from server.kernels import cpu_gemm
    from server.quant.int4 import Int4Linear
    from tests.quant.conftest import KERNEL_KINDS
    from tests.quant.test_quant import build_avx2_gemm

    if "avx2" not in KERNEL_KINDS:
        pytest.skip("needs AVX2, FMA and F16C")
    lib, _, _ = build_avx2_gemm(tmp_path, "-march=haswell")
    monkeypatch.setattr(cpu_gemm, "_state", [lib])
    monkeypatch.delenv("LOCALSERVE_ACTIVATIONS", raising=False)
    model = build_model(*int4_weights, CPU, torch.float32)
    starts = [m.int8_from for m in model.modules() if isinstance(m, Int4Linear)]
    assert cpu_gemm.int8_path(lib) and 0 in starts and any(starts)
    same_however_computed(model, torch.float32)


def same_however_computed(model, dtype, device=CPU) -> None:
    def engine(**config) -> Engine:
        return Engine(model, EngineConfig(**({"num_blocks": 128} | config)), device, dtype)

    def finish(e: Engine) -> None:
        while e.has_unfinished:
            e.step()

    e = engine()
    cold, cached = seeded(), seeded()
    e.add(cold)
    finish(e)
    e.add(cached)  # its prompt is in the prefix cache now
    finish(e)
    assert cached.num_cached_tokens == 144
    chunked = seeded()
    e = engine(max_num_batched_tokens=24, max_itl_stretch=None, enable_prefix_caching=False)
    e.add(chunked)
    finish(e)
    batched = seeded()
    e = engine(max_num_batched_tokens=512)
    for s in others(3) + [batched] + others(6)[3:]:
        e.add(s)
    finish(e)
    # Preempted and recomputed: 14 blocks of 16 cannot hold it beside interactive sequences
    # that keep growing, so the batch-priority seeded one is preempted and resumed.
    preempted = seeded(priority=PRIORITY_BATCH)
    e = engine(num_blocks=14, enable_prefix_caching=False)
    e.add(preempted)
    e.step()
    e.step()
    for s in [Sequence(prompt(40, 200 + i), SamplingParams(max_tokens=30, temperature=0.0,
                                                          ignore_eos=True)) for i in range(2)]:
        e.add(s)
    finish(e)
    assert preempted.num_preemptions > 0
    want = result(cold)
    assert result(cached) == want
    assert result(chunked) == want
    assert result(batched) == want
    assert result(preempted) == want
    # Predicted outputs (speculation.py): its tokens drafted and checked several a step, alone
    # (decode steps) and among others (steps with prompts), the prediction right or not.
    for tokens, among in ((want[0], 0), (want[0][:2] + [7, 7, 7, 7], 6)):
        predicted = seeded()
        predicted.params = replace(predicted.params, prediction=tuple(tokens))
        e = engine()
        for s in others(among)[:3] + [predicted] + others(among)[3:]:
            e.add(s)
        finish(e)
        assert predicted.num_accepted_prediction > 0 or among
        assert result(predicted) == want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("recache", [False, True], ids=["reply-recomputed", "recached-idle"])
def test_a_follow_up_turn_is_the_same_whatever_the_cache_holds_of_the_reply(weights, dtype,
                                                                            recache):
    """A chat's next turn repeats the last reply in its prompt. The reply's blocks were computed
    as generated tokens (decode attention, the decode plan), which round otherwise than prompt
    tokens; reused, they made the next turn's logprobs depend on whether the cache still held
    them. Now the follow-up computes the reply as prompt, as a cold server does, and reuses only
    the first turn's prompt blocks; or (recache.py) the idle engine has computed it so, and the
    follow-up reuses those blocks with the same numbers."""
    model = build_model(*weights, CPU, dtype)

    def run(e: Engine, ids: list[int], n: int) -> Sequence:
        s = Sequence(ids, SamplingParams(max_tokens=n, temperature=0.9, seed=7, logprobs=True,
                                         top_logprobs=2, ignore_eos=True))
        e.add(s)
        while e.has_unfinished:
            e.step()
        return s

    first = prompt(40, 1)
    config = EngineConfig(num_blocks=128, recache_replies_after=0.0 if recache else None)
    e = Engine(model, config, CPU, dtype)
    reply = run(e, first, 60).output_token_ids  # run() steps until idle: recached by then
    follow_up = first + reply + prompt(5, 2)
    warm = run(e, follow_up, 6)
    # the first turn's two full prompt blocks; recached, the reply's too (100 tokens)
    assert warm.num_cached_tokens == (96 if recache else 32)
    cold = run(Engine(model, EngineConfig(num_blocks=128), CPU, dtype), follow_up, 6)
    assert result(warm) == result(cold)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_steps_take_the_decode_plan_and_give_the_modules_numbers(weights, dtype,
                                                                        monkeypatch):
    """Steps of decodes only run through decode_plan.py where the layers are int4 or int8 in
    our kernels' layout, or unquantized (dense_gemm.c), in either compute dtype (fp32 where the
    kernels take bf16 only: x rounded and their outputs widened, as the layers do); the same
    request with the plan off (the modules) gets the same tokens and logprobs bit for bit."""
    plan_gives_the_modules_numbers(build_model(*weights, CPU, dtype), dtype, monkeypatch)


# Each family's layer kinds that the decode plan runs, on SmolLM2-135M's shape at int4
PLANNED_FAMILIES = {
    "qwen3 (q/k norms)": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
    "mistral (a 64-token window)": {"architectures": ["MistralForCausalLM"],
                                    "sliding_window": 64},
    "granite (multipliers)": {"architectures": ["GraniteForCausalLM"],
                              "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                              "attention_multiplier": 0.015625, "logits_scaling": 8.0},
    "smollm3 (rotary-less layers)": {"architectures": ["SmolLM3ForCausalLM"],
                                     "no_rope_layers": [int((i + 1) % 4 != 0)
                                                        for i in range(30)]},
    "ministral3 (queries scaled by position)": {
        "architectures": ["Ministral3ForCausalLM"], "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 32}},
    "gemma3 (sandwich norms, GeGLU, local layers)": {
        "architectures": ["Gemma3ForCausalLM"], "sliding_window": 64,
        "query_pre_attn_scalar": 64, "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": 30.0,
        "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention"
                        for i in range(30)]},
}


@pytest.mark.parametrize("family", PLANNED_FAMILIES)
def test_each_family_s_decode_steps_give_the_modules_numbers(family, monkeypatch):
    config = ModelConfig.from_hf(SMOLLM2_135M | PLANNED_FAMILIES[family])
    state, schemes = quantize_state_dict(random_state(config), 4)
    dtype = pick_dtype(CPU, None, 4)
    plan_gives_the_modules_numbers(build_model(config, state, schemes, CPU, dtype), dtype,
                                   monkeypatch)


def plan_gives_the_modules_numbers(model, dtype, monkeypatch) -> None:
    from server.kernels import cpu_gemm
    from server.models.decode_plan import DecodePlan

    plan = model._decode_plan()
    if cpu_gemm.checked() is None:  # no kernels here
        assert plan is None
        return
    assert plan is not None
    runs = []
    real_run = DecodePlan.run

    def counted(self, *args):
        runs.append(1)
        return real_run(self, *args)

    def generate():
        e = Engine(model, EngineConfig(num_blocks=128), CPU, dtype)
        seqs = [seeded()] + others(3)
        for s in seqs:
            e.add(s)
        while e.has_unfinished:
            e.step()
        return [result(s) for s in seqs]

    monkeypatch.setattr(DecodePlan, "run", counted)
    planned = generate()
    assert len(runs) >= 5  # the decode steps
    monkeypatch.setattr(DecodePlan, "takes", lambda *args: False)
    runs.clear()
    assert generate() == planned and not runs


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="PyTorch without MKL")
def test_prompt_tiles_give_every_row_the_same_bits_on_mkls_avx2_path():
    """MKL's fp32 GEMM on its AVX2 code path (what AVX2-only CPUs run; forced here with
    MKL_ENABLE_INSTRUCTIONS, so that every machine checks it) gave rows 30 and 31 of a 32-row
    tile other bits, and test_seeded_request_is_the_same_however_it_is_computed failed for bf16
    weights in fp32; server/__init__.py sets MKL's strict reproducibility. In a fresh process,
    as the server's: a 150-token prompt's rows through tiled_mm whole and in chunks of 24."""
    code = textwrap.dedent("""
        import torch
        import server
        from server.quant.rows import PROMPT_TILE, tiled_mm
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(150, 576, generator=g), torch.randn(1536, 576, generator=g).t()
        whole = tiled_mm(x, w, PROMPT_TILE)
        parts = torch.cat([tiled_mm(x[i:i + 24], w, PROMPT_TILE) for i in range(0, 150, 24)])
        print(int((whole != parts).any(dim=1).sum()))
    """)
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    env["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "0"  # rows that differ
