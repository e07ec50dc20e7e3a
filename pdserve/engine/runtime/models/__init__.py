"""Model registry: HF architecture name -> model class."""

from __future__ import annotations

from pdserve.engine.checkpoint.model_config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from pdserve.engine.runtime.models.decoder import CausalLM

# All four are the same network; ModelConfig resolves their differences.
MODEL_CLASSES: dict[str, type[CausalLM]] = dict.fromkeys(SUPPORTED_ARCHITECTURES, CausalLM)


def model_class(architecture: str) -> type[CausalLM]:
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        ) from None


__all__ = ["MODEL_CLASSES", "CausalLM", "model_class"]
