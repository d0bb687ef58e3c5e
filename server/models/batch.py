"""What one forward of the model knows, built once per step and passed down to every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.models.attention import AttentionMetadata
from server.quant.rows import RowSplit


@dataclass(slots=True)
class ForwardBatch:
    """A step's flat batch of tokens from many sequences."""

    input_ids: torch.Tensor  # [num_tokens]
    attention: AttentionMetadata  # positions, cache slots, attention groups
    rows: RowSplit | None = None  # which rows hold prompt tokens (None outside an engine step)
    # The rows whose hidden states are read after the forward (the sampling ones), with their
    # own split; None: every row. Past the last layer's attention only these are computed.
    outputs: torch.Tensor | None = None
    output_rows: RowSplit | None = None
