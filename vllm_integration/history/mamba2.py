"""The Mamba-2 history branch as vLLM serves it (`ssm_type="mamba2"`, docs/DESIGN.md): `Mamba2Branch`, with vLLM's
Mamba-2 state layout (conv state `[E + 2GN, K-1]` and ssm state `[Hs, P, N]` per slot) and the metadata of
history/metadata.py (the hybrid's, plus the prefills' chunks of the chunked scan: `HybridMamba2MetadataBuilder`).

The branch over a packed batch (`Mamba2Branch.forward`) runs on either of two op sets with the references'
signatures (`Mamba2Ops`): vLLM's own Mamba-2 kernels on CUDA (`Mamba2Branch.triton_ops`, mamba2_kernels.py), the
PyTorch references elsewhere (modeling/ops: the causal conv over E + 2GN channels, the SSD scan over the state slots,
the grouped gated RMSNorm). Unlike Mamba-1's, its decode step is not fused with the decodes' window attention (the
attention backend runs that on its own). Under tensor parallelism it is refused by name: its sharding is not built
yet.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from vllm.config import CacheConfig
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.model_executor.model_loader.weight_utils import composed_weight_loader, default_weight_loader
from vllm.model_executor.utils import set_weight_attrs
from vllm.platforms import current_platform
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
from .metadata import HybridMamba2SSMBackend, HybridSSMMetadata, token_split

# vLLM's Mamba-2 kernels: the prefill conv computes kernel widths 2 to 4 (a wider one would be wrong, not refused),
# the chunked scan takes chunks of a power of two.
CUDA_CONV_KERNEL_SIZES = (2, 3, 4)


class Mamba2Ops(NamedTuple):
    """The ops `Mamba2Branch.forward` runs (the signatures of the PyTorch references in modeling/ops; the scan steps
    take the raw dt with its bias and softplus, `dt_bias` and `dt_softplus`)."""

    conv_update: Callable  # one new token per request, shifted into its conv state slot
    conv_varlen: Callable  # packed prefills, each continuing from (or starting) its conv state slot
    decode_step: Callable  # one scan step per request, from and into its ssm state slot
    scan_varlen: Callable  # packed prefills, each continuing from (or starting) its ssm state slot
    gated_norm: Callable  # rmsnorm(y * silu(z)) * weight over groups of E/G channels


REFERENCE_OPS = Mamba2Ops(
    causal_conv1d_update_ref, causal_conv1d_varlen_ref, ssd_state_update_ref, ssd_varlen_scan_ref, gated_rms_norm_ref
)


class Mamba2Branch(ServedHistoryBranch):
    """The stateful part of the Mamba-2 branch (conv1d over x, B and C; dt_bias, A, D; the gated norm) with its state
    declared to vLLM. `in_proj` (z | xBC | dt) and `out_proj` live beside q/k/v and o_proj in the model."""

    reference_ops = REFERENCE_OPS

    def __init__(self, config: HybridConfig, cache_config: CacheConfig | None = None, prefix: str = ""):
        super().__init__(config, cache_config, prefix)
        if self.tp_size > 1:
            raise ValueError("the vLLM plugin serves ssm_type 'mamba2' at tensor parallel 1 only so far")
        if current_platform.is_cuda():
            chunk, width = config.ssm_chunk_size, config.ssm_conv_kernel_size
            if width not in CUDA_CONV_KERNEL_SIZES or chunk & (chunk - 1):
                raise ValueError(
                    f"on CUDA the vLLM plugin serves ssm_type 'mamba2' with vLLM's Mamba-2 kernels, which take "
                    f"ssm_conv_kernel_size in {CUDA_CONV_KERNEL_SIZES} and a power-of-two ssm_chunk_size: got {width} "
                    f"and {chunk}"
                )
        self.intermediate_size = self.local_size = config.ssm_intermediate_size
        self.num_heads, self.head_dim = config.ssm_num_heads, config.ssm_head_dim
        self.n_groups, self.state_size = config.ssm_n_groups, config.ssm_state_size
        self.chunk_size = config.ssm_chunk_size
        self.conv_channels = self.intermediate_size + 2 * self.n_groups * self.state_size

        # Values change here only (layout.py): the conv weight as [C, K], A from A_log; A, D and dt_bias in fp32.
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_channels, config.ssm_conv_kernel_size))
        set_weight_attrs(self.conv1d_weight, {"weight_loader": lambda param, w: param.data.copy_(w.flatten(1))})
        self.conv1d_bias = nn.Parameter(torch.empty(self.conv_channels)) if config.ssm_conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.A = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        set_weight_attrs(self.A, {"weight_loader": composed_weight_loader(default_weight_loader, a_from_a_log)})
        self.norm_weight = nn.Parameter(torch.empty(self.intermediate_size))
        self.norm_eps = config.rms_norm_eps

    @staticmethod
    def in_proj_sizes(config: HybridConfig) -> list[int]:
        """The parts of in_proj's output, in order: z, xBC, dt."""
        e, conv_channels = (
            config.ssm_intermediate_size,
            config.ssm_intermediate_size + 2 * config.ssm_n_groups * config.ssm_state_size,
        )
        return [e, conv_channels, config.ssm_num_heads]

    @staticmethod
    def state_shapes(config: HybridConfig, tp_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state shape, ssm state shape) per slot: vLLM's Mamba-2 layout."""
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
    def triton_ops(metadata: HybridSSMMetadata) -> Mamba2Ops:
        """vLLM's Mamba-2 kernels (CUDA; mamba2_kernels.py, imported on first use so that CPU-only installs never
        build them) with this step's metadata bound: the prefill conv's program tables and the scan's chunks."""
        from . import mamba2_kernels as kernels

        return Mamba2Ops(
            conv_update=kernels.conv_update,
            conv_varlen=functools.partial(kernels.conv_varlen, metadata=metadata),
            decode_step=kernels.decode_step,
            scan_varlen=functools.partial(kernels.scan_varlen, metadata=metadata),
            gated_norm=kernels.gated_norm,
        )

    def warm_up_triton_ops(self, branch_input: torch.Tensor) -> None:
        """vLLM's chunked scan is autotuned on its first call, by timing its configs on the GPU: run here, on one chunk
        of zeros with an initial state, in the dtypes of serving (the key of its tuning; the length is not)."""
        from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen

        _, state_dtype = self.get_state_dtype()
        chunk, like = self.chunk_size, branch_input
        x = like.new_zeros(chunk, self.num_heads, self.head_dim)
        B = like.new_zeros(chunk, self.n_groups, self.state_size)
        cu_seqlens = torch.tensor([0, chunk], dtype=torch.int32, device=like.device)
        first_chunk = torch.zeros(1, dtype=torch.int32, device=like.device)
        mamba_chunk_scan_combined_varlen(
            x, like.new_zeros(chunk, self.num_heads), self.A, B, B, chunk, cu_seqlens, cu_seqlens, first_chunk,
            first_chunk, torch.empty_like(x), D=self.D, dt_bias=self.dt_bias,
            initial_states=x.new_zeros(1, *self.get_state_shape()[1], dtype=state_dtype), dt_softplus=True,
            state_dtype=state_dtype,
        )  # fmt: skip

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
        ops: the ops to run (`reference_ops`, or `triton_ops(metadata)`). max_prefill_len: unused (Mamba-1's scan
        sizes its grid from it).
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
        # 3. The gated norm per group of E/G channels.
        group_size = self.intermediate_size // self.n_groups
        output[: prefill.stop] = ops.gated_norm(
            y.flatten(1), z[: prefill.stop], self.norm_weight, group_size, self.norm_eps
        )

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # vLLM's Mamba-2 state layout; the metadata is history/metadata.py's (get_attn_backend).
        return MambaAttentionBackendEnum.MAMBA2

    def get_attn_backend(self) -> type[HybridMamba2SSMBackend]:
        return HybridMamba2SSMBackend
