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
