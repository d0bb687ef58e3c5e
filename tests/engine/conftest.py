"""The tiny random-weight Llama the engine tests share."""

from __future__ import annotations

import pytest
import torch

from server.models.loader import build_model
from tests.helpers import hf_model, our_config


@pytest.fixture(scope="session")
def llama():
    hf = hf_model("llama", seed=8)
    return build_model(our_config(hf), dict(hf.state_dict()), {}, torch.device("cpu"),
                       torch.float32)
