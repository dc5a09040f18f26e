"""`HybridConfig`. Importing this package registers `model_type="hybrid"` with `AutoConfig` and imports nothing of
`modeling`, the package above it: `import modeling` registers the model classes with `AutoModel`,
`AutoModelForCausalLM` and the heads' Auto classes.

A process that only unpickles a config (an FSDP or accelerate worker, a spawned `from_config`) still finds the model
classes: `HybridConfig` is public as `modeling.HybridConfig` (`__module__`, as numpy's `set_module` does), so a pickle
names that module and unpickling imports `modeling`."""

from .versions import check_torch_and_transformers

check_torch_and_transformers()  # before anything that uses them: an unsupported version fails here, by name

from transformers import AutoConfig  # noqa: E402

from .configuration_hybrid import HybridConfig  # noqa: E402

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)

# A name, not an import: pickle resolves it (and `modeling` re-exports the class). Transformers reads a config class's
# `__module__` only to tell its own classes ("transformers.") from others, which this one stays.
HybridConfig.__module__ = "modeling"

__all__ = ["HybridConfig"]
