"""Backward kernel of the Mamba-1 selective scan and its launcher (`selective_scan_fn` in interface.py; gradients
checked against autograd through `selective_scan_ref`).

The backward mirrors the forward (forward.py) in reverse time with the adjoint P_t = dL/dh_{t-1} = a_t * (dy'_t C_t +
P_{t+1}): stage 0 gives each chunk's adjoint carry from a zero right edge, the forward's combine kernel (reversed)
turns them into each chunk's true right-edge adjoint, and stage 1 walks each chunk backwards. Stage 1 needs h_{t-1}
at every step in reverse order: it recomputes them (never h_{t-1} = (h_t - b_t) / a_t, which is unstable) from
checkpoints, the state entering every SEG-th step: saved by the training forward (`save_seg_states`, the default),
else recomputed by a first pass over the chunk into a per-program global scratch. Then, one segment at a time from
the last, it writes the SEG states of that segment to the scratch and walks them backwards. A program rewrites the
same small scratch region for every segment, so it stays in L2. The final state's gradient seeds the adjoint at the
right edge. Packed rows (seq_idx): the adjoint P_t = a_t * G_t stops where a_t = 0, at every sequence start. Loads
are prefetched one step ahead, as in the forward.

dB and dC reduce over channels, which live in different programs: each program writes its partial sums over its
BLOCK_E channels, dB's and dC's side by side, to one [E / BLOCK_E, B, T, 2N] fp32 buffer summed in torch afterwards
by one reduction: deterministic, unlike atomics, at the cost of 2 E N / BLOCK_E fp32 values per token (an fp32
[B, T, E] tensor's worth at the default BLOCK_E = 32, N = 16; a larger bwd_block_e shrinks it). Its sum [B, T, 2N]
is laid out as the [dB, dC] columns of x_proj's output gradient, so the caller can have it written there. dA, dD
and d(dt_bias) (sums over batch and time) are written per (batch row, chunk) program one after the other into one
[B, num_chunks, E N + E (+ E with dt_bias)] buffer and summed likewise: each gradient a contiguous view of the sum.
"""

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..triton_utils import cdiv, next_power_of_2
from .forward import (
    LOG2E,
    _channel_block,
    _dt_step,
    _load_channel_params,
    _load_row,
    _row_pointers,
    _selective_scan_chunk_combine_kernel,
    scan_args,
    token_strides,
)

if TYPE_CHECKING:
    from .interface import ScanBlocks


