"""Backward kernel of the causal depthwise conv1d's training forward and its launcher (`causal_conv1d_fn` in
interface.py; gradients checked against autograd through `causal_conv1d_ref`)."""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..triton_utils import cdiv, next_power_of_2, stride_args
from .forward import _conv_rows, _load_inputs, _load_seq_idx, conv_args


@triton.jit
def _grad_rows(
    p_x, p_w, p_bias, p_hist, p_seq_idx, p_dy, o_t, o_e, m_e, T, m_all_rows, o_hist,
    s_x_t, s_x_e, s_w_e, s_w_k, s_h_e, s_h_k, s_dy_t, s_dy_e,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HISTORY: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
    SILU: tl.constexpr,
):  # fmt: skip
    """g = dy * act'(pre) at rows o_t, fp32 [len(o_t), BLOCK_E]: the gradient at the conv's output before the
    activation (pre recomputed from x: the forward saves only its inputs). Zero on rows from T on."""
    p_g = p_dy + o_t.to(tl.int64)[:, None] * s_dy_t + o_e[None, :] * s_dy_e
    b_g = tl.load(p_g, mask=(o_t < T)[:, None] & m_e[None, :], other=0.0).to(tl.float32)
    if SILU:
        b_pre = _conv_rows(
            p_x, p_w, p_bias, p_hist, p_seq_idx, o_t, o_e, m_e, 0, T, m_all_rows, o_hist,
            s_x_t, s_x_e, s_w_e, s_w_k, s_h_e, s_h_k, 0, K, HAS_BIAS, HAS_HISTORY, HAS_SEQ_IDX,
        )  # fmt: skip
        b_sig = tl.sigmoid(b_pre)
        b_g = b_g * b_sig * (1.0 + b_pre * (1.0 - b_sig))
    return b_g


