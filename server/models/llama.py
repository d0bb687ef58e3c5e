"""The Llama family in plain PyTorch: Llama (SmolLM2), Qwen2 (+ q/k/v bias), Qwen3 (+ q/k norm),
Granite (+ multipliers on the embeddings, attention, residual branches and logits), SmolLM3
(+ layers without rotary embedding), Mistral, Phi-3 (+ q/k/v and gate/up stored fused), Gemma 3
(+ (1 + w) norms, sandwich norms, GeGLU, local and global layers). What differs is a
ModelConfig field, never a copied file.

Submodule and tensor names are Hugging Face's, so loading a checkpoint is a name-for-name copy.
The forward takes a flat batch of tokens from many sequences with their positions and cache
slots (see attention.py) and returns hidden states; logits are computed only where asked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import server.kernels.cpu_gemm as cpu_gemm
import server.kernels.layer_ops as layer_ops
from server.models import rope as rope_math
from server.models.attention import paged_attention
from server.models.batch import ForwardBatch
from server.models.config import ModelConfig
from server.models.decode_plan import DecodePlan
from server.models.linear import Linear
from server.models.mlp import MLP
from server.models.moe import ClampedExpert, SparseMoE
from server.quant import fuse_linears


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = layer_ops.rms_norm(x, self.weight, self.eps)
        if y is not None:
            return y
        # Normalize in fp32 and scale in the input dtype, as the reference implementation does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@dataclass(slots=True)
class Rotary:
    """A step's rotary embedding: the model's fp32 cos/sin tables [max_pos, head_dim] and each
    token's position. layer_ops reads the tables directly; the PyTorch path gathers them per
    token once per step (`gathered`)."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor
    positions: torch.Tensor  # [T]
    dtype: torch.dtype  # the compute dtype
    query_scale: torch.Tensor | None = None  # [T, 1, 1] (Ministral 3: rope.query_scale)
    _gathered: tuple[torch.Tensor, torch.Tensor] | None = None
    _identity: Rotary | None = None

    def identity(self) -> Rotary:
        """The same tokens rotated by nothing (cos 1, sin 0: exact), for a layer without rotary
        embedding, so that it takes the same path (layer_ops.rope_store writes its cache).
        Built once a step, shared by every such layer."""
        if self._identity is None:
            ones = self.cos_table.new_ones(1, self.cos_table.shape[1])
            self._identity = Rotary(ones, torch.zeros_like(ones),
                                    torch.zeros_like(self.positions), self.dtype)
        return self._identity

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of each token, [T, 1, head_dim] in the compute dtype."""
        if self._gathered is None:
            self._gathered = tuple(t[self.positions].to(self.dtype)[:, None, :]
                                   for t in (self.cos_table, self.sin_table))
        return self._gathered


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        h, d, bias = config.hidden_size, config.head_dim, config.qkv_bias
        self.qkv_proj: nn.Module | None = None  # q, k and v in one call, after fuse()
        if config.fused_projections:  # stored fused (Phi-3): held as the checkpoint has it
            self.qkv_proj = Linear(h, (self.num_heads + 2 * self.num_kv_heads) * d, bias=bias)
        else:
            self.q_proj = Linear(h, self.num_heads * d, bias=bias)
            self.k_proj = Linear(h, self.num_kv_heads * d, bias=bias)
            self.v_proj = Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.scale = config.scale
        self.uses_rope = config.uses_rope(layer)
        self.window = config.layer_window(layer)  # None: attends over all before
        self.softcap = config.attn_logit_softcapping  # Gemma 2's capped scores
        # gpt-oss: a learned logit per head that takes part of the softmax, attending nowhere
        self.sinks = nn.Parameter(torch.empty(config.num_heads)) if config.attention_sinks \
            else None
        # Gemma 3's windowed layers rotate with their own base (the model's local tables)
        self.local_rope = self.window is not None and config.local_rope_theta is not None

    def fuse(self) -> None:
        """Replace q/k/v with one projection (fewer kernel calls per step)."""
        if self.qkv_proj is not None:
            return
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: Rotary,
        k_cache: torch.Tensor,  # [Hkv, num_slots, head_dim]
        v_cache: torch.Tensor,  # [Hkv, num_slots, head_dim]
        batch: ForwardBatch,
    ) -> torch.Tensor:
        rows, meta = batch.rows, batch.attention.pool(self.window)
        rope = rope if self.uses_rope else rope.identity()
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x, rows)
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if hasattr(
                self, "q_norm") else (None, None, 0.0)
            q = layer_ops.rope_store(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim, rope.cos_table,
                rope.sin_table, rope.positions, meta.slot_mapping, k_cache, v_cache, None,
                *norms)
            if q is None:
                nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
                q = self._rope_store(*qkv.split([nq, nkv, nkv], dim=-1), rope, k_cache,
                                     v_cache, meta.slot_mapping)
        else:
            q = self._rope_store(self.q_proj(x, rows), self.k_proj(x, rows),
                                 self.v_proj(x, rows), rope, k_cache, v_cache, meta.slot_mapping)
        if rope.query_scale is not None:
            q = q * rope.query_scale
        return self.o_proj(paged_attention(q, k_cache, v_cache, meta, self.scale, self.window,
                                           self.softcap, self.sinks), rows)

    def _rope_store(self, q, k, v, rope: Rotary, k_cache, v_cache, slots) -> torch.Tensor:
        """PyTorch's rotary embedding and cache write (what layer_ops.rope_store does)."""
        t = q.shape[0]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope.gathered()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_cache.index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))
        return q


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.residual_multiplier = config.residual_multiplier
        if not config.is_moe(layer):
            self.mlp = MLP(config)
        elif config.expert_kind == "clamped":
            self.mlp = SparseMoE(config, lambda: ClampedExpert(config))
        else:
            self.mlp = SparseMoE(config, lambda: MLP(config, config.moe_intermediate_size))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sandwich = config.sandwich_norms  # Gemma: post_attention_layernorm is the
        if self.sandwich:  # attention output's; the MLP's own norms before and after it
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, rope: Rotary, k_cache, v_cache, batch: ForwardBatch, last=False):
        """last: the model's last layer, which may compute only batch.outputs past attention
        (every row's keys and values are still stored)."""
        h = self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, batch)
        if self.sandwich:
            h = self.post_attention_layernorm(h)
        x = residual(x, h, self.residual_multiplier)
        rows = batch.rows
        if last and batch.outputs is not None:
            x, rows = x[batch.outputs], batch.output_rows
            if not x.shape[0]:
                return x
        if self.sandwich:
            h = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), rows))
        else:
            h = self.mlp(self.post_attention_layernorm(x), rows)
        return residual(x, h, self.residual_multiplier)


