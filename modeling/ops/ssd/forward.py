"""Forward kernels of Mamba-2's chunked scan (SSD) for training, and their launcher; the public function and its
autograd are in interface.py, the reference (`ssd_chunk_scan_ref`, the same algorithm in PyTorch) in reference.py.

Per head h of a row, chunks of L tokens; G_i = sum of dt_t * A[h] over the chunk's tokens t <= i (the log decay from
the chunk's start to token i, fp32, computed in each program from dt), xdt_j = x_j * dt_j:
    state entering chunk c+1:  H_{c+1} = a_c H_c + sum_j w_j xdt_j B_j^T          [P, N]
    output:                    y_i = e_i H_c C_i + sum_{j <= i} M_ij (C_i . B_j) xdt_j + D x_i
with a_c = exp(G_last), w_j = exp(G_last - G_j), e_i = exp(G_i), M_ij = exp(G_i - G_j). Two launches:
    walk    one program per (row and head, block of P, block of N) walks the chunks in order, storing the state
            entering each chunk ([b, chunks, H, P, N]) and the final state              (sequential over chunks)
    outputs one program per (row and head, chunk, block of P): the two terms of y        (all chunks in parallel)
The walk is one kernel for both directions: the backward walks the state gradients back with it.
The backward (backward.py) recomputes the states rather than keeping them: they are P*N/L fp32 values per token and
head, 8x the input's bytes at P 64, N 128, L 64.

Packed rows (`seq_idx`): the kernels read a segment number per token (a count of sequence starts, `segments`), and a
product that would cross a sequence start is zero: M_ij needs i and j in one segment, e_i needs i in the segment of
the token before the chunk (the row's first token for chunk 0: the initial state belongs to the row's first
sequence), w_j needs j in the segment of the chunk's last token, and a_c the last token in the segment before the
chunk. A zero step (dt = 0: padding) decays by 1 and adds nothing.

Products run on the tensor cores in the inputs' dtype (bf16 operands, fp32 accumulation, as mamba_ssm's SSD kernels
do), and in exact fp32 (input_precision "ieee") for fp32 inputs. No operand of a product is the transpose of another
product's result: a transposed operand is loaded transposed from memory (Triton 3.4-3.7.0 miscompiles `tl.trans` of
a wgmma result on Hopper: fla-org/flash-linear-attention#640).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..triton_utils import cdiv, next_power_of_2, stride_args

CHUNK = 64
# The widest head the kernels take: the backward holds a head's channels in one block.
MAX_HEAD_DIM = 128


@triton.jit
def _chunk_decays(
    p_dt, p_seg, a, i_b, i_h, i_c, T,
    s_dt_b, s_dt_t, s_dt_h, s_seg_b, s_seg_t,
    L: tl.constexpr, HAS_SEQ: tl.constexpr,
):  # fmt: skip
    """What every kernel needs of chunk i_c of (row i_b, head i_h), per token i of the chunk: its offset in the chunk
    o_t and in the row t, validity m_t, step dt, G; the flags is_last (the chunk's last valid token), continues (i
    continues the state entering the chunk), reaches_end (i is in the segment of the chunk's last token); the
    segment numbers (zeros without `seq_idx`); and of the chunk: G at its last token, and whether the state entering
    it passes the whole chunk (`carried`)."""
    o_t = tl.arange(0, L)
    t = tl.cast(i_c, tl.int64) * L + o_t
    m_t = t < T
    b_dt = tl.load(p_dt + i_b * s_dt_b + t * s_dt_t + i_h * s_dt_h, mask=m_t, other=0.0).to(tl.float32)
    b_G = tl.cumsum(b_dt * a, 0)
    is_last = o_t == tl.minimum(T - i_c * L, L) - 1
    G_last = tl.sum(tl.where(is_last, b_G, 0.0), 0)
    if HAS_SEQ:
        b_seg = tl.load(p_seg + i_b * s_seg_b + t * s_seg_t, mask=m_t, other=-1)
        seg_before = tl.load(p_seg + i_b * s_seg_b + tl.maximum(i_c * L - 1, 0) * s_seg_t)
        seg_last = tl.sum(tl.where(is_last, b_seg, 0), 0)
        continues = m_t & (b_seg == seg_before)
        reaches_end = m_t & (b_seg == seg_last)
        carried = seg_last == seg_before
    else:
        b_seg = tl.zeros([L], dtype=tl.int32)
        continues = m_t
        reaches_end = m_t
        carried = tl.full([], 1, tl.int1)
    return o_t, t, m_t, b_dt, b_G, G_last, is_last, continues, reaches_end, b_seg, carried


@triton.jit
def _intra_chunk_decays(o_t, m_t, b_G, b_seg, TRANSPOSED: tl.constexpr):
    """M [i, j] = exp(G_i - G_j) where j <= i in one segment, else 0; its transpose [j, i] with TRANSPOSED, built as
    such (not by transposing). The exponent is never taken of a positive difference: no overflow to inf."""
    keep = (b_seg[:, None] == b_seg[None, :]) & m_t[:, None] & m_t[None, :]
    if TRANSPOSED:
        keep = keep & (o_t[:, None] <= o_t[None, :])
        exponent = b_G[None, :] - b_G[:, None]
    else:
        keep = keep & (o_t[:, None] >= o_t[None, :])
        exponent = b_G[:, None] - b_G[None, :]
    return tl.exp(tl.where(keep, exponent, float("-inf")))


@triton.jit
def _ssd_chunk_walk_kernel(
    p_u, p_dt, p_A, p_K, p_seg, p_start, p_walk, p_end,
    T, H, P, N, num_chunks, heads_per_group,
    s_u_b, s_u_t, s_u_h, s_u_p,
    s_dt_b, s_dt_t, s_dt_h,
    s_K_b, s_K_t, s_K_g, s_K_n,
    s_seg_b, s_seg_t,
    s_start_b, s_start_h, s_start_p, s_start_n,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, REVERSE: tl.constexpr,
    HAS_SEQ: tl.constexpr, HAS_START: tl.constexpr, HAS_END: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """carry <- a_c carry + sum_i weight_i u_i K_i^T over the chunks, storing the carry before each chunk's update in
    `walk` [b, chunks, H, P, N] and the last in `end` [b, H, P, N] (both fp32, contiguous):
        forward  (u, K) = (x, B), weight_j = w_j dt_j, chunks in order from the initial state: the states entering
                 each chunk, then the final state;
        REVERSE  (u, K) = (dy, C), weight_i = e_i, chunks backwards from the final state's gradient: the gradients
                 of the states at each chunk's end, then the initial state's gradient."""
    i_n, i_p, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H  # offsets in int64: [b, chunks, H, P, N] passes 2^31
    i_g = i_h // heads_per_group
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_pn = (o_p[:, None] < P) & (o_n[None, :] < N)
    a = tl.load(p_A + i_h).to(tl.float32)
    p_u += i_b * s_u_b + i_h * s_u_h
    p_K += i_b * s_K_b + i_g * s_K_g
    o_pn = o_p[:, None] * N + o_n[None, :]
    p_walk += (i_b * num_chunks * H + i_h) * P * N + o_pn

    b_carry = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    if HAS_START:
        p_start += i_b * s_start_b + i_h * s_start_h + o_p[:, None] * s_start_p + o_n[None, :] * s_start_n
        b_carry = tl.load(p_start, mask=m_pn, other=0.0).to(tl.float32)
    for i_step in range(num_chunks):
        i_c = num_chunks - 1 - i_step if REVERSE else i_step
        tl.store(p_walk + tl.cast(i_c, tl.int64) * H * P * N, b_carry.to(p_walk.dtype.element_ty), mask=m_pn)
        _, t, m_t, b_dt, b_G, G_last, _, continues, reaches_end, _, carried = _chunk_decays(
            p_dt, p_seg, a, i_b, i_h, i_c, T, s_dt_b, s_dt_t, s_dt_h, s_seg_b, s_seg_t, L, HAS_SEQ
        )
        if REVERSE:
            b_weight = tl.where(continues, tl.exp(b_G), 0.0)
        else:
            b_weight = tl.where(reaches_end, tl.exp(G_last - b_G), 0.0) * b_dt
        b_carry = tl.where(carried, tl.exp(G_last), 0.0) * b_carry
        b_carry += _chunk_contribution(
            p_u, p_K, t, m_t, o_p, o_n, b_weight, P, N, s_u_t, s_u_p, s_K_t, s_K_n, PRECISION
        )
    if HAS_END:
        tl.store(p_end + (i_b * H + i_h) * P * N + o_pn, b_carry, mask=m_pn)


@triton.jit
def _chunk_contribution(
    p_u, p_K, t, m_t, o_p, o_n, b_weight, P, N, s_u_t, s_u_p, s_K_t, s_K_n, PRECISION: tl.constexpr
):
    """sum_i weight_i u_i K_i^T over a chunk's tokens t: [BLOCK_P, BLOCK_N] fp32, products in u's dtype."""
    dot_dtype = p_u.dtype.element_ty
    # u^T [P, L], loaded transposed, times the weights
    b_uT = tl.load(p_u + o_p[:, None] * s_u_p + t[None, :] * s_u_t, mask=(o_p[:, None] < P) & m_t[None, :], other=0.0)
    b_uwT = (b_uT.to(tl.float32) * b_weight[None, :]).to(dot_dtype)
    b_Kc = tl.load(p_K + t[:, None] * s_K_t + o_n[None, :] * s_K_n, mask=m_t[:, None] & (o_n[None, :] < N), other=0.0)
    return tl.dot(b_uwT, b_Kc.to(dot_dtype), input_precision=PRECISION)


@triton.jit
def _ssd_outputs_fwd_kernel(
    p_x, p_dt, p_A, p_B, p_C, p_D, p_seg, p_states, p_y,
    T, H, P, N, num_chunks, heads_per_group,
    s_x_b, s_x_t, s_x_h, s_x_p,
    s_dt_b, s_dt_t, s_dt_h,
    s_B_b, s_B_t, s_B_g, s_B_n,
    s_C_b, s_C_t, s_C_g, s_C_n,
    s_seg_b, s_seg_t,
    s_y_b, s_y_t, s_y_h, s_y_p,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SEQ: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i_p, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H  # offsets in int64: [b, chunks, H, P, N] passes 2^31
    i_g = i_h // heads_per_group
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    a = tl.load(p_A + i_h).to(tl.float32)
    o_t, t, m_t, b_dt, b_G, _, _, continues, _, b_seg, _ = _chunk_decays(
        p_dt, p_seg, a, i_b, i_h, i_c, T, s_dt_b, s_dt_t, s_dt_h, s_seg_b, s_seg_t, L, HAS_SEQ
    )
    p_B += i_b * s_B_b + i_g * s_B_g
    p_C += i_b * s_C_b + i_g * s_C_g
    p_states += ((i_b * num_chunks + i_c) * H + i_h) * P * N
    p_x += i_b * s_x_b + i_h * s_x_h
    b_M = _intra_chunk_decays(o_t, m_t, b_G, b_seg, False)
    b_y, m_tp = _chunk_outputs(
        p_x, p_B, p_C, p_D + i_h, p_states, t, m_t, o_p, b_G, b_dt, b_M, continues, P, N,
        s_x_t, s_x_p, s_B_t, s_B_n, s_C_t, s_C_n, L, BLOCK_P, BLOCK_N, PRECISION,
    )  # fmt: skip
    p_y += i_b * s_y_b + i_h * s_y_h + t[:, None] * s_y_t + o_p[None, :] * s_y_p
    tl.store(p_y, b_y.to(p_y.dtype.element_ty), mask=m_tp)


@triton.jit
def _chunk_outputs(
    p_x, p_B, p_C, p_D, p_state, t, m_t, o_p, b_G, b_dt, b_M, continues, P, N,
    s_x_t, s_x_p, s_B_t, s_B_n, s_C_t, s_C_n,
    L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """y [L, BLOCK_P] (fp32) of a chunk's tokens t and channels o_p of one head: C_i . (the state entering the chunk,
    fp32 [P, N] at p_state) times e_i where token i `continues` it, the chunk's own terms (its decays b_M) and D x_i;
    with the tile's mask. p_x, p_B, p_C at the head's (group's) first element, p_D at the head's D."""
    m_p = o_p < P
    dot_dtype = p_x.dtype.element_ty
    # C_i . (state entering the chunk) and C_i . B_j, over blocks of N
    b_y = tl.zeros([L, BLOCK_P], dtype=tl.float32)
    b_S = tl.zeros([L, L], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < N
        b_Cc = tl.load(p_C + t[:, None] * s_C_t + o_n[None, :] * s_C_n, mask=m_t[:, None] & m_n[None, :], other=0.0)
        b_Cc = b_Cc.to(dot_dtype)
        b_BT = tl.load(p_B + o_n[:, None] * s_B_n + t[None, :] * s_B_t, mask=m_n[:, None] & m_t[None, :], other=0.0)
        b_S += tl.dot(b_Cc, b_BT.to(dot_dtype), input_precision=PRECISION)
        b_hT = tl.load(p_state + o_p[None, :] * N + o_n[:, None], mask=m_n[:, None] & m_p[None, :], other=0.0)
        b_y += tl.dot(b_Cc, b_hT.to(dot_dtype), input_precision=PRECISION)
    b_y *= tl.where(continues, tl.exp(b_G), 0.0)[:, None]

    m_tp = m_t[:, None] & m_p[None, :]
    b_x = tl.load(p_x + t[:, None] * s_x_t + o_p[None, :] * s_x_p, mask=m_tp, other=0.0)
    # dt_j scales column j of the decays (x stays an exact operand; x * dt would round)
    b_y += tl.dot((b_S * b_M * b_dt[None, :]).to(dot_dtype), b_x.to(dot_dtype), input_precision=PRECISION)
    b_y += tl.load(p_D).to(tl.float32) * b_x.to(tl.float32)
    return b_y, m_tp


def dot_precision(x: Tensor) -> str:
    """Exact fp32 products for fp32 inputs (the reference's precision); bf16/fp16 operands take the tensor cores."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def shape_args(x: Tensor, B: Tensor, chunk: int) -> dict:
    _, length, heads, head_dim = x.shape
    return {
        "T": length,
        "H": heads,
        "P": head_dim,
        "N": B.shape[-1],
        "num_chunks": cdiv(length, chunk),
        "heads_per_group": heads // B.shape[2],
        "L": chunk,
    }


def common_strides(x: Tensor, dt: Tensor, B: Tensor, segments: Tensor | None) -> dict:
    return {
        **stride_args("x", x, "bthp"),
        **stride_args("dt", dt, "bth"),
        **stride_args("B", B, "btgn"),
        **stride_args("seg", segments, "bt"),
    }


class SSDBlocks(NamedTuple):
    """Launch shapes of the scan's kernels, exposed so that benchmarks can sweep them: the walk's state tile
    [walk_p, walk_n] and warps; the outputs kernel's blocks of P and N and warps; the per-chunk backward's block of N
    and warps (it holds the head's P channels at once)."""

    walk_p: int
    walk_n: int
    walk_warps: int
    out_p: int
    out_n: int
    out_warps: int
    bwd_n: int
    bwd_warps: int


def pick_ssd_blocks(head_dim: int, state_size: int, **overrides) -> SSDBlocks:
    """Defaults from the shapes, any keyword given (not None) taking precedence; on an H100 each beat every other value
    its sweep tried by 6-52 % (`bench_kernels.py --only ssd_sweep`, BENCHMARKS.md): walk tiles of 32 x 64, so that a
    [b, H] launch still has b * H * cdiv(P, 32) * cdiv(N, 64) programs (256 at b 2, H 32, P 64, N 128); the outputs in
    blocks of 64 x 64; the backward with N in blocks of 32 on 8 warps (blocks of 64 spilled 164 bytes a thread).
    tl.dot's tiles are at least 16."""

    def block(size: int, cap: int) -> int:
        return max(16, min(cap, next_power_of_2(size)))

    defaults = SSDBlocks(
        walk_p=block(head_dim, 32), walk_n=block(state_size, 64), walk_warps=4,
        out_p=block(head_dim, 64), out_n=block(state_size, 64), out_warps=4,
        bwd_n=block(state_size, 32), bwd_warps=8,
    )  # fmt: skip
    return defaults._replace(**{name: value for name, value in overrides.items() if value is not None})


def launch_ssd_chunk_walk(
    u: Tensor, dt: Tensor, A: Tensor, K: Tensor, segments: Tensor | None, start: Tensor | None, chunk: int,
    blocks: SSDBlocks, reverse: bool, with_end: bool = True, walk_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The walk over the chunks (`_ssd_chunk_walk_kernel`) over checked tensors: the states entering every chunk and
    the final state from (x, B) and the initial state, or with `reverse` the gradients of the states at every chunk's
    end and of the initial state from (dy, C) and the final state's gradient. Returns (walk [b, chunks, H, P, N] in
    `walk_dtype` (the running state is fp32 either way), end fp32 [b, H, P, N] or None without `with_end`)."""
    batch, _, heads, head_dim = u.shape
    state_size = K.shape[-1]
    shapes = shape_args(u, K, chunk)
    walk = u.new_empty(batch, shapes["num_chunks"], heads, head_dim, state_size, dtype=walk_dtype)
    end = u.new_empty(batch, heads, head_dim, state_size, dtype=torch.float32) if with_end else None
    grid = (cdiv(state_size, blocks.walk_n), cdiv(head_dim, blocks.walk_p), batch * heads)
    _ssd_chunk_walk_kernel[grid](
        u, dt, A, K, segments, start, walk, end,
        **shapes, **stride_args("u", u, "bthp"), **stride_args("dt", dt, "bth"), **stride_args("K", K, "btgn"),
        **stride_args("seg", segments, "bt"), **stride_args("start", start, "bhpn"),
        BLOCK_P=blocks.walk_p, BLOCK_N=blocks.walk_n, REVERSE=reverse, HAS_SEQ=segments is not None,
        HAS_START=start is not None, HAS_END=with_end, PRECISION=dot_precision(u), num_warps=blocks.walk_warps,
    )  # fmt: skip
    return walk, end


def launch_ssd_outputs_fwd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, segments: Tensor | None, states: Tensor,
    y: Tensor, chunk: int, blocks: SSDBlocks,
) -> None:  # fmt: skip
    """Writes y [b, T, H, P] from the chunks' entering states (`launch_ssd_chunk_walk`)."""
    batch, _, heads, head_dim = x.shape
    shapes = shape_args(x, B, chunk)
    grid = (cdiv(head_dim, blocks.out_p), shapes["num_chunks"], batch * heads)
    _ssd_outputs_fwd_kernel[grid](
        x, dt, A, B, C, D, segments, states, y,
        **shapes, **common_strides(x, dt, B, segments), **stride_args("C", C, "btgn"), **stride_args("y", y, "bthp"),
        BLOCK_P=blocks.out_p, BLOCK_N=blocks.out_n, HAS_SEQ=segments is not None, PRECISION=dot_precision(x),
        num_warps=blocks.out_warps,
    )  # fmt: skip
