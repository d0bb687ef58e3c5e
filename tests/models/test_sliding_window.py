"""Sliding-window layers keep only their window (window_blocks.py): a conversation far longer
than the window, through the engine, holds a bounded number of window blocks at every step,
its windowed layers' caches are that small pool, and its tokens are transformers' own. Gemma 3
(local and global layers) and Mistral with a window (every layer windowed: the main pool holds
no memory at all)."""

from __future__ import annotations

import pytest
import torch

from server.engine.engine import Engine, EngineConfig
from server.engine.sequence import SamplingParams, Sequence
from server.engine.window_blocks import NO_BLOCK
from tests.helpers import hf_model, pull_into, save_hf_folder
from tests.models.test_families import loaded, prompt

CPU = torch.device("cpu")
WINDOW, BLOCK, CHUNK = 24, 16, 32


@pytest.fixture(scope="module", params=[("gemma3", {}), ("mistral", {"sliding_window": WINDOW})],
                ids=["gemma3", "mistral-window"])
def family(request, tmp_path_factory):
    arch, overrides = request.param
    hf = hf_model(arch, seed=5, **overrides)
    folder = save_hf_folder(hf, tmp_path_factory.mktemp("hf") / f"tiny-{arch}")
    home = tmp_path_factory.mktemp("home")
    pull_into(home, folder, 16)
    return hf, home, f"tiny-{arch}:bf16"


def greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens; the mask given, since a reply may hold the pad id."""
    x = torch.tensor([ids])
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("cache_bytes", [256 << 20, 0], ids=["prefix-cache", "no-cache-budget"])
def test_a_conversation_longer_than_the_window_holds_only_the_window(family, monkeypatch,
                                                                       cache_bytes):
    hf, home, alias = family
    model = loaded(home, monkeypatch, alias)
    engine = Engine(model, EngineConfig(num_blocks=64, kv_cache_dtype=torch.float32,
                                        max_num_batched_tokens=CHUNK, max_itl_stretch=None,
                                        prefix_cache_bytes=cache_bytes), CPU, torch.float32)
    bm = engine.block_manager
    window = bm.window
    assert window is not None and window.window == WINDOW
    windowed = [i for i in range(model.config.num_layers) if model.config.layer_window(i)]
    for i, (k, _) in enumerate(engine.runner.kv_caches):  # the windowed layers' small pool
        pool = window if i in windowed else bm
        assert k.shape[1] == len(pool.blocks) * BLOCK + 1
    chunk_bound = -(-(WINDOW + CHUNK) // BLOCK) + 1  # a chunk's blocks and the window before
    decode_bound = -(-(WINDOW - 1) // BLOCK) + 2  # the window and the block being filled

    def converse(ids: list[int], n: int) -> Sequence:
        s = Sequence(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                         logprobs=True))
        engine.add(s)
        while engine.has_unfinished:
            out = engine.step().scheduled
            held = [b for b in s.window_table if b != NO_BLOCK]
            if s.status.is_finished:
                assert window.num_used_blocks == 0
                continue
            assert window.num_used_blocks == len(held) <= chunk_bound
            if out.num_new_tokens == [1]:
                assert len(held) <= decode_bound
            assert len(s.block_table) == -(-s.num_computed_tokens // BLOCK)  # all of it
            if not cache_bytes:  # freed window blocks are written again before fresh ones
                assert window.num_resident_blocks <= chunk_bound
        return s

    first = prompt(60, 1)
    reply = converse(first, 40).output_token_ids
    assert reply == greedy(hf, first, 40)
    follow_up = first + reply + prompt(30, 2)  # 130 tokens, then 40 more: 7 windows long
    second = converse(follow_up, 40)
    assert second.output_token_ids == greedy(hf, follow_up, 40)
    with torch.no_grad():  # each token's logprob, as transformers computes it whole
        whole = torch.log_softmax(hf(torch.tensor([second.token_ids])).logits[0], -1)
    want = [whole[len(follow_up) + k - 1, t].item()
            for k, t in enumerate(second.output_token_ids)]
    assert [lp for lp, _ in second.logprobs] == pytest.approx(want, abs=1e-3)
    if cache_bytes:  # the first turn's prompt blocks (its reply's were generated tokens)
        assert second.num_cached_tokens == 48
    assert bm.num_resident_blocks >= -(-170 // BLOCK)  # the main pool held the whole context