def residual(x: torch.Tensor, branch: torch.Tensor, multiplier: float) -> torch.Tensor:
    """x + branch * multiplier (Granite's; 1 elsewhere), rounded as the reference rounds it:
    the branch scaled in the compute dtype, then added. The decode plan does the same."""
    return x + (branch if multiplier == 1.0 else branch * multiplier)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama/Qwen2/Qwen3 decoder over a paged KV cache."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # fp32 cos/sin tables, built on the first forward's device. Plain attributes, not buffers:
        # casting the model to bf16 must not round them.
        self._rope: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}  # by `local`
        self.rope_context = config.max_position_embeddings  # serve_context
        self._local_rope = any(layer.self_attn.local_rope for layer in self.model.layers)
        self._plan: tuple[tuple, DecodePlan | None] | None = None  # (libraries, plan)

    def _rope_tables(self, device: torch.device, local: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (cos, sin) [max_pos, head_dim]: the model's, or windowed layers' own (local)."""
        tables = self._rope.get(local)
        if tables is None or tables[0].device != device:
            cos, sin = rope_math.tables(self.config, local, self.rope_context)
            tables = self._rope[local] = (cos.to(device), sin.to(device))
        return tables

    def serve_context(self, context: int) -> None:
        """The context the engine serves: longrope's factors are chosen by it (rope.py)."""
        if context != self.rope_context:
            self.rope_context = context
            self._rope.clear()

    def prepare_weights(self) -> None:
        """Once loaded, in the compute dtype: Gemma's RMSNorms scale by (1 + w): the offset
        is added to their weights here, as transformers adds it (in that dtype)."""
        if self.config.norm_offset:
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.data += self.config.norm_offset

    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: ([Hkv, slots, D],)*2
    ) -> torch.Tensor:
        """Hidden states after the final norm: [T, hidden], or [len(batch.outputs), hidden]."""
        x = self.model.embed_tokens(batch.input_ids)
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        positions = batch.attention.positions
        scale = rope_math.query_scale(self.config, positions, x.dtype)
        rotary = Rotary(*self._rope_tables(x.device), positions, x.dtype, scale)
        local = Rotary(*self._rope_tables(x.device, True), positions, x.dtype, scale) \
            if self._local_rope else rotary
        plan = self._decode_plan() if x.device.type == "cpu" else None
        if plan is not None and plan.takes(x, batch, kv_caches):
            return self.model.norm(plan.run(x, rotary, kv_caches, batch, local))
        last = len(self.model.layers) - 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, kv_caches,
                                                            strict=True)):
            x = layer(x, local if layer.self_attn.local_rope else rotary, k_cache, v_cache,
                      batch, i == last)
        return self.model.norm(x)

    def _decode_plan(self) -> DecodePlan | None:
        """The decode plan (decode_plan.py), rebuilt when the C libraries in use change."""
        key = (layer_ops._lib(), cpu_gemm.checked())
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, DecodePlan.build(self))
        return self._plan[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32 logits, for the rows that sample only."""
        if hasattr(self.lm_head, "logits"):  # a head that can skip rounding to bf16 (int8, dense)
            logits = self.lm_head.logits(hidden)
        else:
            logits = self.lm_head(hidden).float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
