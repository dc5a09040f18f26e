"""Sequence-mixing ops of the hybrid model. Each op has a plain-PyTorch reference (`*_ref`) that runs anywhere and is
the ground truth for its Triton kernels in the package beside it:

    causal_conv1d/      training conv (fwd/bwd), varlen prefill conv and decode update over a conv state cache
    selective_scan/     training scan (fwd/bwd), varlen prefill scan and decode state update over an ssm state cache
    mamba_inner/        the branch between its projections (conv, x_proj, dt_proj, scan) as one training op, and its
                        decode step on the caches as one op
    ssd/                Mamba-2's chunked scan (SSD), its decode update and its gated RMSNorm (references)
    mamba2_inner/       the Mamba-2 branch between its projections (conv, step, chunked scan, gated norm) as one
                        training op, and its decode step on the caches as one op
    branch_norm.py      the per-head normalisation of both branches before their sum (`ssm_branch_norm`)
    decay.py            the state decay rates A = -exp(A_log) in fp32, for every path that reads A_log
                        (packages laid out as fla's ops: reference.py, exported here; the kernels behind interface.py)

The kernels that only vLLM's layouts need (the paged window attention, the fused decode of window attention and state
update) live beside the backend that runs them, in vllm_integration/ops.

The kernel modules import Triton; import them where the kernels are used (CUDA, or Triton's interpreter), e.g.
`from modeling.ops.selective_scan.interface import selective_scan_fn`. This package and the references import no
Triton.
"""

from .branch_norm import rms_normalize_heads
from .causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref, causal_conv1d_varlen_ref
from .decay import decay_rates
from .mamba2_inner import mamba2_inner_ref, mamba2_inner_step_ref
from .mamba_inner import mamba_inner_ref, mamba_inner_step_ref
from .selective_scan import selective_scan_ref, selective_scan_varlen_ref, selective_state_update_ref
from .ssd import (
    gated_rms_norm_bwd_ref,
    gated_rms_norm_ref,
    ssd_chunk_scan_ref,
    ssd_scan_ref,
    ssd_state_update_ref,
    ssd_varlen_scan_ref,
)

__all__ = [
    "causal_conv1d_ref",
    "causal_conv1d_update_ref",
    "causal_conv1d_varlen_ref",
    "decay_rates",
    "gated_rms_norm_bwd_ref",
    "gated_rms_norm_ref",
    "mamba2_inner_ref",
    "mamba2_inner_step_ref",
    "mamba_inner_ref",
    "mamba_inner_step_ref",
    "rms_normalize_heads",
    "selective_scan_ref",
    "selective_scan_varlen_ref",
    "selective_state_update_ref",
    "ssd_chunk_scan_ref",
    "ssd_scan_ref",
    "ssd_state_update_ref",
    "ssd_varlen_scan_ref",
]
