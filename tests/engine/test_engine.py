"""The engine's tokens against transformers' and against itself under every scheduling path."""

from __future__ import annotations

import pytest
import torch

from server.engine.engine import Engine, EngineConfig
from server.engine.pacing import MIN_PREFILL_CHUNK, PrefillPacer
from server.engine.scheduler import RequestTooLargeError
from server.engine.sequence import PRIORITY_BATCH, Pooling, SamplingParams, Sequence, SequenceStatus
from server.models.loader import build_model
from tests.helpers import hf_model, our_config

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def models(request):
    hf = hf_model(request.param, seed=7)
    ours = build_model(our_config(hf), dict(hf.state_dict()), {}, CPU, torch.float32)
    return hf, ours


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 260, (n,), generator=g).tolist()


def greedy(max_tokens=10, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run(model, seqs, device=CPU, **config):
    """In fp32, pool too: the tests compare with references computed in fp32 (the default pool
    is bf16 on CPUs without native bf16)."""
    config = {"num_blocks": 128, "kv_cache_dtype": torch.float32} | config
    engine = Engine(model, EngineConfig(**config), device, torch.float32)
    for s in seqs:
        engine.add(s)
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        assert steps < 2000
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    return engine


def solo(model, p, max_tokens=10):
    s = Sequence(p, greedy(max_tokens))
    run(model, [s])
    return s.output_token_ids


def test_greedy_equals_transformers(models):
    hf, ours = models
    prompts = [prompt(n, i) for i, n in enumerate((5, 33, 17))]
    seqs = [Sequence(p, greedy(12)) for p in prompts]
    run(ours, seqs)
    for s, p in zip(seqs, prompts, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert s.output_token_ids == ref


POOLS = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("pool", POOLS)
def test_chunked_prefill_gives_the_same_tokens(llama, pool):
    p = prompt(70, 1)
    whole = Sequence(p, greedy())
    run(llama, [whole], max_num_batched_tokens=512, kv_cache_dtype=pool)
    chunked = Sequence(p, greedy())
    engine = run(llama, [chunked], max_num_batched_tokens=16, kv_cache_dtype=pool)
    assert chunked.output_token_ids == whole.output_token_ids
    assert engine.metrics.num_steps >= 70 // 16 + 10


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("kind, second", [
    ("full blocks", lambda p: p[:32] + prompt(9, 99)),  # shares two full blocks of 16
    ("partial block", lambda p: p[:40] + prompt(5, 98)),  # shares 2 blocks + half of a third
    ("whole prompt", lambda p: list(p)),  # everything but the last token hits
])
def test_prefix_hit_gives_the_same_tokens(llama, kind, second, pool):
    """A prompt found in the cache, to the token (a partial block's keys and values copied from
    the cached block), gives the logprobs it gives cold, bit for bit."""
    p = prompt(48, 2)
    q = second(p)
    cold = Sequence(q, greedy(logprobs=True))
    run(llama, [cold], kv_cache_dtype=pool)
    engine = Engine(llama, EngineConfig(num_blocks=64, kv_cache_dtype=pool), CPU, torch.float32)
    first = Sequence(p, greedy())
    engine.add(first)
    while engine.has_unfinished:
        engine.step()
    hit = Sequence(q, greedy(logprobs=True))
    engine.add(hit)
    while engine.has_unfinished:
        engine.step()
    expected_hit = {"full blocks": 32, "partial block": 40, "whole prompt": 47}[kind]
    assert hit.num_cached_tokens == expected_hit
    assert (hit.output_token_ids, hit.logprobs) == (cold.output_token_ids, cold.logprobs)


def test_preempted_and_resumed_equals_solo(llama):
    prompts = [prompt(20, 10 + i) for i in range(4)]
    alone = [solo(llama, p, 24) for p in prompts]
    seqs = [Sequence(p, greedy(24), priority=PRIORITY_BATCH if i % 2 else 0)
            for i, p in enumerate(prompts)]
    # 10 blocks of 16 for 4 sequences growing to 44 tokens (3 blocks each): preemption needed.
    engine = run(llama, seqs, num_blocks=10)
    assert engine.scheduler.num_preemptions > 0
    assert any(s.num_preemptions for s in seqs)
    assert [s.output_token_ids for s in seqs] == alone


def test_batched_with_fifteen_others_equals_alone(llama):
    target = prompt(25, 50)
    alone = solo(llama, target, 16)
    others = [Sequence(prompt(5 + 3 * i, 60 + i), greedy(4 + i)) for i in range(15)]
    mine = Sequence(target, greedy(16))
    run(llama, others[:7] + [mine] + others[7:], max_num_batched_tokens=64)
    assert mine.output_token_ids == alone


def test_too_big_is_refused_and_the_rest_complete(llama):
    engine = Engine(llama, EngineConfig(num_blocks=4, block_size=16, kv_cache_dtype=torch.float32),
                    CPU, torch.float32)
    small = [Sequence(prompt(10, i), greedy(8)) for i in range(3)]
    engine.add(small[0])
    with pytest.raises(RequestTooLargeError):
        engine.add(Sequence(prompt(60, 5), greedy(10)))  # 70 tokens > 64 in the whole pool
    for s in small[1:]:
        engine.add(s)
    while engine.has_unfinished:
        engine.step()
    assert all(s.status == SequenceStatus.FINISHED_LENGTH for s in small)


def test_seed_reproducible_and_independent_of_batch(llama):
    p = prompt(12, 3)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    a, b = Sequence(p, params), Sequence(p, params)
    run(llama, [a])
    run(llama, [Sequence(prompt(7, 4), SamplingParams(max_tokens=5)), b])
    assert a.output_token_ids == b.output_token_ids
    c = Sequence(p, SamplingParams(max_tokens=12, temperature=1.0, seed=4321))
    run(llama, [c])
    assert c.output_token_ids != a.output_token_ids


def test_last_layer_computing_only_the_sampled_rows_changes_no_number(llama):
    """Past the last layer's attention a step computes only the rows it samples from, unless an
    embedding request (which reads every row) shares the step: a chat's logprobs are the same
    bit for bit either way, its prompt steps shared or not."""
    p = prompt(40, 8)
    alone = Sequence(p, greedy(6, logprobs=True))
    run(llama, [alone], max_num_batched_tokens=16)
    shared = Sequence(p, greedy(6, logprobs=True))
    embedding = Sequence(prompt(60, 9), SamplingParams(max_tokens=0), pooling=Pooling("mean"))
    engine = run(llama, [shared, embedding], max_num_batched_tokens=16)
    assert engine.metrics.num_steps > 6 and embedding.embedding is not None
    assert (shared.output_token_ids, shared.logprobs) == (alone.output_token_ids, alone.logprobs)


def test_logprobs_recorded(llama):
    s = Sequence(prompt(6, 5), greedy(4, logprobs=True, top_logprobs=3))
    run(llama, [s])
    assert len(s.logprobs) == 4
    for token, (lp, tops) in zip(s.output_token_ids, s.logprobs, strict=True):
        assert len(tops) == 3 and tops[0][0] == token  # greedy: the top token was chosen
        assert lp == pytest.approx(tops[0][1]) and lp <= 0


def test_stats_and_pool_sizing(llama):
    engine = Engine(llama, EngineConfig(kv_cache_bytes=1 << 20, kv_cache_dtype=torch.float32),
                    CPU, torch.float32)
    # Tiny llama: 2 layers x 16 tokens x 2 kv heads x 32 dims x 4 bytes x (k, v) = 16 KiB/block.
    assert len(engine.block_manager.blocks) == (1 << 20) // (2 * 2 * 16 * 2 * 32 * 4) == 64
    s = Sequence(prompt(40, 1), greedy(3))
    engine.add(s)
    engine.step()
    stats = engine.stats()
    assert stats["num_running"] == 1 and stats["kv_blocks_used"] == 3  # ceil(40 / 16)
    assert stats["prefix_cache_queries"] == 40 and stats["prefix_cache_hits"] == 0
    assert stats["prompt_tokens"] == {0: 40} and stats["generation_tokens"] == {0: 1}


def test_the_warm_up_leaves_the_engine_as_new(llama):
    """The server's engine runs a request of its own before any real one (first calls' costs at
    load): afterwards the pool, the prefix cache, the counters and the pacer are as new, and a
    request gets what it gets from an engine that never warmed up."""
    config = EngineConfig(num_blocks=64, kv_cache_dtype=torch.float32)
    engine = Engine(llama, config, CPU, torch.float32)
    fresh = engine.stats()
    engine.warm_up()
    assert engine.stats() == fresh
    assert engine.block_manager.num_resident_blocks == 0
    assert engine.pacer.decode_seconds is None and engine.pacer.token_seconds is None
    s = Sequence(prompt(40, 1), greedy(6))
    engine.add(s)
    while engine.has_unfinished:
        engine.step()
    assert s.num_cached_tokens == 0 and s.output_token_ids == solo(llama, prompt(40, 1), 6)
    for small in (EngineConfig(num_blocks=2), EngineConfig(num_blocks=1, block_size=2),
                  EngineConfig(max_model_len=3)):  # a pool or context too small for 48 tokens
        engine = Engine(llama, small, CPU, torch.float32)
        engine.warm_up()
        assert engine.stats()["kv_blocks_cached_free"] == 0 and not engine.has_unfinished


def test_prefill_pacer_sizes_chunks_from_measured_costs():
    pacer = PrefillPacer(stretch=2.0, min_tokens=16)
    assert pacer.cap() is None  # nothing measured yet
    pacer.observe(num_decodes=0, num_prompt_tokens=400, seconds=2.0)  # 5 ms per prompt token
    assert pacer.cap() is None  # no decode step seen yet
    pacer.observe(num_decodes=16, num_prompt_tokens=0, seconds=0.15)
    assert pacer.cap() == 30  # one more decode step's worth: 0.15 s / 5 ms
    # A mixed step: its time beyond the decodes is charged to its prompt tokens.
    pacer.observe(num_decodes=16, num_prompt_tokens=30, seconds=0.15 + 30 * 0.010)
    assert pacer.token_seconds == pytest.approx(0.7 * 0.005 + 0.3 * 0.010)
    assert pacer.cap() == int(0.15 / pacer.token_seconds)
    pacer.observe(num_decodes=16, num_prompt_tokens=0, seconds=0.01)
    assert pacer.cap() == 16  # never below one block: a new prompt always advances
    assert PrefillPacer(stretch=None, min_tokens=16).cap() is None


def test_paced_engine_keeps_decoding_while_a_long_prompt_arrives(llama):
    """Streams keep one token per step while a long prompt is fed in capped chunks, and every
    request still gets the tokens it gets alone. (Stretch 1.0: no extra time for prompts, so
    the cap is its floor, MIN_PREFILL_CHUNK, whatever the timings.)"""
    engine = Engine(llama, EngineConfig(num_blocks=128, max_num_batched_tokens=256,
                                        max_itl_stretch=1.0, kv_cache_dtype=torch.float32),
                    CPU, torch.float32)
    streams = [Sequence(prompt(10, i), greedy(60)) for i in range(4)]
    for s in streams:
        engine.add(s)
    for _ in range(10):
        engine.step()
    assert engine.pacer.decode_seconds and engine.pacer.token_seconds
    long = Sequence(prompt(300, 99), greedy(5))
    engine.add(long)
    chunks = []
    while long.num_computed_tokens < 300:
        out = engine.step().scheduled
        assert [n for x, n in zip(out.seqs, out.num_new_tokens, strict=True) if x in streams] \
            == [1, 1, 1, 1]
        chunks.append(out.num_new_tokens[-1])
    assert engine.scheduler.prefill_tokens_with_decodes == MIN_PREFILL_CHUNK == 32
    assert chunks == [32] * 9 + [12]
    while engine.has_unfinished:
        engine.step()
    assert long.output_token_ids == solo(llama, prompt(300, 99), 5)
    assert [s.output_token_ids for s in streams] == [solo(llama, prompt(10, i), 60)
                                                     for i in range(4)]


def test_idle_engine_computes_a_finished_reply_as_prompt_and_yields_to_arrivals(llama):
    """recache.py: once idle, the engine computes the last reply as prompt, 32 tokens a step,
    for the next turn; an arrival drops it at once (what it computed stays cached), and it
    never shows in the counters."""
    engine = Engine(llama, EngineConfig(num_blocks=128, recache_replies_after=0.0,
                                        kv_cache_dtype=torch.float32), CPU, torch.float32)
    first = Sequence(prompt(20, 1), greedy(60))
    engine.add(first)
    while not first.status.is_finished:
        engine.step()
    counters = engine.stats()
    assert engine.has_unfinished  # the reply's turn as prompt is queued
    out = engine.step().scheduled  # its first block is the cached prompt block
    assert [s.internal for s in out.seqs] == [True] and out.num_new_tokens == [32]
    late = Sequence(prompt(9, 2), greedy(3))
    engine.add(late)
    assert engine.step().scheduled.seqs == [late]
    while engine.has_unfinished:
        engine.step()
    stats = engine.stats()
    assert stats["prompt_tokens"] == {0: counters["prompt_tokens"][0] + 9}
    assert stats["generation_tokens"] == {0: counters["generation_tokens"][0] + 3}
    assert stats["prefix_cache_queries"] == counters["prefix_cache_queries"] + 9
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    # The next turn reuses the prompt block and the two blocks computed before the arrival.
    next_turn = Sequence(first.token_ids + prompt(4, 3), greedy(2))
    assert len(engine.block_manager.match_prefix(next_turn).blocks) == 3


def test_bf16_kv_pool_holds_twice_the_blocks_and_gives_the_same_tokens(llama):
    budget = 1 << 20
    fp32 = Engine(llama, EngineConfig(kv_cache_bytes=budget, kv_cache_dtype=torch.float32), CPU,
                  torch.float32)
    bf16 = Engine(llama, EngineConfig(kv_cache_bytes=budget, kv_cache_dtype=torch.bfloat16), CPU,
                  torch.float32)
    assert bf16.runner.kv_caches[0][0].dtype == torch.bfloat16
    assert len(bf16.block_manager.blocks) == 2 * len(fp32.block_manager.blocks)
    seqs = [Sequence(prompt(20 + i, i), greedy(12)) for i in range(3)]
    run(llama, seqs, kv_cache_dtype=torch.bfloat16)
    assert [s.output_token_ids for s in seqs] == [solo(llama, prompt(20 + i, i), 12)
                                                  for i in range(3)]


@pytest.mark.parametrize("native_bf16", [False, True])
@pytest.mark.parametrize("kernels_fp32", [False, True])
def test_the_default_dtypes_follow_the_cpu_and_its_kernels(llama, monkeypatch, native_bf16,
                                                           kernels_fp32):
    """Compute: bf16 where the CPU has native bf16, but fp32 for int4/int8 models whose layers
    run avx2_gemm.c (Intel with AVX-512 BF16 and no AMX). The pool: bf16 under fp32 compute,
    except beside bf16-activation kernels on a native-bf16 CPU (`--dtype fp32` there)."""
    from server.models import device

    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(device, "cpu_kernels_take_fp32", lambda: kernels_fp32)
    for bits in (4, 8, 16):
        compute = torch.bfloat16 if native_bf16 and (bits == 16 or not kernels_fp32) else \
            torch.float32
        assert device.pick_dtype(CPU, None, bits) == compute
        assert device.pick_dtype(CPU, "bf16", bits) == torch.bfloat16  # asked: as asked
        assert device.pick_dtype(torch.device("cuda"), None, bits) == torch.bfloat16
    pool = torch.float32 if native_bf16 and not kernels_fp32 else torch.bfloat16
    engine = Engine(llama, EngineConfig(kv_cache_bytes=1 << 20), CPU, torch.float32)
    assert engine.kv_dtype == engine.runner.kv_caches[0][0].dtype == pool
    assert len(engine.block_manager.blocks) == (1 << 20) // (2 * 2 * 16 * 2 * 32 * pool.itemsize)
    asked = Engine(llama, EngineConfig(num_blocks=8, kv_cache_dtype=torch.float32), CPU,
                   torch.float32)
    assert asked.runner.kv_caches[0][0].dtype == torch.float32
    assert device.pick_kv_dtype(CPU, torch.bfloat16) == torch.bfloat16
    assert device.pick_kv_dtype(torch.device("cuda"), torch.float32) == torch.float32


def test_the_kernels_said_to_take_fp32_do():
    """What pick_dtype reads before anything is built is what the library of this CPU's first
    kind does (every CI machine has one: AVX2 at least)."""
    from server.kernels import cpu_gemm
    from server.models import device

    lib = cpu_gemm.of_kind(cpu_gemm.KIND)
    assert lib is not None
    assert device.cpu_kernels_take_fp32() == cpu_gemm.takes_fp32(lib)


@pytest.fixture(scope="module", params=[4, 8])
def llama_quantized(request):
    from server.quant import quantize_state_dict

    hf = hf_model("llama", seed=9)
    state, schemes = quantize_state_dict(dict(hf.state_dict()), request.param, group_size=32)
    return build_model(our_config(hf), state, schemes, CPU, torch.bfloat16)


@pytest.mark.parametrize("prompts_unpacked", [True, False])
def test_prompt_rows_give_the_same_logprobs_however_they_are_computed(llama_quantized,
                                                                     prompts_unpacked,
                                                                     monkeypatch):
    """int4/int8 layers send prompt rows through a bf16 GEMM on the unpacked weight and generated
    rows through the packed kernel (or, with our kernels where prompts are not unpacked, every row
    through the kernel), whatever shares the step: a prompt computed whole, in chunks of 16, from
    the prefix cache or among decoding sequences gives the same logprobs bit for bit (with a row-
    count threshold instead, the cached run's tail took the other kernel and real-model greedy text
    diverged)."""
    from server.kernels import cpu_gemm
    from server.quant.int4 import checked_unpack

    monkeypatch.setattr(cpu_gemm, "PROMPTS_UNPACKED", prompts_unpacked)
    llama_int4 = llama_quantized
    layers = [m for m in llama_int4.modules() if hasattr(m, "unpacked_numel")]
    if any(type(m).__name__ == "Int4Linear" for m in layers):
        assert checked_unpack() is not None  # built with the machine's C compiler
    ours = [getattr(m, "q4x32", None) is not None or getattr(m, "q8", None) is not None
            for m in layers]
    assert all(bool(m.unpacked_numel()) == (prompts_unpacked or not mine)
               for m, mine in zip(layers, ours, strict=True) if m is not llama_int4.lm_head)

    def generate(seqs, **config):
        engine = Engine(llama_int4, EngineConfig(**({"num_blocks": 64} | config)), CPU,
                        torch.bfloat16)
        for s in seqs:
            engine.add(s)
            while engine.has_unfinished:  # one after the other: the second hits the cache
                engine.step()
        return [(s.output_token_ids, s.logprobs) for s in seqs]

    p = prompt(90, 3)
    params = dict(max_tokens=12, temperature=0.0, logprobs=True)
    cold = generate([Sequence(p, SamplingParams(**params))], max_num_batched_tokens=512)[0]
    chunked = generate([Sequence(p, SamplingParams(**params))], max_num_batched_tokens=16)[0]
    twice = generate([Sequence(p, SamplingParams(**params)), Sequence(p, SamplingParams(**params))])
    assert chunked == cold and twice[0] == cold and twice[1] == cold
    engine = Engine(llama_int4, EngineConfig(num_blocks=64), CPU, torch.bfloat16)
    engine.add(Sequence(p, SamplingParams(max_tokens=1, temperature=0.0)))
    engine.step()  # a prompt step that ends the request: the engine is idle after it
    assert not engine.has_unfinished and engine.runner.unpacked.block is None
    # Among others: decoding sequences share the steps of its prompt chunks (mixed steps, the
    # prompt rows last or in between), and a second prompt arrives meanwhile.
    engine = Engine(llama_int4, EngineConfig(num_blocks=64, max_num_batched_tokens=40), CPU,
                    torch.bfloat16)
    others = [Sequence(prompt(8 + i, 40 + i), SamplingParams(max_tokens=30, temperature=0.0))
              for i in range(3)]
    mine = Sequence(p, SamplingParams(**params))
    late = Sequence(prompt(50, 7), SamplingParams(max_tokens=3, temperature=0.0))
    for s in others:
        engine.add(s)
    engine.step()
    engine.add(mine)
    engine.step()
    engine.add(late)
    kinds = []
    while engine.has_unfinished:
        out = engine.step().scheduled
        kinds.append(tuple(n > 1 for n in out.num_new_tokens))
    assert any(any(k) and not all(k) for k in kinds)  # there were mixed steps
    assert (mine.output_token_ids, mine.logprobs) == cold
    assert engine.runner.unpacked.block is None  # released once no prompt is left


def test_bf16_decode_across_the_fp32_attention_threshold_is_batch_invariant():
    """Decodes with at most FP32_DECODE_MAX_CONTEXT tokens of context attend in fp32, longer
    ones in bf16, chosen per sequence: a sequence crossing the threshold among others on both
    sides gives the logprobs it gives alone, bit for bit."""
    from server.models.attention import FP32_DECODE_MAX_CONTEXT as LIMIT

    hf = hf_model("llama", seed=11)
    model = build_model(our_config(hf), dict(hf.state_dict()), {}, CPU, torch.bfloat16)
    params = dict(max_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)

    def generate(seqs):
        engine = Engine(model, EngineConfig(num_blocks=128), CPU, torch.bfloat16)
        for s in seqs:
            engine.add(s)
        while engine.has_unfinished:
            engine.step()
        return seqs

    crossing = prompt(LIMIT - 4, 20)  # decodes at 252..261 tokens of context
    alone = generate([Sequence(crossing, SamplingParams(**params))])[0]
    batch = generate([Sequence(prompt(10, 21), SamplingParams(**params)),
                      Sequence(crossing, SamplingParams(**params)),
                      Sequence(prompt(LIMIT + 40, 22), SamplingParams(**params))])
    assert (batch[1].output_token_ids, batch[1].logprobs) == (alone.output_token_ids,
                                                              alone.logprobs)


def test_prompt_logprobs_equal_transformers_through_chunks_and_preemption(models):
    """A prompt's logprobs (completions' echo with logprobs): each token after the first, as a
    transformers forward gives them, and the same, once each, when the prompt goes in chunks
    among others and is preempted and computed again."""
    hf, ours = models
    p = prompt(40, 3)
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
    want = want[torch.arange(len(p) - 1), torch.tensor(p[1:])]
    alone = Sequence(p, greedy(4, prompt_logprobs=2))
    run(ours, [alone])
    assert len(alone.prompt_logprobs) == len(p) - 1
    assert torch.allclose(torch.tensor([lp for lp, _ in alone.prompt_logprobs]), want, atol=1e-4)
    assert all(len(tops) == 2 and tops[0][1] >= lp for lp, tops in alone.prompt_logprobs)
    mine = Sequence(p, greedy(4, prompt_logprobs=2))
    others = [Sequence(prompt(20, 10 + i), greedy(24)) for i in range(4)]
    run(ours, others + [mine], num_blocks=10, max_num_batched_tokens=32)
    assert mine.num_preemptions > 0
    assert mine.prompt_logprobs == alone.prompt_logprobs
    assert mine.output_token_ids == alone.output_token_ids