@triton.jit
def _causal_conv1d_bwd_kernel(
    p_x, p_w, p_bias, p_hist, p_dy,  # the op's tensors, dy
    p_dx, p_partial, p_seq_idx, p_ring,  # gradients (dx; dweight and dbias as partial sums), packed rows, g's ring
    T, E, rows_per_program,
    s_x_b, s_x_t, s_x_e, s_w_e, s_w_k, s_h_b, s_h_e, s_h_k, s_dy_b, s_dy_t, s_dy_e, s_dx_b, s_dx_t, s_dx_e,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_HALO: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_HISTORY: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Gradients of `causal_conv1d_ref` in x, weight and bias (not in the history). Program (i_c, i_e, i_b) owns rows
    i_c*rows_per_program.. (a multiple of BLOCK_T) of batch row i_b: it writes dx there, and its partial sums of
    dweight and (HAS_BIAS) dbias into row i_b * num_programs(0) + i_c of p_partial [P, E K + HAS_BIAS E]: dweight's
    [E, K] (weight's layout), then dbias's [E], so that one reduction sums both.

    With g_t = dy_t * act'(pre_t):  dx_t = sum_i weight[K-1-i] * g_{t+i},  dweight[k] = sum_t g_t * x_{t-K+1+k},
    dbias = sum_t g_t. dx_t reads g of the next K-1 rows, and a register tile's rows cannot be shifted: with silu,
    each g is computed once (pre recomputed from x, `_grad_rows`) and its tile stored to the program's ring in
    global memory (p_ring: [2 * BLOCK_T, BLOCK_E] fp32, row r at slot r mod 2 * BLOCK_T, L1/L2-resident), from which
    the shifted tiles are read back after a barrier. The row blocks are walked last to first, so the rows after a
    block are in the ring when it needs them; the K-1 rows after the program's range (the next program's, or zeros
    past T) are computed first. Without an activation g is dy, read shifted from dy directly.
    With HAS_SEQ_IDX every term pairs an input with an output of the same sequence: dx_t takes g_{t+i} only where
    seq_idx[t+i] == seq_idx[t], and pre and dweight's input tiles are masked as in the forward.
    """
    tl.static_assert(not SILU or (BLOCK_HALO >= K - 1 and BLOCK_T >= K - 1), "a block and the K-1 rows after it")
    i_c, i_e, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p_x += i_b.to(tl.int64) * s_x_b
    if HAS_HISTORY:
        p_hist += i_b.to(tl.int64) * s_h_b
    p_dy += i_b.to(tl.int64) * s_dy_b
    p_dx += i_b.to(tl.int64) * s_dx_b
    if HAS_SEQ_IDX:
        p_seq_idx += i_b.to(tl.int64) * T
    if SILU:
        i_prog = (i_b * tl.num_programs(1) + i_e) * tl.num_programs(0) + i_c
        p_ring += i_prog.to(tl.int64) * (2 * BLOCK_T * BLOCK_E)
    RING: tl.constexpr = 2 * BLOCK_T
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    o_ring_e = tl.arange(0, BLOCK_E)
    o_k = tl.arange(0, BLOCK_K)
    m_e = o_e < E
    o_hist = tl.zeros([BLOCK_T], dtype=tl.int64)
    m_all_rows = o_hist == 0  # a training sequence's history serves every row

    row_start = i_c * rows_per_program
    row_end = tl.minimum(T, row_start + rows_per_program)
    if SILU:
        o_halo = row_end + tl.arange(0, BLOCK_HALO)
        b_g_halo = _grad_rows(
            p_x, p_w, p_bias, p_hist, p_seq_idx, p_dy, o_halo, o_e, m_e, T, o_halo >= 0,
            tl.zeros([BLOCK_HALO], dtype=tl.int64), s_x_t, s_x_e, s_w_e, s_w_k, s_h_e, s_h_k, s_dy_t, s_dy_e,
            K, HAS_BIAS, HAS_HISTORY, HAS_SEQ_IDX, SILU,
        )  # fmt: skip
        p_halo = p_ring + (o_halo % RING)[:, None] * BLOCK_E + o_ring_e[None, :]
        tl.store(p_halo, b_g_halo, mask=(o_halo < row_end + K - 1)[:, None])

    b_dw = tl.zeros([BLOCK_K, BLOCK_E], dtype=tl.float32)
    b_dbias = tl.zeros([BLOCK_E], dtype=tl.float32)
    num_blocks = tl.cdiv(row_end - row_start, BLOCK_T)
    for j in range(num_blocks):
        o_t = row_start + (num_blocks - 1 - j) * BLOCK_T + tl.arange(0, BLOCK_T)
        m_t = o_t < row_end
        b_seq_t = o_t  # not read without seq_idx
        if HAS_SEQ_IDX:
            b_seq_t = _load_seq_idx(p_seq_idx, o_t, T)
        b_g = _grad_rows(
            p_x, p_w, p_bias, p_hist, p_seq_idx, p_dy, o_t, o_e, m_e, T, m_all_rows, o_hist,
            s_x_t, s_x_e, s_w_e, s_w_k, s_h_e, s_h_k, s_dy_t, s_dy_e, K, HAS_BIAS, HAS_HISTORY, HAS_SEQ_IDX, SILU,
        )  # fmt: skip
        if SILU:
            tl.debug_barrier()  # the previous block's reads of these slots are done
            tl.store(p_ring + (o_t % RING)[:, None] * BLOCK_E + o_ring_e[None, :], b_g, mask=m_t[:, None])
            tl.debug_barrier()
        b_dx = b_g * tl.load(p_w + o_e * s_w_e + (K - 1) * s_w_k, mask=m_e, other=0.0).to(tl.float32)[None, :]
        for i in tl.static_range(1, K):
            # g at rows t+i, which x_t feeds through tap K-1-i
            o_s = o_t + i
            if SILU:
                b_gi = tl.load(p_ring + (o_s % RING)[:, None] * BLOCK_E + o_ring_e[None, :])
            else:
                p_gi = p_dy + o_s.to(tl.int64)[:, None] * s_dy_t + o_e[None, :] * s_dy_e
                b_gi = tl.load(p_gi, mask=(o_s < T)[:, None] & m_e[None, :], other=0.0).to(tl.float32)
            if HAS_SEQ_IDX:  # x_t feeds g_{t+i} only within its sequence
                b_gi = tl.where((_load_seq_idx(p_seq_idx, o_s, T) == b_seq_t)[:, None], b_gi, 0.0)
            b_w = tl.load(p_w + o_e * s_w_e + (K - 1 - i) * s_w_k, mask=m_e, other=0.0).to(tl.float32)
            b_dx += b_gi * b_w[None, :]
        p_out = p_dx + o_t.to(tl.int64)[:, None] * s_dx_t + o_e[None, :] * s_dx_e
        tl.store(p_out, b_dx.to(p_dx.dtype.element_ty), mask=m_t[:, None] & m_e[None, :])

        # each g_t of the block (0 past T) enters the weight and bias sums once; the input tiles are pre's own loads
        b_dbias += tl.sum(b_g, axis=0)
        for k in tl.static_range(K):
            b_in = _load_inputs(
                p_x, p_hist, p_seq_idx, b_seq_t, o_t, o_e, m_e, 0, T, m_all_rows, o_hist,
                s_x_t, s_x_e, s_h_e, s_h_k, k - (K - 1), K, HAS_HISTORY, HAS_SEQ_IDX,
            )  # fmt: skip
            b_dw += tl.where(o_k[:, None] == k, tl.sum(b_g * b_in, axis=0)[None, :], 0.0)

    p_partial += (i_b * tl.num_programs(0) + i_c).to(tl.int64) * (K + HAS_BIAS) * E
    tl.store(p_partial + o_e[None, :] * K + o_k[:, None], b_dw, mask=(o_k < K)[:, None] & m_e[None, :])
    if HAS_BIAS:
        tl.store(p_partial + K * E + o_e, b_dbias, mask=m_e)


def launch_causal_conv1d_bwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, history: Tensor | None, dy: Tensor,
    *,
    activation: str | None, rows_per_program: int, block_t: int, block_e: int, num_warps: int,
    dx: Tensor, seq_idx: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """(dx, dweight [E, K] in weight.dtype, dbias [E] in bias.dtype or None) of x [B, T, E]; dx [B, T, E] in
    x.dtype, any strides (e.g. a column range of the caller's gradient of a wider input), written here. Each program
    writes fp32 partial sums of dweight and dbias for its (batch row, range of `rows_per_program` rows, channel
    block) into one buffer, summed here by one reduction."""
    batch_size, seq_len, num_channels = x.shape
    width = weight.shape[1]
    num_row_ranges = cdiv(seq_len, rows_per_program) if seq_len else 0
    # every (batch row, row range) row of the partials is written by the programs of its channel blocks: dweight's
    # [E, K], then dbias's [E], so that each sum is a contiguous view of one reduction's result, which autograd hands
    # to the parameter as it is (a strided one it would copy)
    partial_numel = num_channels * (width + (bias is not None))
    partial = x.new_empty((batch_size * num_row_ranges, partial_numel), dtype=torch.float32)
    if x.numel() > 0:
        grid = (num_row_ranges, cdiv(num_channels, block_e), batch_size)
        ring = None  # each program's ring of g tiles (silu): [2 * block_t, block_e] fp32
        if activation == "silu":
            ring = x.new_empty(grid[0] * grid[1] * grid[2] * 2 * block_t * block_e, dtype=torch.float32)
        _causal_conv1d_bwd_kernel[grid](
            **conv_args(x, weight, bias, history, seq_idx, activation),
            p_dy=dy,
            p_dx=dx,
            p_partial=partial,
            p_ring=ring,
            T=seq_len,
            E=num_channels,
            rows_per_program=rows_per_program,
            **stride_args("dy", dy, "bte"),
            **stride_args("dx", dx, "bte"),
            BLOCK_K=next_power_of_2(width),
            BLOCK_HALO=next_power_of_2(width - 1),
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            num_warps=num_warps,
        )
    sums = partial.sum(0)
    if bias is None or bias.dtype == weight.dtype:
        sums = sums.to(weight.dtype)  # one cast for both (bf16 weights); the views below keep it
    weight_numel = num_channels * width
    dweight = sums[:weight_numel].view(num_channels, width).to(weight.dtype)
    dbias = sums[weight_numel:].to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias
