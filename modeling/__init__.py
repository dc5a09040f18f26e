"""The hybrid model for Transformers. Importing this package registers `HybridConfig` and its models with the Auto
classes: `HybridModel` (`AutoModel`), `HybridForCausalLM` (`AutoModelForCausalLM`) and the standard heads
(`AutoModelForSequenceClassification`, `AutoModelForTokenClassification`, `AutoModelForQuestionAnswering`).

`HybridConfig` (defined in `configuration`) is public here: its pickles name `modeling.HybridConfig`, so a process that
unpickles a config imports this package, and the Auto classes can build the model there."""

from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from configuration import HybridConfig

from .modeling_hybrid import (
    HybridCache,
    HybridForCausalLM,
    HybridForQuestionAnswering,
    HybridForSequenceClassification,
    HybridForTokenClassification,
    HybridModel,
    HybridPreTrainedModel,
    HybridStaticCache,
)

AutoModel.register(HybridConfig, HybridModel, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(HybridConfig, HybridForSequenceClassification, exist_ok=True)
AutoModelForTokenClassification.register(HybridConfig, HybridForTokenClassification, exist_ok=True)
AutoModelForQuestionAnswering.register(HybridConfig, HybridForQuestionAnswering, exist_ok=True)

__all__ = [
    "HybridCache",
    "HybridConfig",
    "HybridForCausalLM",
    "HybridForQuestionAnswering",
    "HybridForSequenceClassification",
    "HybridForTokenClassification",
    "HybridModel",
    "HybridPreTrainedModel",
    "HybridStaticCache",
]
