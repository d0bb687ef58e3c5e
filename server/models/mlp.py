"""The gated MLP every family shares: gate and up (fused into one call once loaded, or stored
fused as Phi-3 keeps them), the activation of gate times up, then down."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import server.kernels.layer_ops as layer_ops
from server.models.config import ModelConfig
from server.models.linear import Linear
from server.quant import fuse_linears
from server.quant.rows import RowSplit

# The gated MLP's activation by the config's name (transformers' ACT2FN names)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate: int | None = None,
                 bias: bool = False) -> None:
        """`intermediate`: its width (a mixture's experts'), default the config's; `bias`:
        every projection has one (gpt-oss's experts)."""
        super().__init__()
        h, i = config.hidden_size, intermediate or config.intermediate_size
        self.gate_up_proj: nn.Module | None = None  # gate and up in one call, after fuse()
        if config.fused_projections:  # stored fused (Phi-3), gate first
            self.gate_up_proj = Linear(h, 2 * i, bias=bias)
        else:
            self.gate_proj = Linear(h, i, bias=bias)
            self.up_proj = Linear(h, i, bias=bias)
        self.down_proj = Linear(i, h, bias=bias)
        self.activation, self.act = config.activation, ACTIVATIONS[config.activation]

    def fuse(self) -> None:
        if self.gate_up_proj is not None:
            return
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x, rows).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x, rows), self.up_proj(x, rows)
        return self.down_proj(self.glu(gate, up), rows)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation of gate and up: on the CPU layer_ops' (the decode plan's own,
        so that its rows and the modules' agree bit for bit), else PyTorch's."""
        if gate.device.type == "cpu" and gate.dim() == 2:
            out = layer_ops.act_mul(gate, up, self.activation)
            if out is not None:
                return out
        return self.act(gate) * up
