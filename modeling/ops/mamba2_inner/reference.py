"""Plain-PyTorch references of the Mamba-2 branch's inner ops: the ground truth of `mamba2_inner_fn` (the branch
without a cache) and `mamba2_inner_step` (its decode step on the caches), both in interface.py."""

import torch
import torch.nn.functional as F

from ..causal_conv1d.reference import causal_conv1d_ref, causal_conv1d_update_ref
from ..decay import decay_rates
from ..ssd.reference import gated_rms_norm_ref, split_heads_and_groups, ssd_chunk_scan_ref, ssd_state_update_ref


def zero_padding(xBC: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """The conv's input [B, T, C] with padding tokens zeroed (itself when there is no mask), so that the conv of the
    first real token sees the zero history of a sequence start."""
    return xBC if padding_mask is None else xBC * padding_mask[..., None].to(xBC.dtype)


def mask_padding_step(
    xBC: torch.Tensor, dt: torch.Tensor, padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's conv input [B, C] and step before its bias [B, Hs] with padding rows (padding_mask [B, 1] 0)
    masked: xBC zeroed (it enters the conv history as zeros) and dt -inf (softplus(-inf) = 0: the state stays as it
    was). Themselves when there is no mask."""
    if padding_mask is None:
        return xBC, dt
    return xBC * padding_mask.to(xBC.dtype), dt.masked_fill(padding_mask == 0, float("-inf"))


def step_sizes(dt: torch.Tensor, dt_bias: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The step per token and head, softplus(dt + dt_bias) in fp32 [B, T, Hs], zero at padding: a padding token
    leaves the state as it was."""
    step = F.softplus(dt.float() + dt_bias.float())
    return step if padding_mask is None else step * padding_mask[..., None].to(step.dtype)


def mamba2_inner_ref(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    n_groups: int,
    eps: float,
    padding_mask: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> torch.Tensor:
    """The Mamba-2 branch from `zxbcdt = in_proj(h)` to what `out_proj` reads, with no cache (training, cache-free
    forwards).

    Args:
        zxbcdt: [B, T, E + (E + 2GN) + Hs]: the gate z, the conv input xBC (x, B, C), the step dt before its bias.
        conv_weight: [E + 2GN, 1, K] (nn.Conv1d's depthwise weight); conv_bias: [E + 2GN] or None.
        dt_bias, A_log, D: [Hs]; norm_weight: [E], the gated norm's weight over G groups of E/G channels.
        n_groups: G, the groups of heads that share B and C (and one norm group each); eps: the norm's epsilon.
        padding_mask: [B, T], 1 for real tokens, 0 for padding, or None: a padding token's xBC is zeroed (the conv of
            the first real token sees the zero history of a sequence start) and its step is 0 (it never enters the
            state).
        seq_idx: [B, T] index of the packed sequence of each token, or None (one sequence per row).
        chunk_size: the chunked scan's chunk (the result does not depend on it; capped at T).

    Returns:
        [B, T, E] = gated_rms_norm(ssd(x, softplus(dt + dt_bias), -exp(A_log), B, C, D), z) with
        (x, B, C) = silu(conv(xBC)); differentiable in every tensor but the mask and seq_idx.
    """
    intermediate_size, num_heads = norm_weight.shape[0], A_log.shape[0]
    z, xBC, dt = zxbcdt.split([intermediate_size, conv_weight.shape[0], num_heads], dim=-1)
    xBC = causal_conv1d_ref(zero_padding(xBC, padding_mask), conv_weight[:, 0], conv_bias, "silu", None, seq_idx)
    x, B, C = split_heads_and_groups(xBC, intermediate_size, num_heads, n_groups)
    dt = step_sizes(dt, dt_bias, padding_mask)
    chunk = min(chunk_size, zxbcdt.shape[1])
    y, _ = ssd_chunk_scan_ref(x, dt, decay_rates(A_log), B, C, D, chunk, None, seq_idx)
    return gated_rms_norm_ref(y.flatten(-2), z, norm_weight, intermediate_size // n_groups, eps)


def mamba2_inner_step_ref(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    n_groups: int,
    eps: float,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of the branch between its projections, row i of the batch on row i of the caches (the
    Transformers model's `generate()`): the conv update, the step, the state update and the gated norm of the module
    path, in place on the caches. Tensor code throughout, no branch on values: a decode step on it exports and
    compiles as one graph.

    Args:
        zxbcdt: [B, 1, E + (E + 2GN) + Hs], in_proj's output for one token per row (`mamba2_inner_ref`'s at T = 1).
        conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, n_groups, eps: as `mamba2_inner_ref` takes them.
        conv_state: [>= B, E + 2GN, K-1], row i shifted by one with the token's xBC entering (in place).
        ssm_state: [>= B, Hs, P, N] (fp32, bf16 or fp16), row i stepped in place.
        padding_mask: [B, 1], 1 for a real token, 0 for padding, or None: a padding token's xBC enters the conv
            history as zeros and its step is 0, so its state stays as it was (what the scan does with it); its output
            is nobody's.

    Returns:
        [B, 1, E] in zxbcdt's dtype: what `mamba2_inner_ref` computes at that position.
    """
    intermediate_size, num_heads = norm_weight.shape[0], A_log.shape[0]
    z, xBC, dt = zxbcdt[:, 0].split([intermediate_size, conv_weight.shape[0], num_heads], dim=-1)
    xBC, dt = mask_padding_step(xBC, dt, padding_mask)
    rows = torch.arange(zxbcdt.shape[0], device=zxbcdt.device)
    xBC = causal_conv1d_update_ref(xBC, conv_weight[:, 0], conv_bias, conv_state, rows, "silu")
    x, B, C = split_heads_and_groups(xBC, intermediate_size, num_heads, n_groups)
    y = ssd_state_update_ref(ssm_state, x, dt, decay_rates(A_log), B, C, D, dt_bias=dt_bias, dt_softplus=True)
    return gated_rms_norm_ref(y.flatten(-2), z, norm_weight, intermediate_size // n_groups, eps)[:, None]
