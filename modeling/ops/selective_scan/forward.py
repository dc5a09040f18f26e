"""Forward kernels of the Mamba-1 selective scan and their launcher, shared by training (`selective_scan_fn`) and
serving (`selective_scan_varlen_fwd`); public functions in interface.py, references in reference.py.

Recurrence per channel e, state index n, step t (all in fp32):
    h_t = a_t * h_{t-1} + b_t,   a_t = exp(dt_t * A),   b_t = dt_t * u_t * B_t
    y_t = (sum_n h_t * C_t + D * u_t) * silu(z_t)
where dt_t is the step (`_dt_step`: the dt argument itself, or softplus(dt + dt_bias) as serving passes it).

Parallel over (sequence, block of BLOCK_E channels, chunk of `chunk` steps: a run-time length, so that a serving
batch's shape picks no compiled variant). A is constant over time, so a chunk's total decay is exactly
exp(A * sum(dt over the chunk)), and the forward runs in three launches:
    stage 0  each chunk's end state from a zero start, and its sum of dt               (all chunks in parallel)
    combine  walk the chunks of a sequence in order: true start state of every chunk   (sequential over chunks only)
    stage 1  rerun every chunk from its true start, writing y (and the final state)    (all chunks in parallel)
When (sequence, channel block) programs alone fill the GPU, one chunk spans the whole sequence and stage 1 alone runs.
The backward (backward.py) reuses the combine, reversed.

Packed training rows (`seq_idx` [B, T], padding-free training): where seq_idx[t] != seq_idx[t - 1] the state
restarts, i.e. a_t = 0 at that step, in every loop that computes a decay. The kernels read it under a constexpr flag,
one scalar load per step (prefetched with the rest), and select the decay (no branch); without it they compile as
if it did not exist. A chunk in which a sequence starts (its first step included) passes none of its incoming carry:
stage 0 writes +inf as its dt sum, which the combine turns into decay 0 both ways.

Every per-step loop prefetches: step t +- 1's loads are issued before step t's arithmetic and stores (the compiler
may not move loads across stores to possibly aliasing pointers), so a program has two steps of loads in flight;
many small programs per SM (one warp each by default) hide the rest of the latency.
"""

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..triton_utils import cdiv, next_power_of_2, softplus, stride_args

# Steps between the training forward's saved states (the backward's recompute checkpoints): the default of
# `pick_scan_blocks`, and the one value serving's launches pass, where nothing is saved.
SEGMENT_STEPS = 64

if TYPE_CHECKING:
    from .interface import ScanBlocks

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


@triton.jit
def _channel_block(p_A, i_e, E, N, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, A_IS_LOG: tl.constexpr):
    """Offsets and masks of channel block i_e ([BLOCK_E] channels, [BLOCK_N] state entries each), and its A * LOG2E
    (fp32 [BLOCK_E, BLOCK_N]). A_IS_LOG: `p_A` holds A_log, and A = -exp(A_log) (`decay_rates`) is taken here."""
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    o_n = tl.arange(0, BLOCK_N)
    m_e, m_n = o_e < E, o_n < N
    m_en = m_e[:, None] & m_n[None, :]
    b_A = tl.load(p_A + o_e[:, None] * N + o_n[None, :], mask=m_en, other=0.0).to(tl.float32)
    if A_IS_LOG:
        b_A = -tl.exp(b_A)
    return o_e, o_n, m_e, m_n, m_en, b_A * LOG2E


