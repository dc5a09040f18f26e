"""The Mamba-2 branch's CUDA ops but its decode step (fused with the window attention: `hybrid_decode_ssd`): vLLM's
own Mamba-2 kernels (vllm/model_executor/layers/mamba/ops, what its `MambaMixer2` runs) behind the signatures of the
references `Mamba2Branch.forward` runs (modeling/ops), for `Mamba2Branch.triton_ops`. This module imports the Triton
kernels: import it where they run (CUDA, or Triton's interpreter with vLLM's Triton turned on:
tests/test_vllm_mamba2_triton_path.py).

    conv_update   `causal_conv1d_update` with state indices
    conv_varlen   `causal_conv1d_fn`, its program tables from the step's metadata (built on the host: no device sync)
    scan_varlen   `mamba_chunk_scan_combined_varlen`, its chunks from the step's metadata (HybridMamba2MetadataBuilder)
    gated_norm    `rms_norm_gated` with groups of `group_size` channels, gated before the norm (norm_before_gate
                  False): rmsnorm(y * silu(z)) * weight, the reference's order (docs/DESIGN.md)

What the adapters add to the kernels, as `MambaMixer2` does around them or where the hybrid differs:
- dt's bias and softplus run inside the kernels (dt_bias, dt_softplus), as in the references given them;
- a first token among the decode rows (has_initial_state False: a one-token prompt, history/metadata.py) starts from
  zero: vLLM's conv update always continues the slot (vLLM keeps such rows prefills), so its conv slot is zeroed
  first (`zero_new_states_`: a launch that writes only those slots; the fused decode reads the flags itself);
- the prefills' initial states are gathered from their slots (zeros for fresh prefills) and their final states
  written back;
- the results land in the caller's buffers: vLLM's decode conv writes over its input, its prefill conv and the norm
  return new tensors.
Padding rows of a replayed decode graph sit on vLLM's null block: its conv update skips them (their outputs are not
read); the fused decode computes them from zero and writes only the null block, which nothing reads (as Mamba-1's).
"""

import torch
from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from vllm.model_executor.layers.mamba.ops.layernorm_gated import rms_norm_gated
from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from ..ops.zero_states.interface import zero_new_states_
from .metadata import HybridSSMMetadata


def conv_update(x, weight, bias, conv_state, state_indices, activation, out, *, has_initial_state=None):
    """`causal_conv1d_update_ref`'s contract (x [R, C], conv_state [slots, C, K-1] any strides)."""
    if has_initial_state is not None:
        zero_new_states_(conv_state, state_indices, has_initial_state, NULL_BLOCK_ID)
    # The kernel writes its output over its input, or over a converted copy of it where the conv state's dtype
    # differs (then copied into `out`).
    result = causal_conv1d_update(out.copy_(x), conv_state, weight, bias, activation, conv_state_indices=state_indices)
    return out if result.data_ptr() == out.data_ptr() else out.copy_(result)


def conv_varlen(
    x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state, activation, out, *,
    metadata: HybridSSMMetadata,
):  # fmt: skip
    """`causal_conv1d_varlen_ref`'s contract (x [T, C]), with the step's metadata."""
    y = causal_conv1d_fn(
        x.T, weight, bias, conv_state, cu_seqlens, cache_indices=state_indices, has_initial_state=has_initial_state,
        activation=activation, metadata=metadata,
    )  # fmt: skip
    return out.copy_(y.T)


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
