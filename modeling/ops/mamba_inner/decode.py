"""Decode step of the SSM branch between its projections (public function `mamba_inner_step` in interface.py;
reference `mamba_inner_step_ref` in reference.py, with the exact semantics): one token per cache row, the conv and
the state updated in place, in two launches where the module path takes the conv update kernel, the x_proj and
dt_proj GEMMs, the decay rates, the state update kernel and about thirteen aten ops between them. Inference only.

    StepBlocks, pick_step_blocks  the launch shape: register tiles of ~4096 fp32 values at any width, so that
                            at small widths (E 1024, R 64) each loop takes one step
    _conv_x_proj_kernel     grid (cdiv(E, BLOCK_E), rows): the conv update of a block of channels
                            (`conv_update_channels`), u stored in the output, and the block's share of x_proj, fp32
                            [block, row, R+2N]
    _dt_state_kernel        grid (rows, cdiv(E, BLOCK_E)): the shares summed into x_proj's output (dt_low, B, C),
                            dt_proj for the program's channels, the state step (`ssm_step`) and the gate, the output
                            written over u (each program reads the u it overwrites)
    launch_mamba_inner_step checks nothing (interface.py does), picks the blocks, launches both

At a decode batch each kernel moves a few hundred kilobytes: its time is the round trips to memory that wait on each
other, not bandwidth. So each kernel issues every load it can before it uses any (the next rows of x_proj's weight
before summing the current ones), and the blocks are shaped so that the loops over x_proj's rows and over the
shares take few steps (one each at E 1024, R 64; three and one at E 2048, R 128).

Why two launches and not one: x_proj sums over every channel, and each channel's conv history is overwritten by the
program that owns it, so no program may read another's channels once the step has begun; the shares of the first
launch are what the second reads. The shares are summed in a fixed order (no atomics): a step gives the same bits
every time. u, x_proj's output and dt are rounded to the activation dtype where the module path's GEMMs round them;
every product and sum is fp32.
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..causal_conv1d.forward import conv_update_channels
from ..selective_scan.decode import pick_state_update_block_e, ssm_step
from ..triton_utils import cdiv, next_power_of_2, softplus


class StepBlocks(NamedTuple):
    """Launch shape of the two kernels, every register tile about 4096 fp32 values whatever the widths: e1, channels
    per conv/x_proj program (E / e1 shares of x_proj per row), j, rows of x_proj's weight per inner step; e2,
    channels per state program (with dt_proj's whole [e2, R] block); p, shares summed per inner step."""

    e1: int
    j: int
    e2: int
    p: int


@functools.cache
def pick_step_blocks(num_channels: int, dt_rank: int, state_size: int) -> StepBlocks:
    # e1: x_proj's rows in one step where a tile holds them, but no more than 32 shares a row to sum (up to E 4096)
    x_proj_rows = next_power_of_2(dt_rank + 2 * state_size)
    e1 = min(next_power_of_2(num_channels), 128, max(16, 4096 // x_proj_rows, next_power_of_2(num_channels) // 32))
    j = min(x_proj_rows, max(16, 4096 // e1))
    e2 = min(pick_state_update_block_e(num_channels, state_size), max(16, 4096 // next_power_of_2(dt_rank)))
    p = min(next_power_of_2(cdiv(num_channels, e1)), max(1, 4096 // next_power_of_2(max(dt_rank, state_size))))
    return StepBlocks(e1, j, e2, p)


@triton.jit
def _conv_x_proj_kernel(
    p_xz, p_conv_w, p_conv_b, p_conv_state, p_mask, p_u, p_x_proj_w, p_parts,
    E, J, num_rows, s_mask, s_xz_r, s_cw_e, s_cw_k, s_cs_r, s_cs_e, s_cs_k, s_xw_j, s_xw_e,
    K: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    """Row i_r, channels i_e*BLOCK_E..: u = silu(conv(history, xs)) stored [rows, E] (xs: xz[:, :E]), the history
    shifted, and the block's share of x_proj, parts[i_e, i_r, :] = x_proj_w[:, block] @ u[block] (J = R + 2N), in
    steps of BLOCK_J of its J rows. A padding row (mask 0) enters the history as zeros, as in the scan."""
    i_e, i_r = tl.program_id(0), tl.program_id(1)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    m_e = o_e < E
    o_j = tl.arange(0, BLOCK_J)
    p_w = p_x_proj_w + o_j[:, None] * s_xw_j + o_e[None, :] * s_xw_e
    # x_proj's first rows in flight while the conv waits on its own loads
    b_w = tl.load(p_w, mask=(o_j < J)[:, None] & m_e[None, :], other=0.0)
    b_x = tl.load(p_xz + i_r.to(tl.int64) * s_xz_r + o_e, mask=m_e, other=0.0).to(tl.float32)
    if HAS_MASK:
        b_x = tl.where(tl.load(p_mask + i_r * s_mask) != 0, b_x, 0.0)
    p_slot = p_conv_state + i_r.to(tl.int64) * s_cs_r + o_e[None, :] * s_cs_e
    b_u = conv_update_channels(
        b_x, p_slot, s_cs_k, True, True, o_e, m_e, p_conv_w, s_cw_e, s_cw_k, p_conv_b, K, BLOCK_K, HAS_BIAS, True
    )
    b_u = b_u.to(p_u.dtype.element_ty)
    tl.store(p_u + i_r.to(tl.int64) * E + o_e, b_u, mask=m_e)

    b_u = b_u.to(tl.float32)
    p_share = p_parts + (i_e * num_rows + i_r).to(tl.int64) * J
    for j0 in range(0, J, BLOCK_J):
        # the next rows requested before this step's sum waits on its own
        m_next = (j0 + BLOCK_J + o_j < J)[:, None] & m_e[None, :]
        b_w_next = tl.load(p_w + (j0 + BLOCK_J) * s_xw_j, mask=m_next, other=0.0)
        tl.store(p_share + j0 + o_j, tl.sum(b_w.to(tl.float32) * b_u[None, :], axis=1), mask=j0 + o_j < J)
        b_w = b_w_next


@triton.jit
def _dt_state_kernel(
    p_u, p_xz, p_parts, p_dt_w, p_dt_b, p_A_log, p_D, p_ssm_state, p_mask, p_out,
    E, R, N, num_parts, num_rows, s_mask, s_xz_r, s_dw_e, s_dw_r, s_al_e, s_al_n, s_ss_r, s_ss_e, s_ss_n,
    HAS_MASK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Row i_r, channels i_e*BLOCK_E..: (dt_low, B, C) = the sum of the row's x_proj shares (in a fixed order,
    rounded to the activation dtype as the GEMM's output would be), dt = dt_proj_w @ dt_low (BLOCK_R >= R), step =
    softplus(dt + dt_bias), the state step with A = -exp(A_log), out = (state . C + D u) silu(z) (z: xz[:, E:]). A
    padding row keeps its state and writes zeros. p_out may be p_u: each of its elements is stored by the program
    that loaded it, after the load (y depends on u)."""
    i_r, i_e = tl.program_id(0), tl.program_id(1)
    dtype = p_u.dtype.element_ty
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    o_r = tl.arange(0, BLOCK_R)
    o_n = tl.arange(0, BLOCK_N)
    m_e, m_r, m_n = o_e < E, o_r < R, o_n < N
    m_en = m_e[:, None] & m_n[None, :]

    # What does not depend on x_proj's output, requested first: its latency hides behind the shares' sums.
    b_dt_w = tl.load(
        p_dt_w + o_e[:, None] * s_dw_e + o_r[None, :] * s_dw_r, mask=m_e[:, None] & m_r[None, :], other=0.0
    )
    b_dt_bias = tl.load(p_dt_b + o_e, mask=m_e, other=0.0)
    p_state = p_ssm_state + i_r.to(tl.int64) * s_ss_r + o_e[:, None] * s_ss_e + o_n[None, :] * s_ss_n
    b_state = tl.load(p_state, mask=m_en, other=0.0)
    b_A_log = tl.load(p_A_log + o_e[:, None] * s_al_e + o_n[None, :] * s_al_n, mask=m_en, other=0.0)
    b_u = tl.load(p_u + i_r.to(tl.int64) * E + o_e, mask=m_e, other=0.0)
    b_z = tl.load(p_xz + i_r.to(tl.int64) * s_xz_r + E + o_e, mask=m_e, other=0.0)
    b_D = tl.load(p_D + o_e, mask=m_e, other=0.0)
    is_real = True
    if HAS_MASK:
        is_real = tl.load(p_mask + i_r * s_mask) != 0

    # x_proj's output for the row: its shares (share k of row i at p_parts + (k * rows + i) * (R + 2N)) summed
    # BLOCK_P at a time, the three column groups of a step loaded together
    o_p = tl.arange(0, BLOCK_P)
    p_row_parts = p_parts + i_r.to(tl.int64) * (R + 2 * N)
    part_stride = num_rows * (R + 2 * N)
    b_dt_low = tl.zeros([BLOCK_R], dtype=tl.float32)
    b_B = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_C = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        m_p = (p0 + o_p < num_parts)[:, None]
        p_shares = p_row_parts + (p0 + o_p).to(tl.int64)[:, None] * part_stride
        b_dt_low += tl.sum(tl.load(p_shares + o_r[None, :], mask=m_p & m_r[None, :], other=0.0), axis=0)
        b_B += tl.sum(tl.load(p_shares + R + o_n[None, :], mask=m_p & m_n[None, :], other=0.0), axis=0)
        b_C += tl.sum(tl.load(p_shares + R + N + o_n[None, :], mask=m_p & m_n[None, :], other=0.0), axis=0)
    b_dt_low = b_dt_low.to(dtype).to(tl.float32)
    b_B = b_B.to(dtype).to(tl.float32)
    b_C = b_C.to(dtype).to(tl.float32)

    b_dt = tl.sum(b_dt_w.to(tl.float32) * b_dt_low[None, :], axis=1).to(dtype).to(tl.float32)
    b_step = softplus(b_dt + b_dt_bias.to(tl.float32))
    b_A = -tl.exp(b_A_log.to(tl.float32))
    b_state, b_y = ssm_step(
        b_state.to(tl.float32), b_u.to(tl.float32), b_step, b_A, b_B, b_C, b_D.to(tl.float32), b_z.to(tl.float32)
    )
    tl.store(p_state, b_state.to(p_ssm_state.dtype.element_ty), mask=tl.where(is_real, m_en, False))
    tl.store(p_out + i_r.to(tl.int64) * E + o_e, tl.where(is_real, b_y, 0.0).to(p_out.dtype.element_ty), mask=m_e)


def launch_mamba_inner_step(
    xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D, conv_state, ssm_state,
    padding_mask, out,
) -> None:  # fmt: skip
    """Both kernels over checked arguments (interface.py's `mamba_inner_step`): xz [rows, 1, 2E] (last dim
    contiguous), padding_mask [rows, 1] or None, out [rows, 1, E] contiguous (u, then the output). The token
    dimension is read through the row strides, not selected away: three aten ops a layer and step fewer on the host,
    which a dynamic-cache generate() step is bound by."""
    num_rows, num_channels = out.shape[0], out.shape[-1]
    dt_rank, state_size = dt_proj_weight.shape[1], A_log.shape[1]
    x_proj_rows = dt_rank + 2 * state_size
    blocks = pick_step_blocks(num_channels, dt_rank, state_size)
    num_parts = cdiv(num_channels, blocks.e1)
    parts = torch.empty(num_parts, num_rows, x_proj_rows, device=xz.device, dtype=torch.float32)
    mask_stride = padding_mask.stride(0) if padding_mask is not None else 0
    _conv_x_proj_kernel[(num_parts, num_rows)](
        xz, conv_weight, conv_bias, conv_state, padding_mask, out, x_proj_weight, parts,
        num_channels, x_proj_rows, num_rows, mask_stride, xz.stride(0),
        conv_weight.stride(0), conv_weight.stride(2),
        *conv_state.stride(), *x_proj_weight.stride(),
        K=conv_weight.shape[2], BLOCK_K=next_power_of_2(conv_weight.shape[2]), HAS_BIAS=conv_bias is not None,
        HAS_MASK=padding_mask is not None, BLOCK_E=blocks.e1, BLOCK_J=blocks.j,
    )  # fmt: skip
    _dt_state_kernel[(num_rows, cdiv(num_channels, blocks.e2))](
        out, xz, parts, dt_proj_weight, dt_proj_bias, A_log, D, ssm_state, padding_mask, out,
        num_channels, dt_rank, state_size, num_parts, num_rows, mask_stride, xz.stride(0), *dt_proj_weight.stride(),
        *A_log.stride(), *ssm_state.stride(),
        HAS_MASK=padding_mask is not None, BLOCK_E=blocks.e2, BLOCK_R=next_power_of_2(dt_rank),
        BLOCK_N=next_power_of_2(state_size), BLOCK_P=blocks.p,
    )  # fmt: skip
