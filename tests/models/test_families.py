"""Every family, as a user gets it: a tiny random-weight model from its transformers config
(every layer kind present: SmolLM3's layers with and without rotary embedding, Granite's
multipliers away from 1, windowed and global layers), saved with save_pretrained and pulled
from the folder, against transformers itself: fp32 logits on prompts of several lengths,
whole and chunked; greedy tokens through the engine alone, batched and from the prefix cache;
at bits 8 and 4 the KL divergence from the bits-16 model, bounded."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn import functional as F

from server.engine.engine import Engine, EngineConfig
from server.engine.sequence import SamplingParams, Sequence
from server.models.loader import load_model
from server.models.simple import prompt_logits
from storage.models import ModelStore
from tests.helpers import hf_config, hf_model, pull_into, save_hf_folder

# (name, transformers family, config overrides): every layer kind of each family
FAMILIES = [("llama", "llama", {}), ("qwen2", "qwen2", {}), ("qwen3", "qwen3", {}),
            # Llama 3.x: llama3 rope scaling (its original context short enough to matter
            # here), tied embeddings as 3.2 1B/3B
            ("llama3", "llama", {"tie_word_embeddings": True, "rope_scaling": {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
            ("granite", "granite", {}), ("smollm3", "smollm3", {}), ("mistral", "mistral", {}),
            ("phi3", "phi3", {}),
            # Phi-4-mini: a quarter of each head passed through, longrope over a short original
            # context (short factors up to it, long ones beyond: LONGROPE below)
            ("phi4-mini", "phi3", {"partial_rotary_factor": 0.75, "rope_scaling": {
                "rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(12)],
                "long_factor": [1.0 + 0.5 * i for i in range(12)]},
                "original_max_position_embeddings": 64}),
            ("ministral", "ministral", {}), ("ministral3", "ministral3", {}),
            ("qwen3-yarn", "qwen3", {"rope_scaling": {
                "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
            # a window far shorter than the prompts (Mistral 7B v0.1: 4,096; Phi-3-mini-4k: 2,047)
            ("mistral-window", "mistral", {"sliding_window": 24}),
            ("phi3-window", "phi3", {"sliding_window": 40}),
            # local (24-token window, own rope base) and global (linear-scaled rope) layers,
            # (1 + w) norms, sandwich norms, GeGLU, soft-capped logits, tied embeddings
            ("gemma3", "gemma3", {"tie_word_embeddings": True}),
            # Gemma 2: its attention scores soft-capped, windowed and global layers
            ("gemma2", "gemma2", {"tie_word_embeddings": True}),
            # a mixture of experts (8, 2 a token) in layers 0 and 2, a plain MLP in layer 1
            ("qwen3-moe", "qwen3_moe", {}),
            # gpt-oss: attention sinks and biases, a router with a bias, clamped experts
            ("gpt-oss", "gpt_oss", {})]
CPU = torch.device("cpu")
LENGTHS = (5, 37, 130)
# Mean KL(bits 16 || bits B) over the positions of a 130-token prompt, nats, measured on a Zen 4
# (AMD EPYC family 25): int8 0.00003-0.00043, int4 0.002-0.033 on these random weights (Granite
# lowest: its logits are divided by 2.5). The bounds leave ~3x.
KL_BOUND = {8: 0.005, 4: 0.1}


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 260, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=FAMILIES, ids=[f[0] for f in FAMILIES])
def family(request, tmp_path_factory):
    """(transformers' model, the store home holding it pulled at 16, 8 and 4 bits, its alias)"""
    name, arch, overrides = request.param
    hf = hf_model(arch, seed=21, **overrides)
    folder = save_hf_folder(hf, tmp_path_factory.mktemp("hf") / f"tiny-{name}")
    home = tmp_path_factory.mktemp("home")
    for bits in (16, 8, 4):
        pull_into(home, folder, bits)
    return hf, home, f"tiny-{name}"


def loaded(home, monkeypatch, name: str):
    monkeypatch.setenv("LOCALSERVE_HOME", str(home))
    return load_model(ModelStore().resolve(name), CPU, torch.float32).model


def served(hf, n: int) -> tuple[int, int | None]:
    """(greedy tokens to take after an n-token prompt, the context to serve it at): longrope
    picks its factors by the served context (rope.py), transformers by the sequence's length,
    so a sequence that stays within the original context is served at that context."""
    rope = hf.config.rope_parameters or {}
    original = rope.get("original_max_position_embeddings")
    if rope.get("rope_type") != "longrope" or n > original:
        return 32, None
    return min(32, original - n), original


def test_pulled_logits_match_transformers_whole_and_chunked(family, monkeypatch):
    hf, home, alias = family
    ours = loaded(home, monkeypatch, f"{alias}:bf16")
    for n in LENGTHS:
        ids = prompt(n, n)
        ours.serve_context(served(hf, n)[1] or ours.config.max_position_embeddings)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(prompt_logits(ours, ids), ref, atol=1e-3, rtol=0)
        torch.testing.assert_close(prompt_logits(ours, ids, chunk=16), ref, atol=1e-3, rtol=0)


def run(model, seqs, context: int | None = None) -> None:
    engine = Engine(model, EngineConfig(num_blocks=128, kv_cache_dtype=torch.float32,
                                        max_num_batched_tokens=64, max_model_len=context),
                    CPU, torch.float32)
    for s in seqs:
        engine.add(s)
    while engine.has_unfinished:
        engine.step()


def test_greedy_tokens_equal_transformers_alone_batched_and_cached(family, monkeypatch):
    """32 greedy tokens a prompt: each alone, all three in one engine (prompts chunked by a
    64-token budget, decodes batched; with longrope, those served at one context), and again
    after a shared prefix is cached."""
    hf, home, alias = family
    ours = loaded(home, monkeypatch, f"{alias}:bf16")
    prompts = [prompt(n, n) for n in LENGTHS]
    plans = [served(hf, n) for n in LENGTHS]
    want = [hf.generate(torch.tensor([p]), max_new_tokens=k, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            for p, (k, _) in zip(prompts, plans, strict=True)]

    def seq(p, k=32):
        return Sequence(p, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True,
                                          logprobs=True))

    alone = [seq(p, k) for p, (k, _) in zip(prompts, plans, strict=True)]
    for s, (_, context) in zip(alone, plans, strict=True):
        run(ours, [s], context)
    for s in alone:  # each generated token's logprob (decode steps) as transformers' whole
        with torch.no_grad():
            whole = F.log_softmax(hf(torch.tensor([s.token_ids])).logits[0], -1)
        n = s.num_prompt_tokens
        assert [lp for lp, _ in s.logprobs] == pytest.approx(
            [whole[n + k - 1, t].item() for k, t in enumerate(s.output_token_ids)], abs=1e-3)
    batched = [seq(p, k) for p, (k, _) in zip(prompts, plans, strict=True)]
    for context in {c for _, c in plans}:
        run(ours, [s for s, (_, c) in zip(batched, plans, strict=True) if c == context],
            context)
    assert [s.output_token_ids for s in alone] == [s.output_token_ids for s in batched] == want

    engine = Engine(ours, EngineConfig(num_blocks=128, kv_cache_dtype=torch.float32), CPU,
                    torch.float32)
    first, again = seq(prompts[2]), seq(prompts[2])
    for s in (first, again):
        engine.add(s)
        while engine.has_unfinished:
            engine.step()
    assert again.num_cached_tokens >= 112  # the 130-token prompt's whole blocks
    assert again.output_token_ids == want[2]


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_models_stay_close_to_bits_16(family, monkeypatch, bits):
    _, home, alias = family
    full = loaded(home, monkeypatch, f"{alias}:bf16")
    quantized = loaded(home, monkeypatch, f"{alias}:int{bits}")
    ids = prompt(130, 130)
    p = F.log_softmax(prompt_logits(full, ids), -1)
    q = F.log_softmax(prompt_logits(quantized, ids), -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    print(f"{alias} int{bits}: KL {kl:.5f}")  # reported (pytest -s)
    assert kl < KL_BOUND[bits]


def test_which_layers_are_windowed_is_read_from_each_config():
    from server.models.config import ModelConfig

    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
             "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 1,
             "max_position_embeddings": 64, "sliding_window": 32}

    def windows(config):
        c = ModelConfig.from_hf(config)
        return [c.layer_window(i) for i in range(c.num_layers)]

    assert windows(qwen2 | {"use_sliding_window": False}) == [None, None]
    assert windows(qwen2 | {"use_sliding_window": True}) == [32, 32]
    assert windows(qwen2 | {"layer_types": ["full_attention", "sliding_attention"]}) == [
        None, 32]
    mistral = qwen2 | {"architectures": ["MistralForCausalLM"]}
    assert windows(mistral) == [32, 32] and windows(mistral | {"sliding_window": None}) == [
        None, None]


@pytest.mark.parametrize(("change", "said"), [
    ({"partial_rotary_factor": 0.25, "head_dim": 12}, "partial rotary embedding over 3 of 12"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "unsupported rope scaling 'dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
     "longrope rope scaling without original_max_position_embeddings"),
    ({"architectures": ["Gemma3nForCausalLM"]}, "unsupported architecture 'Gemma3nForCausalLM'"),
])
def test_what_is_not_implemented_yet_is_refused_by_name(change, said):
    from server.models.config import ModelConfig, UnsupportedModelError

    config = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
              "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}
    with pytest.raises(UnsupportedModelError, match=said):
        ModelConfig.from_hf(config | change)


def vision_language(arch: str):
    """A tiny vision-language model of transformers (Gemma 3 4B's kind, Mistral Small 3.1's),
    weights rounded to bf16 as hf_model's."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
    )

    # Gemma 3's published configs cap no logits (transformers' vision-language wrapper would
    # not apply the cap anyway)
    text = hf_config(arch, **({"final_logit_softcapping": None} if arch == "gemma3" else {}))
    text = text.to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    if arch == "gemma3":
        config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
        cls = Gemma3ForConditionalGeneration
    else:
        config = Mistral3Config(text_config=text, vision_config=vision | {
            "model_type": "pixtral", "head_dim": 16})
        cls = Mistral3ForConditionalGeneration
    torch.manual_seed(4)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            neutral = (0.0 if arch == "gemma3" else 1.0) if "norm" in name else 0.0
            p.normal_(neutral, 0.08).copy_(p.bfloat16().float())
    return model


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_a_vision_language_checkpoint_pulls_as_its_language_model(arch, tmp_path, monkeypatch):
    """Gemma 3 4B and up, Mistral Small 3.1/3.2 are saved with a vision tower: their language
    model is pulled (text in, text out) and gives the whole model's logits on text."""
    hf = vision_language(arch)
    folder = save_hf_folder(hf, tmp_path / f"tiny-vl-{arch}")
    pull_into(tmp_path / "home", folder, 16)
    ours = loaded(tmp_path / "home", monkeypatch, f"tiny-vl-{arch}:bf16")
    assert ours.config.architecture == {"gemma3": "Gemma3ForCausalLM",
                                        "mistral": "MistralForCausalLM"}[arch]
    ids = prompt(37, 3)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prompt_logits(ours, ids), ref, atol=1e-3, rtol=0)


def test_gpt_oss_mxfp4_experts_pull_as_transformers_reads_them(tmp_path, monkeypatch):
    """gpt-oss as published: its experts' weights in MXFP4 (_blocks and _scales). Pulled, the
    model gives the logits transformers gives the same folder, decoded (Mxfp4Config)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    folder = save_hf_folder(hf_model("gpt_oss", seed=3), tmp_path / "tiny-mxfp4")
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, k, n = tensors.pop(name).shape  # [experts, in, out]
        tensors[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=g,
                                                  dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(122, 126, (e, n, k // 32), generator=g,
                                                  dtype=torch.uint8)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    ref = AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32)
    pull_into(tmp_path / "home", folder, 16)
    ours = loaded(tmp_path / "home", monkeypatch, "tiny-mxfp4:bf16")
    ids = prompt(37, 5)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prompt_logits(ours, ids), want, atol=1e-3, rtol=0)
