"""Triton kernels of the causal depthwise conv1d (references with the same signatures in causal_conv1d.py).

Public functions:
    causal_conv1d_fn           training: [B, T, E] -> [B, T, E], autograd (grads for x, weight, bias); rows may pack
                               several sequences (`seq_idx`, padding-free training).
    causal_conv1d_varlen_fwd   serving prefills: packed [T, E] sequences continuing from / updating the conv cache.
    causal_conv1d_update       serving decode: one token per request, CUDA-graph safe.

Layout: token-major, E is the contiguous dimension, so every tile [BLOCK_T, BLOCK_E] is read with coalesced rows.
A program's inputs are one [BLOCK_T + K - 1, BLOCK_E] window, read as K row-shifted [BLOCK_T, BLOCK_E] tiles (Triton
cannot shift the rows of a register tile): the window comes from DRAM once, the overlapping rows are L1/L2 hits.
All math in fp32; outputs are cast once, at the store.

Packed training rows (HAS_SEQ_IDX): seq_idx [B, T] int32 names each token's sequence. Every shifted input tile is
masked where its source row's seq_idx differs from its output row's (the history counts as seq_idx[0]), in
`_load_inputs`, which the forward, the backward's silu recompute and dweight's input tiles all go through; dx masks its
g tiles by the same rule seen from the input side (x_s feeds g_{s+i} only if seq_idx[s+i] == seq_idx[s]). Without
seq_idx the flag is off and none of this is in the compiled code.
"""

import torch
import triton
import triton.language as tl

from .causal_conv1d import check_activation


