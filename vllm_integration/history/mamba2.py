"""The Mamba-2 history branch as vLLM serves it (`ssm_type="mamba2"`, docs/DESIGN.md): `Mamba2Branch`, with vLLM's
Mamba-2 state layout (conv state `[E + 2GN, K-1]` and ssm state `[Hs, P, N]` per slot) and the hybrid's state
metadata (history/metadata.py, Mamba-1's too).

The branch over a packed batch (`Mamba2Branch.forward`) runs on either of two op sets with the references'
signatures (`Mamba2Ops`): on CUDA (`Mamba2Branch.triton_ops`) our Triton kernels, as Mamba-1's: the causal conv
(modeling/ops/causal_conv1d), the SSD scan over packed prefills and state slots and the gated norm (modeling/ops/ssd,
the training kernels' algorithm) and, for the decode step, the fused kernel that runs the decodes' window attention
and their state update in one launch (`hybrid_decode_ssd`, vllm_integration/ops/hybrid_decode); the PyTorch
references elsewhere (modeling/ops: the causal conv over E + 2GN channels, the SSD scan over the state slots, the
grouped gated RMSNorm).

Under tensor parallelism the branch is sharded as vLLM's `MambaMixer2` shards it: each rank holds Hs/tp whole heads
(their channels of z, x, the conv, the norm and out_proj's input, and their dt_bias, A and D), and the groups of B
and C go with their heads, G/tp per rank where tp divides G, the one group on every rank where G is 1 (vLLM's extra
groups, which its Mamba-2 state shapes count). With one group the gated norm spans the ranks: each rank's sum of
squares is all-reduced (`gated_rms_norm_across_ranks`). Either op set then runs on the rank's tensors unchanged.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import CacheConfig, get_current_vllm_config
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.model_executor.model_loader.weight_utils import composed_weight_loader, sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from configuration import HybridConfig
from modeling.ops import (
    causal_conv1d_update_ref,
    causal_conv1d_varlen_ref,
    gated_rms_norm_ref,
    ssd_state_update_ref,
    ssd_varlen_scan_ref,
)

from ..layout import a_from_a_log
from .layer import ServedHistoryBranch
from .metadata import HybridSSMMetadata, token_split


class Mamba2Ops(NamedTuple):
    """The ops `Mamba2Branch.forward` runs (the signatures of the PyTorch references in modeling/ops; the scan steps
    take the raw dt with its bias and softplus, `dt_bias` and `dt_softplus`)."""

    conv_update: Callable  # one new token per request, shifted into its conv state slot
    conv_varlen: Callable  # packed prefills, each continuing from (or starting) its conv state slot
    decode_step: Callable  # one scan step per request, from/into its ssm state slot (CUDA: fused with the attention)
    scan_varlen: Callable  # packed prefills, each continuing from (or starting) its ssm state slot
    gated_norm: Callable  # rmsnorm(y * silu(z)) * weight over groups of E/G channels


REFERENCE_OPS = Mamba2Ops(
    causal_conv1d_update_ref, causal_conv1d_varlen_ref, ssd_state_update_ref, ssd_varlen_scan_ref, gated_rms_norm_ref
)


def check_tensor_parallel(config: HybridConfig, tp_size: int) -> None:
    """Raises ValueError where the branch cannot be sharded over `tp_size` ranks as vLLM's `MambaMixer2` shards it:
    whole heads per rank, and groups either split (tp divides G) or one group replicated on every rank."""
    heads, groups = config.ssm_num_heads, config.ssm_n_groups
    if heads % tp_size:
        raise ValueError(
            f"ssm_num_heads {heads} is not divisible by tensor parallel {tp_size}: each rank holds whole SSM heads"
        )
    if groups % tp_size and groups != 1:
        raise ValueError(
            f"ssm_n_groups {groups} is neither divisible by tensor parallel {tp_size} nor 1: a rank's heads must read "
            "whole groups of B and C, split over the ranks or (one group) replicated on each"
        )


def xbc_shard_spec(config: HybridConfig, tp_size: int) -> list[tuple[int, int, bool]]:
    """The conv's channels x | B | C as `mamba_v2_sharded_weight_loader` takes them, (size with the extra groups,
    extra size, replicated) per part: x split by heads; B and C split by groups or, with one group and several ranks,
    that group whole on every rank (vLLM's extra groups, one copy per rank)."""
    state_size = config.ssm_state_size
    extra = MambaStateShapeCalculator.extra_groups_for_head_shards(config.ssm_n_groups, tp_size)
    groups = ((config.ssm_n_groups + extra) * state_size, extra * state_size, extra > 0)
    return [(config.ssm_intermediate_size, 0, False), groups, groups]


def in_proj_shard_spec(config: HybridConfig, tp_size: int) -> list[tuple[int, int, bool]]:
    """in_proj's output parts z | x | B | C | dt as `mamba_v2_sharded_weight_loader` takes them."""
    return [
        (config.ssm_intermediate_size, 0, False),
        *xbc_shard_spec(config, tp_size),
        (config.ssm_num_heads, 0, False),
    ]


def gated_rms_norm_across_ranks(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`gated_rms_norm_ref` over one group whose channels are split over the tensor-parallel ranks (ssm_n_groups 1
    under tensor parallelism): y, z [T, E/tp] and weight [E/tp] are this rank's channels. Each rank's sum of squares
    is all-reduced (one value per token), as vLLM's `Mixer2RMSNormGated` does."""
    gated = y.float() * F.silu(z.float())
    sums = tensor_model_parallel_all_reduce(gated.pow(2).sum(-1, keepdim=True))
    mean_square = sums / (gated.shape[-1] * get_tensor_model_parallel_world_size())
    return (gated * torch.rsqrt(mean_square + eps) * weight.float()).to(y.dtype)


class Mamba2Branch(ServedHistoryBranch):
    """The stateful part of the Mamba-2 branch (conv1d over x, B and C; dt_bias, A, D; the gated norm) with its state
    declared to vLLM. `in_proj` (z | x | B | C | dt) and `out_proj` live beside q/k/v and o_proj in the model; the
    attributes below are this rank's shard (the module docstring says how the branch is sharded)."""

    reference_ops = REFERENCE_OPS

    def __init__(self, config: HybridConfig, cache_config: CacheConfig | None = None, prefix: str = ""):
        super().__init__(config, cache_config, prefix)
        tp_size = self.tp_size
        check_tensor_parallel(config, tp_size)
        # One group spread over the ranks: its norm all-reduces, and in_proj's output parts have the extra groups.
        self.norm_spans_ranks = config.ssm_n_groups % tp_size != 0
        if self.norm_spans_ranks and get_current_vllm_config().lora_config is not None:
            # vLLM's LoRA layers split an in_proj adapter by in_proj's part sizes, which count the group once per rank
            # where the checkpoint (and the adapter) holds it once.
            raise ValueError(
                f"LoRA under tensor parallel {tp_size} needs ssm_n_groups divisible by it (got 1) with ssm_type "
                "'mamba2': vLLM's LoRA layers cannot split an in_proj adapter whose group every rank holds"
            )
        self.intermediate_size = self.local_size = config.ssm_intermediate_size // tp_size
        self.num_heads, self.head_dim = config.ssm_num_heads // tp_size, config.ssm_head_dim
        self.state_size = config.ssm_state_size
        self.n_groups = max(config.ssm_n_groups // tp_size, 1)  # G/tp, or the one group every rank holds
        self.chunk_size = config.ssm_chunk_size
        self.conv_channels = self.intermediate_size + 2 * self.n_groups * self.state_size
        self.norm_group_size = config.ssm_intermediate_size // config.ssm_n_groups

        # Each rank loads its shard; values change here only (layout.py): the conv weight as [C, K], A from A_log;
        # A, D and dt_bias in fp32.
        conv_sharded = mamba_v2_sharded_weight_loader(
            xbc_shard_spec(config, tp_size), tp_size, get_tensor_model_parallel_rank()
        )
        split_evenly = sharded_weight_loader(0)  # by head (dt_bias, A, D), or by channel in head order (the norm)
        self.add_conv1d(self.conv_channels, config.ssm_conv_kernel_size, config.ssm_conv_bias, conv_sharded)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.A = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        set_weight_attrs(self.dt_bias, {"weight_loader": split_evenly})
        set_weight_attrs(self.A, {"weight_loader": composed_weight_loader(split_evenly, a_from_a_log)})
        set_weight_attrs(self.D, {"weight_loader": split_evenly})
        self.norm_weight = nn.Parameter(torch.empty(self.intermediate_size))
        set_weight_attrs(self.norm_weight, {"weight_loader": split_evenly})
        self.norm_eps = config.rms_norm_eps

    @staticmethod
    def in_proj_sizes(config: HybridConfig, tp_size: int) -> list[int]:
        """The parts of in_proj's output before sharding, in order: z, x, B, C (with the extra groups), dt."""
        return [size for size, _, _ in in_proj_shard_spec(config, tp_size)]

    @staticmethod
    def in_proj_weight_loader(config: HybridConfig, tp_size: int, tp_rank: int) -> Callable:
        """in_proj's rows of this rank: each part's shard, B and C by `xbc_shard_spec` (one group: whole). It takes
        the merged layer's arguments; checkpoints hold in_proj as one tensor, never a shard id."""
        sharded = mamba_v2_sharded_weight_loader(in_proj_shard_spec(config, tp_size), tp_size, tp_rank)

        def loader(param: torch.Tensor, loaded_weight: torch.Tensor, loaded_shard_id: None = None) -> None:
            if loaded_shard_id is not None:
                raise ValueError(f"in_proj of ssm_type 'mamba2' loads as one tensor, not as shard {loaded_shard_id}")
            sharded(param, loaded_weight)

        return loader

    @staticmethod
    def state_shapes(config: HybridConfig, tp_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state shape, ssm state shape) per slot on each rank: vLLM's Mamba-2 layout."""
        check_tensor_parallel(config, tp_size)  # vLLM asks for the shapes before it builds the layers
        return MambaStateShapeCalculator.mamba2_state_shape(
            tp_size,
            config.ssm_intermediate_size,
            config.ssm_n_groups,
            config.ssm_num_heads,
            config.ssm_head_dim,
            config.ssm_state_size,
            config.ssm_conv_kernel_size,
        )

    @staticmethod
    def triton_ops(metadata: HybridSSMMetadata, with_decode_attention: Callable) -> Mamba2Ops:
        """The CUDA ops (imported on first use so that CPU-only installs never build them): our kernels, which size
        their grids from the tensors (the metadata is not needed; the scan finds each prefill's chunks on the device,
        chunks of 64 tokens from each sequence's first token, whatever `ssm_chunk_size`: the chunk length changes
        only the rounding), and the decode step fused with the decodes' window attention: `with_decode_attention`
        binds the attention backend's arguments to `hybrid_decode_ssd`, which then takes the state update's (one
        launch for both)."""
        from modeling.ops.causal_conv1d.interface import causal_conv1d_update, causal_conv1d_varlen_fwd
        from modeling.ops.ssd.gated_norm import gated_rms_norm_fwd
        from modeling.ops.ssd.interface import ssd_varlen_scan_fwd

        from ..ops.hybrid_decode.interface import hybrid_decode_ssd

        return Mamba2Ops(
            conv_update=causal_conv1d_update,
            conv_varlen=causal_conv1d_varlen_fwd,
            decode_step=with_decode_attention(hybrid_decode_ssd),
            scan_varlen=ssd_varlen_scan_fwd,
            gated_norm=gated_rms_norm_fwd,
        )

    def forward(
        self,
        in_proj_output: torch.Tensor,
        output: torch.Tensor,
        metadata: HybridSSMMetadata,
        ops: Mamba2Ops,
        max_prefill_len: int | None = None,
    ) -> None:
        """The whole branch for a packed batch, each request continuing from (or starting) its state slots.

        in_proj_output: [T, E + (E + 2GN) + Hs] (z | xBC | dt), decode tokens first, then the prefill sequences.
        output: [T, E] written with the gated norm's output (before out_proj); rows past both are not.
        (E, G and Hs here: this rank's shares, the attributes.)
        ops: the ops to run (`reference_ops`, or `triton_ops(...)` with the decodes' attention fused in).
        max_prefill_len: unused (Mamba-1's scan sizes its grid from it).
        """
        z, xBC, dt = in_proj_output.split([self.intermediate_size, self.conv_channels, self.num_heads], dim=-1)
        decode, prefill = token_split(metadata)
        conv_state, ssm_state = self.state_views()
        # 1. The causal conv (silu fused) over x, B and C, each request continuing from its conv state slot.
        xBC_conv = self.causal_conv(xBC, conv_state, metadata, ops)
        x, B, C = xBC_conv.split(
            [self.intermediate_size, self.n_groups * self.state_size, self.n_groups * self.state_size], dim=-1
        )
        x = x.unflatten(-1, (self.num_heads, self.head_dim))
        B, C = B.unflatten(-1, (self.n_groups, self.state_size)), C.unflatten(-1, (self.n_groups, self.state_size))
        # 2. The scan from each request's ssm state slot, its final state written back: one step per decode (a first
        #    token, has_initial_states_d False, from a zero state), the packed prefills in chunks. dt's bias and
        #    softplus run inside the ops (vLLM's kernels fuse them).
        y = x.new_empty(prefill.stop, self.num_heads, self.head_dim)
        dt_args = {"dt_bias": self.dt_bias, "dt_softplus": True}
        if metadata.num_decodes:
            ops.decode_step(
                ssm_state, x[decode], dt[decode], self.A, B[decode], C[decode], self.D,
                metadata.state_indices_tensor_d[:, 0], metadata.has_initial_states_d, out=y[decode], **dt_args,
            )  # fmt: skip
        if metadata.num_prefills:
            ops.scan_varlen(
                x[prefill], dt[prefill], self.A, B[prefill], C[prefill], self.D, ssm_state,
                metadata.query_start_loc_p, metadata.state_indices_tensor_p, metadata.has_initial_states_p,
                self.chunk_size, y[prefill], **dt_args,
            )  # fmt: skip
        # 3. The gated norm per group of E/G channels: on this rank, or across the ranks when one group spans them.
        y, z = y.flatten(1), z[: prefill.stop]
        if self.norm_spans_ranks:
            output[: prefill.stop] = gated_rms_norm_across_ranks(y, z, self.norm_weight, self.norm_eps)
        else:
            output[: prefill.stop] = ops.gated_norm(y, z, self.norm_weight, self.norm_group_size, self.norm_eps)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # vLLM's Mamba-2 state layout (its state copy functions for prefix caching).
        return MambaAttentionBackendEnum.MAMBA2
