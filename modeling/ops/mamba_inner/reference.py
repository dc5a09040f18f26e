"""Plain-PyTorch references of the SSM branch's inner op: the ground truth of `mamba_inner_fn` (training, no cache)
and of `mamba_inner_step` (a decode step on the caches), both in interface.py."""

import torch
import torch.nn.functional as F

from ..causal_conv1d.reference import causal_conv1d_ref, causal_conv1d_update_ref
from ..decay import decay_rates
from ..selective_scan.reference import selective_scan_ref, selective_state_update_ref


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


def mamba_inner_step_ref(
    xz: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    dt_proj_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of the branch between its projections, row i of the batch on row i of the caches (the
    Transformers model's `generate()`): the conv update, x_proj, dt_proj and the state update of the module path, in
    place on the caches. Tensor code throughout, no branch on values: a decode step on it exports and compiles as
    one graph.

    Args:
        xz: [B, 1, 2E], in_proj's output for one token per row (`mamba_inner_ref`'s xz at T = 1).
        conv_weight: [E, 1, K] (nn.Conv1d's depthwise weight); conv_bias: [E] or None.
        x_proj_weight: [R + 2N, E]; dt_proj_weight: [E, R]; dt_proj_bias: [E]; A_log: [E, N]; D: [E].
        conv_state: [>= B, E, K-1], row i shifted by one with the token's xs entering (in place).
        ssm_state: [>= B, E, N] (fp32, bf16 or fp16), row i stepped in place.
        padding_mask: [B, 1], 1 for a real token, 0 for padding, or None: a padding token's xs enters the conv
            history as zeros and its state stays as it was (what the scan does with it); its output is zeros.

    Returns:
        y [B, 1, E] in xz.dtype: (state . C + D u) * silu(z) with u = silu(conv(history, xs)), (dt_low, B, C) =
        x_proj(u) and the step softplus(dt_proj(dt_low)), as `mamba_inner_ref` computes at that position.
    """
    dt_rank, state_size = dt_proj_weight.shape[1], A_log.shape[1]
    xs, z = xz[:, 0].chunk(2, dim=-1)
    rows = torch.arange(xz.shape[0], device=xz.device)
    if padding_mask is not None:
        xs = xs * padding_mask.to(xs.dtype)
    u = causal_conv1d_update_ref(xs, conv_weight[:, 0], conv_bias, conv_state, rows, "silu")
    dt_low, B, C = F.linear(u, x_proj_weight).split([dt_rank, state_size, state_size], dim=-1)
    dt = F.linear(dt_low, dt_proj_weight)  # the update adds the bias, then softplus, in fp32
    if padding_mask is not None:
        rows = torch.where(padding_mask[:, 0] != 0, rows, -1)  # -1: the update leaves the row's state alone
    y = torch.empty_like(u)
    selective_state_update_ref(ssm_state, u, dt, decay_rates(A_log), B, C, D, z, dt_proj_bias, rows, y)
    return y[:, None]
