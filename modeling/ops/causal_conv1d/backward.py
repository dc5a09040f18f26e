"""Backward kernel of the causal depthwise conv1d's training forward and its launcher (`causal_conv1d_fn` in
interface.py; gradients checked against autograd through `causal_conv1d_ref`)."""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..triton_utils import cdiv, next_power_of_2, stride_args
from .forward import _conv_rows, _load_inputs, _load_seq_idx, conv_args


@triton.jit
def _causal_conv1d_bwd_kernel(
    p_x, p_w, p_bias, p_hist, p_dy,  # the op's tensors, dy
    p_dx, p_dw, p_dbias, p_seq_idx,  # gradients (dweight, dbias: partial sums), packed rows
    T, E, rows_per_program,
    s_x_b, s_x_t, s_x_e, s_w_e, s_w_k, s_h_b, s_h_e, s_h_k, s_dy_b, s_dy_t, s_dy_e, s_dx_b, s_dx_t, s_dx_e,
    K: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HISTORY: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Gradients of `causal_conv1d_ref` in x, weight and bias (not in the history). Program (i_c, i_e, i_b) walks rows
    i_c*rows_per_program.. (a multiple of BLOCK_T) of batch row i_b in BLOCK_T steps and writes dx there, plus its
    partial sums of dweight [BLOCK_K, BLOCK_E] and dbias [BLOCK_E] into row i_b * num_programs(0) + i_c of
    p_dw [P, K, E] / p_dbias [P, E].

    With g_t = dy_t * act'(pre_t):  dx_t = sum_k weight[k] * g_{t+K-1-k},  dweight[k] = sum_t g_t * x_{t-K+1+k},
    dbias = sum_t g_t. With silu, pre at the K row shifts of g is recomputed from the 2K-1 shifted x tiles
    (`_load_inputs` makes a repeated load identical IR, which the compiler merges): the forward saves only its inputs.
    With HAS_SEQ_IDX every term pairs an input with an output of the same sequence: dx_t takes g_{t+i} only where
    seq_idx[t+i] == seq_idx[t], and pre and dweight's input tiles are masked as in the forward.
    """
    i_c, i_e, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p_x += i_b.to(tl.int64) * s_x_b
    if HAS_HISTORY:
        p_hist += i_b.to(tl.int64) * s_h_b
    p_dy += i_b.to(tl.int64) * s_dy_b
    p_dx += i_b.to(tl.int64) * s_dx_b
    if HAS_SEQ_IDX:
        p_seq_idx += i_b.to(tl.int64) * T
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    o_k = tl.arange(0, BLOCK_K)
    m_e = o_e < E
    o_hist = tl.zeros([BLOCK_T], dtype=tl.int64)
    m_all_rows = o_hist == 0  # a training sequence's history serves every row

    b_dw = tl.zeros([BLOCK_K, BLOCK_E], dtype=tl.float32)
    b_dbias = tl.zeros([BLOCK_E], dtype=tl.float32)
    row_end = tl.minimum(T, (i_c + 1) * rows_per_program)
    for t_start in range(i_c * rows_per_program, row_end, BLOCK_T):
        o_t = t_start + tl.arange(0, BLOCK_T)
        m_t = o_t < row_end
        b_seq_t = o_t  # not read without seq_idx
        if HAS_SEQ_IDX:
            b_seq_t = _load_seq_idx(p_seq_idx, o_t, T)
        b_dx = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for i in tl.static_range(K):
            # g at rows t+i, which x_t feeds through tap K-1-i
            o_s = o_t + i
            m_s = o_s < T
            p_g = p_dy + o_s.to(tl.int64)[:, None] * s_dy_t + o_e[None, :] * s_dy_e
            b_g = tl.load(p_g, mask=m_s[:, None] & m_e[None, :], other=0.0).to(tl.float32)
            if SILU:
                b_pre = _conv_rows(
                    p_x, p_w, p_bias, p_hist, p_seq_idx, o_t, o_e, m_e, 0, T, m_all_rows, o_hist,
                    s_x_t, s_x_e, s_w_e, s_w_k, s_h_e, s_h_k, i, K, HAS_BIAS, HAS_HISTORY, HAS_SEQ_IDX,
                )  # fmt: skip
                b_sig = tl.sigmoid(b_pre)
                b_g = b_g * b_sig * (1.0 + b_pre * (1.0 - b_sig))
            if HAS_SEQ_IDX and i > 0:  # x_t feeds g_{t+i} only within its sequence (always true at i == 0)
                b_g = tl.where((_load_seq_idx(p_seq_idx, o_s, T) == b_seq_t)[:, None], b_g, 0.0)
            b_w = tl.load(p_w + o_e * s_w_e + (K - 1 - i) * s_w_k, mask=m_e, other=0.0).to(tl.float32)
            b_dx += b_g * b_w[None, :]
            if i == 0:
                # the rows of this block (g is 0 past T): each g_t enters the weight and bias sums exactly once
                b_dbias += tl.sum(b_g, axis=0)
                for k in tl.static_range(K):
                    b_in = _load_inputs(
                        p_x, p_hist, p_seq_idx, b_seq_t, o_t, o_e, m_e, 0, T, m_all_rows, o_hist,
                        s_x_t, s_x_e, s_h_e, s_h_k, k - (K - 1), K, HAS_HISTORY, HAS_SEQ_IDX,
                    )  # fmt: skip
                    b_dw += tl.where(o_k[:, None] == k, tl.sum(b_g * b_in, axis=0)[None, :], 0.0)
        p_out = p_dx + o_t.to(tl.int64)[:, None] * s_dx_t + o_e[None, :] * s_dx_e
        tl.store(p_out, b_dx.to(p_dx.dtype.element_ty), mask=m_t[:, None] & m_e[None, :])

    i_partial = (i_b * tl.num_programs(0) + i_c).to(tl.int64)
    p_dw_out = p_dw + i_partial * K * E + o_k[:, None] * E + o_e[None, :]
    tl.store(p_dw_out, b_dw, mask=(o_k < K)[:, None] & m_e[None, :])
    if HAS_BIAS:
        tl.store(p_dbias + i_partial * E + o_e, b_dbias, mask=m_e)


def launch_causal_conv1d_bwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, history: Tensor | None, dy: Tensor,
    *,
    activation: str | None, rows_per_program: int, block_t: int, block_e: int, num_warps: int,
    seq_idx: Tensor | None = None, dx: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """(dx [B, T, E] in x.dtype, dweight [E, K] in weight.dtype, dbias [E] in bias.dtype or None) of x [B, T, E];
    dx written where given (any strides: e.g. a column range of the caller's gradient of a wider input), else into
    a new contiguous tensor. Each program writes fp32 partial sums of dweight and dbias for its (batch row, range of
    `rows_per_program` rows, channel block), summed here."""
    batch_size, seq_len, num_channels = x.shape
    width = weight.shape[1]
    num_row_ranges = cdiv(seq_len, rows_per_program) if seq_len else 0
    if dx is None:
        dx = torch.empty((batch_size, seq_len, num_channels), dtype=x.dtype, device=x.device)
    # every (batch row, row range) row of the partials is written by the programs of its channel blocks
    dw_partial = x.new_empty((batch_size * num_row_ranges, width, num_channels), dtype=torch.float32)
    dbias_partial = (
        x.new_empty((batch_size * num_row_ranges, num_channels), dtype=torch.float32) if bias is not None else None
    )
    if x.numel() > 0:
        grid = (num_row_ranges, cdiv(num_channels, block_e), batch_size)
        _causal_conv1d_bwd_kernel[grid](
            **conv_args(x, weight, bias, history, seq_idx, activation),
            p_dy=dy,
            p_dx=dx,
            p_dw=dw_partial,
            p_dbias=dbias_partial,
            T=seq_len,
            E=num_channels,
            rows_per_program=rows_per_program,
            **stride_args("dy", dy, "bte"),
            **stride_args("dx", dx, "bte"),
            BLOCK_K=next_power_of_2(width),
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            num_warps=num_warps,
        )
    dweight = dw_partial.sum(0).t().to(weight.dtype)  # [K, E] -> [E, K]
    dbias = dbias_partial.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias
