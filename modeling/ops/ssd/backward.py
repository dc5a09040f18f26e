"""Backward kernels of Mamba-2's chunked scan (SSD) and their launchers; notation and masks as in forward.py.

With dy the output's gradient and dH_c the gradient of the state at the end of chunk c (entering chunk c+1):
    dH_{c-1} = a_c dH_c + sum_i e_i dy_i C_i^T       (walking the chunks backwards from the final state's gradient;
                                                      after chunk 0 it is the initial state's gradient)
and within chunk c, with S_ij = C_i . B_j and dS_ij = dy_i . xdt_j:
    dxdt_j = sum_i M_ij S_ij dy_i  + w_j dH_c B_j
    dC_i   = sum_j M_ij dS_ij B_j  + e_i H_c^T dy_i
    dB_j   = sum_i M_ij dS_ij C_i  + w_j dH_c^T xdt_j
    dG_i   = sum_j M_ij S_ij dS_ij - sum_j M_ji S_ji dS_ji + C_i . (e_i H_c^T dy_i) - B_i . (w_i dH_c^T xdt_i)
             + [i last] (sum_j B_j . (w_j dH_c^T xdt_j) + a_c <H_c, dH_c>)
and G's gradient goes to the steps by a reversed cumulative sum within the chunk (dg_t = sum_{i >= t} dG_i), whence
ddt_t = dxdt_t . x_t + dg_t A and dA = sum_t dg_t dt_t. B and C are per group: each head's share is written and the
launcher sums a group's heads. dx, dB and dC come back side by side in one [b, T, H P + 2 G N] buffer, the layout of
Mamba-2's conv output (x, B, C) whose gradient they are, so that the branch hands it to the conv's backward as is.

Three launches: the states recomputed and their gradients walked back (forward.py's walk, both directions), then one
program per (chunk, row and head) for all the rest, over the head's P channels at once and N in blocks.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..triton_utils import next_power_of_2, stride_args
from .forward import (
    SSDBlocks,
    _chunk_decays,
    _intra_chunk_decays,
    common_strides,
    dot_precision,
    launch_ssd_chunk_walk,
    shape_args,
)


@triton.jit
def _ssd_chunk_bwd_kernel(
    p_x, p_dt, p_A, p_B, p_C, p_D, p_seg, p_states, p_dstates, p_dy,
    p_dx, p_ddt, p_dBC, p_dAD,
    T, H, P, N, num_chunks, heads_per_group,
    s_x_b, s_x_t, s_x_h, s_x_p, s_dx_b, s_dx_t,
    s_dt_b, s_dt_t, s_dt_h,
    s_B_b, s_B_t, s_B_g, s_B_n,
    s_C_b, s_C_t, s_C_g, s_C_n,
    s_seg_b, s_seg_t,
    s_dy_b, s_dy_t, s_dy_h, s_dy_p,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SEQ: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H  # offsets in int64: [b, chunks, H, P, N] passes 2^31
    i_g = i_h // heads_per_group
    a = tl.load(p_A + i_h).to(tl.float32)
    dot_dtype = p_x.dtype.element_ty
    o_t, t, m_t, b_dt, b_G, G_last, is_last, continues, reaches_end, b_seg, carried = _chunk_decays(
        p_dt, p_seg, a, i_b, i_h, i_c, T, s_dt_b, s_dt_t, s_dt_h, s_seg_b, s_seg_t, L, HAS_SEQ
    )
    b_e = tl.where(continues, tl.exp(b_G), 0.0)
    b_w = tl.where(reaches_end, tl.exp(G_last - b_G), 0.0)
    carry = tl.where(carried, tl.exp(G_last), 0.0)
    o_p = tl.arange(0, BLOCK_P)
    m_p = o_p < P
    m_tp = m_t[:, None] & m_p[None, :]
    m_pt = m_p[:, None] & m_t[None, :]
    p_x += i_b * s_x_b + i_h * s_x_h
    p_dy += i_b * s_dy_b + i_h * s_dy_h
    p_B += i_b * s_B_b + i_g * s_B_g
    p_C += i_b * s_C_b + i_g * s_C_g
    chunk_offset = ((i_b * num_chunks + i_c) * H + i_h) * P * N  # states and dstates: contiguous [b, chunks, H, P, N]
    p_states += chunk_offset
    p_dstates += chunk_offset

    # 1. S = C B^T and its transpose (each from memory), and the state term of dxdt: w_j dH_c B_j
    b_S = tl.zeros([L, L], dtype=tl.float32)
    b_ST = tl.zeros([L, L], dtype=tl.float32)
    b_dxdt = tl.zeros([L, BLOCK_P], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_tn = m_t[:, None] & (o_n[None, :] < N)
        m_nt = (o_n[:, None] < N) & m_t[None, :]
        b_Cc = tl.load(p_C + t[:, None] * s_C_t + o_n[None, :] * s_C_n, mask=m_tn, other=0.0).to(dot_dtype)
        b_Bc = tl.load(p_B + t[:, None] * s_B_t + o_n[None, :] * s_B_n, mask=m_tn, other=0.0).to(dot_dtype)
        b_CT = tl.load(p_C + o_n[:, None] * s_C_n + t[None, :] * s_C_t, mask=m_nt, other=0.0).to(dot_dtype)
        b_BT = tl.load(p_B + o_n[:, None] * s_B_n + t[None, :] * s_B_t, mask=m_nt, other=0.0).to(dot_dtype)
        b_S += tl.dot(b_Cc, b_BT, input_precision=PRECISION)
        b_ST += tl.dot(b_Bc, b_CT, input_precision=PRECISION)
        m_np = (o_n[:, None] < N) & m_p[None, :]
        b_dHT = tl.load(p_dstates + o_p[None, :] * N + o_n[:, None], mask=m_np, other=0.0).to(dot_dtype)
        b_dxdt += tl.dot(b_Bc, b_dHT, input_precision=PRECISION)
    b_dxdt *= b_w[:, None]

    # 2. dS = dy xdt^T and its transpose; G's gradient within the chunk; the intra-chunk term of dxdt
    b_dy = tl.load(p_dy + t[:, None] * s_dy_t + o_p[None, :] * s_dy_p, mask=m_tp, other=0.0).to(dot_dtype)
    # dt_j scales a column of dS (a row of its transpose) after the product: x and dy are the inputs' own values,
    # exact as operands, where x * dt would round
    b_xT = tl.load(p_x + o_p[:, None] * s_x_p + t[None, :] * s_x_t, mask=m_pt, other=0.0).to(dot_dtype)
    b_M = _intra_chunk_decays(o_t, m_t, b_G, b_seg, False)
    b_dSM = tl.dot(b_dy, b_xT, input_precision=PRECISION) * (b_M * b_dt[None, :])  # [i, j]
    b_Q = b_S * b_dSM
    b_dG = tl.sum(b_Q, 1) - tl.sum(b_Q, 0)
    b_x = tl.load(p_x + t[:, None] * s_x_t + o_p[None, :] * s_x_p, mask=m_tp, other=0.0).to(dot_dtype)
    b_dyT = tl.load(p_dy + o_p[:, None] * s_dy_p + t[None, :] * s_dy_t, mask=m_pt, other=0.0).to(dot_dtype)
    b_MT = _intra_chunk_decays(o_t, m_t, b_G, b_seg, True)
    b_dSMT = (tl.dot(b_x, b_dyT, input_precision=PRECISION) * (b_MT * b_dt[:, None])).to(dot_dtype)  # [j, i]
    b_dxdt += tl.dot((b_ST * b_MT).to(dot_dtype), b_dy, input_precision=PRECISION)
    b_dSM = b_dSM.to(dot_dtype)

    # 3. dC and dB per block of N, with their terms of dG
    to_last = tl.full([], 0.0, dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_tn = m_t[:, None] & (o_n[None, :] < N)
        m_pn = m_p[:, None] & (o_n[None, :] < N)
        b_Cc = tl.load(p_C + t[:, None] * s_C_t + o_n[None, :] * s_C_n, mask=m_tn, other=0.0)
        b_Bc = tl.load(p_B + t[:, None] * s_B_t + o_n[None, :] * s_B_n, mask=m_tn, other=0.0)
        b_h = tl.load(p_states + o_p[:, None] * N + o_n[None, :], mask=m_pn, other=0.0)
        b_dH = tl.load(p_dstates + o_p[:, None] * N + o_n[None, :], mask=m_pn, other=0.0)
        b_dC = tl.dot(b_dy, b_h.to(dot_dtype), input_precision=PRECISION) * b_e[:, None]
        b_dG += tl.sum(b_Cc.to(tl.float32) * b_dC, 1)
        b_dC += tl.dot(b_dSM, b_Bc.to(dot_dtype), input_precision=PRECISION)
        b_dB = tl.dot(b_x, b_dH.to(dot_dtype), input_precision=PRECISION) * (b_w * b_dt)[:, None]
        b_to_end = tl.sum(b_Bc.to(tl.float32) * b_dB, 1)
        b_dG -= b_to_end
        to_last += tl.sum(b_to_end, 0) + carry * tl.sum(tl.sum(b_h * b_dH, 1), 0)
        b_dB += tl.dot(b_dSMT, b_Cc.to(dot_dtype), input_precision=PRECISION)
        # per-head shares [b, T, 2, H, N] fp32 (dB's, then dC's), contiguous
        o_tn = ((i_b * T + t[:, None]) * 2 * H + i_h) * N + o_n[None, :]
        tl.store(p_dBC + o_tn, b_dB, mask=m_tn)
        tl.store(p_dBC + H * N + o_tn, b_dC, mask=m_tn)
    b_dG = tl.where(is_last, b_dG + to_last, b_dG)

    # 4. To the inputs: xdt = x dt and G = cumsum(dt A)
    b_dg = tl.cumsum(b_dG, 0, reverse=True)
    b_dy = b_dy.to(tl.float32)
    D = tl.load(p_D + i_h).to(tl.float32)
    # dx: [b, T, H, P], heads contiguous
    o_tp = i_b * s_dx_b + t.to(tl.int64)[:, None] * s_dx_t + i_h * P + o_p[None, :]
    tl.store(p_dx + o_tp, (b_dxdt * b_dt[:, None] + D * b_dy).to(p_dx.dtype.element_ty), mask=m_tp)
    b_ddt = tl.sum(b_dxdt * b_x, 1) + b_dg * a
    tl.store(p_ddt + (i_b * T + t) * H + i_h, b_ddt, mask=m_t)  # ddt: contiguous [b, T, H]
    o_part = (i_b * num_chunks + i_c) * 2 * H + i_h  # per-chunk partial sums [b, chunks, 2, H]: dA's, then dD's
    tl.store(p_dAD + o_part, tl.sum(b_dg * b_dt, 0))
    tl.store(p_dAD + o_part + H, tl.sum(tl.sum(b_dy * b_x, 1), 0))


def launch_ssd_chunk_scan_bwd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, segments: Tensor | None, states: Tensor,
    dy: Tensor, dfinal: Tensor | None, has_initial_state: bool, chunk: int, blocks: SSDBlocks,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """Gradients (dxBC, ddt, dA, dD, d initial_state) from dy [b, T, H, P] and the final state's gradient (None:
    zero), over checked tensors and the recomputed entering states (forward.py): dxBC those of x, B and C side by
    side, [b, T, H P + 2 G N] in the promoted dtype of x, B and C; ddt, dA and dD in fp32. The initial state's
    gradient is None when `has_initial_state` is False."""
    batch, length, heads, head_dim = x.shape
    groups, state_size = B.shape[2:]
    shapes = shape_args(x, B, chunk)
    num_chunks = shapes["num_chunks"]
    dstates, dh0 = launch_ssd_chunk_walk(
        dy, dt, A, C, segments, dfinal, chunk, blocks, reverse=True, with_end=has_initial_state
    )

    x_channels = heads * head_dim
    # the kernel writes dx's columns; in the dtype of x, B and C promoted (one dtype in Mamba-2's branch)
    grad_dtype = torch.promote_types(x.dtype, torch.promote_types(B.dtype, C.dtype))
    dxBC = x.new_empty(batch, length, x_channels + 2 * groups * state_size, dtype=grad_dtype)
    ddt = x.new_empty(batch, length, heads, dtype=torch.float32)
    dBC_heads = x.new_empty(batch, length, 2, heads, state_size, dtype=torch.float32)
    dAD_parts = x.new_empty(batch, num_chunks, 2, heads, dtype=torch.float32)
    _ssd_chunk_bwd_kernel[(num_chunks, batch * heads)](
        x, dt, A, B, C, D, segments, states, dstates, dy,
        dxBC, ddt, dBC_heads, dAD_parts,
        **shapes, **common_strides(x, dt, B, segments), s_dx_b=dxBC.stride(0), s_dx_t=dxBC.stride(1),
        **stride_args("C", C, "btgn"), **stride_args("dy", dy, "bthp"),
        BLOCK_P=max(16, next_power_of_2(head_dim)), BLOCK_N=blocks.bwd_n, HAS_SEQ=segments is not None,
        PRECISION=dot_precision(x), num_warps=blocks.bwd_warps,
    )  # fmt: skip
    # a group's heads summed, dB's and dC's in one reduction, into the last 2 G N columns
    dBC = dBC_heads.view(batch, length, 2, groups, heads // groups, state_size).sum(4)
    dxBC[..., x_channels:].view(batch, length, 2, groups, state_size).copy_(dBC)
    dA, dD = dAD_parts.sum((0, 1))  # contiguous rows: gradients autograd hands on as they are
    return dxBC, ddt, dA, dD, dh0
