"""Tiny random-weight models and tokenizers, built in-process (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch

from server.models.tokenizer import byte_to_unicode

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# A reranker's answers as tokens of their own (make_tokenizer(ANSWER_MERGES)): ids 267-269,
# within VOCAB_SIZE's spare rows
ANSWER_MERGES = ("y e", "ye s", "n o")


def tiny_vocab(extra_merges: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Special tokens, the 256 byte tokens and a few merges: (tokens, merges)."""
    chars = list(byte_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e", *extra_merges]
    merged = [m.replace(" ", "") for m in merges]
    return SPECIAL_TOKENS + chars + merged, merges


def make_tokenizer(extra_merges: tuple[str, ...] = (), added: tuple[str, ...] = (),
                   special: tuple[str, ...] = ()):
    """A byte-level BPE fast tokenizer with a chat template (vocab 267, more with merges,
    `added`: tokens of their own that are text, not special, as Qwen3's <think> is, and
    `special`: control tokens decoding drops, as Mistral's [TOOL_CALLS] is)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens, merges = tiny_vocab(extra_merges)
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


VOCAB_SIZE = len(tiny_vocab()[0]) + 5  # a few spare rows, as real checkpoints have
# Qwen3's tokens of its own (text, not special): they take four of the spare rows
QWEN3_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def hf_config(arch: str, **overrides):
    """A tiny transformers config of the given family (fp32, 2 layers, GQA 4:2)."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        GraniteConfig,
        LlamaConfig,
        Ministral3Config,
        MinistralConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
        SmolLM3Config,
    )

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "granite": GraniteConfig, "smollm3": SmolLM3Config, "mistral": MistralConfig,
           "phi3": Phi3Config, "gemma3": Gemma3TextConfig, "ministral": MinistralConfig,
           "ministral3": Ministral3Config, "gemma2": Gemma2Config,
           "qwen3_moe": Qwen3MoeConfig, "gpt_oss": GptOssConfig}[arch]
    kwargs = dict(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    if arch == "qwen3_moe":  # 8 experts, 2 a token, renormalized; layer 1 a plain MLP
        kwargs |= dict(head_dim=32, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=64, norm_topk_prob=True, num_hidden_layers=3,
                       mlp_only_layers=[1])
    if arch == "granite":  # every multiplier away from 1 (real ones: 12, 0.22, 1/128, 8)
        kwargs |= dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                       attention_multiplier=0.1, logits_scaling=2.5)
    if arch == "smollm3":  # layer 0 with rotary embedding, layer 1 without
        kwargs |= dict(no_rope_layer_interval=2, pad_token_id=0)
    if arch == "mistral":  # its own head_dim (not hidden / heads); no window (v0.3, Small 3)
        kwargs |= dict(head_dim=48, sliding_window=None)
    if arch == "ministral":  # windowed and full layers as layer_types say
        kwargs |= dict(sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                       head_dim=32)
    if arch == "ministral3":  # YaRN over a short original context, queries scaled past it
        kwargs |= dict(head_dim=32, pad_token_id=0, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 64})
    if arch == "gemma2":  # windowed and global layers; scores capped low enough to matter here
        kwargs |= dict(num_hidden_layers=3, sliding_window=24, head_dim=32,
                       query_pre_attn_scalar=24, attn_logit_softcapping=0.5,
                       final_logit_softcapping=30.0, pad_token_id=0)
    if arch == "gpt_oss":  # 8 experts, 2 a token; windowed and global layers; YaRN; the clamp
        kwargs |= dict(head_dim=32, num_local_experts=8, num_experts_per_tok=2,  # low enough
                       sliding_window=24, swiglu_limit=0.3, rope_parameters={  # to matter here
                           "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                           "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                           "original_max_position_embeddings": 64})
    if arch == "phi3":  # q/k/v and gate/up stored fused
        kwargs |= dict(pad_token_id=0, sliding_window=None)
    if arch == "gemma3":  # local (windowed, own rope base) and global layers (linear scaling)
        kwargs |= dict(num_hidden_layers=3, sliding_window_pattern=2, sliding_window=24,
                       head_dim=32, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                       rope_scaling={"rope_type": "linear", "factor": 2.0}, pad_token_id=0)
    kwargs.update(overrides)
    return cls(**kwargs)


def hf_model(arch: str, seed: int = 0, **overrides):
    """A random-weight transformers model, weights rounded to bf16 so stored copies are exact."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08).copy_(p.bfloat16().float())
        # RMSNorm weights near their neutral value: 1, or 0 where the norm scales by (1 + w)
        neutral = 0.0 if arch.startswith("gemma") else 1.0
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((neutral + 0.1 * torch.randn_like(p)).bfloat16().float())
    return model.eval()


def save_hf_folder(model, path: Path) -> Path:
    """A local Hugging Face folder: config.json, safetensors, tokenizer files."""
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


def pull_into(home: Path, folder: Path, bits: int = 16) -> None:
    """`localserve pull FOLDER --bits BITS` into the store of $LOCALSERVE_HOME=home."""
    import pytest

    from cli.main import main

    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALSERVE_HOME", str(home))
    try:
        assert main(["pull", str(folder), "--bits", str(bits)]) == 0
    finally:
        mp.undo()


def our_config(model):
    from server.models.config import ModelConfig

    return ModelConfig.from_hf(model.config.to_dict() | {"architectures": [
        type(model).__name__]})


def database_at_version(path: Path, version: int, *statements: str):
    """A localserve database at `path` taken back to schema `version` (the statements undo what
    later versions added), then opened again: what an older release's file becomes at startup.
    Close it."""
    from storage.db import Database

    db = Database(path)

    def downgrade() -> None:
        for statement in statements:
            db.conn.execute(statement)
        db.conn.execute(f"pragma user_version={version}")
    db.call(downgrade)
    db.close()
    return Database(path)
