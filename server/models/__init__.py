"""Model code: the Llama family, its config, and loading from the model store."""

from __future__ import annotations

from server.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "UnsupportedModelError", "model_class"]


def model_class(architecture: str):
    """Registry by architecture name: every family shares one implementation (llama.py)."""
    from server.models.llama import LlamaForCausalLM

    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported architecture {architecture!r}")
    return LlamaForCausalLM
