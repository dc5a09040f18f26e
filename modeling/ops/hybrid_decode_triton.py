"""Triton kernels of the hybrid layer's decode step; references (same signatures) in hybrid_decode.py, whose docstring
has the glossary (B, H, KVH, G, D, W, P, NB, MB, S, E, N) and the exact semantics.

    selective_state_update   one SSM step per decoding request, state updated in its slot.
    hybrid_decode            ONE launch for a batch of decoding requests: the sliding-window attention over vLLM's
                             paged KV cache AND the SSM state update. Inference only: no autograd.

Grid of `hybrid_decode` (1-D, sized from shapes and host ints only, so it is CUDA-graph safe):

    pid in [0, B * KVH * S)             attention: request i, kv head h, split s (s fastest, then h, then i)
    pid in [B * KVH * S, ... + B * EB)   SSM update: request i, channel block e (EB = cdiv(E, BLOCK_E))

The attention programs come first: they are the long ones, and the short SSM programs then fill the SMs while the
last attention programs drain. An attention program packs the G query heads of its kv head into one [BLOCK_G, D]
tile (padded to 16 rows for tl.dot), so each key/value of the window is read once for all of them, and streams its
share of the window in [BLOCK_N, D] tiles with an online softmax (base 2, fp32).

Split-K: with S = num_splits > 1 the window's tiles are shared out between S programs per (request, kv head), for
enough programs to keep HBM busy when B * KVH is small. Each writes its partial (running max, sum, unnormalised
output) to a fp32 workspace and increments a per-(request, kv head) counter; the program that arrives last merges
the S partials, writes the output and resets the counter to zero, all in the same launch. num_splits is a runtime
argument, not a constant of the compilation: it follows the batch size, and a constant would compile a variant per
value while serving (seen on the H200: seconds of compiles in the first mixed batches). The counter must be
zero before the launch: the launcher zeroes a fresh one unless it is handed a persistent zeroed `counters` buffer
(which the kernel leaves zeroed, so one buffer serves launch after launch on one stream: the next layer, the next
CUDA-graph replay).
"""

import functools
import math

import torch
import triton
import triton.language as tl

from .triton_utils import num_sms, softplus


