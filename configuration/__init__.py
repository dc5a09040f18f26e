"""`HybridConfig`; importing this package registers `model_type="hybrid"` with `AutoConfig`."""

from transformers import AutoConfig

from .configuration_hybrid import HybridConfig

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)

__all__ = ["HybridConfig"]
