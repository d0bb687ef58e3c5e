"""Runs one scheduled step: builds the flat batch, one forward, samples, one host sync."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from server.engine.sampler import Sampler, chosen_first, token_logprobs
from server.engine.scheduler import SchedulerOutput
from server.engine.sequence import Sequence
from server.models.attention import build_metadata
from server.models.batch import ForwardBatch
from server.models.simple import allocate_kv, release_slots
from server.quant.rows import UnpackedWeights, end_step, split_rows


@dataclass(slots=True)
class StepResult:
    token_ids: list[int]  # one per sampling sequence, in batch order
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    embeddings: list[list[float]] = field(default_factory=list)  # one per pooling sequence


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype,
                       layers: list[int] | None = None) -> int:
    """Keys and values of every layer (or of these layers) for one block."""
    elem = torch.empty((), dtype=dtype).element_size()
    n = config.num_layers if layers is None else len(layers)
    return 2 * n * block_size * config.num_kv_heads * config.head_dim * elem


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device, dtype,
                 kv_dtype: torch.dtype, window_blocks: int = 0,
                 windowed: tuple[int, ...] = ()) -> None:
        """window_blocks: the size of the sliding-window layers' own pool (window_blocks.py),
        holding the caches of the `windowed` layers (engine.PoolSizes); 0: every layer keeps
        its keys and values in the main pool."""
        self.model = model
        self.block_size = block_size
        self.device, self.dtype = device, dtype
        config = model.config
        windowed = list(windowed) if window_blocks else []
        # Per pool (main, window), the layers whose keys and values it holds.
        self.pool_layers = [[i for i in range(config.num_layers) if i not in windowed],
                            windowed]
        self.kv_caches = allocate_kv(model, num_blocks * block_size, device, kv_dtype,
                                     {i: window_blocks * block_size for i in windowed})
        self.sampler = Sampler(config.vocab_size)
        self.unpacked = UnpackedWeights(model)  # int4 layers' bf16 copies while prompts run
        # Embedding requests whose prompt spans steps: the fp32 sum of their hidden states so
        # far (mean pooling), by sequence id.
        self.pooled_sums: dict[int, torch.Tensor] = {}

    @property
    def has_window_pool(self) -> bool:
        return bool(self.pool_layers[1])

    def _caches(self, pool: int) -> list[tuple[torch.Tensor, ...]]:
        return [self.kv_caches[i] for i in self.pool_layers[pool]]

    def release_blocks(self, block_ids: list[int], pool: int = 0) -> int:
        """Hand these blocks' pages of a pool (0 main, 1 window) back to the OS; returns the
        bytes given back."""
        runs: list[tuple[int, int]] = []  # consecutive block ids as slot ranges
        for b in block_ids:
            if runs and runs[-1][1] == b * self.block_size:
                runs[-1] = (runs[-1][0], (b + 1) * self.block_size)
            else:
                runs.append((b * self.block_size, (b + 1) * self.block_size))
        return release_slots(self._caches(pool), runs)

    def copy_slots(self, src: int, dst: int, n: int, pool: int = 0) -> None:
        """Block src's first n slots' keys and values into block dst's, every layer of the
        pool (a prompt that shares part of a cached block: block_manager.py)."""
        s, d = src * self.block_size, dst * self.block_size
        for layer in self._caches(pool):
            for t in layer:  # [num_kv_heads, slots, head_dim]
                t[:, d:d + n] = t[:, s:s + n]

    def release(self, seq) -> None:
        """A sequence left the engine: drop its pooling sum."""
        self.pooled_sums.pop(seq.seq_id, None)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> StepResult:
        seqs, num_new = out.seqs, out.num_new_tokens
        input_ids: list[int] = []
        seq_lens = []
        prompt_rows: list[int] = []  # rows holding prompt tokens (quantized layers' path)
        prompts_continue = False  # a prompt has tokens left for later steps
        prompt_lens: list[int] = []  # per sequence: how many of its new tokens are prompt
        scored: list[tuple[int, Sequence, int]] = []  # (row, sequence, the token it predicts)
        for seq, n in zip(seqs, num_new, strict=True):
            start = seq.num_computed_tokens
            first = len(input_ids)
            input_ids += seq.token_ids[start:start + n]
            seq_lens.append(start + n)
            num_prompt = max(0, min(n, seq.num_prompt_tokens - start))
            prompt_lens.append(num_prompt)
            prompt_rows += range(first, first + num_prompt)
            prompts_continue |= start + n < seq.num_prompt_tokens
            if seq.params.prompt_logprobs is not None:
                # position p's row predicts prompt token p + 1; those known already (a prompt
                # recomputed after preemption) are not asked again
                done = len(seq.prompt_logprobs) + 1
                scored += [(first + p - start, seq, seq.token_ids[p + 1])
                           for p in range(start, start + num_prompt)
                           if done <= p + 1 < seq.num_prompt_tokens]
        attention = build_metadata(num_new, seq_lens, [s.block_table for s in seqs],
                                   self.block_size, self.device, self.dtype, prompt_lens)
        if self.has_window_pool:
            attention.windowed = build_metadata(num_new, seq_lens, [s.window_table for s in seqs],
                                                self.block_size, self.device, self.dtype,
                                                prompt_lens)
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, device=self.device),
            attention=attention,
            rows=split_rows(prompt_rows, len(input_ids), self.device, self.unpacked,
                            prompts_continue))
        # Logits only for the last token of each sequence that samples this step. In a step
        # with prompt rows, most rows are read by nothing after it: the last layer computes
        # only the sampled ones past attention (unless a sequence pools every row).
        # A sequence with drafts (speculation.py) samples at its last token and at each draft.
        # Rows scored for prompt logprobs follow the sampled ones.
        ends = itertools.accumulate(num_new)
        sampled = [row for end, rows in zip(ends, out.num_sampled_rows, strict=True)
                   for row in range(end - rows, end)]
        wanted = sampled + [row for row, _, _ in scored]
        wanted_rows = torch.tensor(wanted, dtype=torch.long, device=self.device)
        pooling = any(s.pooling for s in seqs)
        if prompt_rows and not pooling:
            prompt = set(prompt_rows)
            batch.outputs = wanted_rows
            batch.output_rows = split_rows([i for i, r in enumerate(wanted) if r in prompt],
                                           len(wanted), self.device, self.unpacked,
                                           prompts_continue)
        try:
            hidden = self.model(batch, self.kv_caches)
        finally:
            end_step(batch.rows)
        embeddings = self._pool(out, hidden) if pooling else []
        sampling = [s for s, rows in zip(seqs, out.num_sampled_rows, strict=True)
                    for _ in range(rows)]  # a sequence per sampled row
        if not wanted:
            return StepResult([], None, None, embeddings)
        logits = self.model.compute_logits(hidden if batch.outputs is not None
                                           else hidden[wanted_rows])
        if scored:
            _score_prompts(logits[len(sampled):], scored)
        if not sampling:
            return StepResult([], None, None, embeddings)
        result = self.sampler(logits[:len(sampled)], sampling)
        # The step's one host sync: everything needed on the host comes over together.
        token_ids = result.token_ids.tolist()
        self.sampler.advance(sampling, token_ids)
        if result.logprobs is None:
            return StepResult(token_ids, None, None, embeddings)
        logprobs = result.logprobs.tolist()
        tops = None
        if result.top_ids is not None:
            ids, lps = result.top_ids.tolist(), result.top_logprobs.tolist()
            tops = [chosen_first(i, lp, t) for i, lp, t in zip(ids, lps, token_ids, strict=True)]
        return StepResult(token_ids, logprobs, tops, embeddings)

    def _pool(self, out: SchedulerOutput, hidden: torch.Tensor) -> list[list[float]]:
        """Add this step's rows of embedding requests to their sums; the vectors of those whose
        prompt ends here, in batch order. Each row is pooled alone, so a text's vector does not
        depend on what shares its steps (rows are batch-invariant)."""
        vectors = []
        first = 0
        for seq, n, ends in zip(out.seqs, out.num_new_tokens, out.is_pooling, strict=True):
            rows = hidden[first:first + n]  # [n, hidden]
            first += n
            pooling = seq.pooling
            if pooling is None:
                continue
            if pooling.mode == "mean":
                if seq.num_computed_tokens == 0:  # a new prompt, or recomputed after preemption
                    self.pooled_sums[seq.seq_id] = torch.zeros(rows.shape[1], device=rows.device)
                self.pooled_sums[seq.seq_id] += rows.float().sum(0)
            if not ends:
                continue
            if pooling.mode == "mean":
                vector = self.pooled_sums.pop(seq.seq_id) / seq.num_prompt_tokens
            elif pooling.token_ids:  # a score: these tokens' logits after the prompt
                vector = self.model.compute_logits(rows[-1:])[0, list(pooling.token_ids)]
            else:
                vector = rows[-1].float()
            if pooling.normalize:
                vector = F.normalize(vector, dim=0)
            vectors.append(vector.tolist())
        return vectors


def _score_prompts(logits: torch.Tensor, scored: list[tuple[int, Sequence, int]]) -> None:
    """Each scored row's logprob of the prompt token after it and its sequence's number of
    alternatives, appended to the sequence's prompt_logprobs in prompt order (the sampler's
    log_softmax: the model's own numbers, as for sampled tokens)."""
    targets = torch.tensor([t for _, _, t in scored], device=logits.device)
    k = max(seq.params.prompt_logprobs for _, seq, _ in scored)
    chosen, top_ids, top_lp = token_logprobs(torch.log_softmax(logits, dim=-1), targets, k)
    chosen = chosen.tolist()
    ids, lps = (top_ids.tolist(), top_lp.tolist()) if k else (None, None)
    for i, (_, seq, target) in enumerate(scored):
        want = seq.params.prompt_logprobs
        tops = chosen_first(ids[i], lps[i], target)[:want] if want else []
        seq.prompt_logprobs.append((chosen[i], tops))
