"""The hybrid model for Transformers. Importing this package registers `HybridConfig`, `HybridModel` and
`HybridForCausalLM` with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`."""

from transformers import AutoModel, AutoModelForCausalLM

from configuration import HybridConfig

from .modeling_hybrid import HybridCache, HybridForCausalLM, HybridModel, HybridPreTrainedModel

AutoModel.register(HybridConfig, HybridModel, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)

__all__ = ["HybridCache", "HybridConfig", "HybridForCausalLM", "HybridModel", "HybridPreTrainedModel"]