@triton.jit
def _dt_grad(b_dstep, b_dt, b_dt_bias, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    """dL/d(dt argument) from dL/d(step) (`_dt_step`'s derivative): times softplus' derivative, sigmoid, when
    DT_SOFTPLUS (above softplus' linear threshold 20, sigmoid rounds to its slope 1 in fp32)."""
    if DT_SOFTPLUS:
        if HAS_DT_BIAS:
            b_dt = b_dt + b_dt_bias
        b_dstep = b_dstep * tl.sigmoid(b_dt)
    return b_dstep


@triton.jit
def _recompute_states(
    b_h, b_A2, b_dt_bias, p_u, p_dt, p_B, s_u_t, s_dt_t, s_BC_t, o_e, o_n, m_e, m_n, t_lo, t_hi, p_seg, o_blk, p_seq_idx,
    STORE: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    UNROLL: tl.constexpr,
):  # fmt: skip
    """Walks the state forward over steps [t_lo, t_hi) (loads prefetched one step ahead) and returns it; STORE:
    also writes each step's incoming state h_{t-1} to `p_seg + (t - t_lo) * block + o_blk`. HAS_SEQ_IDX: decay 0
    where seq_idx (`p_seq_idx`: this row's) changes, as in the forward; the step is `_dt_step` of dt."""
    b_u = _load_row(p_u, t_lo, s_u_t, o_e, m_e)
    b_dt = _load_row(p_dt, t_lo, s_dt_t, o_e, m_e)
    b_Bt = _load_row(p_B, t_lo, s_BC_t, o_n, m_n)
    if HAS_SEQ_IDX:
        seq_prev = tl.load(p_seq_idx + tl.maximum(t_lo - 1, 0))
        seq_cur = tl.load(p_seq_idx + t_lo)
    for t in tl.range(t_lo, t_hi, loop_unroll_factor=UNROLL):
        has_next = t + 1 < t_hi
        b_u_next = _load_row(p_u, t + 1, s_u_t, o_e, m_e & has_next)
        b_dt_next = _load_row(p_dt, t + 1, s_dt_t, o_e, m_e & has_next)
        b_Bt_next = _load_row(p_B, t + 1, s_BC_t, o_n, m_n & has_next)
        if HAS_SEQ_IDX:
            seq_next = tl.load(p_seq_idx + t + 1, mask=has_next, other=0)
        if STORE:
            tl.store(p_seg + (t - t_lo) * b_h.numel + o_blk, b_h)
        b_step = _dt_step(b_dt, b_dt_bias, HAS_DT_BIAS, DT_SOFTPLUS)
        b_a = tl.exp2(b_step[:, None] * b_A2)
        if HAS_SEQ_IDX:
            b_a = tl.where(seq_cur == seq_prev, b_a, 0.0)
            seq_prev, seq_cur = seq_cur, seq_next
        b_h = b_a * b_h + (b_step * b_u)[:, None] * b_Bt[None, :]
        b_u, b_dt, b_Bt = b_u_next, b_dt_next, b_Bt_next
    return b_h


@triton.jit
def _selective_scan_bwd_kernel(
    p_u, p_dt, p_A, p_B, p_C, p_D, p_z, p_dt_bias, p_dy,  # the op's tensors, dy
    p_h0, p_dhT, p_dh0, p_chunk_h, p_chunk_dh, p_seg_h, p_scratch,  # states, chunk buffers, checkpoints
    p_du, p_ddt, p_dz, p_dBC_part, p_param_part,  # gradients
    p_seq_idx,
    T, E, N, num_chunks,
    s_u_b, s_u_t, s_dt_b, s_dt_t, s_z_b, s_z_t, s_BC_b, s_BC_t, s_dy_b, s_dy_t, s_dz_b, s_dz_t,
    STAGE: tl.constexpr, CHUNKED: tl.constexpr, HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr,
    SEG_H_SAVED: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    CHUNK: tl.constexpr, SEG: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
    A_IS_LOG: tl.constexpr,
):  # fmt: skip
    """One (batch row, channel block, chunk) of the backward, walking the chunk in reverse with the adjoint
    P_t = dL/dh_{t-1} = a_t * G_t, G_t = dL/dh_t = dy'_t C_t + P_{t+1} (dy' = dy * silu(z)).
    STAGE 0: the P leaving the chunk at its start from a zero right edge, into `p_chunk_dh` [B, num_chunks, E, N].
    STAGE 1: all gradients; the right-edge adjoint is `p_chunk_dh` after the combine when CHUNKED, else dL/dh_T;
    the segment checkpoints come from the forward (`p_seg_h` [B, cdiv(T, SEG), E, N]) when SEG_H_SAVED, else from
    a recompute pass over the chunk into the scratch.
    Gradient buffers are contiguous but dz: du, ddt [B, T, E]; dz [B, T, E] at strides s_dz_b, s_dz_t (a column
    range of the caller's wider gradient); dB and dC partials side by side [E / BLOCK_E, B, T, 2N]; dA, dD and
    dt_bias partials one after the other [B, num_chunks, E N + E (+ E)]; dh0 [B, E, N] (written here only when
    not CHUNKED).
    HAS_SEQ_IDX: `p_seq_idx` [B, T] int32 or int64; a_t = 0 where a sequence starts (t > 0, seq_idx[t] !=
    seq_idx[t - 1]), as in the forward, so nothing of the adjoint crosses back into the previous sequence.
    HAS_DT_BIAS / DT_SOFTPLUS: the step is `_dt_step` of dt, as in the forward, and ddt is the gradient of the dt
    argument (through the softplus), and so, summed over the chunk's tokens in fp32, dt_bias's partial.
    A_IS_LOG: `p_A` is A_log (A = -exp(A_log)), and the dA partials are A_log's: dA * A, per (channel, state)."""
    i_b, i_e, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t_start = i_c * CHUNK
    t_end = tl.minimum(t_start + CHUNK, T)

    o_e, o_n, m_e, m_n, m_en, b_A2 = _channel_block(p_A, i_e, E, N, BLOCK_E, BLOCK_N, A_IS_LOG)
    b_D, b_dt_bias = _load_channel_params(p_D, p_dt_bias, o_e, m_e, HAS_DT_BIAS)
    o_chunk = (i_b * num_chunks + i_c).to(tl.int64)
    o_chunk_h = o_chunk * E * N + o_e[:, None] * N + o_n[None, :]
    o_state = i_b.to(tl.int64) * E * N + o_e[:, None] * N + o_n[None, :]

    i_b = i_b.to(tl.int64)
    p_u, p_dt, p_z, p_B, p_C = _row_pointers(i_b, p_u, p_dt, p_z, p_B, p_C, s_u_b, s_dt_b, s_z_b, s_BC_b)
    p_dy += i_b * s_dy_b
    if HAS_SEQ_IDX:
        p_seq_idx += i_b * T

    if STAGE == 0:
        b_P = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
        t = t_end - 1
        b_dt = _load_row(p_dt, t, s_dt_t, o_e, m_e)
        b_z = _load_row(p_z, t, s_z_t, o_e, m_e)
        b_dy = _load_row(p_dy, t, s_dy_t, o_e, m_e)
        b_Ct = _load_row(p_C, t, s_BC_t, o_n, m_n)
        if HAS_SEQ_IDX:
            seq_cur = tl.load(p_seq_idx + t)
        for i in tl.range(t_end - t_start, loop_unroll_factor=UNROLL):
            t = t_end - 1 - i
            has_next = t > t_start  # prefetch step t - 1, as in the forward
            b_dt_next = _load_row(p_dt, t - 1, s_dt_t, o_e, m_e & has_next)
            b_z_next = _load_row(p_z, t - 1, s_z_t, o_e, m_e & has_next)
            b_dy_next = _load_row(p_dy, t - 1, s_dy_t, o_e, m_e & has_next)
            b_Ct_next = _load_row(p_C, t - 1, s_BC_t, o_n, m_n & has_next)
            if HAS_SEQ_IDX:
                # Token t - 1's index: step t's keep, then step t - 1's own. Loaded at the chunk's first step too
                # (the token before the chunk); the row's first token compares with itself (keeps).
                seq_prev = tl.load(p_seq_idx + tl.maximum(t - 1, 0))
            b_G = (b_dy * b_z * tl.sigmoid(b_z))[:, None] * b_Ct[None, :] + b_P
            b_a = tl.exp2(_dt_step(b_dt, b_dt_bias, HAS_DT_BIAS, DT_SOFTPLUS)[:, None] * b_A2)
            if HAS_SEQ_IDX:
                b_a = tl.where(seq_cur == seq_prev, b_a, 0.0)
                seq_cur = seq_prev
            b_P = b_a * b_G
            b_dt, b_z, b_dy, b_Ct = b_dt_next, b_z_next, b_dy_next, b_Ct_next
        tl.store(p_chunk_dh + o_chunk_h, b_P, mask=m_en)
    else:
        # Per-program scratch: the SEG states h_{t-1} of the segment being walked, then (unless the forward saved
        # them) the NUM_SEG segment checkpoints. Every element is written and read back by the same thread (same
        # block shape and layout); the barriers order the phases anyway.
        NUM_SEG: tl.constexpr = CHUNK // SEG
        i_prog = ((i_b * tl.num_programs(1) + i_e) * tl.num_programs(2) + i_c).to(tl.int64)
        o_blk = tl.arange(0, BLOCK_E)[:, None] * BLOCK_N + o_n[None, :]
        segs_in_chunk = tl.cdiv(t_end - t_start, SEG)
        if SEG_H_SAVED:
            p_seg = p_scratch + i_prog * SEG * BLOCK_E * BLOCK_N
            p_ckpt = p_seg_h + (i_b * tl.cdiv(T, SEG) + i_c * NUM_SEG) * E * N
            s_ckpt = E * N
            o_ckpt = o_e[:, None] * N + o_n[None, :]
        else:
            p_seg = p_scratch + i_prog * (NUM_SEG + SEG) * BLOCK_E * BLOCK_N
            p_ckpt = p_seg + SEG * BLOCK_E * BLOCK_N
            s_ckpt = BLOCK_E * BLOCK_N
            o_ckpt = o_blk
            if CHUNKED:
                b_h = tl.load(p_chunk_h + o_chunk_h, mask=m_en, other=0.0)
            elif HAS_H0:
                b_h = tl.load(p_h0 + o_state, mask=m_en, other=0.0)
            else:
                b_h = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
            for j in range(segs_in_chunk):
                tl.store(p_ckpt + j * s_ckpt + o_ckpt, b_h)
                seg_start = t_start + j * SEG
                b_h = _recompute_states(
                    b_h, b_A2, b_dt_bias, p_u, p_dt, p_B, s_u_t, s_dt_t, s_BC_t, o_e, o_n, m_e, m_n,
                    seg_start, tl.minimum(seg_start + SEG, t_end), p_seg, o_blk, p_seq_idx,
                    False, HAS_SEQ_IDX, HAS_DT_BIAS, DT_SOFTPLUS, UNROLL,
                )  # fmt: skip

        if CHUNKED:
            b_P = tl.load(p_chunk_dh + o_chunk_h, mask=m_en, other=0.0)
        elif HAS_DHT:
            b_P = tl.load(p_dhT + o_state, mask=m_en, other=0.0)
        else:
            b_P = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
        b_dA = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
        b_dD = tl.zeros([BLOCK_E], dtype=tl.float32)
        b_d_dt_bias = tl.zeros([BLOCK_E], dtype=tl.float32)
        for jj in range(segs_in_chunk):
            j = segs_in_chunk - 1 - jj
            seg_start = t_start + j * SEG
            seg_end = tl.minimum(seg_start + SEG, t_end)
            tl.debug_barrier()
            b_h = tl.load(p_ckpt + j * s_ckpt + o_ckpt, mask=m_en, other=0.0)
            _recompute_states(
                b_h, b_A2, b_dt_bias, p_u, p_dt, p_B, s_u_t, s_dt_t, s_BC_t, o_e, o_n, m_e, m_n,
                seg_start, seg_end, p_seg, o_blk, p_seq_idx,
                True, HAS_SEQ_IDX, HAS_DT_BIAS, DT_SOFTPLUS, UNROLL,
            )  # fmt: skip
            tl.debug_barrier()
            t = seg_end - 1
            b_h_prev = tl.load(p_seg + (t - seg_start) * BLOCK_E * BLOCK_N + o_blk)
            b_u = _load_row(p_u, t, s_u_t, o_e, m_e)
            b_dt = _load_row(p_dt, t, s_dt_t, o_e, m_e)
            b_z = _load_row(p_z, t, s_z_t, o_e, m_e)
            b_dy = _load_row(p_dy, t, s_dy_t, o_e, m_e)
            b_Bt = _load_row(p_B, t, s_BC_t, o_n, m_n)
            b_Ct = _load_row(p_C, t, s_BC_t, o_n, m_n)
            if HAS_SEQ_IDX:
                seq_cur = tl.load(p_seq_idx + t)
            for i in tl.range(seg_end - seg_start, loop_unroll_factor=UNROLL):
                t = seg_end - 1 - i
                has_next = t > seg_start  # prefetch step t - 1
                b_h_prev_next = tl.load(
                    p_seg + (t - 1 - seg_start) * BLOCK_E * BLOCK_N + o_blk, mask=(o_blk >= 0) & has_next, other=0.0
                )
                b_u_next = _load_row(p_u, t - 1, s_u_t, o_e, m_e & has_next)
                b_dt_next = _load_row(p_dt, t - 1, s_dt_t, o_e, m_e & has_next)
                b_z_next = _load_row(p_z, t - 1, s_z_t, o_e, m_e & has_next)
                b_dy_next = _load_row(p_dy, t - 1, s_dy_t, o_e, m_e & has_next)
                b_Bt_next = _load_row(p_B, t - 1, s_BC_t, o_n, m_n & has_next)
                b_Ct_next = _load_row(p_C, t - 1, s_BC_t, o_n, m_n & has_next)
                if HAS_SEQ_IDX:
                    seq_prev = tl.load(p_seq_idx + tl.maximum(t - 1, 0))  # as in stage 0

                b_step = _dt_step(b_dt, b_dt_bias, HAS_DT_BIAS, DT_SOFTPLUS)
                b_a = tl.exp2(b_step[:, None] * b_A2)
                if HAS_SEQ_IDX:
                    b_a = tl.where(seq_cur == seq_prev, b_a, 0.0)
                    seq_cur = seq_prev
                b_ah = b_a * b_h_prev  # [BLOCK_E, BLOCK_N]
                b_h = b_ah + (b_step * b_u)[:, None] * b_Bt[None, :]
                b_sig = tl.sigmoid(b_z)
                b_pre = tl.sum(b_h * b_Ct[None, :], axis=1) + b_D * b_u  # y before the gate
                b_dpre = b_dy * b_z * b_sig  # dy' = dL/d(pre-gate y)
                b_dz = b_dy * b_pre * b_sig * (1.0 + b_z * (1.0 - b_sig))
                b_G = b_dpre[:, None] * b_Ct[None, :] + b_P  # dL/dh_t
                b_GB = tl.sum(b_G * b_Bt[None, :], axis=1)
                b_GahA = tl.sum(b_G * b_ah * b_A2, axis=1) * (1.0 / LOG2E)  # with A, not A * LOG2E
                b_du = b_step * b_GB + b_dpre * b_D
                b_ddt = _dt_grad(b_u * b_GB + b_GahA, b_dt, b_dt_bias, HAS_DT_BIAS, DT_SOFTPLUS)
                b_dBt = tl.sum(b_G * (b_step * b_u)[:, None], axis=0)
                b_dCt = tl.sum(b_h * b_dpre[:, None], axis=0)
                b_dA += b_G * b_ah * b_step[:, None]
                b_dD += b_dpre * b_u
                b_d_dt_bias += b_ddt
                b_P = b_a * b_G

                o_tok = (i_b * T + t).to(tl.int64) * E + o_e
                tl.store(p_du + o_tok, b_du.to(p_du.dtype.element_ty), mask=m_e)
                tl.store(p_ddt + o_tok, b_ddt.to(p_ddt.dtype.element_ty), mask=m_e)
                p_dz_t = p_dz + i_b * s_dz_b + t.to(tl.int64) * s_dz_t
                tl.store(p_dz_t + o_e, b_dz.to(p_dz.dtype.element_ty), mask=m_e)
                o_part = ((i_e * tl.num_programs(0) + i_b) * T + t).to(tl.int64) * 2 * N + o_n
                tl.store(p_dBC_part + o_part, b_dBt, mask=m_n)
                tl.store(p_dBC_part + o_part + N, b_dCt, mask=m_n)
                b_h_prev, b_u, b_dt, b_z, b_dy = b_h_prev_next, b_u_next, b_dt_next, b_z_next, b_dy_next
                b_Bt, b_Ct = b_Bt_next, b_Ct_next

        if A_IS_LOG:  # d/dA_log = d/dA * dA/dA_log = d/dA * A, A constant over the sum
            b_dA *= b_A2 * (1.0 / LOG2E)
        # this (row, chunk)'s partials: dA's [E, N], then dD's [E], then dt_bias's [E], each contiguous
        p_param = p_param_part + o_chunk * E * (N + 1 + HAS_DT_BIAS)
        tl.store(p_param + o_e[:, None] * N + o_n[None, :], b_dA, mask=m_en)
        tl.store(p_param + E * N + o_e, b_dD, mask=m_e)
        if HAS_DT_BIAS:
            tl.store(p_param + E * (N + 1) + o_e, b_d_dt_bias, mask=m_e)
        if not CHUNKED and HAS_H0:
            tl.store(p_dh0 + o_state, b_P, mask=m_en)


def launch_selective_scan_bwd(
    u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, z: Tensor, dy: Tensor,
    initial_state: Tensor | None, d_final_state: Tensor | None,
    chunk_h: Tensor | None, chunk_dtsum: Tensor | None, seg_states: Tensor | None,
    *,
    blocks: "ScanBlocks", dt_bias: Tensor | None = None, dt_softplus: bool = False, seq_idx: Tensor | None = None,
    dz: Tensor | None = None, dBC: Tensor | None = None, A_is_log: bool = False,
) -> tuple[Tensor | None, ...]:  # fmt: skip
    """The backward's launches (training layout [B, T, E], B and C sharing their strides); chunk_dtsum as
    `launch_selective_scan_fwd` returned it (None: one chunk per row), seg_states as it filled them, or None and the
    chunk start states chunk_h it returned, from which the backward recomputes them (chunk_h is not read otherwise),
    dt_bias / dt_softplus / seq_idx as the forward got them; dz: where to write z's gradient ([B, T, E] in z's
    dtype, channels contiguous: e.g. a column range of the caller's gradient of a wider input), or None for a new
    tensor; dBC: where to write dB and dC side by side ([B, T, 2N], e.g. the last 2N columns of x_proj's output
    gradient, in B's dtype), or None for a new tensor; A_is_log as the forward got it (then dA is A_log's gradient).
    Returns (du, ddt, dA, dB, dC, dD, dz, d_initial_state, d_dt_bias) in the dtypes of the inputs (None for an absent
    initial state or dt_bias); dB and dC are views of dBC (dC a copy when C's dtype is not B's)."""
    batch_size, seq_len, num_channels = u.shape
    state_size = A.shape[-1]
    block_n = next_power_of_2(state_size)
    num_chunks = cdiv(seq_len, blocks.chunk)
    num_eblocks = cdiv(num_channels, blocks.bwd_block_e)
    chunked = chunk_dtsum is not None
    du = torch.empty(batch_size, seq_len, num_channels, dtype=u.dtype, device=u.device)
    ddt = torch.empty(batch_size, seq_len, num_channels, dtype=dt.dtype, device=u.device)
    if dz is None:
        dz = torch.empty(batch_size, seq_len, num_channels, dtype=z.dtype, device=u.device)
    dBC_part = u.new_empty(num_eblocks, batch_size, seq_len, 2 * state_size, dtype=torch.float32)
    # dA's E N, dD's E and dt_bias's E, so that each sum is a contiguous view of one reduction's result, which
    # autograd hands to the parameter as it is (a strided one it would copy)
    param_numel = num_channels * (state_size + 1 + (dt_bias is not None))
    param_part = u.new_empty(batch_size, num_chunks, param_numel, dtype=torch.float32)
    d_initial = torch.empty_like(initial_state) if initial_state is not None else None
    chunk_dh = u.new_empty(batch_size, num_chunks, num_channels, state_size, dtype=torch.float32) if chunked else None
    grid = (batch_size, num_eblocks, num_chunks)
    # Per program: one segment of states and, unless the forward saved them, the chunk's segment checkpoints, each
    # [BLOCK_E, BLOCK_N] fp32.
    states_per_program = blocks.seg + (0 if seg_states is not None else blocks.chunk // blocks.seg)
    scratch_per_program = states_per_program * blocks.bwd_block_e * block_n
    scratch = u.new_empty(grid[0] * grid[1] * grid[2] * scratch_per_program, dtype=torch.float32)
    shared = {
        "T": seq_len,
        "E": num_channels,
        "N": state_size,
        "num_chunks": num_chunks,
        "HAS_SEQ_IDX": seq_idx is not None,
        "A_IS_LOG": A_is_log,
        "BLOCK_E": blocks.bwd_block_e,
        "BLOCK_N": block_n,
        "num_warps": blocks.bwd_num_warps,
    }
    stage = {  # the arguments both stages take
        **scan_args(u, dt, A, B, C, D, z, dt_bias, dt_softplus),
        "p_dy": dy,
        "p_h0": initial_state,
        "p_dhT": d_final_state,
        "p_dh0": d_initial,
        "p_chunk_h": chunk_h,
        "p_chunk_dh": chunk_dh,
        "p_seg_h": seg_states,
        "p_scratch": scratch,
        "p_du": du,
        "p_ddt": ddt,
        "p_dz": dz,
        "p_dBC_part": dBC_part,
        "p_param_part": param_part,
        "p_seq_idx": seq_idx,
        **token_strides("dy", dy),
        **token_strides("dz", dz),
        "CHUNKED": chunked,
        "HAS_H0": initial_state is not None,
        "HAS_DHT": d_final_state is not None,
        "SEG_H_SAVED": seg_states is not None,
        "CHUNK": blocks.chunk,
        "SEG": blocks.seg,
        "UNROLL": blocks.unroll,
    }
    if chunked:
        _selective_scan_bwd_kernel[grid](**stage, **shared, STAGE=0)
        # The forward's combine, right to left: dL/dh entering each chunk from its right edge. Both ends (the final
        # state's gradient, the initial state's) are contiguous [B, E, N].
        _selective_scan_chunk_combine_kernel[grid[:2]](
            p_A=A,
            p_chunk_h=chunk_dh,
            p_chunk_dtsum=chunk_dtsum,
            p_first=d_final_state,
            p_last=d_initial,
            p_state_indices=None,
            p_has_first=None,
            p_cu_seqlens=None,
            chunk=blocks.chunk,
            s_h_slot=num_channels * state_size,
            s_h_e=state_size,
            s_h_n=1,
            REVERSE=True,
            HAS_FIRST=d_final_state is not None,
            STORE_LAST=d_initial is not None,
            USE_STATE_INDICES=False,
            IS_VARLEN=False,
            **shared,
        )
    _selective_scan_bwd_kernel[grid](**stage, **shared, STAGE=1)
    dBC_sums = dBC_part.sum(0)  # [B, T, 2N]: the reduction over channel blocks
    if dBC is None:
        dBC = dBC_sums.to(B.dtype)
    else:
        dBC.copy_(dBC_sums)
    dB, dC = dBC[..., :state_size], dBC[..., state_size:].to(C.dtype)
    param_sums = param_part.sum((0, 1))  # over batch and chunks
    param_dtypes = {A.dtype, D.dtype} | ({dt_bias.dtype} if dt_bias is not None else set())
    if len(param_dtypes) == 1:
        param_sums = param_sums.to(D.dtype)  # one cast for the three (bf16 weights); the views below keep it
    a_numel = num_channels * state_size
    dA = param_sums[:a_numel].view(num_channels, state_size).to(A.dtype)
    dD = param_sums[a_numel : a_numel + num_channels].to(D.dtype)
    d_dt_bias = param_sums[a_numel + num_channels :].to(dt_bias.dtype) if dt_bias is not None else None
    return du, ddt, dA, dB, dC, dD, dz, d_initial, d_dt_bias
