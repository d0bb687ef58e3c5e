"""A step of decodes only, through the decoder layers in one C call (CPU kernels).

At one sequence a layer's kernels take ~100 us and the Python around them took as much again:
nine module calls, the quantized layers' dispatch, each C helper's checks and allocations, the
attention groups' bookkeeping. When every row of a step is a generated token, the layers are
int4 or int8 in our kernels' layout (cpu_gemm.py) or unquantized ones that dense_gemm.c takes,
and layer_ops.c is built, `DecodePlan.run` hands the whole step to decode_step.c: the same C
functions on the same inputs, every shape checked once when the plan is built, the residual
adds, query scale and gated activation done as the modules do them (the MLP modules call the
same act_mul). A row's numbers are therefore the ones the modules compute, bit for bit
(tested), so steps that mix prompt rows in, which keep the modules, agree with it: batch
invariance holds.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
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


_P, _I = ctypes.c_void_p, ctypes.c_int64
_ROPES = ((True, False), (False, False), (True, True))  # (uses rope, local tables): the step's


class _Proj(ctypes.Structure):  # decode_step.c's struct proj
    _fields_ = [("kind", _I), ("w", _P), ("scale", _P), ("group", _I), ("int8_from", _I),
                ("w_bf16", _I)]


class _CLayer(ctypes.Structure):  # struct layer
    _fields_ = ([(n, _P) for n in ("norm1", "norm2", "post_attn", "post_ffn", "q_norm",
                                   "k_norm")]
                + [(n, _Proj) for n in ("qkv", "o", "gate_up", "down")]
                + [("rope", _I), ("window", _I)])


class _Step(ctypes.Structure):  # struct step
    _fields_ = ([(n, _I) for n in ("t", "h", "inter", "hq", "hkv", "d", "bf16", "cache_bf16",
                                   "act", "widen")]
                + [(n, ctypes.c_double) for n in ("eps", "scale", "residual_multiplier")]
                + [(n, _P) for n in ("x", "normed", "proj", "qkv", "q", "att", "gu", "actv",
                                     "xb", "yb", "xsum", "query_scale")]
                + [(n, _P * 3) for n in ("cos", "sin", "positions")]
                + [(n, _P * 2) for n in ("slots", "ctx", "lens")] + [("max_ctx", _I * 2)]
                + [("caches", _P), ("num_slots", _P), ("int4", _P), ("int8", _P),
                   ("int8_f32", _I)])


def _proj(m: Packed) -> _Proj:
    """A projection as decode_step.c calls it: the call its module makes (int4.py, int8.py,
    linear.py: packed_gemm where it packed its weight, else dense_gemm)."""
    if isinstance(m, Int4Linear):
        return _Proj(0, m.q4x32.data_ptr(), None, m.group_size, m.int8_from, 0)
    if isinstance(m, Int8Linear):
        return _Proj(1, m.q8.data_ptr(), m.q8_scale.data_ptr(), 0, 0, 0)
    if m.packed is not None:
        return _Proj(2, m.packed.data_ptr(), None, 0, 0, 1)
    return _Proj(3, m.weight.data_ptr(), None, 0, 0, m.weight.dtype == torch.bfloat16)


def _c_layer(la: _Layer, windows: list) -> _CLayer:
    """The layer's weights as pointers (the modules keep the tensors)."""
    norms = (la.norm1, la.norm2, la.post_attn, la.post_ffn, la.q_norm, la.k_norm)
    return _CLayer(*(None if n is None else n.data_ptr() for n in norms),
                   *(_proj(m) for m in (la.qkv, la.o, la.gate_up, la.down)),
                   _ROPES.index((la.uses_rope, la.local_rope)), windows.index(la.window))


