"""layer_ops' load-time check (layer_ops._self_check): each function of the built library
against the PyTorch reference within rounding, and a batch of rows bit for bit against the same
rows computed one at a time (batch invariance). A library that fails is not used."""

from __future__ import annotations

import torch


def self_check(ops, lib) -> str | None:
    """None if every function of `ops` (the layer_ops module) on `lib` matches PyTorch within
    rounding and gives each row the same bits alone and batched; else what failed."""
    g = torch.Generator().manual_seed(0)
    for dtype in ops._DTYPES:  # fp32 and bf16, as the library takes them
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        x = torch.randn(9, 576, generator=g).to(dtype)
        w = (torch.rand(576, generator=g) + 0.5).to(dtype)
        got = ops.rms_norm(x, w, 1e-5, lib)
        h = x.float()
        want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        if got is None or not torch.allclose(got.float(), want.float(), rtol=tol, atol=tol):
            return f"rms_norm {dtype}"
        if not torch.equal(got[3:4], ops.rms_norm(x[3:4].contiguous(), w, 1e-5, lib)):
            return f"rms_norm rows {dtype}"
        problem = (_check_attention(ops, lib, dtype, tol, g)
                   or _check_dense(ops, lib, dtype, tol, g) or _check_act(ops, lib, dtype, tol, g))
        if problem:
            return problem
    return _check_packed(ops, lib, g) or _check_argmax(ops, lib, g)


def _check_argmax(ops, lib, g: torch.Generator) -> str | None:
    """argmax against x.max(dim=-1).indices: ties (the first), a NaN (the first wins), -inf rows,
    widths past and short of a vector."""
    x = torch.randint(0, 40, (6, 1000), generator=g).float()
    x[1, 7], x[1, 900], x[2] = float("nan"), float("nan"), float("-inf")
    x[3, 999] = 100.0
    for rows in (x, x[:, :5].contiguous()):
        got = ops.argmax(rows, lib)
        if got is None or not torch.equal(got, rows.max(dim=-1).indices):
            return "argmax"
    return None


def _check_dense(ops, lib, dtype: torch.dtype, tol: float, g: torch.Generator) -> str | None:
    """dense_mm against the fp32 product (weights in the compute dtype and in bf16), and each
    row alone the same bits as in a batch."""
    x = torch.randn(11, 96, generator=g).to(dtype)
    for wdtype in {dtype, torch.bfloat16}:
        w = torch.randn(48, 96, generator=g).to(wdtype)
        got, want = ops.dense_mm(x, w, lib), x.float() @ w.float().t()
        if got is None or not torch.allclose(got.float(), want, rtol=tol, atol=tol * 10):
            return f"dense_mm {dtype} x {wdtype}"
        if not all(torch.equal(got[i:i + 1], ops.dense_mm(x[i:i + 1], w, lib)) for i in range(11)):
            return f"dense_mm rows {dtype} x {wdtype}"
        wide = ops.dense_mm(x, w, lib, fp32_out=True)  # the same sums, rounded only to fp32
        if wide is None or not torch.equal(wide.to(dtype), got):
            return f"dense_mm fp32 out {dtype} x {wdtype}"
    return None


