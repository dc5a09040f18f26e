"""Plain-PyTorch reference of the SSM branch's inner op: the ground truth of `mamba_inner_fn` (interface.py)."""

import torch
import torch.nn.functional as F

from ..causal_conv1d.reference import causal_conv1d_ref
from ..decay import decay_rates
from ..selective_scan.reference import selective_scan_ref


def mamba_inner_ref(
    xz: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    dt_proj_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The branch from `xz = in_proj(h)` to what `out_proj` reads, with no cache (training, cache-free forwards).

    Args:
        xz: [B, T, 2E], the conv input `xs` then the gate `z`.
        conv_weight: [E, 1, K] (nn.Conv1d's depthwise weight); conv_bias: [E] or None.
        x_proj_weight: [R + 2N, E]; dt_proj_weight: [E, R]; dt_proj_bias: [E]; A_log: [E, N]; D: [E].
        padding_mask: [B, T], 1 for real tokens, 0 for padding, or None: a padding token's xs is zeroed (the conv of
            the first real token sees the zero history of a sequence start) and its step is 0 (it never enters the
            state).
        seq_idx: [B, T] index of the packed sequence of each token, or None (one sequence per row).

    Returns:
        y [B, T, E] = (scan(u, softplus(dt_proj(dt_low)), -exp(A_log), B, C) + D u) * silu(z), with
        u = silu(conv(xs)) and (dt_low, B, C) = x_proj(u); differentiable in every tensor but the mask and seq_idx.
    """
    dt_rank, state_size = dt_proj_weight.shape[1], A_log.shape[1]
    xs, z = xz.chunk(2, dim=-1)
    if padding_mask is not None:
        xs = xs * padding_mask[..., None].to(xs.dtype)
    u = causal_conv1d_ref(xs, conv_weight[:, 0], conv_bias, "silu", None, seq_idx)
    dt_low, B, C = F.linear(u, x_proj_weight).split([dt_rank, state_size, state_size], dim=-1)
    dt = F.linear(dt_low, dt_proj_weight, dt_proj_bias)
    if padding_mask is not None:
        dt = dt.masked_fill(padding_mask[..., None] == 0, float("-inf"))
    A = decay_rates(A_log)
    y, _ = selective_scan_ref(u, dt, A, B, C, D, z, None, seq_idx, dt_softplus=True)
    return y
