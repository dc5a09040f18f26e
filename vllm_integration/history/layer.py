"""What every served history branch shares: a vLLM Mamba-style layer (`MambaBase`) registered under its own prefix,
with its state slots bound by vLLM's KV-cache manager and the state metadata of history/metadata.py."""

from collections.abc import Callable

import torch
from torch import nn
from vllm.config import CacheConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator, is_conv_state_dim_first
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, get_kv_cache_torch_dtype
from vllm.v1.attention.backend import AttentionBackend

from configuration import HybridConfig

from .metadata import HybridSSMBackend, token_split


class ServedHistoryBranch(MambaBase, nn.Module):
    """The base of each kind's layer (history/__init__.py lists what a kind adds): registration, the state's dtypes,
    copy functions and views, and the metadata backend."""

    def __init__(self, config: HybridConfig, cache_config: CacheConfig | None, prefix: str):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_world_size()
        vllm_config = get_current_vllm_config()
        compilation_config = vllm_config.compilation_config
        if prefix in compilation_config.static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        compilation_config.static_forward_context[prefix] = self
        # Replaced by vLLM's KV-cache binding: (conv state, ssm state), one row per slot.
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        self.config = config
        self.model_config = vllm_config.model_config
        self.cache_config = cache_config
        self.prefix = prefix

    def add_conv1d(self, channels: int, kernel_size: int, bias: bool, sharded_loader: Callable) -> None:
        """The depthwise conv's parameters, which `causal_conv` reads: `conv1d_weight` [channels, K] and, with `bias`,
        `conv1d_bias` [channels] (else None), this rank's channels. `sharded_loader(param, full)` takes the rank's
        rows of a full tensor; the checkpoint's weight [all channels, 1, K] reaches it as [all channels, K]."""
        self.conv1d_weight = nn.Parameter(torch.empty(channels, kernel_size))
        set_weight_attrs(self.conv1d_weight, {"weight_loader": lambda param, w: sharded_loader(param, w.flatten(1))})
        if bias:
            self.conv1d_bias = nn.Parameter(torch.empty(channels))
            set_weight_attrs(self.conv1d_bias, {"weight_loader": sharded_loader})
        else:
            self.conv1d_bias = None

    @staticmethod
    def in_proj_weight_loader(config: HybridConfig, tp_size: int, tp_rank: int) -> Callable | None:
        """How a rank loads its rows of in_proj's weight (the merged layer's loader's arguments) where its parts do
        not all split evenly over the ranks; None: in_proj's own loader, which splits each part evenly."""
        return None

    @staticmethod
    def state_dtypes(model_dtype, cache_config: CacheConfig) -> tuple[torch.dtype, ...]:
        """(conv state dtype, ssm state dtype). Unlike vLLM's Mamba default, the ssm state stays fp32 unless
        `mamba_ssm_cache_dtype` asks otherwise: the Transformers model keeps it in fp32 too."""
        conv_dtype = get_kv_cache_torch_dtype(cache_config.mamba_cache_dtype, model_dtype)
        if cache_config.mamba_ssm_cache_dtype == "auto":
            return conv_dtype, torch.float32
        return conv_dtype, STR_DTYPE_TO_TORCH_DTYPE[cache_config.mamba_ssm_cache_dtype]

    @staticmethod
    def state_copy_func():
        """How vLLM copies a cached state into a running slot (prefix caching): the conv state and the ssm state
        each by slot, as for vLLM's Mamba-1 and Mamba-2 layers."""
        return MambaStateCopyFuncCalculator.mamba1_state_copy_func()

    def state_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state [slots, channels, K-1], ssm state [slots, ...]) whatever vLLM's conv-state layout."""
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        return conv_state, self.kv_cache[1]

    def causal_conv(self, inputs: torch.Tensor, conv_state: torch.Tensor, metadata, ops) -> torch.Tensor:
        """The branch's causal depthwise conv (silu fused) over a packed batch [T, channels], each request continuing
        from its conv state slot: the decodes' one-token update and the prefills' packed conv, written into one
        buffer in batch order (CUDA-graph padding rows past both left out). `ops` has the references' signatures."""
        decode, prefill = token_split(metadata)
        out = inputs.new_empty(prefill.stop, inputs.shape[-1])
        if metadata.num_decodes:
            ops.conv_update(
                inputs[decode], self.conv1d_weight, self.conv1d_bias, conv_state, metadata.state_indices_tensor_d[:, 0],
                "silu", out[decode], has_initial_state=metadata.has_initial_states_d,
            )  # fmt: skip
        if metadata.num_prefills:
            ops.conv_varlen(
                inputs[prefill], self.conv1d_weight, self.conv1d_bias, conv_state, metadata.query_start_loc_p,
                metadata.state_indices_tensor_p, metadata.has_initial_states_p, "silu", out[prefill],
            )  # fmt: skip
        return out

    def get_state_shape(self):
        return self.state_shapes(self.config, self.tp_size)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.state_dtypes(self.model_config.dtype, self.cache_config)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return HybridSSMBackend
