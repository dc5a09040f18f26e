"""Packed prefills of Mamba-2's chunked scan over a cache of state slots, for serving: `ssd_varlen_scan_ref`'s contract
(reference.py) on Triton kernels. The algorithm is forward.py's (its docstring has the formulas), with each sequence
cut into its own chunks of L tokens from its first token, so that no chunk holds two sequences and no segment masks
are needed; the programs find their sequence on the device (no host sync, no metadata from the caller):

    walk     one program per (sequence, block of P and N, head) walks the sequence's chunks in order, starting
             from its slot's state (zeros for a fresh one), carrying it in fp32, storing the state entering each
             chunk ([chunks, H, P, N] in x's dtype, in which the outputs' products take it) and writing the final
             state back into the slot (the sequences in parallel: their chains are independent)
    outputs  one program per (chunk, block of P, head): y of the chunk's tokens (all chunks in parallel), its sequence
             found by a binary search over the sequences' first chunks (no compile-time size tied to the batch: one
             compilation serves every number of prefills)

`split_walk` replaces the walk by two kernels: chunk states (one program per chunk, block and head: each chunk's own
contribution to the state and its decay, all chunks in parallel) and a pass (one program per sequence, block and
head) that only chains them: fp32 multiply-adds down the sequence, no products on the chain.

No kernel lets Triton specialize on `num_seqs` (it would compile a batch of one prefill, and one of a multiple of 16,
apart from the others: a stall while serving), nor on the alignment of the slots (vLLM's Mamba metadata hands the
prefills' slots as a slice past the decodes', at an alignment that changes with the number of decodes). Chunks run
on the grid's first axis (up to 2^31 - 1 programs; the others stop at 65535).

dt is the raw step: its bias and softplus are applied in both kernels (`dt_bias`, `dt_softplus`), as the reference
applies them.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..triton_utils import cdiv, softplus, stride_args
from .forward import SSDBlocks, _chunk_contribution, _chunk_outputs, _intra_chunk_decays, dot_precision


@triton.jit
def _varlen_chunk(
    p_dt, p_dt_bias, a, i_h, t0, t1, i_c, s_dt_t, s_dt_h,
    L: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
):  # fmt: skip
    """Chunk i_c of the sequence of tokens [t0, t1), per token i: its offset o_t, token t, validity m_t, step dt
    (zero past the sequence) and G (the log decay from the chunk's start to i); and G at the chunk's last token."""
    o_t = tl.arange(0, L)
    t = t0 + tl.cast(i_c, tl.int64) * L + o_t
    m_t = t < t1
    b_dt = tl.load(p_dt + t * s_dt_t + i_h * s_dt_h, mask=m_t, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(p_dt_bias + i_h).to(tl.float32)
    if DT_SOFTPLUS:
        b_dt = softplus(b_dt)
    b_dt = tl.where(m_t, b_dt, 0.0)
    b_G = tl.cumsum(b_dt * a, 0)
    G_last = tl.sum(tl.where(o_t == tl.minimum(t1 - t0 - i_c * L, L) - 1, b_G, 0.0), 0)
    return o_t, t, m_t, b_dt, b_G, G_last


@triton.jit
def _chunk_sequence(p_cu, p_offsets, num_seqs, i_chunk):
    """Packed chunk i_chunk's sequence, its tokens [t0, t1), and the chunk's number i_c in it: the last sequence whose
    first chunk is at or before i_chunk (offsets[lo] <= i_chunk < offsets[hi] throughout the binary search)."""
    lo, hi = tl.full([], 0, tl.int32), num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(p_offsets + mid) <= i_chunk:
            lo = mid
        else:
            hi = mid
    t0, t1 = tl.load(p_cu + lo).to(tl.int64), tl.load(p_cu + lo + 1).to(tl.int64)
    return t0, t1, i_chunk - tl.load(p_offsets + lo)


@triton.jit
def _state_tile(i_pn, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile i_pn of a [P, N] state in [BLOCK_P, BLOCK_N] tiles (N's fastest): its rows, columns and mask."""
    i_n, i_p = i_pn % tl.cdiv(N, BLOCK_N), i_pn // tl.cdiv(N, BLOCK_N)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return o_p, o_n, (o_p[:, None] < P) & (o_n[None, :] < N)


@triton.jit
def _own_contribution(
    p_x, p_B, p_dt, p_dt_bias, a, i_h, t0, t1, i_c, o_p, o_n, P, N,
    s_x_t, s_x_p, s_dt_t, s_dt_h, s_B_t, s_B_n,
    L: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Chunk i_c's own contribution to the state leaving it (as if it entered at zero), fp32 [BLOCK_P, BLOCK_N] of
    one head (p_x, p_B at the head's and its group's first element), and its log decay G_last."""
    _, t, m_t, b_dt, b_G, G_last = _varlen_chunk(
        p_dt, p_dt_bias, a, i_h, t0, t1, i_c, s_dt_t, s_dt_h, L, HAS_DT_BIAS, DT_SOFTPLUS
    )
    b_weight = tl.where(m_t, tl.exp(G_last - b_G), 0.0) * b_dt
    b_own = _chunk_contribution(p_x, p_B, t, m_t, o_p, o_n, b_weight, P, N, s_x_t, s_x_p, s_B_t, s_B_n, PRECISION)
    return b_own, G_last


@triton.jit
def _slot_state(
    p_cache, p_idx, p_init, i_s, i_h, o_p, o_n, m_pn, s_cache_s, s_cache_h, s_cache_p, s_cache_n,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Sequence i_s's slot tile of head i_h: its pointers, and the state it starts from (fp32: the slot's if it has
    an initial state, else zeros)."""
    p_slot = p_cache + tl.load(p_idx + i_s).to(tl.int64) * s_cache_s + i_h * s_cache_h
    p_slot += o_p[:, None] * s_cache_p + o_n[None, :] * s_cache_n
    b_start = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    if tl.load(p_init + i_s):
        b_start = tl.load(p_slot, mask=m_pn, other=0.0).to(tl.float32)
    return p_slot, b_start


@triton.jit(do_not_specialize=["num_seqs"])
def _ssd_varlen_chunk_states_kernel(
    p_x, p_dt, p_dt_bias, p_A, p_B, p_cu, p_offsets, p_walk, p_decay, num_seqs,
    H, P, N, heads_per_group,
    s_x_t, s_x_h, s_x_p, s_dt_t, s_dt_h, s_B_t, s_B_g, s_B_n,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The split walk's first half: each chunk's own contribution to the state leaving it (as if it entered at zero)
    into walk[chunk], and its decay exp(G_last) into decay[chunk, head]: all chunks in parallel."""
    i_chunk, i_pn, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if i_chunk >= tl.load(p_offsets + num_seqs):
        return
    t0, t1, i_c = _chunk_sequence(p_cu, p_offsets, num_seqs, i_chunk)
    i_g = i_h // heads_per_group
    o_p, o_n, m_pn = _state_tile(i_pn, P, N, BLOCK_P, BLOCK_N)
    b_own, G_last = _own_contribution(
        p_x + i_h * s_x_h, p_B + i_g * s_B_g, p_dt, p_dt_bias, tl.load(p_A + i_h).to(tl.float32), i_h, t0, t1, i_c,
        o_p, o_n, P, N, s_x_t, s_x_p, s_dt_t, s_dt_h, s_B_t, s_B_n, L, HAS_DT_BIAS, DT_SOFTPLUS, PRECISION,
    )  # fmt: skip
    p_walk += (tl.cast(i_chunk, tl.int64) * H + i_h) * P * N + o_p[:, None] * N + o_n[None, :]
    tl.store(p_walk, b_own, mask=m_pn)
    if i_pn == 0:
        tl.store(p_decay + tl.cast(i_chunk, tl.int64) * H + i_h, tl.exp(G_last))


@triton.jit(do_not_specialize_on_alignment=["p_idx"])
def _ssd_varlen_state_pass_kernel(
    p_cache, p_idx, p_init, p_offsets, p_walk, p_decay, H, P, N, s_cache_s, s_cache_h, s_cache_p, s_cache_n,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The split walk's second half, one program per (sequence, tile of the state, head): down the sequence's chunks,
    walk[c] (chunk c's own contribution) is read and replaced by the state entering chunk c, and the state leaving
    it is decay[c] * that + the contribution; the last one goes into the sequence's slot. No products: a stream of
    loads that do not depend on the running state."""
    i_s, i_pn, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_p, o_n, m_pn = _state_tile(i_pn, P, N, BLOCK_P, BLOCK_N)
    c0, c1 = tl.load(p_offsets + i_s), tl.load(p_offsets + i_s + 1)
    p_slot, b_carry = _slot_state(
        p_cache, p_idx, p_init, i_s, i_h, o_p, o_n, m_pn, s_cache_s, s_cache_h, s_cache_p, s_cache_n, BLOCK_P, BLOCK_N
    )
    p_walk += i_h * P * N + o_p[:, None] * N + o_n[None, :]
    for i_chunk in tl.range(c0, c1, num_stages=2):
        p_chunk = p_walk + tl.cast(i_chunk, tl.int64) * H * P * N
        b_own = tl.load(p_chunk, mask=m_pn, other=0.0)
        b_decay = tl.load(p_decay + tl.cast(i_chunk, tl.int64) * H + i_h)
        tl.store(p_chunk, b_carry, mask=m_pn)
        b_carry = b_decay * b_carry + b_own
    tl.store(p_slot, b_carry.to(p_cache.dtype.element_ty), mask=m_pn)


@triton.jit(do_not_specialize_on_alignment=["p_idx"])
def _ssd_varlen_walk_kernel(
    p_x, p_dt, p_dt_bias, p_A, p_B, p_cache, p_cu, p_idx, p_init, p_offsets, p_walk,
    H, P, N, heads_per_group,
    s_x_t, s_x_h, s_x_p, s_dt_t, s_dt_h, s_B_t, s_B_g, s_B_n,
    s_cache_s, s_cache_h, s_cache_p, s_cache_n,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The walk down sequence i_s's chunks for one tile of one head's state: walk[c] = the state entering chunk c,
    then the state leaving it = exp(G_last) * that + the chunk's contribution; the last one into the slot."""
    i_s, i_pn, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_g = i_h // heads_per_group
    o_p, o_n, m_pn = _state_tile(i_pn, P, N, BLOCK_P, BLOCK_N)
    a = tl.load(p_A + i_h).to(tl.float32)
    p_x += i_h * s_x_h
    p_B += i_g * s_B_g
    p_walk += i_h * P * N + o_p[:, None] * N + o_n[None, :]
    t0, t1 = tl.load(p_cu + i_s).to(tl.int64), tl.load(p_cu + i_s + 1).to(tl.int64)
    c0, c1 = tl.load(p_offsets + i_s), tl.load(p_offsets + i_s + 1)
    p_slot, b_carry = _slot_state(
        p_cache, p_idx, p_init, i_s, i_h, o_p, o_n, m_pn, s_cache_s, s_cache_h, s_cache_p, s_cache_n, BLOCK_P, BLOCK_N
    )
    for i_c in range(c1 - c0):
        p_entering = p_walk + tl.cast(c0 + i_c, tl.int64) * H * P * N
        tl.store(p_entering, b_carry.to(p_walk.dtype.element_ty), mask=m_pn)
        b_own, G_last = _own_contribution(
            p_x, p_B, p_dt, p_dt_bias, a, i_h, t0, t1, i_c, o_p, o_n, P, N,
            s_x_t, s_x_p, s_dt_t, s_dt_h, s_B_t, s_B_n, L, HAS_DT_BIAS, DT_SOFTPLUS, PRECISION,
        )  # fmt: skip
        b_carry = tl.exp(G_last) * b_carry + b_own
    tl.store(p_slot, b_carry.to(p_cache.dtype.element_ty), mask=m_pn)


@triton.jit(do_not_specialize=["num_seqs"])
def _ssd_varlen_outputs_kernel(
    p_x, p_dt, p_dt_bias, p_A, p_B, p_C, p_D, p_cu, p_offsets, p_walk, p_y, num_seqs,
    H, P, N, heads_per_group,
    s_x_t, s_x_h, s_x_p, s_dt_t, s_dt_h, s_B_t, s_B_g, s_B_n, s_C_t, s_C_g, s_C_n, s_y_t, s_y_h, s_y_p,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i_chunk, i_p, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if i_chunk >= tl.load(p_offsets + num_seqs):  # the grid has spare chunks at the end
        return
    t0, t1, i_c = _chunk_sequence(p_cu, p_offsets, num_seqs, i_chunk)
    i_g = i_h // heads_per_group
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    a = tl.load(p_A + i_h).to(tl.float32)
    o_t, t, m_t, b_dt, b_G, _ = _varlen_chunk(
        p_dt, p_dt_bias, a, i_h, t0, t1, i_c, s_dt_t, s_dt_h, L, HAS_DT_BIAS, DT_SOFTPLUS
    )
    # One sequence a chunk: every token continues the state entering it, and one segment holds them all.
    b_M = _intra_chunk_decays(o_t, m_t, b_G, tl.zeros([L], dtype=tl.int32), False)
    b_y, m_tp = _chunk_outputs(
        p_x + i_h * s_x_h, p_B + i_g * s_B_g, p_C + i_g * s_C_g, p_D + i_h,
        p_walk + (tl.cast(i_chunk, tl.int64) * H + i_h) * P * N, t, m_t, o_p, b_G, b_dt, b_M, m_t, P, N,
        s_x_t, s_x_p, s_B_t, s_B_n, s_C_t, s_C_n, L, BLOCK_P, BLOCK_N, PRECISION,
    )  # fmt: skip
    p_y += i_h * s_y_h + t[:, None] * s_y_t + o_p[None, :] * s_y_p
    tl.store(p_y, b_y.to(p_y.dtype.element_ty), mask=m_tp)


def launch_ssd_varlen_scan(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, state_cache: Tensor, cu_seqlens: Tensor,
    state_indices: Tensor, has_initial_state: Tensor, out: Tensor, dt_bias: Tensor | None, dt_softplus: bool,
    blocks: SSDBlocks, tile: int, split_walk: bool,
) -> None:  # fmt: skip
    """The walk, then the outputs, over checked tensors (`ssd_varlen_scan_fwd` in interface.py): x [T, H, P], dt
    [T, H], B and C [T, G, N] (the last dimension contiguous), A, D and dt_bias [H] contiguous, state_cache [slots,
    H, P, N], cu_seqlens, state_indices and has_initial_state of S >= 1 sequences, out [T, H, P]; chunks of `tile`
    tokens; the walk in one kernel, or split in two (`split_walk`: the chunks' own contributions in parallel, then
    a pass down each sequence that only adds them up)."""
    num_tokens, heads, head_dim = x.shape
    num_seqs, state_size = state_indices.shape[0], B.shape[-1]
    # Each sequence's first chunk: the chunks of the sequences before it (no host sync: the grid takes a bound).
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
    offsets = torch.zeros(num_seqs + 1, dtype=torch.int32, device=x.device)
    torch.cumsum(torch.div(lengths + tile - 1, tile, rounding_mode="floor"), 0, dtype=torch.int32, out=offsets[1:])
    max_chunks = cdiv(num_tokens, tile) + num_seqs
    # The states entering the chunks in the dtype the outputs' products take them in (x's: bf16 states for bf16
    # inputs, half the bytes of fp32 and the same y); the split walk sums fp32 contributions in them, so fp32.
    walk_dtype = torch.float32 if split_walk else x.dtype
    walk = x.new_empty(max_chunks, heads, head_dim, state_size, dtype=walk_dtype)
    common = {
        "H": heads, "P": head_dim, "N": state_size, "heads_per_group": heads // B.shape[1],
        **stride_args("x", x, "thp"), **stride_args("dt", dt, "th"), **stride_args("B", B, "tgn"), "L": tile,
        "HAS_DT_BIAS": dt_bias is not None, "DT_SOFTPLUS": dt_softplus, "PRECISION": dot_precision(x),
    }  # fmt: skip
    dt_bias = dt_bias if dt_bias is not None else A  # never read without HAS_DT_BIAS
    walk_tiles = cdiv(state_size, blocks.walk_n) * cdiv(head_dim, blocks.walk_p)
    walk_blocks = {"BLOCK_P": blocks.walk_p, "BLOCK_N": blocks.walk_n, "num_warps": blocks.walk_warps}
    cache_strides = stride_args("cache", state_cache, "shpn")
    if split_walk:
        decay = x.new_empty(max_chunks, heads, dtype=torch.float32)
        _ssd_varlen_chunk_states_kernel[(max_chunks, walk_tiles, heads)](
            x, dt, dt_bias, A, B, cu_seqlens, offsets, walk, decay, num_seqs, **common, **walk_blocks,
        )  # fmt: skip
        _ssd_varlen_state_pass_kernel[(num_seqs, walk_tiles, heads)](
            state_cache, state_indices, has_initial_state, offsets, walk, decay, heads, head_dim, state_size,
            **cache_strides, **walk_blocks,
        )  # fmt: skip
    else:
        _ssd_varlen_walk_kernel[(num_seqs, walk_tiles, heads)](
            x, dt, dt_bias, A, B, state_cache, cu_seqlens, state_indices, has_initial_state, offsets, walk,
            **cache_strides, **common, **walk_blocks,
        )  # fmt: skip
    _ssd_varlen_outputs_kernel[(max_chunks, cdiv(head_dim, blocks.out_p), heads)](
        x, dt, dt_bias, A, B, C, D, cu_seqlens, offsets, walk, out, num_seqs,
        **stride_args("C", C, "tgn"), **stride_args("y", out, "thp"), **common, BLOCK_P=blocks.out_p,
        BLOCK_N=blocks.out_n, num_warps=blocks.out_warps,
    )  # fmt: skip