class DecodePlan:
    def __init__(self, model: nn.Module, layers: list[_Layer]) -> None:
        c = model.config
        self.hidden, self.inter = c.hidden_size, c.intermediate_size
        self.hq, self.hkv, self.d = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.scale = c.scale
        self.residual_multiplier = c.residual_multiplier
        self.act = layer_ops.ACTIVATIONS[c.activation]  # act_mul's, as the MLP modules call it
        self.layers = layers
        # the layers' attention windows (None: the whole context), each a context of the step
        windows = list(dict.fromkeys(la.window for la in layers))
        self.c_layers = (_CLayer * len(layers))(*[_c_layer(la, windows) for la in layers])
        self.windows = (windows * 2)[:2]  # the step takes two (decode_step.c)
        # a layer of each window: layers of one window keep their caches in one pool, allocated
        # alike (allocate_kv), so one of them tells the pool's dtype and layout
        self.pool_layers = sorted({la.window: i for i, la in reversed(list(enumerate(layers)))
                                   }.values())
        self.ops, self.gemm_lib = layer_ops._lib(), cpu_gemm.checked()
        self.max_group_count = max([m.in_features // m.group_size for la in layers for m in (
            la.qkv, la.o, la.gate_up, la.down) if isinstance(m, Int4Linear)], default=1)
        # per (thread, dtype, widen): scratch for the most rows a step has asked, whose
        # prefixes serve smaller steps (the C step reads pointers only); and the pools' pointers
        self._scratch: dict[tuple, tuple[int, list[torch.Tensor], list[int]]] = {}
        self._pools: tuple | None = None

    @staticmethod
    def build(model: nn.Module) -> DecodePlan | None:
        """The plan for this model, or None where it does not apply (then the modules run)."""
        if not layer_ops.enabled() or cpu_gemm.checked() is None:
            return None
        c = model.config
        if c.attn_logit_softcapping is not None or c.attention_sinks:  # the C attention has
            return None  # neither a cap nor sinks
        if c.activation not in layer_ops.ACTIVATIONS:
            return None
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
        if len({la.window for la in layers}) > 2:  # the step's contexts: whole and windowed
            return None
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
        """x [T, hidden] (the embeddings, updated in place) -> the last layer's output, in one
        call of decode_step.c. `local`: windowed layers' own rope (Gemma 3), where the model
        has it."""
        t, h, dt = x.shape[0], self.hidden, x.dtype
        bf16 = dt == torch.bfloat16
        # fp32 compute with kernels that take bf16 only (avx512_gemm.c, amx_gemm.c): the int4
        # and int8 layers round x to bf16 and widen their bf16 outputs (int4.py, int8.py)
        widen = not bf16 and not cpu_gemm.takes_fp32(self.gemm_lib)
        scale = rope.query_scale.contiguous() if rope.query_scale is not None else None
        kept, tables, contexts = self._inputs(rope, local, batch.attention)
        caches, slots = self._pool_pointers(kv_caches)
        step = _Step(
            t, h, self.inter, self.hq, self.hkv, self.d, bf16,
            kv_caches[0][0].dtype == torch.bfloat16, self.act, widen, self.eps, self.scale,
            self.residual_multiplier, x.data_ptr(), *self._buffers(t, dt, widen),
            None if scale is None else scale.data_ptr(),
            *(tuple(tables[key][i] for key in _ROPES) for i in range(3)),
            *(tuple(contexts[w][i] for w in self.windows) for i in range(4)),
            ctypes.addressof(caches), ctypes.addressof(slots), self._int4(bf16 or widen),
            *self._int8(bf16 or widen))
        if self.ops.decode_step(ctypes.byref(step), self.c_layers, len(self.layers)):
            # shapes were checked when the plan was built: a kernel's own refusal
            raise RuntimeError("a CPU kernel declined a decode step it was planned for")
        del kept
        return x

    def _buffers(self, t: int, dtype: torch.dtype, widen: bool) -> list[int]:
        """The step's scratch for t rows, as pointers: x-sized, normed, q|k|v, q, attention,
        gate|up, activation (dtype); two bf16 copies where it widens; the int4 group sums."""
        key = (threading.get_ident(), dtype, widen)
        rows, _, pointers = self._scratch.get(key, (0, None, None))
        if rows < t:  # (and the scratch of threads gone since goes)
            alive = {thread.ident for thread in threading.enumerate()}
            self._scratch = {k: v for k, v in self._scratch.items() if k[0] in alive}
            nq, nkv = self.hq * self.d, self.hkv * self.d
            width = max(self.hidden, nq + 2 * nkv, 2 * self.inter) if widen else 0
            kept = [torch.empty(t, n, dtype=dtype) for n in (
                self.hidden, self.hidden, nq + 2 * nkv, nq, nq, 2 * self.inter, self.inter)]
            kept += [torch.empty(t * width, dtype=torch.bfloat16) for _ in range(2)]
            kept.append(torch.empty(t * self.max_group_count, dtype=torch.float32))
            pointers = [b.data_ptr() for b in kept]
            self._scratch[key] = (t, kept, pointers)
        return pointers

    def _pool_pointers(self, kv_caches) -> tuple:
        """The KV pools' pointers and slot counts as the step takes them, built again only for
        another list of pools (a runner allocates its list once and never changes it; the
        first pool is held weakly, so a new list in a freed one's place is told apart)."""
        key = (id(kv_caches), len(kv_caches))
        if self._pools is None or self._pools[0] != key or self._pools[1]() is not kv_caches[0][0]:
            caches = (ctypes.c_void_p * (2 * len(kv_caches)))(
                *[c.data_ptr() for pair in kv_caches for c in pair])
            slots = (ctypes.c_int64 * len(kv_caches))(*[k.shape[1] for k, _ in kv_caches])
            self._pools = (key, weakref.ref(kv_caches[0][0]), caches, slots)
        return self._pools[2], self._pools[3]

    def _int4(self, takes_bf16: bool) -> int | None:
        """The int4 GEMM the layers' modules call for rows of this dtype, as a pointer."""
        lib = self.gemm_lib
        fn = lib.int4_gemm if takes_bf16 else lib.int4_gemm_f32
        return ctypes.cast(fn, ctypes.c_void_p).value

    def _int8(self, takes_bf16: bool) -> tuple[int | None, bool]:
        """The int8 GEMM as a pointer, and whether it is the fp32 one (no output flag)."""
        lib = self.gemm_lib
        fn = lib.int8_gemm if takes_bf16 else lib.int8_gemm_f32
        return ctypes.cast(fn, ctypes.c_void_p).value, not takes_bf16
