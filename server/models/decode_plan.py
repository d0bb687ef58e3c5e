"""A step of decodes only, through the decoder layers in a few calls per layer (CPU kernels).

At one sequence a layer's kernels take ~100 us and the Python around them took as much again:
nine module calls, the quantized layers' dispatch, each C helper's checks and allocations, the
attention groups' bookkeeping. When every row of a step is a generated token, the layers are
int4 or int8 in our kernels' layout (cpu_gemm.py) or unquantized ones that dense_gemm.c takes,
and layer_ops.c is built, `DecodePlan.run`
calls the same C functions on the same inputs with every shape checked once when the plan is
built, into buffers allocated once per step, and the same PyTorch operators for the residual
adds and SiLU * up. A row's numbers are therefore the ones the modules compute, bit for bit
(tested), so steps that mix prompt rows in, which keep the modules, agree with it: batch
invariance holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import server.kernels.cpu_gemm as cpu_gemm
import server.kernels.layer_ops as layer_ops
from server.models.linear import Linear
from server.quant.int4 import Int4Linear
from server.quant.int8 import Int8Linear

Packed = Int4Linear | Int8Linear | Linear  # Linear: an unquantized layer (dense_gemm.c's
# packed_gemm where it packed its weight, else dense_gemm)


@dataclass(slots=True)
class _Layer:
    norm1: torch.Tensor  # the two RMSNorm weights
    norm2: torch.Tensor
    qkv: Packed
    o: Packed
    gate_up: Packed
    down: Packed
    uses_rope: bool = True  # False: the identity rotation (Rotary.identity), as the module
    window: int | None = None  # its attention window (AttentionGroup.within), as the module
    q_norm: torch.Tensor | None = None  # per-head q/k RMSNorm weights (Qwen3), as the module
    k_norm: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None  # Gemma's norms of the attention's and the MLP's
    post_ffn: torch.Tensor | None = None  # outputs (norm2 is then the MLP's input norm)
    local_rope: bool = False  # Gemma's windowed layers: the model's local rope tables


def _fits(m: nn.Module | None, shape: tuple[int, int]) -> bool:
    """An int4 or int8 layer of this (in, out) shape in our kernels' layout, called whole."""
    if isinstance(m, Int4Linear):
        return (m.q4x32 is not None and m.bias is None and m.group_size % 2 == 0
                and (m.in_features, m.out_features) == shape
                and m.q4x32.shape[0] * cpu_gemm.BLOCK == m.out_features
                and m.q4x32.shape[1] * m.group_size == m.in_features)
    if isinstance(m, Int8Linear):
        return (m.q8 is not None and m.bias is None and not m.tiled
                and (m.in_features, m.out_features) == shape
                and m.q8.shape[0] * cpu_gemm.BLOCK == m.out_features
                and m.q8.shape[1] * 2 == m.in_features)
    if isinstance(m, Linear) and m.packed is not None:  # packed_gemm, as its forward
        return m.bias is None and tuple(m.packed.shape) == (shape[1] // 16, shape[0] // 2, 16, 2)
    if isinstance(m, Linear):  # what its forward hands generated rows: dense_mm, if it takes it
        w = m.weight
        return (m.bias is None and tuple(w.shape) == shape[::-1]
                and layer_ops.dense_mm(w.new_zeros(1, shape[0]), w) is not None)
    return False


class DecodePlan:
    def __init__(self, model: nn.Module, layers: list[_Layer]) -> None:
        c = model.config
        self.hidden, self.inter = c.hidden_size, c.intermediate_size
        self.hq, self.hkv, self.d = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.scale = c.scale
        self.residual_multiplier = c.residual_multiplier
        self.act = model.model.layers[0].mlp.act  # the gated MLP's activation, as the modules
        self.layers = layers
        # a layer of each window: layers of one window keep their caches in one pool, allocated
        # alike (allocate_kv), so one of them tells the pool's dtype and layout
        self.pool_layers = sorted({la.window: i for i, la in reversed(list(enumerate(layers)))
                                   }.values())
        self.ops, self.gemm_lib = layer_ops._lib(), cpu_gemm.checked()
        self.max_group_count = max([m.in_features // m.group_size for la in layers for m in (
            la.qkv, la.o, la.gate_up, la.down) if isinstance(m, Int4Linear)], default=1)

    @staticmethod
    def build(model: nn.Module) -> DecodePlan | None:
        """The plan for this model, or None where it does not apply (then the modules run)."""
        if not layer_ops.enabled() or cpu_gemm.checked() is None:
            return None
        c = model.config
        if c.attn_logit_softcapping is not None or c.attention_sinks:  # the C attention has
            return None  # neither a cap nor sinks
        if (c.head_dim % 16 or c.head_dim > layer_ops.MAX_DIM
                or c.hidden_size > layer_ops.MAX_HIDDEN or c.num_heads % c.num_kv_heads):
            return None
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = ((c.hidden_size, nq + 2 * nkv), (nq, c.hidden_size),
                  (c.hidden_size, 2 * c.intermediate_size), (c.intermediate_size, c.hidden_size))
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = (getattr(attn, "qkv_proj", None), attn.o_proj,
                     getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
            if not all(_fits(m, shape) for m, shape in zip(parts, shapes, strict=True)):
                return None
            qk = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else ()
            if any(n.eps != c.rms_norm_eps for n in qk):
                return None
            if layer.sandwich:  # Gemma: input, post-attention, pre- and post-MLP norms
                norms = (layer.input_layernorm, layer.pre_feedforward_layernorm,
                         layer.post_attention_layernorm, layer.post_feedforward_layernorm)
            else:
                norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.eps != c.rms_norm_eps for n in norms):
                return None
            weights = [n.weight for n in norms] + [None, None]
            layers.append(_Layer(
                weights[0], weights[1], *parts, uses_rope=attn.uses_rope, window=attn.window,
                q_norm=qk[0].weight if qk else None, k_norm=qk[1].weight if qk else None,
                post_attn=weights[2], post_ffn=weights[3], local_rope=attn.local_rope))
        return DecodePlan(model, layers)

    def takes(self, x: torch.Tensor, batch, kv_caches) -> bool:
        """Whether this step is one the plan runs: decodes only, every row's output wanted, in
        step order, on the CPU, in a dtype the kernels take, with caches layer_ops reads."""
        meta, rows = batch.attention, batch.rows
        if (rows is not None and rows.prompt is not None) or batch.outputs is not None:
            return False
        pools = [meta] if meta.windowed is None else [meta, meta.windowed]
        if any(len(m.groups) != 1 or not m.groups[0].whole_step for m in pools):
            return False
        if any(m.groups[0].first_tile >= 0 or m.groups[0].lens is None for m in pools):
            return False
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return False
        index = [i for m in pools for i in (m.positions, m.slot_mapping,
                                            m.groups[0].context_slots, m.groups[0].lens)]
        dtype = kv_caches[0][0].dtype
        return (dtype in (torch.float32, torch.bfloat16)
                and all(t.dtype == dtype and t.is_contiguous()
                        for i in self.pool_layers for t in kv_caches[i])
                and x.is_contiguous() and self.layers[0].norm1.dtype == x.dtype
                and all(i.dtype == torch.int64 and i.is_contiguous() for i in index))

    def _inputs(self, rope, local, meta) -> tuple[list, dict, dict]:
        """The rope tables of each layer kind, by (uses rope, local tables), and by window,
        the pool's new slots and its decode group as the window sees it, as pointers; with
        the objects that hold them."""
        identity = rope.identity() if not all(la.uses_rope for la in self.layers) else rope
        ropes = {(True, False): rope, (False, False): identity, (True, True): local or rope}
        tables = {key: tuple(r.data_ptr() for r in (ro.cos_table, ro.sin_table, ro.positions))
                  for key, ro in ropes.items()}
        views = {la.window: meta.pool(la.window).groups[0].within(la.window)
                 for la in self.layers}
        contexts = {w: (meta.pool(w).slot_mapping.data_ptr(), v.context_slots.data_ptr(),
                        v.lens.data_ptr(), v.context_slots.shape[1]) for w, v in views.items()}
        return [ropes, views], tables, contexts

    def run(self, x: torch.Tensor, rope, kv_caches, batch, local=None) -> torch.Tensor:
        """x [T, hidden] (the embeddings, updated in place) -> the last layer's output.
        `local`: windowed layers' own rope (Gemma 3), where the model has it."""
        t, h, dt = x.shape[0], self.hidden, x.dtype
        bf16 = int(dt == torch.bfloat16)
        cache_bf16 = int(kv_caches[0][0].dtype == torch.bfloat16)
        nq, nkv = self.hq * self.d, self.hkv * self.d
        normed, proj = x.new_empty(t, h), x.new_empty(t, h)
        qkv = x.new_empty(t, nq + 2 * nkv)
        q, att = x.new_empty(t, self.hq, self.d), x.new_empty(t, nq)
        gu = x.new_empty(t, 2 * self.inter)
        gate, up = gu.chunk(2, dim=-1)
        xsum = torch.empty(t * self.max_group_count, dtype=torch.float32)
        ops, lib = self.ops, self.gemm_lib
        # fp32 compute with kernels that take bf16 only (avx512_gemm.c, amx_gemm.c): the int4
        # and int8 layers round x to bf16 and widen their bf16 outputs (int4.py, int8.py)
        widen = not bf16 and not cpu_gemm.takes_fp32(lib)
        gemm4 = lib.int4_gemm if bf16 or widen else lib.int4_gemm_f32
        if widen:  # the bf16 copies in and out, once for the whole step
            width = max(h, nq + 2 * nkv, 2 * self.inter)
            xb, yb = (torch.empty(t * width, dtype=torch.bfloat16) for _ in range(2))
        xp, np_, qkvp, qp, ap, xs = (a.data_ptr() for a in (x, normed, qkv, q, att, xsum))
        # `kept` holds what the pointers point at
        kept, tables, contexts = self._inputs(rope, local, batch.attention)

        def mm(m: Packed, xin: torch.Tensor, yout: torch.Tensor, n: int, k: int) -> int:
            """The call the layer's module makes for these rows (int4.py, int8.py)."""
            if isinstance(m, Linear):
                return _dense(ops, m, xin, yout, t, n, k, bf16)
            if widen:
                xr, yr = xb[:t * k].view(t, k), yb[:t * n].view(t, n)
                xr.copy_(xin)
                failed = packed(m, xr.data_ptr(), yr.data_ptr(), n, k)
                yout.copy_(yr)
                return failed
            return packed(m, xin.data_ptr(), yout.data_ptr(), n, k)

        def packed(m: Packed, xin: int, yout: int, n: int, k: int) -> int:
            if isinstance(m, Int4Linear):
                return gemm4(xin, m.q4x32.data_ptr(), yout, xs, t, n, k, m.group_size,
                             m.int8_from)
            if bf16 or widen:
                return lib.int8_gemm(xin, m.q8.data_ptr(), m.q8_scale.data_ptr(), yout, t, n, k,
                                     0)
            return lib.int8_gemm_f32(xin, m.q8.data_ptr(), m.q8_scale.data_ptr(), yout, t, n, k)

        failed = 0
        for la, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            kc, vc, num_slots = k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1]
            slots, ctx, lens, max_ctx = contexts[la.window]
            failed |= ops.rms_norm(xp, la.norm1.data_ptr(), np_, t, h, self.eps, bf16)
            failed |= mm(la.qkv, normed, qkv, nq + 2 * nkv, h)
            cos, sin, pos = tables[la.uses_rope, la.local_rope]
            qn, kn = (None if n is None else n.data_ptr() for n in (la.q_norm, la.k_norm))
            failed |= ops.rope_store(qkvp, t, nq + 2 * nkv, self.hq, self.hkv, self.d, cos, sin,
                                     pos, slots, qp, kc, vc, num_slots, bf16, cache_bf16, qn, kn,
                                     self.eps)
            if rope.query_scale is not None:  # as the module scales it (Ministral 3)
                q.mul_(rope.query_scale)
            failed |= ops.paged_decode(qp, kc, vc, ctx, lens, ap, t, self.hq, self.hkv, self.d,
                                       max_ctx, num_slots, self.scale, bf16, cache_bf16)
            failed |= mm(la.o, att, proj, h, nq)
            if la.post_attn is not None:  # in place: rms_norm reads a row before writing it
                failed |= ops.rms_norm(proj.data_ptr(), la.post_attn.data_ptr(),
                                       proj.data_ptr(), t, h, self.eps, bf16)
            add_residual(x, proj, self.residual_multiplier)
            failed |= ops.rms_norm(xp, la.norm2.data_ptr(), np_, t, h, self.eps, bf16)
            failed |= mm(la.gate_up, normed, gu, 2 * self.inter, h)
            act = self.act(gate) * up
            failed |= mm(la.down, act, proj, h, self.inter)
            if la.post_ffn is not None:
                failed |= ops.rms_norm(proj.data_ptr(), la.post_ffn.data_ptr(),
                                       proj.data_ptr(), t, h, self.eps, bf16)
            add_residual(x, proj, self.residual_multiplier)
        if failed:  # shapes were checked when the plan was built: a kernel's own refusal
            raise RuntimeError("a CPU kernel declined a decode step it was planned for")
        return x


def _dense(ops, m: Linear, xin: torch.Tensor, yout: torch.Tensor, t: int, n: int, k: int,
           bf16: bool) -> int:
    """The call an unquantized layer's forward makes for these rows: packed_gemm where it
    packed its weight, else dense_gemm."""
    if m.packed is not None:
        return ops.packed_gemm(xin.data_ptr(), m.packed.data_ptr(), yout.data_ptr(), t, n, k, 0)
    return ops.dense_gemm(xin.data_ptr(), m.weight.data_ptr(), yout.data_ptr(), t, n, k, bf16,
                          m.weight.dtype == torch.bfloat16, 0)


def add_residual(x: torch.Tensor, branch: torch.Tensor, multiplier: float) -> None:
    """x += branch * multiplier in place, rounded as llama.residual rounds it (the branch
    scaled in the compute dtype first)."""
    if multiplier != 1.0:
        branch.mul_(multiplier)
    x.add_(branch)