@triton.jit
def _ssm_update_block(
    i_b,
    i_e,
    p_state,
    p_u,
    p_dt,
    p_A,
    p_B,
    p_C,
    p_D,
    p_z,
    p_dt_bias,
    p_state_idx,
    p_has_initial,
    p_out,
    E,
    N,
    s_state_slot,
    s_state_e,
    s_state_n,
    s_u,
    s_dt,
    s_z,
    s_B,
    s_C,
    s_out,
    BLOCK_E: tl.constexpr,
    BLOCK_NS: tl.constexpr,
    HAS_INITIAL_FLAGS: tl.constexpr,
):
    """One SSM step for request `i_b` and channels [i_e * BLOCK_E, (i_e + 1) * BLOCK_E): the body of
    `selective_state_update` and of the SSM programs of `hybrid_decode`. Padding rows (slot < 0) touch no state
    and write zeros; a row whose has_initial_state flag is False starts from a zero state (its request's first
    token), whatever its slot holds."""
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    o_n = tl.arange(0, BLOCK_NS)
    m_e, m_n = o_e < E, o_n < N
    m_en = m_e[:, None] & m_n[None, :]

    slot = tl.load(p_state_idx + i_b).to(tl.int64)
    is_real = slot >= 0
    continues = is_real
    if HAS_INITIAL_FLAGS:
        continues = continues & (tl.load(p_has_initial + i_b) != 0)
    p_slot = p_state + slot * s_state_slot + o_e[:, None] * s_state_e + o_n[None, :] * s_state_n
    b_state = tl.load(p_slot, mask=m_en & continues, other=0.0).to(tl.float32)

    b_u = tl.load(p_u + i_b * s_u + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_dt = tl.load(p_dt + i_b * s_dt + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_z = tl.load(p_z + i_b * s_z + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_B = tl.load(p_B + i_b * s_B + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_C = tl.load(p_C + i_b * s_C + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_A = tl.load(p_A + o_e[:, None] * N + o_n[None, :], mask=m_en, other=0.0)
    b_D = tl.load(p_D + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_dt_bias = tl.load(p_dt_bias + o_e, mask=m_e, other=0.0).to(tl.float32)

    b_dt = softplus(b_dt + b_dt_bias)
    b_state = tl.exp(b_dt[:, None] * b_A) * b_state + (b_dt * b_u)[:, None] * b_B[None, :]
    b_y = tl.sum(b_state * b_C[None, :], axis=1) + b_D * b_u
    b_y = b_y * b_z * tl.sigmoid(b_z)

    tl.store(p_slot, b_state.to(p_state.dtype.element_ty), mask=m_en & is_real)
    tl.store(p_out + i_b * s_out + o_e, tl.where(is_real, b_y, 0.0).to(p_out.dtype.element_ty), mask=m_e)


@triton.jit
def _selective_state_update_kernel(
    p_state,
    p_u,
    p_dt,
    p_A,
    p_B,
    p_C,
    p_D,
    p_z,
    p_dt_bias,
    p_state_idx,
    p_has_initial,
    p_out,
    E,
    N,
    s_state_slot,
    s_state_e,
    s_state_n,
    s_u,
    s_dt,
    s_z,
    s_B,
    s_C,
    s_out,
    BLOCK_E: tl.constexpr,
    BLOCK_NS: tl.constexpr,
    HAS_INITIAL_FLAGS: tl.constexpr,
):
    _ssm_update_block(
        tl.program_id(0),
        tl.program_id(1),
        p_state,
        p_u,
        p_dt,
        p_A,
        p_B,
        p_C,
        p_D,
        p_z,
        p_dt_bias,
        p_state_idx,
        p_has_initial,
        p_out,
        E,
        N,
        s_state_slot,
        s_state_e,
        s_state_n,
        s_u,
        s_dt,
        s_z,
        s_B,
        s_C,
        s_out,
        BLOCK_E,
        BLOCK_NS,
        HAS_INITIAL_FLAGS,
    )


@triton.jit
def _window_attention_split(
    pid,
    p_q,
    p_k,
    p_v,
    p_block_table,
    p_seq_lens,
    p_o,
    p_part_o,
    p_part_ml,
    p_counters,
    qk_scale,
    window,
    KVH,
    G,
    s_q_b,
    s_q_h,
    s_k_blk,
    s_k_pos,
    s_k_h,
    s_k_d,
    s_v_blk,
    s_v_pos,
    s_v_h,
    s_v_d,
    s_bt,
    s_o_b,
    s_o_h,
    num_splits,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Window attention of one (request, kv head, split) program of `hybrid_decode`: the G query heads of kv head
    `i_h` against this split's tiles of the window. Keys outside [start, seq_len) are masked, never loaded, so
    blocks freed before the window (null blocks) are never read."""
    i_s = pid % num_splits
    i_h = (pid // num_splits) % KVH
    i_b = pid // (num_splits * KVH)

    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_g, m_d = o_g < G, o_d < HEAD_DIM
    m_gd = m_g[:, None] & m_d[None, :]
    o_heads = i_h * G + o_g  # query heads served by kv head i_h
    b_q = tl.load(p_q + i_b.to(tl.int64) * s_q_b + o_heads[:, None] * s_q_h + o_d[None, :], mask=m_gd, other=0.0)

    seq_len = tl.load(p_seq_lens + i_b)
    start = tl.maximum(seq_len - window, 0)
    # Tiles are aligned to multiples of BLOCK_N positions; this split owns a contiguous run of them.
    tile_lo = start // BLOCK_N
    tile_hi = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
    split_lo = tile_lo + i_s * tiles_per_split
    split_hi = tl.minimum(split_lo + tiles_per_split, tile_hi)

    p_pages = p_block_table + i_b.to(tl.int64) * s_bt
    p_k_head = p_k + i_h * s_k_h
    p_v_head = p_v + i_h * s_v_h
    b_m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_G], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for i_t in tl.range(split_lo, split_hi):
        o_pos = i_t * BLOCK_N + tl.arange(0, BLOCK_N)
        m_pos = (o_pos >= start) & (o_pos < seq_len)
        m_kv = m_pos[:, None] & m_d[None, :]
        b_page = tl.load(p_pages + o_pos // PAGE_SIZE, mask=m_pos, other=0).to(tl.int64)
        o_slot = o_pos % PAGE_SIZE
        p_keys = p_k_head + (b_page * s_k_blk + o_slot * s_k_pos)[:, None] + o_d[None, :] * s_k_d
        b_k = tl.load(p_keys, mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        b_s = tl.where(m_pos[None, :], b_s, float("-inf"))
        # Every tile of the range holds at least one key of the window, so b_m_new is finite.
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp2(b_m - b_m_new)
        b_p = tl.exp2(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        p_values = p_v_head + (b_page * s_v_blk + o_slot * s_v_pos)[:, None] + o_d[None, :] * s_v_d
        b_v = tl.load(p_values, mask=m_kv, other=0.0)  # [BLOCK_N, BLOCK_D]
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_m = b_m_new

    p_out = p_o + i_b.to(tl.int64) * s_o_b + o_heads[:, None] * s_o_h + o_d[None, :]
    if not SPLIT_K:
        # An empty window (seq_len == 0: CUDA-graph padding) has b_l == 0 and b_acc == 0: it writes zeros.
        b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
        tl.store(p_out, b_o.to(p_o.dtype.element_ty), mask=m_gd)
    else:
        # Partials of (request, kv head) are [num_splits, G, D] (output) and [num_splits, 2, G] (max, sum), fp32.
        i_pair = i_b * KVH + i_h
        p_part_o_pair = p_part_o + i_pair.to(tl.int64) * num_splits * G * HEAD_DIM
        p_part_ml_pair = p_part_ml + i_pair.to(tl.int64) * num_splits * 2 * G
        o_gd = o_g[:, None] * HEAD_DIM + o_d[None, :]
        tl.store(p_part_o_pair + i_s * G * HEAD_DIM + o_gd, b_acc, mask=m_gd)
        tl.store(p_part_ml_pair + i_s * 2 * G + o_g, b_m, mask=m_g)
        tl.store(p_part_ml_pair + i_s * 2 * G + G + o_g, b_l, mask=m_g)
        # Release: the barrier orders every thread's partial stores before the counter increment (acq_rel, gpu
        # scope); the last program's acquire then sees all num_splits partials (loaded bypassing L1: .cg).
        tl.debug_barrier()
        n_before = tl.atomic_add(p_counters + i_pair, 1, sem="acq_rel", scope="gpu")
        if n_before == num_splits - 1:
            tl.store(p_counters + i_pair, 0)  # every split has arrived: ready for the next launch
            b_m_all = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
            b_l_all = tl.zeros([BLOCK_G], dtype=tl.float32)
            b_acc_all = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
            for i_p in tl.range(0, num_splits):
                p_ml = p_part_ml_pair + i_p * 2 * G + o_g
                b_m_p = tl.load(p_ml, mask=m_g, other=float("-inf"), cache_modifier=".cg")
                b_l_p = tl.load(p_ml + G, mask=m_g, other=0.0, cache_modifier=".cg")
                p_acc = p_part_o_pair + i_p * G * HEAD_DIM + o_gd
                b_acc_p = tl.load(p_acc, mask=m_gd, other=0.0, cache_modifier=".cg")
                # Splits without keys carry a max of -inf: a finite reference max keeps exp2 away from -inf - -inf.
                b_m_new = tl.maximum(b_m_all, b_m_p)
                b_m_ref = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
                b_alpha = tl.exp2(b_m_all - b_m_ref)
                b_beta = tl.exp2(b_m_p - b_m_ref)
                b_l_all = b_l_all * b_alpha + b_l_p * b_beta
                b_acc_all = b_acc_all * b_alpha[:, None] + b_acc_p * b_beta[:, None]
                b_m_all = b_m_new
            b_o = b_acc_all / tl.where(b_l_all > 0, b_l_all, 1.0)[:, None]
            tl.store(p_out, b_o.to(p_o.dtype.element_ty), mask=m_gd)


# One compilation for every batch size and split count: the split count only picks SPLIT_K (split or not).
@triton.jit(do_not_specialize=["num_attn_programs", "num_splits"])
def _hybrid_decode_kernel(
    # attention
    p_q,
    p_k,
    p_v,
    p_block_table,
    p_seq_lens,
    p_o,
    p_part_o,
    p_part_ml,
    p_counters,
    qk_scale,
    window,
    KVH,
    G,
    s_q_b,
    s_q_h,
    s_k_blk,
    s_k_pos,
    s_k_h,
    s_k_d,
    s_v_blk,
    s_v_pos,
    s_v_h,
    s_v_d,
    s_bt,
    s_o_b,
    s_o_h,
    # SSM
    p_state,
    p_u,
    p_dt,
    p_A,
    p_B,
    p_C,
    p_D,
    p_z,
    p_dt_bias,
    p_state_idx,
    p_has_initial,
    p_ssm_out,
    E,
    N,
    s_state_slot,
    s_state_e,
    s_state_n,
    s_u,
    s_dt,
    s_z,
    s_B,
    s_C,
    s_ssm_out,
    # grid split
    num_attn_programs,
    num_e_blocks,
    num_splits,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_NS: tl.constexpr,
    HAS_INITIAL_FLAGS: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_attn_programs:
        _window_attention_split(
            pid,
            p_q,
            p_k,
            p_v,
            p_block_table,
            p_seq_lens,
            p_o,
            p_part_o,
            p_part_ml,
            p_counters,
            qk_scale,
            window,
            KVH,
            G,
            s_q_b,
            s_q_h,
            s_k_blk,
            s_k_pos,
            s_k_h,
            s_k_d,
            s_v_blk,
            s_v_pos,
            s_v_h,
            s_v_d,
            s_bt,
            s_o_b,
            s_o_h,
            num_splits,
            HEAD_DIM,
            PAGE_SIZE,
            SPLIT_K,
            BLOCK_G,
            BLOCK_N,
            BLOCK_D,
            DOT_PRECISION,
        )
    else:
        pid_ssm = pid - num_attn_programs
        _ssm_update_block(
            pid_ssm // num_e_blocks,
            pid_ssm % num_e_blocks,
            p_state,
            p_u,
            p_dt,
            p_A,
            p_B,
            p_C,
            p_D,
            p_z,
            p_dt_bias,
            p_state_idx,
            p_has_initial,
            p_ssm_out,
            E,
            N,
            s_state_slot,
            s_state_e,
            s_state_n,
            s_u,
            s_dt,
            s_z,
            s_B,
            s_C,
            s_ssm_out,
            BLOCK_E,
            BLOCK_NS,
            HAS_INITIAL_FLAGS,
        )


@functools.cache
def _pick_ssm_block_e(num_channels: int, state_size: int) -> int:
    """Channels per SSM program: a [BLOCK_E, N] fp32 state block of about 2048 values (16 per thread at 4 warps)."""
    return min(triton.next_power_of_2(num_channels), max(1, 2048 // triton.next_power_of_2(state_size)))


def _pick_attention_config(
    num_decodes: int, num_kv_heads: int, head_dim: int, max_keys: int, device: torch.device
) -> dict:
    """Launch defaults of `hybrid_decode`'s attention: [BLOCK_N, D] tiles of 16 KiB in bf16 at D = 128. Split-K only
    when there are fewer than two (request, kv head) pairs per SM: then about four programs per SM, each split
    keeping at least four tiles of the window (below that the merge costs more than the parallelism brings)."""
    block_n = 64 if head_dim >= 128 else 128
    pairs = max(1, num_decodes * num_kv_heads)
    sms = num_sms(device)
    splits = 1
    if pairs < 2 * sms:
        splits = max(1, min(triton.cdiv(4 * sms, pairs), triton.cdiv(max_keys, block_n) // 4))
    return {"block_n": block_n, "num_splits": splits, "num_warps": 4, "num_stages": 2}


def _check_ssm_args(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, out, has_initial_state) -> None:
    num_decodes, num_channels = u.shape
    state_size = A.shape[-1]
    for name, x in (("u", u), ("dt", dt), ("z", z), ("out", out)):
        if x.shape != (num_decodes, num_channels):
            raise ValueError(f"{name}: expected {(num_decodes, num_channels)}, got {x.shape}")
    for name, x in (("B", B), ("C", C)):
        if x.shape != (num_decodes, state_size):
            raise ValueError(f"{name}: expected {(num_decodes, state_size)}, got {x.shape}")
    for name, x in (("u", u), ("dt", dt), ("z", z), ("out", out), ("B", B), ("C", C)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous (row-strided views are fine)")
    if not (A.shape == (num_channels, state_size) and A.dtype == torch.float32 and A.is_contiguous()):
        raise ValueError(f"A: expected contiguous fp32 {(num_channels, state_size)}, got {A.dtype} {A.shape}")
    for name, x in (("D", D), ("dt_bias", dt_bias)):
        if not (x.shape == (num_channels,) and x.is_contiguous()):
            raise ValueError(f"{name}: expected contiguous ({num_channels},)")
    if not (ssm_state.dim() == 3 and ssm_state.shape[1:] == (num_channels, state_size)):
        raise ValueError(f"ssm_state: expected [slots, {num_channels}, {state_size}], got {ssm_state.shape}")
    if ssm_state.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"ssm_state: expected fp32, bf16 or fp16, got {ssm_state.dtype}")
    if not (state_indices.shape == (num_decodes,) and state_indices.dtype == torch.int32):
        raise ValueError(
            f"state_indices: expected int32 ({num_decodes},), got {state_indices.dtype} {state_indices.shape}"
        )
    if not state_indices.is_contiguous():
        raise ValueError("state_indices: must be contiguous")
    if not (
        has_initial_state is None
        or (
            has_initial_state.shape == (num_decodes,)
            and has_initial_state.dtype == torch.bool
            and has_initial_state.is_contiguous()
        )
    ):
        raise ValueError(f"has_initial_state: expected a contiguous bool ({num_decodes},) or None")


def _ssm_args(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, out, has_initial_state) -> tuple:
    """Pointers, sizes and strides in the order `_ssm_update_block` takes them (state_indices stands in for an absent
    has_initial_state: HAS_INITIAL_FLAGS=False never reads it)."""
    flags = state_indices if has_initial_state is None else has_initial_state
    return (
        *(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, flags, out),
        *(u.shape[1], A.shape[1]),
        *ssm_state.stride(),
        *(u.stride(0), dt.stride(0), z.stride(0), B.stride(0), C.stride(0), out.stride(0)),
    )


def selective_state_update(
    ssm_state: torch.Tensor,
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor,
    *,
    has_initial_state: torch.Tensor | None = None,
    block_e: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """One selective-scan step per decoding request, state updated in its slot; same contract as
    `selective_state_update_ref` (hybrid_decode.py): ssm_state [S, E, N] (fp32/bf16/fp16, any strides); u, dt, z
    [B, E] and B, C [B, N] (row-strided views allowed); A [E, N] fp32; D, dt_bias [E]; state_indices [B] int32 (-1 =
    padding: no state touched, zeros written); out [B, E]; has_initial_state [B] bool or None (False: start from a
    zero state). `dt` is the raw dt_proj output, softplus(dt + dt_bias) is taken here. One launch, no host sync:
    CUDA-graph safe. Returns `out`."""
    _check_ssm_args(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, out, has_initial_state)
    num_decodes, num_channels = u.shape
    state_size = A.shape[1]
    block_e = block_e or _pick_ssm_block_e(num_channels, state_size)
    if num_decodes == 0:  # an empty grid is not a valid launch
        return out
    grid = (num_decodes, triton.cdiv(num_channels, block_e))
    _selective_state_update_kernel[grid](
        *_ssm_args(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, out, has_initial_state),
        BLOCK_E=block_e,
        BLOCK_NS=triton.next_power_of_2(state_size),
        HAS_INITIAL_FLAGS=has_initial_state is not None,
        num_warps=num_warps,
    )
    return out


def hybrid_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    attn_out: torch.Tensor,
    ssm_state: torch.Tensor,
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    ssm_out: torch.Tensor,
    *,
    block_n: int | None = None,
    num_splits: int | None = None,
    block_e: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    counters: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode step of a hybrid layer in one launch: window attention over the paged KV cache and the SSM state
    update. Same contract as `hybrid_decode_ref` (hybrid_decode.py):

        query [B, H, D] (RoPE applied; head stride free, last dim contiguous); key_cache, value_cache [NB, P, KVH, D]
        with any strides (e.g. vLLM's Triton layout `kv_cache.transpose(1, 2).split(D, dim=-1)`); block_table
        [B, MB] int32; seq_lens [B] int32 (0 = padding row: zeros written); scale; window W or None;
        attn_out [B, H, D]; the SSM arguments as in `selective_state_update`.

    Tuning (defaults from `_pick_attention_config` / `_pick_ssm_block_e`): block_n keys per tile, num_splits
    programs per (request, kv head), block_e channels per SSM program, num_warps, num_stages. `counters`: an int32
    buffer of at least B * KVH zeros, left zeroed by the kernel; pass a persistent one to avoid zeroing a fresh one
    (a memset launch) on every call when num_splits > 1. The grid depends only on shapes and host ints: CUDA-graph
    safe. Returns (attn_out, ssm_out)."""
    num_decodes, num_heads, head_dim = query.shape
    num_blocks, page_size, num_kv_heads, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"query: {num_heads} heads is not a multiple of {num_kv_heads} kv heads")
    for name, x in (("key_cache", key_cache), ("value_cache", value_cache)):
        if x.shape != (num_blocks, page_size, num_kv_heads, head_dim):
            raise ValueError(f"{name}: expected {(num_blocks, page_size, num_kv_heads, head_dim)}, got {x.shape}")
        if x.dtype != query.dtype:
            raise ValueError(f"{name}: dtype {x.dtype} differs from the query's {query.dtype}")
    if attn_out.shape != query.shape:
        raise ValueError(f"attn_out: expected {query.shape}, got {attn_out.shape}")
    for name, x in (("query", query), ("attn_out", attn_out)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: the head dim must be contiguous")
    if not (block_table.dim() == 2 and block_table.shape[0] == num_decodes and block_table.dtype == torch.int32):
        raise ValueError(
            f"block_table: expected int32 [{num_decodes}, max_blocks], got {block_table.dtype} {block_table.shape}"
        )
    if block_table.stride(-1) != 1:
        raise ValueError("block_table: rows must be contiguous")
    if not (seq_lens.shape == (num_decodes,) and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()):
        raise ValueError(
            f"seq_lens: expected contiguous int32 ({num_decodes},), got {seq_lens.dtype} {seq_lens.shape}"
        )
    if window is not None and window < 1:
        raise ValueError(f"window: expected None or >= 1, got {window}")
    if u.shape[0] != num_decodes:
        raise ValueError(f"u: expected {num_decodes} rows (one per decoding request), got {u.shape[0]}")
    _check_ssm_args(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_out, has_initial_state)

    max_keys = block_table.shape[1] * page_size
    window_keys = max_keys if window is None else min(window, max_keys)
    config = _pick_attention_config(num_decodes, num_kv_heads, head_dim, window_keys, query.device)
    block_n = block_n or config["block_n"]
    splits = num_splits or config["num_splits"]
    num_channels, state_size = u.shape[1], A.shape[1]
    block_e = block_e or _pick_ssm_block_e(num_channels, state_size)
    group = num_heads // num_kv_heads
    if not (block_n >= 16 and block_n & (block_n - 1) == 0):
        raise ValueError(f"block_n: expected a power of two >= 16, got {block_n}")
    if num_decodes == 0:  # an empty grid is not a valid launch
        return attn_out, ssm_out

    num_pairs = num_decodes * num_kv_heads
    if splits > 1:
        part_o = query.new_empty(num_pairs * splits * group * head_dim, dtype=torch.float32)
        part_ml = query.new_empty(num_pairs * splits * 2 * group, dtype=torch.float32)
        if counters is None:
            counters = torch.zeros(num_pairs, dtype=torch.int32, device=query.device)
        if not (
            counters.dtype == torch.int32
            and counters.numel() >= num_pairs
            and counters.is_contiguous()
            and counters.device == query.device
        ):
            raise ValueError(
                f"counters: expected a contiguous int32 buffer of at least {num_pairs} zeros on {query.device}"
            )
    else:  # never dereferenced: without split-K the programs write attn_out directly
        part_o = part_ml = counters = attn_out
    num_attn_programs = num_pairs * splits
    num_e_blocks = triton.cdiv(num_channels, block_e)
    grid = (num_attn_programs + num_decodes * num_e_blocks,)
    _hybrid_decode_kernel[grid](
        *(query, key_cache, value_cache, block_table, seq_lens, attn_out, part_o, part_ml, counters),
        scale * math.log2(math.e),  # softmax in base 2
        2**31 - 1 if window is None else window,
        *(num_kv_heads, group),
        *query.stride()[:2],
        *key_cache.stride(),
        *value_cache.stride(),
        block_table.stride(0),
        *attn_out.stride()[:2],
        *_ssm_args(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_out, has_initial_state),
        num_attn_programs,
        num_e_blocks,
        splits,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        SPLIT_K=splits > 1,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        # fp32 caches: exact FMA products. Decode streams the KV window (memory-bound), so the FMAs cost nothing that
        # shows; the compute-bound prefill kernel (paged_attention_triton) takes tf32x3 on the tensor cores instead.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        BLOCK_E=block_e,
        BLOCK_NS=triton.next_power_of_2(state_size),
        HAS_INITIAL_FLAGS=has_initial_state is not None,
        num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"],
    )
    return attn_out, ssm_out