@triton.jit
def _load_channel_params(p_D, p_dt_bias, o_e, m_e, HAS_DT_BIAS: tl.constexpr):
    """D and dt_bias (zeros without HAS_DT_BIAS) of the channel block, fp32 [BLOCK_E]."""
    b_D = tl.load(p_D + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_dt_bias = tl.zeros_like(b_D)
    if HAS_DT_BIAS:
        b_dt_bias = tl.load(p_dt_bias + o_e, mask=m_e, other=0.0).to(tl.float32)
    return b_D, b_dt_bias


@triton.jit
def _row_pointers(i_b, p_u, p_dt, p_z, p_B, p_C, s_u_b, s_dt_b, s_z_b, s_BC_b):
    """u, dt, z, B and C of batch row i_b (int64 i_b; the batch strides are 0 for packed sequences)."""
    return p_u + i_b * s_u_b, p_dt + i_b * s_dt_b, p_z + i_b * s_z_b, p_B + i_b * s_BC_b, p_C + i_b * s_BC_b


@triton.jit
def _load_state(p_h, slot, p_flags, i_s, o_e, o_n, m_en, s_h_slot, s_h_e, s_h_n, USE_STATE_INDICES: tl.constexpr):
    """The fp32 [BLOCK_E, BLOCK_N] state block of state row `slot` (`_state_slot`); zeros for a padding sequence
    (slot < 0) and, with USE_STATE_INDICES, for a sequence whose flag in `p_flags` is False (it starts from zero)."""
    m_h = m_en & (slot >= 0)
    if USE_STATE_INDICES:
        m_h = m_h & (tl.load(p_flags + i_s) != 0)
    p_h_blk = p_h + slot * s_h_slot + o_e[:, None] * s_h_e + o_n[None, :] * s_h_n
    return tl.load(p_h_blk, mask=m_h, other=0.0).to(tl.float32)


@triton.jit
def _store_state(p_h, slot, b_h, o_e, o_n, m_en, s_h_slot, s_h_e, s_h_n):
    """Stores the state block b_h into state row `slot` in p_h's dtype; nothing for a padding sequence (slot < 0)."""
    p_h_blk = p_h + slot * s_h_slot + o_e[:, None] * s_h_e + o_n[None, :] * s_h_n
    tl.store(p_h_blk, b_h.to(p_h.dtype.element_ty), mask=m_en & (slot >= 0))


@triton.jit
def _dt_step(b_dt, b_dt_bias, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr):
    """The step of the recurrence from the dt argument (reference.py's `dt_step`): dt (+ dt_bias), through softplus
    when DT_SOFTPLUS. Without either flag it is dt itself, the same IR as reading dt directly."""
    if HAS_DT_BIAS:
        b_dt = b_dt + b_dt_bias
    if DT_SOFTPLUS:
        b_dt = softplus(b_dt)
    return b_dt


# Batch shapes and chunk lengths share a compilation per launch configuration. Serving passes the prefills' slots as a
# slice past the decodes' (vLLM's Mamba metadata), at an alignment that changes with the number of decodes: not
# specialized on.
@triton.jit(do_not_specialize=["T", "num_chunks", "chunk"], do_not_specialize_on_alignment=["p_state_indices"])
def _selective_scan_fwd_kernel(
    p_u, p_dt, p_A, p_B, p_C, p_D, p_z, p_dt_bias, p_y,  # the op's tensors
    p_h0, p_hT, p_state_indices, p_has_h0, p_cu_seqlens,  # states, serving batch
    p_chunk_h, p_chunk_dtsum, p_seg_h, p_seq_idx,  # chunk buffers, checkpoints, packed rows
    T, E, N, num_chunks, chunk,
    s_u_b, s_u_t, s_dt_b, s_dt_t, s_z_b, s_z_t, s_BC_b, s_BC_t, s_y_b, s_y_t, s_h_slot, s_h_e, s_h_n,
    STAGE: tl.constexpr, CHUNKED: tl.constexpr, HAS_H0: tl.constexpr, USE_STATE_INDICES: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, SAVE_SEG_H: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr, SEG: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
    A_IS_LOG: tl.constexpr,
):  # fmt: skip
    """One (sequence, channel block, chunk). STAGE 0: the chunk's end state from a zero start and its sum of steps,
    into the chunk buffers [S, num_chunks, E, N] / [S, num_chunks, E]. STAGE 1: y for the chunk from its true start
    state (the chunk buffer after the combine when CHUNKED, else the sequence's initial state), and the final state
    when not CHUNKED (the combine writes it otherwise); SAVE_SEG_H (training): also the state entering every SEG-th
    step, into `p_seg_h` [S, cdiv(T, SEG), E, N] fp32, the backward's recompute checkpoints. HAS_SEQ_IDX (training
    rows only): `p_seq_idx` [B, T] int32 or int64; a step whose token starts a new sequence has decay 0, and stage 0
    writes +inf as the dt sum of a chunk with such a step (the combine passes none of its incoming carry).
    The step is `_dt_step` of dt (HAS_DT_BIAS, DT_SOFTPLUS). B and C share their strides (s_BC_*), the initial and
    final states theirs (s_h_*: one tensor when the cache is updated in place). A_IS_LOG: `p_A` is A_log."""
    i_s, i_e, i_c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, seq_len = _sequence_bounds(p_cu_seqlens, i_s, T, IS_VARLEN)
    t_start = i_c * chunk
    if t_start >= seq_len:
        return
    t_end = tl.minimum(t_start + chunk, seq_len)
    slot = _state_slot(p_state_indices, i_s, USE_STATE_INDICES)
    is_real = slot >= 0  # padding sequences (slot -1) get zeros and touch no state

    o_e, o_n, m_e, m_n, m_en, b_A2 = _channel_block(p_A, i_e, E, N, BLOCK_E, BLOCK_N, A_IS_LOG)
    b_D, b_dt_bias = _load_channel_params(p_D, p_dt_bias, o_e, m_e, HAS_DT_BIAS)
    o_chunk = (i_s * num_chunks + i_c).to(tl.int64)
    o_chunk_h = o_chunk * E * N + o_e[:, None] * N + o_n[None, :]

    if STAGE == 1 and CHUNKED:
        b_h = tl.load(p_chunk_h + o_chunk_h, mask=m_en, other=0.0)
    elif STAGE == 1 and HAS_H0:
        b_h = _load_state(p_h0, slot, p_has_h0, i_s, o_e, o_n, m_en, s_h_slot, s_h_e, s_h_n, USE_STATE_INDICES)
    else:
        b_h = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
    b_dtsum = tl.zeros([BLOCK_E], dtype=tl.float32)

    i_s = i_s.to(tl.int64)
    p_u, p_dt, p_z, p_B, p_C = _row_pointers(i_s, p_u, p_dt, p_z, p_B, p_C, s_u_b, s_dt_b, s_z_b, s_BC_b)
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
    b_Bt = _load_row(p_B, row, s_BC_t, o_n, m_n)
    if STAGE == 1:
        b_z = _load_row(p_z, row, s_z_t, o_e, m_e)
        b_Ct = _load_row(p_C, row, s_BC_t, o_n, m_n)
    for t in tl.range(t_start, t_end, loop_unroll_factor=UNROLL):
        row = bos + t
        has_next = t + 1 < t_end
        b_u_next = _load_row(p_u, row + 1, s_u_t, o_e, m_e & has_next)
        b_dt_next = _load_row(p_dt, row + 1, s_dt_t, o_e, m_e & has_next)
        b_Bt_next = _load_row(p_B, row + 1, s_BC_t, o_n, m_n & has_next)
        if STAGE == 1:
            b_z_next = _load_row(p_z, row + 1, s_z_t, o_e, m_e & has_next)
            b_Ct_next = _load_row(p_C, row + 1, s_BC_t, o_n, m_n & has_next)
        if HAS_SEQ_IDX:
            seq_next = tl.load(p_seq_idx + t + 1, mask=has_next, other=0)

        if SAVE_SEG_H:  # noqa: SIM102 (a constexpr branch around a run-time one)
            if (t - t_start) % SEG == 0:
                o_seg = tl.cast(t // SEG, tl.int64) * E * N  # int64: T / SEG * E * N passes 2^31 at long contexts
                tl.store(p_seg_h + o_seg + o_e[:, None] * N + o_n[None, :], b_h, mask=m_en)
        b_dt = _dt_step(b_dt, b_dt_bias, HAS_DT_BIAS, DT_SOFTPLUS)
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
        _store_state(p_hT, slot, b_h, o_e, o_n, m_en, s_h_slot, s_h_e, s_h_n)


@triton.jit(do_not_specialize=["T", "num_chunks", "chunk"], do_not_specialize_on_alignment=["p_state_indices"])
def _selective_scan_chunk_combine_kernel(
    p_A, p_chunk_h, p_chunk_dtsum, p_first, p_last, p_state_indices, p_has_first, p_cu_seqlens,
    T, E, N, num_chunks, chunk, s_h_slot, s_h_e, s_h_n,
    REVERSE: tl.constexpr, HAS_FIRST: tl.constexpr, STORE_LAST: tl.constexpr, USE_STATE_INDICES: tl.constexpr,
    IS_VARLEN: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
    A_IS_LOG: tl.constexpr,
):  # fmt: skip
    """One (sequence, channel block): walks its chunks in order (REVERSE: last to first) replacing each chunk's
    zero-start carry in `p_chunk_h` [S, num_chunks, E, N] by the true carry entering it:
        carry_in(next) = exp(A * dtsum(chunk)) * carry_in(chunk) + zero_start_carry(chunk),
    starting from `p_first` (initial state, or the final state's gradient) and storing what leaves the last chunk
    into `p_last` (final state, or the initial state's gradient), both with the strides s_h_*. The same recurrence
    serves forward and backward because a chunk's decay is the same both ways. HAS_SEQ_IDX: a dt sum of +inf
    (forward stage 0: a sequence starts in the chunk) means decay 0, in both directions (the adjoint through a reset
    step is 0 too)."""
    i_s, i_e = tl.program_id(0), tl.program_id(1)
    _, seq_len = _sequence_bounds(p_cu_seqlens, i_s, T, IS_VARLEN)
    chunks_in_seq = tl.cdiv(seq_len, chunk)
    slot = _state_slot(p_state_indices, i_s, USE_STATE_INDICES)

    o_e, o_n, m_e, _, m_en, b_A2 = _channel_block(p_A, i_e, E, N, BLOCK_E, BLOCK_N, A_IS_LOG)
    if HAS_FIRST:
        b_carry = _load_state(
            p_first, slot, p_has_first, i_s, o_e, o_n, m_en, s_h_slot, s_h_e, s_h_n, USE_STATE_INDICES
        )
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
        _store_state(p_last, slot, b_carry, o_e, o_n, m_en, s_h_slot, s_h_e, s_h_n)


def token_strides(name: str, x: torch.Tensor) -> dict[str, int]:
    """The kernels' `s_{name}_b`, `s_{name}_t` of a [B, T, X] tensor, or of a packed [T, X] one (batch stride 0: its
    sequences are found through cu_seqlens); X is read with stride 1."""
    s_b, s_t = (x.stride(0), x.stride(1)) if x.dim() == 3 else (0, x.stride(0))
    return {f"s_{name}_b": s_b, f"s_{name}_t": s_t}


def scan_args(u, dt, A, B, C, D, z, dt_bias, dt_softplus: bool) -> dict:
    """The arguments the forward and backward kernels share: the op's tensors, their token strides (B and C share
    theirs) and the dt flags."""
    return {
        "p_u": u,
        "p_dt": dt,
        "p_A": A,
        "p_B": B,
        "p_C": C,
        "p_D": D,
        "p_z": z,
        "p_dt_bias": dt_bias,
        **token_strides("u", u),
        **token_strides("dt", dt),
        **token_strides("z", z),
        **token_strides("BC", B),
        "HAS_DT_BIAS": dt_bias is not None,
        "DT_SOFTPLUS": dt_softplus,
    }


def launch_selective_scan_fwd(
    u: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, z: Tensor, y: Tensor,
    initial_state: Tensor | None, final_state: Tensor,
    *,
    blocks: "ScanBlocks", max_seq_len: int, dt_bias: Tensor | None = None, dt_softplus: bool = False,
    cu_seqlens: Tensor | None = None, state_indices: Tensor | None = None, has_initial_state: Tensor | None = None,
    seg_states: Tensor | None = None, seq_idx: Tensor | None = None, A_is_log: bool = False,
) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
    """The forward's launches over checked tensors. u, dt, z, y: [B, T, E] or packed [T, E] (then `cu_seqlens` [S+1]
    delimits the sequences); B, C likewise with N, sharing their strides; initial_state / final_state: [rows, E, N]
    with the same strides (the same tensor when the cache is updated in place), indexed by `state_indices` [S]
    (negative = padding sequence) or by batch row; `has_initial_state` [S] bool masks the initial-state read per
    sequence; `seg_states` [B, cdiv(T, seg), E, N] fp32 (training only) receives the backward's segment checkpoints;
    `seq_idx` [B, T] (training only) restarts the state where it changes; `A_is_log`: A holds A_log (A = -exp(A_log)
    taken in the kernels).
    Returns the chunk start states [S, num_chunks, E, N] fp32 (None when one chunk covers every sequence) and the
    chunks' sums of dt [S, num_chunks, E] (+inf for a chunk in which a sequence starts), which the backward reuses."""
    num_channels, state_size = A.shape
    num_seqs = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else u.shape[0]
    num_chunks = cdiv(max_seq_len, blocks.chunk)
    chunked = num_chunks > 1
    if state_indices is not None and initial_state is not None and has_initial_state is None:
        raise ValueError("initial states read through state_indices need has_initial_state (which sequences read one)")
    if (initial_state is not None and initial_state.stride() != final_state.stride()) or B.stride() != C.stride():
        raise ValueError("the kernels read initial and final state with one set of strides, and B and C with another")
    chunk_h = chunk_dtsum = None
    if chunked:
        chunk_h = u.new_empty(num_seqs, num_chunks, num_channels, state_size, dtype=torch.float32)
        chunk_dtsum = u.new_empty(num_seqs, num_chunks, num_channels, dtype=torch.float32)
    shared = {  # the arguments both kernels take
        "p_state_indices": state_indices,
        "p_cu_seqlens": cu_seqlens,
        "T": u.shape[-2],
        "E": num_channels,
        "N": state_size,
        "num_chunks": num_chunks,
        "chunk": blocks.chunk,
        **stride_args("h", final_state, ("slot", "e", "n")),
        "USE_STATE_INDICES": state_indices is not None,
        "IS_VARLEN": cu_seqlens is not None,
        "HAS_SEQ_IDX": seq_idx is not None,
        "A_IS_LOG": A_is_log,
        "BLOCK_E": blocks.block_e,
        "BLOCK_N": next_power_of_2(state_size),
        "num_warps": blocks.num_warps,
    }
    stage = {  # the arguments both stages take
        **scan_args(u, dt, A, B, C, D, z, dt_bias, dt_softplus),
        "p_y": y,
        "p_h0": initial_state,
        "p_hT": final_state,
        "p_has_h0": has_initial_state,
        "p_chunk_h": chunk_h,
        "p_chunk_dtsum": chunk_dtsum,
        "p_seq_idx": seq_idx,
        **token_strides("y", y),
        "CHUNKED": chunked,
        "HAS_H0": initial_state is not None,
        # Read only where segment checkpoints are saved (training): serving's launches keep one value, so that one
        # compiled variant serves every chunk length.
        "SEG": blocks.seg if seg_states is not None else SEGMENT_STEPS,
        "UNROLL": blocks.unroll,
    }
    grid = (num_seqs, cdiv(num_channels, blocks.block_e), num_chunks)
    if chunked:
        _selective_scan_fwd_kernel[grid](**stage, **shared, STAGE=0, p_seg_h=None, SAVE_SEG_H=False)
        _selective_scan_chunk_combine_kernel[grid[:2]](
            p_A=A,
            p_chunk_h=chunk_h,
            p_chunk_dtsum=chunk_dtsum,
            p_first=initial_state,
            p_last=final_state,
            p_has_first=has_initial_state,
            REVERSE=False,
            HAS_FIRST=initial_state is not None,
            STORE_LAST=True,
            **shared,
        )
    save_seg_h = seg_states is not None
    _selective_scan_fwd_kernel[grid](**stage, **shared, STAGE=1, p_seg_h=seg_states, SAVE_SEG_H=save_seg_h)
    return chunk_h, chunk_dtsum
