"""The engine on a CUDA device, where one is present (CI has none: these skip there).

`localserve serve` picks CUDA by itself when PyTorch sees a GPU, so the API tests run their
servers there too on such a machine; these check the engine's own numbers on the device."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from server.engine.grammar import GrammarCompiler, json_schema_grammar
from server.engine.sequence import SamplingParams, Sequence, SequenceStatus
from server.models.loader import build_model
from server.models.simple import prompt_logits
from server.quant import quantize_state_dict
from server.quant.int4 import Int4Linear
from tests.engine.test_engine import run
from tests.engine.test_grammar import EOS, SCHEMA
from tests.engine.test_invariance import model_weights, same_however_computed
from tests.helpers import VOCAB_SIZE, hf_model, make_tokenizer, our_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = torch.device("cuda")


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 260, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_transformers_on_cuda(arch):
    """fp32 weights, compute and pool on the GPU, three prompts batched: transformers' greedy
    tokens on the same GPU."""
    hf = hf_model(arch, seed=7)
    ours = build_model(our_config(hf), dict(hf.state_dict()), {}, CUDA, torch.float32)
    hf = hf.to(CUDA)
    prompts = [prompt(n, i) for i, n in enumerate((5, 33, 17))]
    seqs = [Sequence(p, SamplingParams(max_tokens=12, temperature=0.0)) for p in prompts]
    run(ours, seqs, CUDA)
    for s, p in zip(seqs, prompts, strict=True):
        ref = hf.generate(torch.tensor([p], device=CUDA), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert s.output_token_ids == ref


@pytest.mark.parametrize("hidden", [128, 576], ids=["K-tiles-8", "K-tiles-4"])
def test_int4_kernel_on_cuda_matches_the_dequantized_weights(hidden):
    """tinygemm on the GPU against the same stored int4 weights dequantized (the reference
    path, also in bf16), at a hidden size the kernel packs 8 K tiles to a word and at
    smollm2-135m's 576, which takes 4: logits within bf16 rounding (5% of their norm; a wrong
    packing is ~100%), the same greedy token wherever the reference has no near tie."""
    hf = hf_model("llama", seed=5, hidden_size=hidden, intermediate_size=2 * hidden,
                  **({"num_attention_heads": 9, "num_key_value_heads": 3} if hidden == 576
                     else {}))
    tensors, schemes = quantize_state_dict(dict(hf.state_dict()), 4, 32)
    kernel = build_model(our_config(hf), dict(tensors), schemes, CUDA, torch.bfloat16)
    reference = build_model(our_config(hf), dict(tensors), schemes, CUDA, torch.bfloat16,
                            use_kernels=False)
    layers = [m for m in kernel.modules() if isinstance(m, Int4Linear)]
    assert layers and all(m.kernel_weight is not None for m in layers)
    ids = prompt(40, 1)
    got, want = prompt_logits(kernel, ids), prompt_logits(reference, ids)
    assert (got - want).norm() < 0.05 * want.norm()
    scale = want.abs().max()
    top2 = want.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale  # positions without a near tie
    assert clear.sum() > 20
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


@pytest.mark.parametrize("bits", [4, 16], ids=["int4", "bf16-weights"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_seeded_request_is_the_same_however_it_is_computed_on_cuda(bits, dtype):
    """The fidelity invariant on the GPU: a seeded request's tokens and logprobs do not depend on
    the prefix cache, chunking, batch neighbours or preemption (smollm2-135m's shape)."""
    same_however_computed(build_model(*model_weights(bits), CUDA, dtype), dtype, CUDA)


def test_every_sampling_option_and_a_grammar_run_on_cuda():
    """Each of the sampler's paths on the GPU (every request with temperature > 0 failed there
    once: indices built on the CPU): top-k, top-p, min-p, penalties, logit bias, logprobs, a
    seed, a JSON-schema grammar; the seeded requests again give the same tokens."""
    hf = hf_model("llama", seed=8)
    model = build_model(our_config(hf), dict(hf.state_dict()), {}, CUDA, torch.float32)
    tokenizer = make_tokenizer()
    grammar = GrammarCompiler(tokenizer, VOCAB_SIZE, [EOS]).compile(json_schema_grammar(SCHEMA))

    def requests() -> list[Sequence]:
        options = [dict(temperature=1.0, seed=1, grammar=grammar, max_tokens=80),
                   dict(temperature=0.8, seed=2, top_k=5, top_p=0.9, min_p=0.05,
                        presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                        logit_bias={5: 2.0}, logprobs=True, top_logprobs=3, max_tokens=12,
                        ignore_eos=True),
                   dict(temperature=0.0, logprobs=True, top_logprobs=2, max_tokens=12,
                        ignore_eos=True)]
        return [Sequence(prompt(20, 50 + i), SamplingParams(**o), eos_token_ids=(EOS,))
                for i, o in enumerate(options)]

    first, again = requests(), requests()
    run(model, first, CUDA)
    run(model, again, CUDA)
    assert [s.output_token_ids for s in first] == [s.output_token_ids for s in again]
    constrained, sampled, greedy = first
    assert constrained.status == SequenceStatus.FINISHED_STOPPED
    text = tokenizer.decode(constrained.output_token_ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMA)
    for s, k in ((sampled, 3), (greedy, 2)):
        assert len(s.logprobs) == len(s.output_token_ids) == 12
        assert all(len(tops) == k for _, tops in s.logprobs)
