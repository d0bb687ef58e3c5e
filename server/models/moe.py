"""A mixture of experts in place of a layer's MLP: a router picks each token's top-k experts of
num_experts; the token's output is the experts' outputs weighted by the router's probabilities,
as transformers computes them. Qwen3-MoE (`gate`): the softmax over every expert, renormalized
over the k where norm_topk_prob; its experts the family's MLP. gpt-oss (`router`, with a bias):
the softmax over the k best logits; its experts a SwiGLU clamped at swiglu_limit, with biases
(ClampedExpert).

The step's (token, slot) pairs are grouped by expert, so each chosen expert runs once over its
tokens, reading its weights once; experts no token chose are not read at all. Each expert is the
family's MLP (int4/int8 layers in our kernels, rows independent of each other), and a token sums
its k weighted outputs in the order of its slots (the router's rank order): its numbers never
depend on the other tokens of the step, however many share an expert with it. Where the experts
are int4 in our kernels' layout, all of that is one C call a layer (server/kernels/experts.c,
the modules' numbers); otherwise one Python call an expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import server.kernels.cpu_gemm as cpu_gemm
import server.kernels.experts as experts_c
from server.kernels.experts import ExpertKernel
from server.models.config import ModelConfig
from server.models.linear import Linear
from server.models.mlp import MLP
from server.quant.int4 import Int4Linear
from server.quant.rows import RowSplit


class ClampedExpert(MLP):
    """gpt-oss's expert: the gate clamped above and up on both sides at `limit`, then
    gate * sigmoid(alpha * gate) * (up + 1); every projection with a bias."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, config.moe_intermediate_size, bias=True)
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, expert: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        self.clamped = config.expert_kind == "clamped"
        router = Linear(config.hidden_size, config.num_experts, bias=self.clamped)
        setattr(self, "router" if self.clamped else "gate", router)  # transformers' names
        self.experts = nn.ModuleList(expert() for _ in range(config.num_experts))
        self.activation = "clamped" if self.clamped else config.activation
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        self._kernel: tuple[tuple, ExpertKernel | None] | None = None  # (libraries, kernel)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, k] weights in x's dtype, [T, k] expert ids), best first."""
        if self.clamped:  # gpt-oss: the k best logits, then their softmax
            logits, experts = torch.topk(self.router(x), self.top_k, dim=-1)
            return torch.softmax(logits, dim=-1), experts
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def kernel(self) -> ExpertKernel | None:
        """The experts in one C call (experts.c), once they are in our int4 layout; rebuilt
        if the libraries change (tests switch them)."""
        key = (experts_c._lib(), cpu_gemm.checked())
        if self._kernel is None or self._kernel[0] != key:
            self._kernel = (key, self._build_kernel() if key[0] else None)
        return self._kernel[1]

    def _build_kernel(self) -> ExpertKernel | None:
        """experts.c's view of the experts: each one's gate|up and down in our int4 layout,
        all of one shape, an activation it has; else None."""
        parts = [(getattr(e, "gate_up_proj", None), getattr(e, "down_proj", None))
                 for e in self.experts]
        if (self.activation not in experts_c.ACTIVATIONS
                or not all(isinstance(m, Int4Linear) and m.q4x32 is not None
                           for pair in parts for m in pair)):
            return None
        gu, down = parts[0]
        h, inter = gu.in_features, down.in_features
        shapes = {(g.in_features, g.out_features, g.group_size, g.int8_from, g.bias is None,
                   d.in_features, d.out_features, d.group_size, d.int8_from, d.bias is None)
                  for g, d in parts}
        if (len(shapes) != 1 or max(h, inter) > experts_c.MAX_WIDTH
                or gu.out_features != 2 * inter or down.out_features != h
                or down.group_size != gu.group_size):
            return None
        return ExpertKernel([g.q4x32 for g, _ in parts], [d.q4x32 for _, d in parts],
                            [g.bias for g, _ in parts], [d.bias for _, d in parts], h, inter,
                            gu.group_size, self.activation, self.limit, self.alpha,
                            (gu.int8_from, down.int8_from))

    def forward(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. `rows` is not passed on: an expert's rows are a subset
        of the step's, each through the kernel the layer takes outside a step."""
        t, k = x.shape[0], self.top_k
        weights, experts = self.route(x)
        kernel = self.kernel()
        if kernel is not None and (y := kernel(x, experts, weights)) is not None:
            return y
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert
        chosen, counts = torch.unique_consecutive(flat[order], return_counts=True)
        out = x.new_empty(t * k, x.shape[1])
        start = 0
        for e, n in zip(chosen.tolist(), counts.tolist(), strict=True):  # one host sync
            pairs = order[start:start + n]
            out[pairs] = self.experts[e](x[pairs // k])
            start += n
        out = out.view(t, k, -1)
        y = out[:, 0] * weights[:, :1]
        for j in range(1, k):  # a fixed order: the token's own slots
            y = y + out[:, j] * weights[:, j:j + 1]
        return y