def _pick_blocks(num_channels: int, num_rows: int, max_block_t: int, max_block_e: int, per_thread: int):
    """(BLOCK_T, BLOCK_E, num_warps) for a [BLOCK_T, BLOCK_E] tile with about `per_thread` elements per thread.

    128 channels (256 B of bf16) per tile row. Elements per thread measured on the H200 (`bench_kernels.py --only
    sweep`, B=4 T=4096 E=1024, 2026-11-29): 4 warps per tile beat 8 and 16 everywhere (forward 32x128 tiles: 34 us
    against 48 us at 8 warps; backward 16x128: 0.29 ms against 0.91 ms at 16 warps), so the forward takes 32
    elements per thread and the backward, which holds 2K-1 x tiles and K dy tiles at once, 16."""
    block_e = min(max_block_e, triton.next_power_of_2(max(num_channels, 1)))
    block_t = min(max_block_t, triton.next_power_of_2(max(num_rows, 1)))
    num_warps = max(1, min(16, block_t * block_e // (32 * per_thread)))
    return block_t, block_e, num_warps


# ---------------------------------------------------------------------------------------------------------------------
# Shared jit helpers
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _load_seq_idx(p_seq_idx, o_src, T):
    """seq_idx [BLOCK_T] int32 of source rows o_src of a packed row: rows before 0 (the history) read seq_idx[0], rows
    from T on get -1 (their inputs and g are zeros, whatever they match)."""
    return tl.load(p_seq_idx + tl.maximum(o_src, 0), mask=o_src < T, other=-1)


@triton.jit
def _load_inputs(
    p_x,
    p_hist,
    p_seq_idx,
    b_seq_dst,
    o_t,
    o_e,
    m_e,
    b_bos,
    T,
    m_hist_rows,
    o_hist,
    s_x_t,
    s_x_e,
    s_h_e,
    s_h_k,
    SHIFT: tl.constexpr,
    K: tl.constexpr,
    HAS_HISTORY: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
):
    """Inputs at rows o_t + SHIFT of the sequence extended by its history, fp32 [BLOCK_T, BLOCK_E]: x rows from the
    sequence start b_bos on (below T); before it, history entry K-1 + (row - b_bos) at p_hist + o_hist (rows
    m_hist_rows), else zeros. Masks and pointers depend on the source row only, so two loads of one row in a kernel
    are the same IR and the compiler merges them. With HAS_SEQ_IDX (training only: b_bos is 0) the tile is then zeroed
    on rows whose sequence (`_load_seq_idx`) is not b_seq_dst [BLOCK_T], the sequence of the output rows they feed:
    a select after the load, so the loads themselves still merge."""
    o_src = o_t + SHIFT
    m_x = ((o_src >= b_bos) & (o_src < T))[:, None] & m_e[None, :]
    p_in = p_x + o_src.to(tl.int64)[:, None] * s_x_t + o_e[None, :] * s_x_e
    b_in = tl.load(p_in, mask=m_x, other=0.0).to(tl.float32)
    if HAS_HISTORY:
        m_h = ((o_src < b_bos) & m_hist_rows)[:, None] & m_e[None, :]
        p_h = p_hist + o_hist[:, None] + o_e[None, :] * s_h_e + (K - 1 + o_src - b_bos)[:, None] * s_h_k
        b_in += tl.load(p_h, mask=m_h, other=0.0).to(tl.float32)
    if HAS_SEQ_IDX:
        b_in = tl.where((_load_seq_idx(p_seq_idx, o_src, T) == b_seq_dst)[:, None], b_in, 0.0)
    return b_in


@triton.jit
def _conv_rows(
    p_x,
    p_w,
    p_bias,
    p_hist,
    p_seq_idx,
    o_t,
    o_e,
    m_e,
    b_bos,
    T,
    m_hist_rows,
    o_hist,
    s_x_t,
    s_x_e,
    s_w_e,
    s_w_k,
    s_h_e,
    s_h_k,
    SHIFT: tl.constexpr,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_HISTORY: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
):
    """Pre-activation conv output at rows o_t + SHIFT, fp32 [BLOCK_T, BLOCK_E] (`_load_inputs` for the arguments);
    with HAS_SEQ_IDX each tap reads only inputs of its output row's sequence."""
    b_seq_dst = o_t  # not read without seq_idx
    if HAS_SEQ_IDX:
        b_seq_dst = _load_seq_idx(p_seq_idx, o_t + SHIFT, T)
    b_acc = tl.zeros([o_t.shape[0], o_e.shape[0]], dtype=tl.float32)
    for k in tl.static_range(K):
        b_in = _load_inputs(
            p_x, p_hist, p_seq_idx, b_seq_dst, o_t, o_e, m_e, b_bos, T, m_hist_rows, o_hist,
            s_x_t, s_x_e, s_h_e, s_h_k, SHIFT + k - (K - 1), K, HAS_HISTORY, HAS_SEQ_IDX,
        )  # fmt: skip
        b_w = tl.load(p_w + o_e * s_w_e + k * s_w_k, mask=m_e, other=0.0).to(tl.float32)
        b_acc += b_in * b_w[None, :]
    if HAS_BIAS:
        b_acc += tl.load(p_bias + o_e, mask=m_e, other=0.0).to(tl.float32)[None, :]
    return b_acc


@triton.jit
def _find_sequence(p_cu_seqlens, o_t, num_seqs, search_steps):
    """Sequence s of each packed row, cu_seqlens[s] <= row < cu_seqlens[s+1] (the last sequence for rows past the end):
    a branch-free binary search of ceil(log2(num_seqs)) steps, so no host-side row -> sequence map is needed."""
    b_lo = tl.zeros_like(o_t)
    b_hi = b_lo + num_seqs
    for _ in range(search_steps):
        b_mid = (b_lo + b_hi) // 2
        m_right = tl.load(p_cu_seqlens + b_mid) <= o_t
        b_lo = tl.where(m_right, b_mid, b_lo)
        b_hi = tl.where(m_right, b_hi, b_mid)
    return b_lo


# ---------------------------------------------------------------------------------------------------------------------
# Forward over sequences: training batches [B, T, E] and packed serving prefills [T, E]
# ---------------------------------------------------------------------------------------------------------------------


# One compilation for every batch shape; the prefills' slots come as a slice past the decodes' (vLLM's Mamba metadata),
# at an alignment that changes with the number of decodes: not specialized on.
@triton.jit(do_not_specialize=["T", "num_seqs", "search_steps"], do_not_specialize_on_alignment=["p_state_indices"])
def _causal_conv1d_fwd_kernel(
    p_x,
    p_w,
    p_bias,
    p_hist,
    p_y,
    p_cu_seqlens,
    p_state_indices,
    p_has_initial_state,
    p_seq_idx,
    T,
    E,
    num_seqs,
    search_steps,
    s_x_b,
    s_x_t,
    s_x_e,
    s_w_e,
    s_w_k,
    s_h_b,
    s_h_e,
    s_h_k,
    s_y_b,
    s_y_t,
    s_y_e,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_HISTORY: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """y = act(conv(x) + bias) for one [BLOCK_T, BLOCK_E] tile; `causal_conv1d_ref` / `causal_conv1d_varlen_ref`.

    Training (IS_VARLEN False): program (i_t, i_e, i_b) owns rows i_t*BLOCK_T.. of batch row i_b of x [B, T, E];
    history [B, E, K-1] when HAS_HISTORY; with HAS_SEQ_IDX the batch row packs the sequences of seq_idx [B, T]
    (contiguous int32), and a tap reads only inputs of its output token's sequence. Serving (IS_VARLEN True): program
    (i_t, i_e, 0) owns packed rows i_t*BLOCK_T.. of x [T, E], which may span several sequences; each row reads the
    history of its sequence's slot in conv_state [slots, E, K-1] (p_hist) if has_initial_state. Rows of padding
    sequences (slot -1) and rows past cu_seqlens[-1] get zeros. This kernel only reads the cache (see
    `_varlen_conv_state_kernel`).
    """
    tl.static_assert(not (IS_VARLEN and HAS_SEQ_IDX), "serving prefills delimit sequences by cu_seqlens")
    i_t, i_e, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    m_e = o_e < E
    m_store = o_t < T
    if IS_VARLEN:
        i_seq = _find_sequence(p_cu_seqlens, o_t, num_seqs, search_steps)
        b_bos = tl.load(p_cu_seqlens + i_seq)
        b_slot = tl.load(p_state_indices + i_seq)
        m_rows = m_store & (o_t < tl.load(p_cu_seqlens + num_seqs)) & (b_slot >= 0)
        m_hist_rows = m_rows & (tl.load(p_has_initial_state + i_seq) != 0)
        o_hist = b_slot.to(tl.int64) * s_h_b
    else:
        p_x += i_b.to(tl.int64) * s_x_b
        p_y += i_b.to(tl.int64) * s_y_b
        p_hist += i_b.to(tl.int64) * s_h_b
        if HAS_SEQ_IDX:
            p_seq_idx += i_b.to(tl.int64) * T
        b_bos = 0
        m_rows = m_store
        m_hist_rows = m_rows
        o_hist = tl.zeros([BLOCK_T], dtype=tl.int64)

    b_y = _conv_rows(
        p_x, p_w, p_bias, p_hist, p_seq_idx, o_t, o_e, m_e, b_bos, T, m_hist_rows, o_hist,
        s_x_t, s_x_e, s_w_e, s_w_k, s_h_e, s_h_k, 0, K, HAS_BIAS, HAS_HISTORY, HAS_SEQ_IDX,
    )  # fmt: skip
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)
    b_y = tl.where(m_rows[:, None], b_y, 0.0)
    p_out = p_y + o_t.to(tl.int64)[:, None] * s_y_t + o_e[None, :] * s_y_e
    tl.store(p_out, b_y.to(p_y.dtype.element_ty), mask=m_store[:, None] & m_e[None, :])


@triton.jit
def _causal_conv1d_bwd_kernel(
    p_x,
    p_w,
    p_bias,
    p_hist,
    p_dy,
    p_dx,
    p_dw,
    p_dbias,
    p_seq_idx,
    T,
    E,
    rows_per_program,
    s_x_b,
    s_x_t,
    s_x_e,
    s_w_e,
    s_w_k,
    s_h_b,
    s_h_e,
    s_h_k,
    s_dy_b,
    s_dy_t,
    s_dy_e,
    s_dx_b,
    s_dx_t,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_HISTORY: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
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
        p_out = p_dx + o_t.to(tl.int64)[:, None] * s_dx_t + o_e[None, :]
        tl.store(p_out, b_dx.to(p_dx.dtype.element_ty), mask=m_t[:, None] & m_e[None, :])

    i_partial = (i_b * tl.num_programs(0) + i_c).to(tl.int64)
    p_dw_out = p_dw + i_partial * K * E + o_k[:, None] * E + o_e[None, :]
    tl.store(p_dw_out, b_dw, mask=(o_k < K)[:, None] & m_e[None, :])
    if HAS_BIAS:
        tl.store(p_dbias + i_partial * E + o_e, b_dbias, mask=m_e)


def _check_weights(weight: torch.Tensor, bias: torch.Tensor | None, num_channels: int) -> int:
    if weight.dim() != 2 or weight.shape[0] != num_channels:
        raise ValueError(
            f"weight must be [E={num_channels}, K] (squeeze the nn.Conv1d weight), got {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (num_channels,):
        raise ValueError(f"bias must be [E={num_channels}], got {tuple(bias.shape)}")
    return weight.shape[1]


def _check_training_inputs(x, weight, bias, initial_history) -> int:
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, E], got {tuple(x.shape)}")
    batch_size, _, num_channels = x.shape
    width = _check_weights(weight, bias, num_channels)
    if initial_history is not None and initial_history.shape != (batch_size, num_channels, width - 1):
        raise ValueError(
            f"initial_history must be [B, E, K-1] = {(batch_size, num_channels, width - 1)}, "
            f"got {tuple(initial_history.shape)}"
        )
    return width


def _check_seq_idx(seq_idx: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """seq_idx as the kernels read it: a contiguous [B, T] int32 on x's device (a no-op when it already is one)."""
    if seq_idx is None:
        return None
    if seq_idx.shape != x.shape[:2] or seq_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"seq_idx must be an int32 or int64 [B, T] = {tuple(x.shape[:2])}, got {tuple(seq_idx.shape)} "
            f"{seq_idx.dtype}"
        )
    if seq_idx.device != x.device:
        raise ValueError(f"seq_idx must be on x's device {x.device}, got {seq_idx.device}")
    return seq_idx.to(torch.int32).contiguous()


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_history: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    seq_idx: torch.Tensor | None = None,
    block_t: int | None = None,
    block_e: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Forward launcher of `causal_conv1d_fn`: x [B, T, E] (any strides: the `xs` half of the in_proj output is read in
    place), weight [E, K], bias [E] or None, initial_history [B, E, K-1] or None, seq_idx [B, T] int32/int64 or None.
    Returns y [B, T, E] contiguous in x.dtype (written into `out` when given)."""
    check_activation(activation)
    width = _check_training_inputs(x, weight, bias, initial_history)
    seq_idx = _check_seq_idx(seq_idx, x)
    batch_size, seq_len, num_channels = x.shape
    if out is None:
        out = torch.empty((batch_size, seq_len, num_channels), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if x.numel() == 0:
        return out
    if initial_history is None:
        default_t, default_e, default_warps = _pick_blocks(num_channels, seq_len, 32, 128, per_thread=32)
    else:  # the history [B, E, K-1] is strided along E, a 64-bit pointer per element: fewer elements per thread
        default_t, default_e, default_warps = _pick_blocks(num_channels, seq_len, 16, 128, per_thread=4)
    block_t, block_e, num_warps = block_t or default_t, block_e or default_e, num_warps or default_warps
    hist = initial_history if initial_history is not None else x  # a valid pointer, never read without history
    hist_strides = initial_history.stride() if initial_history is not None else (0, 0, 0)
    grid = (triton.cdiv(seq_len, block_t), triton.cdiv(num_channels, block_e), batch_size)
    _causal_conv1d_fwd_kernel[grid](
        x, weight, bias, hist, out, None, None, None, seq_idx,
        seq_len, num_channels, 0, 0,
        *x.stride(), *weight.stride(), *hist_strides, *out.stride(),
        K=width,
        HAS_BIAS=bias is not None,
        HAS_HISTORY=initial_history is not None,
        IS_VARLEN=False,
        HAS_SEQ_IDX=seq_idx is not None,
        SILU=activation == "silu",
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=num_warps,
    )  # fmt: skip
    return out


def causal_conv1d_bwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dy: torch.Tensor,
    activation: str | None = "silu",
    initial_history: torch.Tensor | None = None,
    *,
    seq_idx: torch.Tensor | None = None,
    block_t: int | None = None,
    block_e: int | None = None,
    num_warps: int | None = None,
    rows_per_program: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward launcher of `causal_conv1d_fn` (the forward's arguments, and dy [B, T, E]): returns (dx [B, T, E]
    contiguous in x.dtype, dweight [E, K] in weight.dtype, dbias [E] in bias.dtype or None).

    dweight and dbias are sums over B and T. Each program writes fp32 partial sums for its (batch row, row range,
    channel block) and torch adds them up: deterministic (fp32 atomics would make every run differ in the last bits)
    and cheap, since each program walks `rows_per_program` rows (default: enough programs to fill the GPU a few times
    over, about 1024) so the partials stay a few MB at most.
    """
    check_activation(activation)
    width = _check_training_inputs(x, weight, bias, initial_history)
    if dy.shape != x.shape:
        raise ValueError(f"dy must be {tuple(x.shape)}, got {tuple(dy.shape)}")
    seq_idx = _check_seq_idx(seq_idx, x)
    batch_size, seq_len, num_channels = x.shape
    default_t, default_e, default_warps = _pick_blocks(num_channels, seq_len, 16, 128, per_thread=16)
    block_t, block_e, num_warps = block_t or default_t, block_e or default_e, num_warps or default_warps
    num_e_blocks = triton.cdiv(num_channels, block_e)
    if rows_per_program is None:
        num_row_ranges = max(1, min(triton.cdiv(seq_len, block_t), triton.cdiv(1024, batch_size * num_e_blocks)))
        rows_per_program = triton.cdiv(triton.cdiv(seq_len, num_row_ranges), block_t) * block_t
    if rows_per_program % block_t:
        raise ValueError(f"rows_per_program ({rows_per_program}) must be a multiple of block_t ({block_t})")
    num_row_ranges = triton.cdiv(seq_len, rows_per_program) if seq_len else 0

    dx = torch.empty((batch_size, seq_len, num_channels), dtype=x.dtype, device=x.device)
    # every (batch row, row range) row of the partials is written by the programs of its channel blocks
    dw_partial = x.new_empty((batch_size * num_row_ranges, width, num_channels), dtype=torch.float32)
    dbias_partial = (
        x.new_empty((batch_size * num_row_ranges, num_channels), dtype=torch.float32) if bias is not None else None
    )
    if x.numel() > 0:
        hist = initial_history if initial_history is not None else x
        hist_strides = initial_history.stride() if initial_history is not None else (0, 0, 0)
        grid = (num_row_ranges, num_e_blocks, batch_size)
        _causal_conv1d_bwd_kernel[grid](
            x, weight, bias, hist, dy, dx, dw_partial, dbias_partial, seq_idx,
            seq_len, num_channels, rows_per_program,
            *x.stride(), *weight.stride(), *hist_strides, *dy.stride(), dx.stride(0), dx.stride(1),
            K=width,
            BLOCK_K=triton.next_power_of_2(width),
            HAS_BIAS=bias is not None,
            HAS_HISTORY=initial_history is not None,
            HAS_SEQ_IDX=seq_idx is not None,
            SILU=activation == "silu",
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            num_warps=num_warps,
        )  # fmt: skip
    dweight = dw_partial.sum(0).t().to(weight.dtype)  # [K, E] -> [E, K]
    dbias = dbias_partial.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias


class CausalConv1dFunction(torch.autograd.Function):
    """Autograd of the training conv. Saves only x (and the weights, history and seq_idx): the backward recomputes the
    pre-activation. No gradient for the history or seq_idx."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, initial_history, seq_idx):
        ctx.save_for_backward(x, weight, bias, initial_history, seq_idx)
        ctx.activation = activation
        return causal_conv1d_fwd(x, weight, bias, activation, initial_history, seq_idx=seq_idx)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, initial_history, seq_idx = ctx.saved_tensors
        dx, dweight, dbias = causal_conv1d_bwd(x, weight, bias, dy, ctx.activation, initial_history, seq_idx=seq_idx)
        return dx, dweight, dbias, None, None, None


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_history: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv1d for training, same contract as `causal_conv1d_ref`.

    x: [B, T, E], any strides (the `xs` half of `in_proj(h).chunk(2, -1)` is read in place, not copied);
    weight: [E, K]; bias: [E] or None; activation: None or "silu"; initial_history: [B, E, K-1] the inputs before
    x[:, 0] (a chunk continuing from the Transformers cache) or None for zeros. It gets NO gradient: the backward
    treats it as a constant (a cache entry), whatever its requires_grad.
    seq_idx: [B, T] int32 or int64 (mamba_ssm's convention), the index of the sequence each token belongs to, for
    padding-free training on rows that pack several sequences; None: one sequence per row. A tap reads only inputs of
    its output token's sequence (zeros elsewhere) and the history belongs to the row's first sequence (it feeds token
    t only if seq_idx[t] == seq_idx[0]); the backward follows the same rule, so each sequence's output, dx and its
    share of dweight / dbias are those of the sequence run alone. Only equality is compared, as in the reference: the
    indices need not start at 0 or increase, but each sequence must be one contiguous run of its row. Converted to
    int32 (indices beyond the int32 range wrap); no gradient.
    Returns y [B, T, E] contiguous in x.dtype, differentiable in x, weight and bias (fp32 accumulation).
    """
    seq_idx = _check_seq_idx(seq_idx, x) if x.dim() == 3 else seq_idx  # a bad x is reported by the forward
    return CausalConv1dFunction.apply(x, weight, bias, activation, initial_history, seq_idx)


# ---------------------------------------------------------------------------------------------------------------------
# Serving: packed prefills and decode, against the conv-state cache [slots, E, K-1] (any strides)
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize_on_alignment=["p_state_indices"])  # as _causal_conv1d_fwd_kernel's
def _varlen_conv_state_kernel(
    p_x,
    p_state,
    p_cu_seqlens,
    p_state_indices,
    p_has_initial_state,
    E,
    s_x_t,
    s_x_e,
    s_st_b,
    s_st_e,
    s_st_k,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Program (i_e, i_s): the new history of sequence i_s, the last K-1 entries of (history, inputs), into its slot
    (the state half of `causal_conv1d_varlen_ref`). Launched after `_causal_conv1d_fwd_kernel`, which read the old
    histories: a slot is read and written by this one program only."""
    i_e, i_s = tl.program_id(0), tl.program_id(1)
    slot = tl.load(p_state_indices + i_s)
    if slot >= 0:
        bos = tl.load(p_cu_seqlens + i_s)
        seq_len = tl.load(p_cu_seqlens + i_s + 1) - bos
        o_k = tl.arange(0, BLOCK_K)
        o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
        m_k, m_e = o_k < K - 1, o_e < E
        # new history entry k = entry seq_len + k of (old history [K-1], inputs [seq_len])
        o_src = seq_len + o_k
        m_x = (m_k & (o_src >= K - 1))[:, None] & m_e[None, :]
        p_in = p_x + (bos + o_src - (K - 1)).to(tl.int64)[:, None] * s_x_t + o_e[None, :] * s_x_e
        b_new = tl.load(p_in, mask=m_x, other=0.0).to(tl.float32)
        has_history = tl.load(p_has_initial_state + i_s) != 0
        m_h = (m_k & (o_src < K - 1) & has_history)[:, None] & m_e[None, :]
        p_slot = p_state + slot.to(tl.int64) * s_st_b + o_e[None, :] * s_st_e
        b_new += tl.load(p_slot + o_src[:, None] * s_st_k, mask=m_h, other=0.0).to(tl.float32)
        # another thread of this program may still be reading the entry this thread overwrites
        tl.debug_barrier()
        tl.store(p_slot + o_k[:, None] * s_st_k, b_new.to(p_state.dtype.element_ty), mask=m_k[:, None] & m_e[None, :])


def _check_conv_state(conv_state: torch.Tensor, num_channels: int, width: int) -> None:
    if conv_state.dim() != 3 or conv_state.shape[1:] != (num_channels, width - 1):
        raise ValueError(
            f"conv_state must be [slots, E, K-1] = [slots, {num_channels}, {width - 1}] (pass a transposed view of a "
            f"[slots, K-1, E] cache), got {tuple(conv_state.shape)}"
        )


def _check_index(name: str, tensor: torch.Tensor, length: int, dtype: torch.dtype) -> None:
    # The kernels read entry i at `pointer + i`: a strided view (a column of a wider table) would read wrong entries.
    if tensor.shape != (length,) or tensor.dtype != dtype or not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous [{length}] {dtype}, got {tuple(tensor.shape)} {tensor.dtype} "
            f"with strides {tensor.stride()}"
        )


def _check_out(out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    return out


def causal_conv1d_varlen_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    *,
    block_t: int | None = None,
    block_e: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Packed prefills, same contract as `causal_conv1d_varlen_ref`: x [T, E] (any strides: rows of the in_proj
    output), weight [E, K], bias [E] or None, conv_state [slots, E, K-1] any strides (updated in place), cu_seqlens
    [S+1] int32, state_indices [S] int32 (-1 = padding sequence), has_initial_state [S] bool. Returns out [T, E].

    Two launches: the conv reads every history it needs, then `_varlen_conv_state_kernel` writes the new ones. (In one
    launch a sequence's history is read by the program of each row block holding one of its first K-1 rows, so no
    program could know when overwriting it is safe.) No host synchronisation: rows find their sequence on the device.
    """
    check_activation(activation)
    if x.dim() != 2:
        raise ValueError(f"x must be [T, E], got {tuple(x.shape)}")
    num_tokens, num_channels = x.shape
    width = _check_weights(weight, bias, num_channels)
    _check_conv_state(conv_state, num_channels, width)
    num_seqs = state_indices.shape[0]
    _check_index("cu_seqlens", cu_seqlens, num_seqs + 1, torch.int32)
    _check_index("state_indices", state_indices, num_seqs, torch.int32)
    _check_index("has_initial_state", has_initial_state, num_seqs, torch.bool)
    out = _check_out(out, x)
    if num_seqs == 0 or num_channels == 0:
        return out.zero_()
    default_t, default_e, default_warps = _pick_blocks(num_channels, num_tokens, 16, 128, per_thread=16)
    block_t, block_e, num_warps = block_t or default_t, block_e or default_e, num_warps or default_warps
    if num_tokens:
        grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_channels, block_e), 1)
        _causal_conv1d_fwd_kernel[grid](
            x, weight, bias, conv_state, out, cu_seqlens, state_indices, has_initial_state, None,
            num_tokens, num_channels, num_seqs, (num_seqs - 1).bit_length(),
            0, *x.stride(), *weight.stride(), *conv_state.stride(), 0, *out.stride(),
            K=width,
            HAS_BIAS=bias is not None,
            HAS_HISTORY=True,
            IS_VARLEN=True,
            HAS_SEQ_IDX=False,
            SILU=activation == "silu",
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            num_warps=num_warps,
        )  # fmt: skip
    grid = (triton.cdiv(num_channels, block_e), num_seqs)
    _varlen_conv_state_kernel[grid](
        x, conv_state, cu_seqlens, state_indices, has_initial_state,
        num_channels, *x.stride(), *conv_state.stride(),
        K=width,
        BLOCK_K=triton.next_power_of_2(width),
        BLOCK_E=block_e,
        num_warps=num_warps,
    )  # fmt: skip
    return out


@triton.jit
def _causal_conv1d_update_kernel(
    p_x,
    p_w,
    p_bias,
    p_state,
    p_state_indices,
    p_has_initial_state,
    p_out,
    E,
    s_x_n,
    s_x_e,
    s_w_e,
    s_w_k,
    s_st_b,
    s_st_e,
    s_st_k,
    s_o_n,
    s_o_e,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INITIAL_FLAGS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """One decode step of request i_n for channels i_e*BLOCK_E.. (`causal_conv1d_update_ref`): window = (slot's
    history [K-1], x), out = act(window . weight + bias), slot <- window[1:]. Padding rows (slot -1) write zeros; a
    row whose has_initial_state flag is False reads a zero history (its request's first token)."""
    i_e, i_n = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BLOCK_K)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    m_e = o_e < E
    slot = tl.load(p_state_indices + i_n)
    m_slot = slot >= 0
    m_history = m_slot
    if HAS_INITIAL_FLAGS:
        m_history = m_history & (tl.load(p_has_initial_state + i_n) != 0)

    b_x = tl.load(p_x + i_n.to(tl.int64) * s_x_n + o_e * s_x_e, mask=m_e, other=0.0).to(tl.float32)
    p_slot = p_state + slot.to(tl.int64) * s_st_b + o_e[None, :] * s_st_e
    m_slot_e = m_slot & m_e[None, :]
    m_read = m_history & m_e[None, :]
    # window tap k: history entry k for k < K-1, the new token at k = K-1
    b_window = tl.load(p_slot + o_k[:, None] * s_st_k, mask=(o_k < K - 1)[:, None] & m_read, other=0.0)
    b_window = tl.where((o_k == K - 1)[:, None], b_x[None, :], b_window.to(tl.float32))
    # the shifted history: tap k + 1 of the window
    b_shifted = tl.load(p_slot + (o_k + 1)[:, None] * s_st_k, mask=(o_k + 1 < K - 1)[:, None] & m_read, other=0.0)
    b_shifted = tl.where((o_k == K - 2)[:, None], b_x[None, :], b_shifted.to(tl.float32))

    p_weight = p_w + o_e[None, :] * s_w_e + o_k[:, None] * s_w_k
    b_w = tl.load(p_weight, mask=(o_k < K)[:, None] & m_e[None, :], other=0.0).to(tl.float32)
    b_y = tl.sum(b_window * b_w, axis=0)
    if HAS_BIAS:
        b_y += tl.load(p_bias + o_e, mask=m_e, other=0.0).to(tl.float32)
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)
    b_y = tl.where(m_slot, b_y, 0.0)
    tl.store(p_out + i_n.to(tl.int64) * s_o_n + o_e * s_o_e, b_y.to(p_out.dtype.element_ty), mask=m_e)

    # another thread of this program may still be reading the entry this thread overwrites
    tl.debug_barrier()
    m_write = (o_k < K - 1)[:, None] & m_slot_e
    tl.store(p_slot + o_k[:, None] * s_st_k, b_shifted.to(p_state.dtype.element_ty), mask=m_write)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    *,
    has_initial_state: torch.Tensor | None = None,
    block_e: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Decode step, same contract as `causal_conv1d_update_ref`: x [N, E] (any strides), weight [E, K], bias [E] or
    None, conv_state [slots, E, K-1] any strides (updated in place), state_indices [N] int32 (-1 = padding row: output
    zeros, no state touched), has_initial_state [N] bool or None (False: a zero history). Returns out [N, E].
    CUDA-graph safe: shape checks only, grid from shapes, no host sync. Slots of one call must be distinct (vLLM
    gives each running request its own), except padding rows on vLLM's null block, whose results nobody reads."""
    check_activation(activation)
    if x.dim() != 2:
        raise ValueError(f"x must be [N, E], got {tuple(x.shape)}")
    num_requests, num_channels = x.shape
    width = _check_weights(weight, bias, num_channels)
    _check_conv_state(conv_state, num_channels, width)
    _check_index("state_indices", state_indices, num_requests, torch.int32)
    if has_initial_state is not None:
        _check_index("has_initial_state", has_initial_state, num_requests, torch.bool)
    out = _check_out(out, x)
    if x.numel() == 0:
        return out
    block_e = block_e or min(256, triton.next_power_of_2(num_channels))
    num_warps = num_warps or 4
    grid = (triton.cdiv(num_channels, block_e), num_requests)
    _causal_conv1d_update_kernel[grid](
        x, weight, bias, conv_state, state_indices, has_initial_state if has_initial_state is not None else out, out,
        num_channels, *x.stride(), *weight.stride(), *conv_state.stride(), *out.stride(),
        K=width,
        BLOCK_K=triton.next_power_of_2(width),
        HAS_BIAS=bias is not None,
        HAS_INITIAL_FLAGS=has_initial_state is not None,
        SILU=activation == "silu",
        BLOCK_E=block_e,
        num_warps=num_warps,
    )  # fmt: skip
    return out
