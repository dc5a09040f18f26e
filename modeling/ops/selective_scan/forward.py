"""Triton kernels of the Mamba-1 selective scan. References (selective_scan.py, same signatures):
`selective_scan_fn` <-> `selective_scan_ref` (training, forward + backward) and
`selective_scan_varlen_fwd` <-> `selective_scan_varlen_ref` (serving prefill over packed sequences with a state cache).

Recurrence per channel e, state index n, step t (all in fp32):
    h_t = a_t * h_{t-1} + b_t,   a_t = exp(dt_t * A),   b_t = dt_t * u_t * B_t
    y_t = (sum_n h_t * C_t + D * u_t) * silu(z_t)

Parallel over (sequence, block of BLOCK_E channels, chunk of `chunk` steps: in the forward a run-time length, so
that a serving batch's shape picks no compiled variant). A is constant over time, so a chunk's
total decay is exactly exp(A * sum(dt over the chunk)), and the forward runs in three launches:
    stage 0  each chunk's end state from a zero start, and its sum of dt               (all chunks in parallel)
    combine  walk the chunks of a sequence in order: true start state of every chunk   (sequential over chunks only)
    stage 1  rerun every chunk from its true start, writing y (and the final state)    (all chunks in parallel)
When (sequence, channel block) programs alone fill the GPU, one chunk spans the whole sequence and stage 1 alone runs.
The backward mirrors it in reverse time with the adjoint P_t = dL/dh_{t-1} = a_t * (dy'_t C_t + P_{t+1}): stage 0
gives each chunk's adjoint carry from a zero right edge, the same combine kernel (reversed) turns them into each
chunk's true right-edge adjoint, and stage 1 walks each chunk backwards. Stage 1 needs h_{t-1} at every step in
reverse order: it recomputes them (never h_{t-1} = (h_t - b_t) / a_t, which is unstable) from checkpoints, the
state entering every SEG-th step: saved by the training forward (`save_seg_states`, the default), else recomputed
by a first pass over the chunk into a per-program global scratch. Then, one segment at a time from the last, it
writes the SEG states of that segment to the scratch and walks them backwards. A program rewrites the same small
scratch region for every segment, so it stays in L2. The final state's gradient seeds the adjoint at the right
edge.

Packed training rows (`seq_idx` [B, T], padding-free training): where seq_idx[t] != seq_idx[t - 1] the state
restarts, i.e. a_t = 0 at that step, in every loop that computes a decay (forward stages, the recompute, the
backward's stages; the adjoint P_t = a_t * G_t then stops there too). The kernels read it under a constexpr flag,
one scalar load per step (prefetched with the rest), and select the decay (no branch); without it they compile as
before. A chunk in which a sequence starts (its first step included) passes none of its incoming carry: stage 0
writes +inf as its dt sum, which the combine turns into decay 0 both ways.

Every per-step loop prefetches: step t +- 1's loads are issued before step t's arithmetic and stores (the compiler
may not move loads across stores to possibly aliasing pointers), so a program has two steps of loads in flight;
many small programs per SM (one warp each by default) hide the rest of the latency.

dB and dC reduce over channels, which live in different programs: each program writes its partial sum over its
BLOCK_E channels to a [E / BLOCK_E, B, T, N] fp32 buffer summed in torch afterwards: deterministic, unlike atomics,
at the cost of E * N / BLOCK_E fp32 values per token each (half an fp32 [B, T, E] tensor's worth at the default
BLOCK_E = 32, N = 16; a larger bwd_block_e shrinks it). dA and dD (sums over batch and time) are written per (sequence, chunk) program and
summed likewise.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_utils import softplus

# exp(x) = exp2(x * log2(e)); A is pre-scaled by LOG2E once per program so each step's decay is a single ex2.approx.ftz
# (tl.exp lowers to a non-ftz ex2 wrapped in a multiply and a denormal range fix-up: 5 instructions instead of 1).
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _load_row(p, row, s_row, o, m):
    """One token's row (offsets `o` within it) as fp32; masked elements read 0."""
    return tl.load(p + row * s_row + o, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _sequence_bounds(p_cu_seqlens, i_s, T, IS_VARLEN: tl.constexpr):
    """(first row of sequence i_s in the packed token dimension, its length)."""
    if IS_VARLEN:
        bos = tl.load(p_cu_seqlens + i_s).to(tl.int64)
        seq_len = (tl.load(p_cu_seqlens + i_s + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = tl.full([], 0, tl.int64)
        seq_len = T
    return bos, seq_len


@triton.jit
def _state_slot(p_state_indices, i_s, USE_STATE_INDICES: tl.constexpr):
    """The state row of sequence i_s: its cache slot (negative for padding) or its batch index."""
    if USE_STATE_INDICES:
        slot = tl.load(p_state_indices + i_s).to(tl.int64)
    else:
        slot = tl.full([], 0, tl.int64) + i_s
    return slot


# Batch shapes and chunk lengths share a compilation per launch configuration. Serving passes the prefills' slots as a
# slice past the decodes' (vLLM's Mamba metadata), at an alignment that changes with the number of decodes: not
# specialized on.
@triton.jit(do_not_specialize=["T", "num_chunks", "chunk"], do_not_specialize_on_alignment=["p_state_indices"])
def _selective_scan_fwd_kernel(
    p_u,
    p_dt,
    p_A,
    p_B,
    p_C,
    p_D,
    p_z,
    p_dt_bias,
    p_y,
    p_h0,
    p_hT,
    p_state_indices,
    p_has_h0,
    p_cu_seqlens,
    p_chunk_h,
    p_chunk_dtsum,
    p_seg_h,
    p_seq_idx,
    T,
    E,
    N,
    num_chunks,
    chunk,
    s_u_b,
    s_u_t,
    s_dt_b,
    s_dt_t,
    s_z_b,
    s_z_t,
    s_B_b,
    s_B_t,
    s_C_b,
    s_C_t,
    s_y_b,
    s_y_t,
    s_h0_s,
    s_h0_e,
    s_h0_n,
    s_hT_s,
    s_hT_e,
    s_hT_n,
    STAGE: tl.constexpr,
    CHUNKED: tl.constexpr,
    HAS_H0: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    SAVE_SEG_H: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    SEG: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """One (sequence, channel block, chunk). STAGE 0: the chunk's end state from a zero start and its sum of dt,
    into the chunk buffers [S, num_chunks, E, N] / [S, num_chunks, E]. STAGE 1: y for the chunk from its true start
    state (the chunk buffer after the combine when CHUNKED, else the sequence's initial state), and the final state
    when not CHUNKED (the combine writes it otherwise); SAVE_SEG_H (training): also the state entering every SEG-th
    step, into `p_seg_h` [S, cdiv(T, SEG), E, N] fp32, the backward's recompute checkpoints. HAS_SEQ_IDX (training
    rows only): `p_seq_idx` [B, T] int32 contiguous; a step whose token starts a new sequence has decay 0, and stage 0
    writes +inf as the dt sum of a chunk with such a step (the combine passes none of its incoming carry)."""
    i_s, i_e, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, seq_len = _sequence_bounds(p_cu_seqlens, i_s, T, IS_VARLEN)
    t_start = i_c * chunk
    if t_start >= seq_len:
        return
    t_end = tl.minimum(t_start + chunk, seq_len)
    slot = _state_slot(p_state_indices, i_s, USE_STATE_INDICES)
    is_real = slot >= 0  # padding sequences (slot -1) get zeros and touch no state

    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    o_n = tl.arange(0, BLOCK_N)
    m_e, m_n = o_e < E, o_n < N
    m_en = m_e[:, None] & m_n[None, :]
    b_A2 = tl.load(p_A + o_e[:, None] * N + o_n[None, :], mask=m_en, other=0.0).to(tl.float32) * LOG2E
    b_D = tl.load(p_D + o_e, mask=m_e, other=0.0).to(tl.float32)
    if DT_SOFTPLUS:
        b_dt_bias = tl.load(p_dt_bias + o_e, mask=m_e, other=0.0).to(tl.float32)
    o_chunk = (i_s * num_chunks + i_c).to(tl.int64)
    o_chunk_h = o_chunk * E * N + o_e[:, None] * N + o_n[None, :]

    if STAGE == 1 and CHUNKED:
        b_h = tl.load(p_chunk_h + o_chunk_h, mask=m_en, other=0.0)
    elif STAGE == 1 and HAS_H0:
        m_h0 = m_en & is_real
        if USE_STATE_INDICES:
            m_h0 = m_h0 & (tl.load(p_has_h0 + i_s) != 0)
        p_h0_blk = p_h0 + slot * s_h0_s + o_e[:, None] * s_h0_e + o_n[None, :] * s_h0_n
        b_h = tl.load(p_h0_blk, mask=m_h0, other=0.0).to(tl.float32)
    else:
        b_h = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
    b_dtsum = tl.zeros([BLOCK_E], dtype=tl.float32)

    i_s = i_s.to(tl.int64)
    p_u += i_s * s_u_b
    p_dt += i_s * s_dt_b
    p_z += i_s * s_z_b
    p_B += i_s * s_B_b
    p_C += i_s * s_C_b
    p_y += i_s * s_y_b
    if SAVE_SEG_H:
        p_seg_h += i_s * tl.cdiv(T, SEG) * E * N
    if HAS_SEQ_IDX:
        # Step t keeps the state iff seq_idx[t] == seq_idx[t - 1]; the chunk's first step compares with the token
        # before the chunk, and the row's first token with itself (always keeps: the initial state is the first
        # sequence's).
        p_seq_idx += i_s * T
        seq_prev = tl.load(p_seq_idx + tl.maximum(t_start - 1, 0))
        seq_cur = tl.load(p_seq_idx + t_start)
        num_resets = tl.zeros([], dtype=tl.int32)
    # Prefetch (module docstring): step t + 1's loads are issued before step t's arithmetic and store of y.
    row = bos + t_start
    b_u = _load_row(p_u, row, s_u_t, o_e, m_e)
    b_dt = _load_row(p_dt, row, s_dt_t, o_e, m_e)
    b_Bt = _load_row(p_B, row, s_B_t, o_n, m_n)
    if STAGE == 1:
        b_z = _load_row(p_z, row, s_z_t, o_e, m_e)
        b_Ct = _load_row(p_C, row, s_C_t, o_n, m_n)
    for t in tl.range(t_start, t_end, loop_unroll_factor=UNROLL):
        row = bos + t
        has_next = t + 1 < t_end
        b_u_next = _load_row(p_u, row + 1, s_u_t, o_e, m_e & has_next)
        b_dt_next = _load_row(p_dt, row + 1, s_dt_t, o_e, m_e & has_next)
        b_Bt_next = _load_row(p_B, row + 1, s_B_t, o_n, m_n & has_next)
        if STAGE == 1:
            b_z_next = _load_row(p_z, row + 1, s_z_t, o_e, m_e & has_next)
            b_Ct_next = _load_row(p_C, row + 1, s_C_t, o_n, m_n & has_next)
        if HAS_SEQ_IDX:
            seq_next = tl.load(p_seq_idx + t + 1, mask=has_next, other=0)

        if SAVE_SEG_H:
            if (t - t_start) % SEG == 0:
                o_seg = tl.cast(t // SEG, tl.int64) * E * N  # int64: T / SEG * E * N passes 2^31 at long contexts
                tl.store(p_seg_h + o_seg + o_e[:, None] * N + o_n[None, :], b_h, mask=m_en)
        if DT_SOFTPLUS:
            b_dt = softplus(b_dt + b_dt_bias)
        b_a = tl.exp2(b_dt[:, None] * b_A2)
        if HAS_SEQ_IDX:
            keep = seq_cur == seq_prev
            b_a = tl.where(keep, b_a, 0.0)
            seq_prev, seq_cur = seq_cur, seq_next
        b_h = b_a * b_h + (b_dt * b_u)[:, None] * b_Bt[None, :]
        if STAGE == 0:
            b_dtsum += b_dt
            if HAS_SEQ_IDX:
                num_resets += tl.where(keep, 0, 1)
        else:
            b_y = (tl.sum(b_h * b_Ct[None, :], axis=1) + b_D * b_u) * b_z * tl.sigmoid(b_z)
            b_y = tl.where(is_real, b_y, 0.0)
            tl.store(p_y + row * s_y_t + o_e, b_y.to(p_y.dtype.element_ty), mask=m_e)
            b_z, b_Ct = b_z_next, b_Ct_next
        b_u, b_dt, b_Bt = b_u_next, b_dt_next, b_Bt_next

    if STAGE == 0:
        if HAS_SEQ_IDX:
            # The chunk's total decay is 0 when a sequence starts in it (its first step included): +inf marks it
            # for the combine, which then selects decay 0 (exp2(inf * A2) itself would be NaN where A = 0).
            b_dtsum = tl.where(num_resets > 0, float("inf"), b_dtsum)
        tl.store(p_chunk_h + o_chunk_h, b_h, mask=m_en)
        tl.store(p_chunk_dtsum + o_chunk * E + o_e, b_dtsum, mask=m_e)
    elif not CHUNKED:
        p_hT_blk = p_hT + slot * s_hT_s + o_e[:, None] * s_hT_e + o_n[None, :] * s_hT_n
        tl.store(p_hT_blk, b_h.to(p_hT.dtype.element_ty), mask=m_en & is_real)


@triton.jit(do_not_specialize=["T", "num_chunks", "chunk"], do_not_specialize_on_alignment=["p_state_indices"])
def _selective_scan_chunk_combine_kernel(
    p_A,
    p_chunk_h,
    p_chunk_dtsum,
    p_first,
    p_last,
    p_state_indices,
    p_has_first,
    p_cu_seqlens,
    T,
    E,
    N,
    num_chunks,
    chunk,
    s_first_s,
    s_first_e,
    s_first_n,
    s_last_s,
    s_last_e,
    s_last_n,
    REVERSE: tl.constexpr,
    HAS_FIRST: tl.constexpr,
    STORE_LAST: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (sequence, channel block): walks its chunks in order (REVERSE: last to first) replacing each chunk's
    zero-start carry in `p_chunk_h` [S, num_chunks, E, N] by the true carry entering it:
        carry_in(next) = exp(A * dtsum(chunk)) * carry_in(chunk) + zero_start_carry(chunk),
    starting from `p_first` (initial state, or the final state's gradient) and storing what leaves the last chunk
    into `p_last` (final state, or the initial state's gradient). The same recurrence serves forward and backward
    because a chunk's decay is the same both ways. HAS_SEQ_IDX: a dt sum of +inf (forward stage 0: a sequence
    starts in the chunk) means decay 0, in both directions (the adjoint through a reset step is 0 too)."""
    i_s, i_e = tl.program_id(0), tl.program_id(1)
    _, seq_len = _sequence_bounds(p_cu_seqlens, i_s, T, IS_VARLEN)
    chunks_in_seq = tl.cdiv(seq_len, chunk)
    slot = _state_slot(p_state_indices, i_s, USE_STATE_INDICES)
    is_real = slot >= 0

    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    o_n = tl.arange(0, BLOCK_N)
    m_e, m_n = o_e < E, o_n < N
    m_en = m_e[:, None] & m_n[None, :]
    b_A2 = tl.load(p_A + o_e[:, None] * N + o_n[None, :], mask=m_en, other=0.0).to(tl.float32) * LOG2E
    if HAS_FIRST:
        m_first = m_en & is_real
        if USE_STATE_INDICES:
            m_first = m_first & (tl.load(p_has_first + i_s) != 0)
        p_first_blk = p_first + slot * s_first_s + o_e[:, None] * s_first_e + o_n[None, :] * s_first_n
        b_carry = tl.load(p_first_blk, mask=m_first, other=0.0).to(tl.float32)
    else:
        b_carry = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)

    # Chunk blocks of this sequence; the next chunk's loads are issued before this chunk's update (prefetch).
    o_blk = o_e[:, None] * N + o_n[None, :]
    p_chunk_h += (i_s * num_chunks).to(tl.int64) * E * N
    p_chunk_dtsum += (i_s * num_chunks).to(tl.int64) * E
    if REVERSE:
        i_c = (chunks_in_seq - 1).to(tl.int64)
        step = -1
    else:
        i_c = tl.full([], 0, tl.int64)
        step = 1
    m_any = chunks_in_seq > 0
    b_local = tl.load(p_chunk_h + i_c * E * N + o_blk, mask=m_en & m_any, other=0.0)
    b_dtsum = tl.load(p_chunk_dtsum + i_c * E + o_e, mask=m_e & m_any, other=0.0)
    for i in range(chunks_in_seq):
        i_next = i_c + step
        has_next = i + 1 < chunks_in_seq
        b_local_next = tl.load(p_chunk_h + i_next * E * N + o_blk, mask=m_en & has_next, other=0.0)
        b_dtsum_next = tl.load(p_chunk_dtsum + i_next * E + o_e, mask=m_e & has_next, other=0.0)
        tl.store(p_chunk_h + i_c * E * N + o_blk, b_carry, mask=m_en)
        b_decay = tl.exp2(b_dtsum[:, None] * b_A2)
        if HAS_SEQ_IDX:
            b_decay = tl.where(b_dtsum[:, None] == float("inf"), 0.0, b_decay)
        b_carry = b_decay * b_carry + b_local
        b_local, b_dtsum, i_c = b_local_next, b_dtsum_next, i_next

    if STORE_LAST:
        p_last_blk = p_last + slot * s_last_s + o_e[:, None] * s_last_e + o_n[None, :] * s_last_n
        tl.store(p_last_blk, b_carry.to(p_last.dtype.element_ty), mask=m_en & is_real)


@triton.jit
def _recompute_states(
    b_h,
    b_A2,
    p_u,
    p_dt,
    p_B,
    s_u_t,
    s_dt_t,
    s_B_t,
    o_e,
    o_n,
    m_e,
    m_n,
    t_lo,
    t_hi,
    p_seg,
    o_blk,
    p_seq_idx,
    STORE: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """Walks the state forward over steps [t_lo, t_hi) (loads prefetched one step ahead) and returns it; STORE:
    also writes each step's incoming state h_{t-1} to `p_seg + (t - t_lo) * block + o_blk`. HAS_SEQ_IDX: decay 0
    where seq_idx (`p_seq_idx`: this row's) changes, as in the forward."""
    b_u = _load_row(p_u, t_lo, s_u_t, o_e, m_e)
    b_dt = _load_row(p_dt, t_lo, s_dt_t, o_e, m_e)
    b_Bt = _load_row(p_B, t_lo, s_B_t, o_n, m_n)
    if HAS_SEQ_IDX:
        seq_prev = tl.load(p_seq_idx + tl.maximum(t_lo - 1, 0))
        seq_cur = tl.load(p_seq_idx + t_lo)
    for t in tl.range(t_lo, t_hi, loop_unroll_factor=UNROLL):
        has_next = t + 1 < t_hi
        b_u_next = _load_row(p_u, t + 1, s_u_t, o_e, m_e & has_next)
        b_dt_next = _load_row(p_dt, t + 1, s_dt_t, o_e, m_e & has_next)
        b_Bt_next = _load_row(p_B, t + 1, s_B_t, o_n, m_n & has_next)
        if HAS_SEQ_IDX:
            seq_next = tl.load(p_seq_idx + t + 1, mask=has_next, other=0)
        if STORE:
            tl.store(p_seg + (t - t_lo) * b_h.numel + o_blk, b_h)
        b_a = tl.exp2(b_dt[:, None] * b_A2)
        if HAS_SEQ_IDX:
            b_a = tl.where(seq_cur == seq_prev, b_a, 0.0)
            seq_prev, seq_cur = seq_cur, seq_next
        b_h = b_a * b_h + (b_dt * b_u)[:, None] * b_Bt[None, :]
        b_u, b_dt, b_Bt = b_u_next, b_dt_next, b_Bt_next
    return b_h


@triton.jit
def _selective_scan_bwd_kernel(
    p_u,
    p_dt,
    p_A,
    p_B,
    p_C,
    p_D,
    p_z,
    p_dy,
    p_h0,
    p_dhT,
    p_dh0,
    p_chunk_h,
    p_chunk_dh,
    p_seg_h,
    p_scratch,
    p_du,
    p_ddt,
    p_dz,
    p_dB_part,
    p_dC_part,
    p_dA_part,
    p_dD_part,
    p_seq_idx,
    T,
    E,
    N,
    num_chunks,
    s_u_b,
    s_u_t,
    s_dt_b,
    s_dt_t,
    s_z_b,
    s_z_t,
    s_B_b,
    s_B_t,
    s_C_b,
    s_C_t,
    s_dy_b,
    s_dy_t,
    STAGE: tl.constexpr,
    CHUNKED: tl.constexpr,
    HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr,
    SEG_H_SAVED: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    CHUNK: tl.constexpr,
    SEG: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """One (batch row, channel block, chunk) of the backward, walking the chunk in reverse with the adjoint
    P_t = dL/dh_{t-1} = a_t * G_t, G_t = dL/dh_t = dy'_t C_t + P_{t+1} (dy' = dy * silu(z)).
    STAGE 0: the P leaving the chunk at its start from a zero right edge, into `p_chunk_dh` [B, num_chunks, E, N].
    STAGE 1: all gradients; the right-edge adjoint is `p_chunk_dh` after the combine when CHUNKED, else dL/dh_T;
    the segment checkpoints come from the forward (`p_seg_h` [B, cdiv(T, SEG), E, N]) when SEG_H_SAVED, else from
    a recompute pass over the chunk into the scratch.
    Gradient buffers are contiguous: du, ddt, dz [B, T, E]; dB/dC partials [E / BLOCK_E, B, T, N]; dA partials
    [B, num_chunks, E, N]; dD partials [B, num_chunks, E]; dh0 [B, E, N] (written here only when not CHUNKED).
    HAS_SEQ_IDX: `p_seq_idx` [B, T] int32; a_t = 0 where a sequence starts (t > 0, seq_idx[t] != seq_idx[t - 1]),
    as in the forward, so nothing of the adjoint crosses back into the previous sequence."""
    i_b, i_e, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t_start = i_c * CHUNK
    t_end = tl.minimum(t_start + CHUNK, T)

    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    o_n = tl.arange(0, BLOCK_N)
    m_e, m_n = o_e < E, o_n < N
    m_en = m_e[:, None] & m_n[None, :]
    b_A2 = tl.load(p_A + o_e[:, None] * N + o_n[None, :], mask=m_en, other=0.0).to(tl.float32) * LOG2E
    b_D = tl.load(p_D + o_e, mask=m_e, other=0.0).to(tl.float32)
    o_chunk = (i_b * num_chunks + i_c).to(tl.int64)
    o_chunk_h = o_chunk * E * N + o_e[:, None] * N + o_n[None, :]
    o_state = i_b.to(tl.int64) * E * N + o_e[:, None] * N + o_n[None, :]

    i_b = i_b.to(tl.int64)
    p_u += i_b * s_u_b
    p_dt += i_b * s_dt_b
    p_z += i_b * s_z_b
    p_B += i_b * s_B_b
    p_C += i_b * s_C_b
    p_dy += i_b * s_dy_b
    if HAS_SEQ_IDX:
        p_seq_idx += i_b * T

    if STAGE == 0:
        b_P = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
        t = t_end - 1
        b_dt = _load_row(p_dt, t, s_dt_t, o_e, m_e)
        b_z = _load_row(p_z, t, s_z_t, o_e, m_e)
        b_dy = _load_row(p_dy, t, s_dy_t, o_e, m_e)
        b_Ct = _load_row(p_C, t, s_C_t, o_n, m_n)
        if HAS_SEQ_IDX:
            seq_cur = tl.load(p_seq_idx + t)
        for i in tl.range(t_end - t_start, loop_unroll_factor=UNROLL):
            t = t_end - 1 - i
            has_next = t > t_start  # prefetch step t - 1, as in the forward
            b_dt_next = _load_row(p_dt, t - 1, s_dt_t, o_e, m_e & has_next)
            b_z_next = _load_row(p_z, t - 1, s_z_t, o_e, m_e & has_next)
            b_dy_next = _load_row(p_dy, t - 1, s_dy_t, o_e, m_e & has_next)
            b_Ct_next = _load_row(p_C, t - 1, s_C_t, o_n, m_n & has_next)
            if HAS_SEQ_IDX:
                # Token t - 1's index: step t's keep, then step t - 1's own. Loaded at the chunk's first step too
                # (the token before the chunk); the row's first token compares with itself (keeps).
                seq_prev = tl.load(p_seq_idx + tl.maximum(t - 1, 0))
            b_G = (b_dy * b_z * tl.sigmoid(b_z))[:, None] * b_Ct[None, :] + b_P
            b_a = tl.exp2(b_dt[:, None] * b_A2)
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
                    b_h,
                    b_A2,
                    p_u,
                    p_dt,
                    p_B,
                    s_u_t,
                    s_dt_t,
                    s_B_t,
                    o_e,
                    o_n,
                    m_e,
                    m_n,
                    seg_start,
                    tl.minimum(seg_start + SEG, t_end),
                    p_seg,
                    o_blk,
                    p_seq_idx,
                    STORE=False,
                    HAS_SEQ_IDX=HAS_SEQ_IDX,
                    UNROLL=UNROLL,
                )

        if CHUNKED:
            b_P = tl.load(p_chunk_dh + o_chunk_h, mask=m_en, other=0.0)
        elif HAS_DHT:
            b_P = tl.load(p_dhT + o_state, mask=m_en, other=0.0)
        else:
            b_P = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
        b_dA = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
        b_dD = tl.zeros([BLOCK_E], dtype=tl.float32)
        for jj in range(segs_in_chunk):
            j = segs_in_chunk - 1 - jj
            seg_start = t_start + j * SEG
            seg_end = tl.minimum(seg_start + SEG, t_end)
            tl.debug_barrier()
            b_h = tl.load(p_ckpt + j * s_ckpt + o_ckpt, mask=m_en, other=0.0)
            _recompute_states(
                b_h,
                b_A2,
                p_u,
                p_dt,
                p_B,
                s_u_t,
                s_dt_t,
                s_B_t,
                o_e,
                o_n,
                m_e,
                m_n,
                seg_start,
                seg_end,
                p_seg,
                o_blk,
                p_seq_idx,
                STORE=True,
                HAS_SEQ_IDX=HAS_SEQ_IDX,
                UNROLL=UNROLL,
            )
            tl.debug_barrier()
            t = seg_end - 1
            b_h_prev = tl.load(p_seg + (t - seg_start) * BLOCK_E * BLOCK_N + o_blk)
            b_u = _load_row(p_u, t, s_u_t, o_e, m_e)
            b_dt = _load_row(p_dt, t, s_dt_t, o_e, m_e)
            b_z = _load_row(p_z, t, s_z_t, o_e, m_e)
            b_dy = _load_row(p_dy, t, s_dy_t, o_e, m_e)
            b_Bt = _load_row(p_B, t, s_B_t, o_n, m_n)
            b_Ct = _load_row(p_C, t, s_C_t, o_n, m_n)
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
                b_Bt_next = _load_row(p_B, t - 1, s_B_t, o_n, m_n & has_next)
                b_Ct_next = _load_row(p_C, t - 1, s_C_t, o_n, m_n & has_next)
                if HAS_SEQ_IDX:
                    seq_prev = tl.load(p_seq_idx + tl.maximum(t - 1, 0))  # as in stage 0

                b_a = tl.exp2(b_dt[:, None] * b_A2)
                if HAS_SEQ_IDX:
                    b_a = tl.where(seq_cur == seq_prev, b_a, 0.0)
                    seq_cur = seq_prev
                b_ah = b_a * b_h_prev  # [BLOCK_E, BLOCK_N]
                b_h = b_ah + (b_dt * b_u)[:, None] * b_Bt[None, :]
                b_sig = tl.sigmoid(b_z)
                b_pre = tl.sum(b_h * b_Ct[None, :], axis=1) + b_D * b_u  # y before the gate
                b_dpre = b_dy * b_z * b_sig  # dy' = dL/d(pre-gate y)
                b_dz = b_dy * b_pre * b_sig * (1.0 + b_z * (1.0 - b_sig))
                b_G = b_dpre[:, None] * b_Ct[None, :] + b_P  # dL/dh_t
                b_GB = tl.sum(b_G * b_Bt[None, :], axis=1)
                b_GahA = tl.sum(b_G * b_ah * b_A2, axis=1) * (1.0 / LOG2E)  # with A, not A * LOG2E
                b_du = b_dt * b_GB + b_dpre * b_D
                b_ddt = b_u * b_GB + b_GahA
                b_dBt = tl.sum(b_G * (b_dt * b_u)[:, None], axis=0)
                b_dCt = tl.sum(b_h * b_dpre[:, None], axis=0)
                b_dA += b_G * b_ah * b_dt[:, None]
                b_dD += b_dpre * b_u
                b_P = b_a * b_G

                o_tok = (i_b * T + t).to(tl.int64) * E + o_e
                tl.store(p_du + o_tok, b_du.to(p_du.dtype.element_ty), mask=m_e)
                tl.store(p_ddt + o_tok, b_ddt.to(p_ddt.dtype.element_ty), mask=m_e)
                tl.store(p_dz + o_tok, b_dz.to(p_dz.dtype.element_ty), mask=m_e)
                o_part = ((i_e * tl.num_programs(0) + i_b) * T + t).to(tl.int64) * N + o_n
                tl.store(p_dB_part + o_part, b_dBt, mask=m_n)
                tl.store(p_dC_part + o_part, b_dCt, mask=m_n)
                b_h_prev, b_u, b_dt, b_z, b_dy = b_h_prev_next, b_u_next, b_dt_next, b_z_next, b_dy_next
                b_Bt, b_Ct = b_Bt_next, b_Ct_next

        tl.store(p_dA_part + o_chunk_h, b_dA, mask=m_en)
        tl.store(p_dD_part + o_chunk * E + o_e, b_dD, mask=m_e)
        if not CHUNKED and HAS_H0:
            tl.store(p_dh0 + o_state, b_P, mask=m_en)


class ScanBlocks(NamedTuple):
    """Launch shape, exposed so benchmarks can sweep it. block_e: channels per program; chunk: steps per time chunk
    (a power of two; chunk >= the longest sequence runs one chunk per sequence: forward stage 1 alone, no combine);
    seg: steps per backward recompute segment (divides chunk); unroll: unroll factor of the per-step loops (on top
    of the one-step load prefetch); num_warps / bwd_num_warps: warps per forward / backward program; bwd_block_e:
    channels per backward program; save_seg_states: the training forward saves the state entering every seg-th
    step (fp32 [B, cdiv(T, seg), E, N]: N / seg fp32 values per token and channel kept for the backward), which
    spares the backward a recompute pass."""

    block_e: int
    chunk: int
    seg: int
    unroll: int
    num_warps: int
    bwd_num_warps: int
    bwd_block_e: int
    save_seg_states: bool


def _pick_blocks(num_seqs: int, max_seq_len: int, num_channels: int, state_size: int, **overrides) -> ScanBlocks:
    """Defaults from the shapes, any keyword given (not None) taking precedence.

    Measured on the H200 (`bench_kernels.py --only scan_sweep`, bf16, B=4 T=4096 E=1024 N=16, 2026-11-29), fwd+bwd:
    32 channels per program and ONE warp, forward and backward (a [32, 16] fp32 state block, 16 values per
    thread), 1.44 ms; 16 channels with 1/2 warps 2.33 ms; 16 channels with a 1-warp backward 1.79 ms; 64-channel
    backward with 2 warps 1.59 ms. With one warp Triton's reductions over the block are shuffles, not shared-memory
    round trips, and many small programs per SM hide each other's load latency. Larger N keeps 16 values per thread
    with more warps (not measured). Chunks only as short as needed for ~4096 programs (~30 per H200 SM): every
    chunk boundary costs a stage-0 rerun (one more exp per element); chunk 256 instead of the picked 128 measured
    the same (1.42 ms)."""
    block_n = triton.next_power_of_2(state_size)
    block_e = overrides.get("block_e") or (32 if block_n <= 16 else 16)
    programs = num_seqs * triton.cdiv(num_channels, block_e)
    chunk = overrides.get("chunk") or max(64, triton.next_power_of_2(triton.cdiv(max_seq_len * programs, 4096)))
    bwd_block_e = overrides.get("bwd_block_e") or block_e
    blocks = ScanBlocks(
        block_e=block_e,
        chunk=chunk,
        seg=min(overrides.get("seg") or 16, chunk),
        unroll=overrides.get("unroll") or 1,
        num_warps=overrides.get("num_warps") or max(1, min(8, block_e * block_n // 512)),
        bwd_num_warps=overrides.get("bwd_num_warps") or max(1, min(8, bwd_block_e * block_n // 512)),
        bwd_block_e=bwd_block_e,
        save_seg_states=overrides.get("save_seg_states", True),
    )
    if blocks.chunk % blocks.seg or any(triton.next_power_of_2(x) != x for x in (chunk, block_e, bwd_block_e)):
        raise ValueError(f"{blocks}: chunk, block_e and bwd_block_e must be powers of two and seg must divide chunk")
    return blocks


def _check_token_tensor(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {x.stride()}")


def _batch_strides(x: torch.Tensor) -> tuple[int, int]:
    """(sequence stride, token stride) of a [B, T, X] tensor, or (0, token stride) of a packed [T_total, X] one."""
    return (x.stride(0), x.stride(1)) if x.dim() == 3 else (0, x.stride(0))


def _scan_forward(
    u,
    dt,
    A,
    B,
    C,
    D,
    z,
    y,
    initial_state,
    final_state,
    blocks: ScanBlocks,
    *,
    num_seqs,
    seq_len,
    max_seq_len,
    cu_seqlens=None,
    state_indices=None,
    has_initial_state=None,
    dt_bias=None,
    seg_states=None,
    seq_idx=None,
):
    """Forward launcher shared by training and serving. u, dt, z, y: [B, T, E] or packed [T_total, E] (then
    `cu_seqlens` [S + 1] delimits the sequences); B, C likewise with N; initial_state / final_state: [rows, E, N]
    any strides, indexed by `state_indices` [S] (negative = padding sequence) or by batch row, and the same tensor
    when the cache is updated in place; `has_initial_state` [S] bool masks the initial-state read per sequence;
    `seg_states` [S, cdiv(T, seg), E, N] fp32 (training only) receives the backward's segment checkpoints;
    `seq_idx` [B, T] contiguous int32 (training only) restarts the state where it changes.
    Returns the chunk start states [S, num_chunks, E, N] fp32 (None when one chunk covers every sequence) and the
    chunks' sums of dt [S, num_chunks, E] (+inf for a chunk in which a sequence starts), which the backward reuses."""
    num_channels, state_size = A.shape
    num_chunks = triton.cdiv(max_seq_len, blocks.chunk)
    chunked = num_chunks > 1
    dummy = y  # stands in for absent optional pointers; the constexpr flags keep it untouched
    h0 = initial_state if initial_state is not None else final_state
    optional = {
        "p_state_indices": state_indices if state_indices is not None else dummy,
        "p_cu_seqlens": cu_seqlens if cu_seqlens is not None else dummy,
    }
    meta = {
        "USE_STATE_INDICES": state_indices is not None,
        "IS_VARLEN": cu_seqlens is not None,
        "BLOCK_E": blocks.block_e,
        "BLOCK_N": triton.next_power_of_2(state_size),
        "num_warps": blocks.num_warps,
    }
    chunk_h = chunk_dtsum = None
    if chunked:
        chunk_h = u.new_empty(num_seqs, num_chunks, num_channels, state_size, dtype=torch.float32)
        chunk_dtsum = u.new_empty(num_seqs, num_chunks, num_channels, dtype=torch.float32)
    grid = (num_seqs, triton.cdiv(num_channels, blocks.block_e), num_chunks)

    def launch_stage(stage: int) -> None:
        _selective_scan_fwd_kernel[grid](
            u,
            dt,
            A,
            B,
            C,
            D,
            z,
            dt_bias if dt_bias is not None else dummy,
            y,
            h0,
            final_state,
            p_has_h0=has_initial_state if has_initial_state is not None else dummy,
            p_chunk_h=chunk_h if chunked else dummy,
            p_chunk_dtsum=chunk_dtsum if chunked else dummy,
            p_seg_h=seg_states if seg_states is not None and stage == 1 else dummy,
            p_seq_idx=seq_idx if seq_idx is not None else dummy,
            T=seq_len,
            E=num_channels,
            N=state_size,
            num_chunks=num_chunks,
            chunk=blocks.chunk,
            s_u_b=_batch_strides(u)[0],
            s_u_t=_batch_strides(u)[1],
            s_dt_b=_batch_strides(dt)[0],
            s_dt_t=_batch_strides(dt)[1],
            s_z_b=_batch_strides(z)[0],
            s_z_t=_batch_strides(z)[1],
            s_B_b=_batch_strides(B)[0],
            s_B_t=_batch_strides(B)[1],
            s_C_b=_batch_strides(C)[0],
            s_C_t=_batch_strides(C)[1],
            s_y_b=_batch_strides(y)[0],
            s_y_t=_batch_strides(y)[1],
            s_h0_s=h0.stride(0),
            s_h0_e=h0.stride(1),
            s_h0_n=h0.stride(2),
            s_hT_s=final_state.stride(0),
            s_hT_e=final_state.stride(1),
            s_hT_n=final_state.stride(2),
            STAGE=stage,
            CHUNKED=chunked,
            HAS_H0=initial_state is not None,
            DT_SOFTPLUS=dt_bias is not None,
            SAVE_SEG_H=seg_states is not None and stage == 1,
            HAS_SEQ_IDX=seq_idx is not None,
            SEG=blocks.seg,
            UNROLL=blocks.unroll,
            **optional,
            **meta,
        )

    if chunked:
        launch_stage(0)
        _selective_scan_chunk_combine_kernel[grid[:2]](
            A,
            chunk_h,
            chunk_dtsum,
            h0,
            final_state,
            p_has_first=has_initial_state if has_initial_state is not None else dummy,
            T=seq_len,
            E=num_channels,
            N=state_size,
            num_chunks=num_chunks,
            chunk=blocks.chunk,
            s_first_s=h0.stride(0),
            s_first_e=h0.stride(1),
            s_first_n=h0.stride(2),
            s_last_s=final_state.stride(0),
            s_last_e=final_state.stride(1),
            s_last_n=final_state.stride(2),
            REVERSE=False,
            HAS_FIRST=initial_state is not None,
            STORE_LAST=True,
            HAS_SEQ_IDX=seq_idx is not None,
            **optional,
            **meta,
        )
    launch_stage(1)
    return chunk_h, chunk_dtsum


def _scan_backward(
    u,
    dt,
    A,
    B,
    C,
    D,
    z,
    dy,
    initial_state,
    d_final_state,
    chunk_h,
    chunk_dtsum,
    seg_states,
    seq_idx,
    blocks: ScanBlocks,
):
    """Backward launcher (training layout [B, T, E]); chunk_h / chunk_dtsum as `_scan_forward` returned them,
    seg_states as it filled them (or None: the backward recomputes them), seq_idx as the forward got it (or None).
    Returns (du, ddt, dA, dB, dC, dD, dz, d_initial_state) in the dtypes of the inputs."""
    batch_size, seq_len, num_channels = u.shape
    state_size = A.shape[-1]
    block_n = triton.next_power_of_2(state_size)
    num_chunks = triton.cdiv(seq_len, blocks.chunk)
    num_eblocks = triton.cdiv(num_channels, blocks.bwd_block_e)
    chunked = chunk_h is not None
    du = torch.empty(batch_size, seq_len, num_channels, dtype=u.dtype, device=u.device)
    ddt = torch.empty(batch_size, seq_len, num_channels, dtype=dt.dtype, device=u.device)
    dz = torch.empty(batch_size, seq_len, num_channels, dtype=z.dtype, device=u.device)
    dB_part = u.new_empty(num_eblocks, batch_size, seq_len, state_size, dtype=torch.float32)
    dC_part = torch.empty_like(dB_part)
    dA_part = u.new_empty(batch_size, num_chunks, num_channels, state_size, dtype=torch.float32)
    dD_part = u.new_empty(batch_size, num_chunks, num_channels, dtype=torch.float32)
    d_initial = torch.empty_like(initial_state) if initial_state is not None else None
    chunk_dh = torch.empty_like(chunk_h) if chunked else None
    grid = (batch_size, num_eblocks, num_chunks)
    # Per program: one segment of states and, unless the forward saved them, the chunk's segment checkpoints, each
    # [BLOCK_E, BLOCK_N] fp32.
    states_per_program = blocks.seg + (0 if seg_states is not None else blocks.chunk // blocks.seg)
    scratch_per_program = states_per_program * blocks.bwd_block_e * block_n
    scratch = u.new_empty(grid[0] * grid[1] * grid[2] * scratch_per_program, dtype=torch.float32)
    dummy = du
    meta = {"BLOCK_E": blocks.bwd_block_e, "BLOCK_N": block_n, "num_warps": blocks.bwd_num_warps}

    def launch_stage(stage: int) -> None:
        _selective_scan_bwd_kernel[grid](
            u,
            dt,
            A,
            B,
            C,
            D,
            z,
            dy,
            initial_state if initial_state is not None else dummy,
            d_final_state if d_final_state is not None else dummy,
            d_initial if d_initial is not None else dummy,
            chunk_h if chunked else dummy,
            chunk_dh if chunked else dummy,
            seg_states if seg_states is not None else dummy,
            scratch,
            du,
            ddt,
            dz,
            dB_part,
            dC_part,
            dA_part,
            dD_part,
            seq_idx if seq_idx is not None else dummy,
            seq_len,
            num_channels,
            state_size,
            num_chunks,
            u.stride(0),
            u.stride(1),
            dt.stride(0),
            dt.stride(1),
            z.stride(0),
            z.stride(1),
            B.stride(0),
            B.stride(1),
            C.stride(0),
            C.stride(1),
            dy.stride(0),
            dy.stride(1),
            STAGE=stage,
            CHUNKED=chunked,
            HAS_H0=initial_state is not None,
            HAS_DHT=d_final_state is not None,
            SEG_H_SAVED=seg_states is not None,
            HAS_SEQ_IDX=seq_idx is not None,
            CHUNK=blocks.chunk,
            SEG=blocks.seg,
            UNROLL=blocks.unroll,
            **meta,
        )

    if chunked:
        launch_stage(0)
        # The same combine as the forward's, right to left: dL/dh entering each chunk from its right edge.
        state_strides = (num_channels * state_size, state_size, 1)
        _selective_scan_chunk_combine_kernel[grid[:2]](
            A,
            chunk_dh,
            chunk_dtsum,
            d_final_state if d_final_state is not None else dummy,
            d_initial if d_initial is not None else dummy,
            dummy,
            dummy,
            dummy,
            seq_len,
            num_channels,
            state_size,
            num_chunks,
            blocks.chunk,
            *state_strides,
            *state_strides,
            REVERSE=True,
            HAS_FIRST=d_final_state is not None,
            STORE_LAST=d_initial is not None,
            USE_STATE_INDICES=False,
            IS_VARLEN=False,
            HAS_SEQ_IDX=seq_idx is not None,
            **meta,
        )
    launch_stage(1)
    dB = dB_part.sum(0).to(B.dtype)  # [B, T, N]: the reduction over channel blocks
    dC = dC_part.sum(0).to(C.dtype)
    dA = dA_part.sum((0, 1)).to(A.dtype)  # [E, N]: over batch and chunks
    dD = dD_part.sum((0, 1)).to(D.dtype)
    return du, ddt, dA, dB, dC, dD, dz, d_initial


class SelectiveScanFn(torch.autograd.Function):
    """Training scan; the final state's gradient flows too (it seeds the adjoint at the right edge)."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, D, z, initial_state, seq_idx, blocks: ScanBlocks):
        batch_size, seq_len, num_channels = u.shape
        y = torch.empty(batch_size, seq_len, num_channels, dtype=u.dtype, device=u.device)
        final_state = u.new_empty(batch_size, num_channels, A.shape[-1], dtype=torch.float32)
        seg_states = None
        if blocks.save_seg_states:
            seg_states = u.new_empty(
                batch_size, triton.cdiv(seq_len, blocks.seg), num_channels, A.shape[-1], dtype=torch.float32
            )
        chunk_h, chunk_dtsum = _scan_forward(
            u,
            dt,
            A,
            B,
            C,
            D,
            z,
            y,
            initial_state,
            final_state,
            blocks,
            num_seqs=batch_size,
            seq_len=seq_len,
            max_seq_len=seq_len,
            seg_states=seg_states,
            seq_idx=seq_idx,
        )
        ctx.save_for_backward(u, dt, A, B, C, D, z, initial_state, chunk_h, chunk_dtsum, seg_states, seq_idx)
        ctx.blocks = blocks
        return y, final_state

    @staticmethod
    def backward(ctx, dy, d_final_state):
        u, dt, A, B, C, D, z, initial_state, chunk_h, chunk_dtsum, seg_states, seq_idx = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        if d_final_state is not None:
            d_final_state = d_final_state.float().contiguous()
        grads = _scan_backward(
            u,
            dt,
            A,
            B,
            C,
            D,
            z,
            dy,
            initial_state,
            d_final_state,
            chunk_h,
            chunk_dtsum,
            seg_states,
            seq_idx,
            ctx.blocks,
        )
        return *grads, None, None  # no gradient for seq_idx and the launch shape


def selective_scan_fn(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    *,
    block_e: int | None = None,
    chunk: int | None = None,
    seg: int | None = None,
    unroll: int | None = None,
    num_warps: int | None = None,
    bwd_num_warps: int | None = None,
    bwd_block_e: int | None = None,
    save_seg_states: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable Triton selective scan with the contract of `selective_scan_ref` (selective_scan.py).

    Args:
        u, dt, z: [B, T, E], any float dtypes (may differ); strided views with a contiguous last dimension (the
            halves of one [B, T, 2E] tensor) are read in place.
        A: [E, N] (fp32). B, C: [B, T, N]. D: [E].
        initial_state: [B, E, N] or None (zeros); with seq_idx, the state before the row's first sequence.
        seq_idx: [B, T] int32 or int64 (values in int32 range) index of the sequence of every token, for rows that
            pack several sequences (padding-free training, mamba_ssm's convention): where it changes between two
            consecutive tokens the state restarts from zero, forward and backward; the final state is that of the
            row's last sequence. None: one sequence per row. Not differentiable.
        block_e, chunk, seg, unroll, num_warps, bwd_num_warps, bwd_block_e: launch shape (`ScanBlocks`); None picks
            it from the shapes.
        save_seg_states: keep every seg-th state from the forward for the backward (`ScanBlocks`): faster backward,
            fp32 [B, cdiv(T, seg), E, N] more saved activations; False recomputes them in the backward.

    Returns:
        y [B, T, E] in u's dtype and the final state [B, E, N] fp32. Gradients flow to every input (dA, dD, and
        d_initial_state in fp32 sums) and from both outputs.
    """
    batch_size, seq_len, num_channels = u.shape
    state_size = A.shape[-1]
    for name, x in (("u", u), ("dt", dt), ("z", z)):
        _check_token_tensor(name, x, (batch_size, seq_len, num_channels))
    for name, x in (("B", B), ("C", C)):
        _check_token_tensor(name, x, (batch_size, seq_len, state_size))
    if tuple(A.shape) != (num_channels, state_size) or tuple(D.shape) != (num_channels,):
        raise ValueError(
            f"A, D: expected [E, N] = {(num_channels, state_size)} and [E], got {tuple(A.shape)}, {tuple(D.shape)}"
        )
    if initial_state is not None:
        if tuple(initial_state.shape) != (batch_size, num_channels, state_size):
            raise ValueError(
                f"initial_state: expected {(batch_size, num_channels, state_size)}, got {tuple(initial_state.shape)}"
            )
        initial_state = initial_state.float().contiguous()
    if seq_idx is not None:
        if tuple(seq_idx.shape) != (batch_size, seq_len):
            raise ValueError(f"seq_idx: expected shape [B, T] = {(batch_size, seq_len)}, got {tuple(seq_idx.shape)}")
        if seq_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"seq_idx: expected an int32 or int64 tensor, got {seq_idx.dtype}")
        seq_idx = seq_idx.to(torch.int32).contiguous()  # the kernels read row b, token t at `b * T + t`
    blocks = _pick_blocks(
        batch_size,
        seq_len,
        num_channels,
        state_size,
        block_e=block_e,
        chunk=chunk,
        seg=seg,
        unroll=unroll,
        num_warps=num_warps,
        bwd_num_warps=bwd_num_warps,
        bwd_block_e=bwd_block_e,
        # Without a backward to come (inference, no_grad) the checkpoints would be written for nothing.
        save_seg_states=save_seg_states
        and torch.is_grad_enabled()
        and any(x is not None and x.requires_grad for x in (u, dt, A, B, C, D, z, initial_state)),
    )
    if seq_len == 0:  # nothing to scan; keeps the kernels free of empty-grid corner cases
        final_state = (
            initial_state
            if initial_state is not None
            else u.new_zeros(batch_size, num_channels, state_size, dtype=torch.float32)
        )
        return torch.empty_like(u), final_state
    return SelectiveScanFn.apply(u, dt, A.contiguous(), B, C, D.contiguous(), z, initial_state, seq_idx, blocks)


def selective_scan_varlen_fwd(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    out: torch.Tensor,
    *,
    max_seq_len: int | None = None,
    block_e: int | None = None,
    chunk: int | None = None,
    unroll: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Serving prefill over packed sequences with a state cache; reference `selective_scan_varlen_ref`
    (selective_scan.py), same signature plus keyword-only launch arguments. Not differentiable.

    Args:
        u, z: [T_total, E] (strided views with a contiguous last dimension are read in place).
        dt: [T_total, E] RAW dt_proj output; the kernel steps with softplus(dt + dt_bias) in fp32 (vLLM's
            delta_bias + delta_softplus).
        A: [E, N] (fp32); B, C: [T_total, N]; D, dt_bias: [E].
        cu_seqlens: [S + 1] int32 token offsets of the sequences.
        ssm_state: [num_slots, E, N] cache (fp32, bf16 or fp16; any strides, e.g. a view of a bigger cache), updated
            in place with each sequence's final state in its dtype; other slots are not touched.
        state_indices: [S] int32 slot per sequence; -1 = padding: its tokens get zeros in `out`, no slot touched.
        has_initial_state: [S] bool; False starts from zero whatever the slot holds; None: all False.
            One difference from the reference: an EMPTY sequence leaves its slot as it is (the reference writes
            zeros there when it has no initial state); vLLM never schedules an empty prefill.
        out: [T_total, E] written with y * silu(z) (contiguous last dimension).
        max_seq_len: the longest sequence; computed from cu_seqlens (a host sync) when None.
        block_e, chunk, unroll, num_warps: launch shape (`ScanBlocks`); None picks it from the shapes.

    Returns:
        `out`.
    """
    total_tokens, num_channels = u.shape
    state_size = A.shape[-1]
    num_seqs = cu_seqlens.shape[0] - 1
    for name, x in (("u", u), ("dt", dt), ("z", z), ("out", out)):
        _check_token_tensor(name, x, (total_tokens, num_channels))
    for name, x in (("B", B), ("C", C)):
        _check_token_tensor(name, x, (total_tokens, state_size))
    for name, x, shape in (
        ("A", A, (num_channels, state_size)),
        ("D", D, (num_channels,)),
        ("dt_bias", dt_bias, (num_channels,)),
        ("state_indices", state_indices, (num_seqs,)),
        ("has_initial_state", has_initial_state, (num_seqs,)),
    ):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    if ssm_state.dim() != 3 or tuple(ssm_state.shape[1:]) != (num_channels, state_size):
        raise ValueError(
            f"ssm_state: expected [num_slots, {num_channels}, {state_size}], got {tuple(ssm_state.shape)}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or state_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens, state_indices: expected int32, got {cu_seqlens.dtype}, {state_indices.dtype}")
    # The kernels read entry i at `pointer + i`: a strided view (a column of a wider table) would read wrong entries.
    for name, x in (
        ("cu_seqlens", cu_seqlens),
        ("state_indices", state_indices),
        ("has_initial_state", has_initial_state),
    ):
        if x is not None and not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {x.stride()}")
    if num_seqs == 0 or total_tokens == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    blocks = _pick_blocks(
        num_seqs,
        max_seq_len,
        num_channels,
        state_size,
        block_e=block_e,
        chunk=chunk,
        unroll=unroll,
        num_warps=num_warps,
    )
    _scan_forward(
        u,
        dt,
        A.contiguous(),
        B,
        C,
        D.contiguous(),
        z,
        out,
        ssm_state if has_initial_state is not None else None,  # None: no slot is read
        ssm_state,
        blocks,
        num_seqs=num_seqs,
        seq_len=total_tokens,
        max_seq_len=max(max_seq_len, 1),
        cu_seqlens=cu_seqlens,
        state_indices=state_indices,
        has_initial_state=has_initial_state,
        dt_bias=dt_bias.contiguous(),
    )
    return out