def _check_act(ops, lib, dtype: torch.dtype, tol: float, g: torch.Generator) -> str | None:
    """act_mul against PyTorch's act(gate) * up on the halves of fused rows (values to +-12,
    where the exponentials saturate), each row alone the same bits as in the batch."""
    torch_acts = {"silu": torch.nn.functional.silu,
                  "gelu_pytorch_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}
    fused = (torch.randn(7, 2 * 300, generator=g) * 4).clamp(-12, 12).to(dtype)
    gate, up = fused.chunk(2, dim=-1)
    for name, act in torch_acts.items():
        got, want = ops.act_mul(gate, up, name, lib), act(gate.float()) * up.float()
        if got is None or not torch.allclose(got.float(), want, rtol=tol, atol=tol):
            return f"act_mul {name} {dtype}"
        if not torch.equal(got[4:5], ops.act_mul(gate[4:5], up[4:5], name, lib)):
            return f"act_mul rows {name} {dtype}"
    return None


def _check_packed(ops, lib, g: torch.Generator) -> str | None:
    """packed_mm against the fp32 product where this build has it, 80 outputs (a pass of 48,
    one of 32; with AMX tiles two of 32, one of 16) and 37 rows (4 passes of 8, one of 5; with
    tiles a pass of 32 and one of 5, padded): each row alone the same bits as in the batch, and
    bf16 outputs its fp32 ones rounded."""
    w = torch.randn(80, 96, generator=g).bfloat16()
    packed = ops.pack_weight(w, lib)
    if packed is None:
        return None
    x = torch.randn(37, 96, generator=g).bfloat16()
    got, want = ops.packed_mm(x, packed, lib, fp32_out=True), x.float() @ w.float().t()
    if got is None or not torch.allclose(got, want, rtol=1e-4, atol=1e-3):
        return "packed_mm"
    if not all(torch.equal(got[i:i + 1], ops.packed_mm(x[i:i + 1], packed, lib, fp32_out=True))
               for i in range(37)):
        return "packed_mm rows"
    if not torch.equal(ops.packed_mm(x, packed, lib), got.bfloat16()):
        return "packed_mm bf16 out"
    return None


def _check_attention(ops, lib, dtype: torch.dtype, tol: float, g: torch.Generator) -> str | None:
    hq, hkv, d, slots, t = 6, 2, 64, 97, 5
    positions = torch.tensor([3, 0, 40, 7, 95])
    where = torch.randperm(slots - 1, generator=g)[:t]
    angles = torch.outer(torch.arange(128.0), torch.rand(d // 2, generator=g))
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    caches = [torch.randn(hkv, slots, d, generator=g).to(dtype) for _ in range(2)]
    before = [c.clone() for c in caches]
    q = ops.rope_store(qkv, hq, hkv, d, cos, sin, positions, where, *caches, lib=lib)
    x = qkv.float().view(t, hq + 2 * hkv, d)
    c, s = cos[positions][:, None], sin[positions][:, None]
    rotated = x * c + torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1) * s
    before[0][:, where] = rotated[:, hq:hq + hkv].transpose(0, 1).to(dtype)
    before[1][:, where] = x[:, hq + hkv:].transpose(0, 1).to(dtype)
    if (q is None or not torch.allclose(q.float(), rotated[:, :hq], rtol=tol, atol=tol)
            or not all(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
                       for a, b in zip(caches, before, strict=True))):
        return f"rope_store {dtype}"
    problem = _check_normed_rope(ops, lib, qkv, hq, hkv, cos, sin, positions, where, g)
    if problem:
        return problem
    lens = torch.tensor([1, 50, 96, 17])
    ctx = torch.stack([torch.randperm(slots - 1, generator=g) for _ in lens])
    qd = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    got = ops.paged_decode(qd, *caches, ctx, lens, d**-0.5, lib)
    if got is None:
        return f"paged_decode {dtype}"
    for i, n in enumerate(lens.tolist()):
        k, v = (c[:, ctx[i, :n]].float().repeat_interleave(hq // hkv, 0) for c in caches)
        p = torch.softmax(qd[i].float()[:, None] @ k.transpose(1, 2) * d**-0.5, dim=-1)
        want = (p @ v).reshape(-1)
        alone = ops.paged_decode(qd[i:i + 1].contiguous(), *caches, ctx[i:i + 1].contiguous(),
                             lens[i:i + 1].contiguous(), d**-0.5, lib)
        if (not torch.allclose(got[i].float(), want, rtol=tol, atol=tol)
                or alone is None or not torch.equal(alone[0], got[i])):
            return f"paged_decode {dtype} row {i}"
    return _check_prompt(ops, lib, dtype, tol, caches, ctx[2], g)


def _check_normed_rope(ops, lib, qkv, hq, hkv, cos, sin, positions, slots, g) -> str | None:
    """rope_store with q/k norms: the bits of rms_norm on each q and k head, then rope_store."""
    t, d, dtype = qkv.shape[0], qkv.shape[1] // (hq + 2 * hkv), qkv.dtype
    qn, kn = ((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2))
    heads = qkv.view(t, hq + 2 * hkv, d)
    normed = torch.cat([ops.rms_norm(heads[:, :hq].reshape(-1, d), qn, 1e-6, lib).view(t, hq, d),
                        ops.rms_norm(heads[:, hq:hq + hkv].reshape(-1, d), kn, 1e-6, lib).view(
                            t, hkv, d), heads[:, hq + hkv:]], dim=1).reshape(t, -1)
    caches = [[torch.zeros(hkv, 97, d, dtype=dtype) for _ in range(2)] for _ in range(2)]
    fused = ops.rope_store(qkv, hq, hkv, d, cos, sin, positions, slots, *caches[0], lib=lib,
                       q_norm=qn, k_norm=kn, eps=1e-6)
    apart = ops.rope_store(normed, hq, hkv, d, cos, sin, positions, slots, *caches[1], lib=lib)
    if (fused is None or apart is None or not torch.equal(fused, apart)
            or not all(torch.equal(a, b) for a, b in zip(*caches, strict=True))):
        return f"rope_store with q/k norms {dtype}"
    return None


def _check_prompt(ops, lib, dtype: torch.dtype, tol: float, caches: list[torch.Tensor],
                  slots: torch.Tensor, g: torch.Generator) -> str | None:
    """paged_prompt against PyTorch's causal attention, and a chunk alone the same bits as the
    same rows computed with the whole prompt (positions 0..40, the chunk 23..40)."""
    hkv, d = caches[0].shape[0], caches[0].shape[2]
    for hq in (hkv * 3, hkv):  # query groups of 3 (SmolLM2) and 1 (multi-head)
        qp = torch.randn(41, hq, d, generator=g).to(dtype)
        whole = ops.paged_prompt(qp, *caches, slots, 0, d**-0.5, lib)
        part = ops.paged_prompt(qp[23:].contiguous(), *caches, slots, 23, d**-0.5, lib)
        if whole is None or part is None or not torch.equal(part, whole[23:]):
            return f"paged_prompt {dtype} chunk"
        k, v = (c[:, slots[:41]].float().repeat_interleave(hq // hkv, 0) for c in caches)
        s = qp.float().transpose(0, 1) @ k.transpose(1, 2) * d**-0.5  # [hq, 41, 41]
        s += torch.full((41, 41), float("-inf")).triu(1)
        want = (torch.softmax(s, dim=-1) @ v).transpose(0, 1).reshape(41, -1)
        if not torch.allclose(whole.float(), want, rtol=tol, atol=tol):
            return f"paged_prompt {dtype}"
    return None
