"""The Mamba-2 branch's CUDA ops that are vLLM's own Mamba-2 kernels (vllm/model_executor/layers/mamba/ops, what its
`MambaMixer2` runs), behind the signatures of the references `Mamba2Branch.forward` runs (modeling/ops), for
`Mamba2Branch.triton_ops` (which takes the causal conv from our kernels and the decode step from `hybrid_decode_ssd`).
This module imports the Triton kernels: import it where they run (CUDA, or Triton's interpreter with vLLM's Triton
turned on: tests/test_vllm_mamba2_triton_path.py).

    scan_varlen   `mamba_chunk_scan_combined_varlen`, its chunks from the step's metadata (HybridMamba2MetadataBuilder)
    gated_norm    `rms_norm_gated` with groups of `group_size` channels, gated before the norm (norm_before_gate
                  False): rmsnorm(y * silu(z)) * weight, the reference's order (docs/DESIGN.md)

What the adapters add to the kernels, as `MambaMixer2` does around them: dt's bias and softplus run inside the scan
(dt_bias, dt_softplus), as in the references given them; the prefills' initial states are gathered from their slots
(zeros for fresh prefills) and their final states written back, and the scan's output lands in the caller's buffer
(the norm returns a new tensor, which the branch copies into its output).
"""

import torch
from vllm.model_executor.layers.mamba.ops.layernorm_gated import rms_norm_gated
from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen

from .metadata import HybridSSMMetadata


def scan_varlen(
    x, dt, A, B, C, D, ssm_state, cu_seqlens, state_indices, has_initial_state, chunk_size, out, *, dt_bias,
    dt_softplus, metadata: HybridSSMMetadata,
):  # fmt: skip
    """`ssd_varlen_scan_ref`'s contract (x [T, H, P], dt [T, H] raw), with the step's metadata (its chunks)."""
    # Every prefill gets an initial state, zeros for a fresh one: one compiled variant of the scan, where vLLM also
    # compiles one without (for batches in which no prefill continues).
    initial_states = torch.where(has_initial_state[:, None, None, None], ssm_state[state_indices], 0)
    final_states = mamba_chunk_scan_combined_varlen(
        x, dt, A, B, C, chunk_size, cu_seqlens, metadata.cu_chunk_seqlen_p, metadata.last_chunk_indices_p,
        metadata.seq_idx_p, out, D=D, dt_bias=dt_bias, initial_states=initial_states, dt_softplus=dt_softplus,
        state_dtype=ssm_state.dtype,
    )  # fmt: skip
    ssm_state[state_indices] = final_states
    return out


def gated_norm(y, z, weight, group_size, eps):
    """`gated_rms_norm_ref`'s contract (y, z [T, E])."""
    return rms_norm_gated(y, weight, None, z=z, eps=eps, group_size=group_size, norm_before_gate=False)
