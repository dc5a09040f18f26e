"""`HybridConfig`. Importing this package registers `model_type="hybrid"` with `AutoConfig`, and the model classes
with `AutoModel` and `AutoModelForCausalLM` (through `modeling`), so that a process that only unpickles or loads a
config (an FSDP or accelerate worker, a spawned `from_config`) can build the model."""

from transformers import AutoConfig

from .configuration_hybrid import HybridConfig

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)

# Last, once `HybridConfig` is bound: `modeling` imports it from here. Started from `import modeling`, this returns
# the partly initialised package, which registers the model classes itself when it finishes. Cheap on a machine
# without a GPU: the Triton kernels are defined, not compiled, and CUDA is not initialised.
import modeling  # noqa: F401

__all__ = ["HybridConfig"]
