"""Forward kernels of the causal depthwise conv1d and their launchers (references in reference.py, public functions in
interface.py): the conv over sequences (training batches [B, T, E] and packed serving prefills [T, E]), the prefills'
conv-state write, and the decode update.

Layout: token-major, E is the contiguous dimension, so every tile [BLOCK_T, BLOCK_E] is read with coalesced rows.
A program's inputs are one [BLOCK_T + K - 1, BLOCK_E] window, read as K row-shifted [BLOCK_T, BLOCK_E] tiles (Triton
cannot shift the rows of a register tile): the window comes from DRAM once, the overlapping rows are L1/L2 hits.
All math in fp32; outputs are cast once, at the store.

Packed training rows (HAS_SEQ_IDX): seq_idx [B, T] names each token's sequence. Every shifted input tile is masked
where its source row's seq_idx differs from its output row's (the history counts as seq_idx[0]), in `_load_inputs`,
which the forward, the backward's silu recompute and dweight's input tiles all go through; dx masks its g tiles by
the same rule seen from the input side (x_s feeds g_{s+i} only if seq_idx[s+i] == seq_idx[s]). Without seq_idx the
flag is off and none of this is in the compiled code.

Launchers take checked tensors and a launch shape (interface.py validates and picks it), compute each tensor's strides
once and derive the constexpr flags from their arguments.
"""

import triton
import triton.language as tl
from torch import Tensor

from ..triton_utils import cdiv, next_power_of_2, stride_args

# ---------------------------------------------------------------------------------------------------------------------
# Shared jit helpers
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit
def _load_seq_idx(p_seq_idx, o_src, T):
    """seq_idx [BLOCK_T] of source rows o_src of a packed row: rows before 0 (the history) read seq_idx[0], rows
    from T on get -1 (their inputs and g are zeros, whatever they match)."""
    return tl.load(p_seq_idx + tl.maximum(o_src, 0), mask=o_src < T, other=-1)


@triton.jit
def _load_inputs(
    p_x, p_hist, p_seq_idx, b_seq_dst, o_t, o_e, m_e, b_bos, T, m_hist_rows, o_hist, s_x_t, s_x_e, s_h_e, s_h_k,
    SHIFT: tl.constexpr, K: tl.constexpr, HAS_HISTORY: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
):  # fmt: skip
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
    p_x, p_w, p_bias, p_hist, p_seq_idx, o_t, o_e, m_e, b_bos, T, m_hist_rows, o_hist,
    s_x_t, s_x_e, s_w_e, s_w_k, s_h_e, s_h_k,
    SHIFT: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HISTORY: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
):  # fmt: skip
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
    p_x, p_w, p_bias, p_hist, p_y,  # the op's tensors
    p_cu_seqlens, p_state_indices, p_has_initial_state, p_seq_idx,  # serving batch, packed training rows
    T, E, num_seqs, search_steps,
    s_x_b, s_x_t, s_x_e, s_w_e, s_w_k, s_h_b, s_h_e, s_h_k, s_y_b, s_y_t, s_y_e,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_HISTORY: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_SEQ_IDX: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """y = act(conv(x) + bias) for one [BLOCK_T, BLOCK_E] tile; `causal_conv1d_ref` / `causal_conv1d_varlen_ref`.

    Training (IS_VARLEN False): program (i_t, i_e, i_b) owns rows i_t*BLOCK_T.. of batch row i_b of x [B, T, E];
    history [B, E, K-1] when HAS_HISTORY; with HAS_SEQ_IDX the batch row packs the sequences of seq_idx [B, T]
    (int32 or int64), and a tap reads only inputs of its output token's sequence. Serving (IS_VARLEN True): program
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
        if HAS_HISTORY:
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


def conv_args(
    x: Tensor, weight: Tensor, bias: Tensor | None, history: Tensor | None, seq_idx: Tensor | None,
    activation: str | None,
) -> dict:  # fmt: skip
    """The arguments the forward and backward kernels share: x, its history (None: zeros), the weights and seq_idx,
    their strides, and the constexpr flags they imply."""
    return {
        "p_x": x,
        "p_w": weight,
        "p_bias": bias,
        "p_hist": history,
        "p_seq_idx": seq_idx,
        **stride_args("x", x, "bte"),
        **stride_args("w", weight, "ek"),
        **stride_args("h", history, "bek"),
        "K": weight.shape[1],
        "HAS_BIAS": bias is not None,
        "HAS_HISTORY": history is not None,
        "HAS_SEQ_IDX": seq_idx is not None,
        "SILU": activation == "silu",
    }


def launch_causal_conv1d_fwd(
    x: Tensor, weight: Tensor, bias: Tensor | None, history: Tensor | None, out: Tensor,
    *,
    activation: str | None, block_t: int, block_e: int, num_warps: int, seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None, state_indices: Tensor | None = None, has_initial_state: Tensor | None = None,
) -> None:  # fmt: skip
    """`_causal_conv1d_fwd_kernel` into `out` (x's shape). Training: x [B, T, E], history [B, E, K-1] or None,
    seq_idx [B, T] or None. Serving (cu_seqlens given): x [T, E], history the conv-state cache [slots, E, K-1],
    state_indices [S] and has_initial_state [S]; the cache is only read."""
    is_varlen = cu_seqlens is not None
    num_rows, num_channels = x.shape[-2:]
    num_seqs = state_indices.shape[0] if is_varlen else 0
    grid = (cdiv(num_rows, block_t), cdiv(num_channels, block_e), 1 if is_varlen else x.shape[0])
    _causal_conv1d_fwd_kernel[grid](
        **conv_args(x, weight, bias, history, seq_idx, activation),
        p_y=out,
        p_cu_seqlens=cu_seqlens,
        p_state_indices=state_indices,
        p_has_initial_state=has_initial_state,
        T=num_rows,
        E=num_channels,
        num_seqs=num_seqs,
        search_steps=(num_seqs - 1).bit_length() if is_varlen else 0,
        **stride_args("y", out, "bte"),
        IS_VARLEN=is_varlen,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        num_warps=num_warps,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Serving: the prefills' conv-state write and the decode update, against the cache [slots, E, K-1] (any strides)
# ---------------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize_on_alignment=["p_state_indices"])  # as _causal_conv1d_fwd_kernel's
def _varlen_conv_state_kernel(
    p_x, p_state, p_cu_seqlens, p_state_indices, p_has_initial_state,
    E, s_x_t, s_x_e, s_st_slot, s_st_e, s_st_k,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
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
        p_slot = p_state + slot.to(tl.int64) * s_st_slot + o_e[None, :] * s_st_e
        b_new += tl.load(p_slot + o_src[:, None] * s_st_k, mask=m_h, other=0.0).to(tl.float32)
        # another thread of this program may still be reading the entry this thread overwrites
        tl.debug_barrier()
        tl.store(p_slot + o_k[:, None] * s_st_k, b_new.to(p_state.dtype.element_ty), mask=m_k[:, None] & m_e[None, :])


def launch_varlen_conv_state(
    x: Tensor, conv_state: Tensor, cu_seqlens: Tensor, state_indices: Tensor, has_initial_state: Tensor,
    *,
    block_e: int, num_warps: int,
) -> None:  # fmt: skip
    """`_varlen_conv_state_kernel`: every sequence's new history into its slot of conv_state [slots, E, K-1]."""
    width = conv_state.shape[2] + 1
    grid = (cdiv(x.shape[1], block_e), state_indices.shape[0])
    _varlen_conv_state_kernel[grid](
        p_x=x,
        p_state=conv_state,
        p_cu_seqlens=cu_seqlens,
        p_state_indices=state_indices,
        p_has_initial_state=has_initial_state,
        E=x.shape[1],
        **stride_args("x", x, "te"),
        **stride_args("st", conv_state, ("slot", "e", "k")),
        K=width,
        BLOCK_K=next_power_of_2(width),
        BLOCK_E=block_e,
        num_warps=num_warps,
    )


@triton.jit
def conv_update_channels(
    b_x, p_slot, s_st_k, is_real, reads_history, o_e, m_e, p_w, s_w_e, s_w_k, p_bias,
    K: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    """One decode step of one request over a block of channels o_e (the body of `_causal_conv1d_update_kernel` and
    of the fused branch step, modeling/ops/mamba_inner/decode.py): window = (history [K-1], x), returns
    act(window . weight + bias) in fp32 (zeros unless `is_real`), and shifts x into the history at p_slot ([1,
    BLOCK_E] pointers to tap 0 of the request's slot) when `is_real`. With `reads_history` False the history reads
    as zeros (a request's first token)."""
    o_k = tl.arange(0, BLOCK_K)
    m_read = reads_history & m_e[None, :]
    # Every load before any arithmetic on one: a decode step is a few dependent trips to memory, not bandwidth.
    # window tap k: history entry k for k < K-1, the new token at k = K-1
    b_window = tl.load(p_slot + o_k[:, None] * s_st_k, mask=(o_k < K - 1)[:, None] & m_read, other=0.0)
    # the shifted history: tap k + 1 of the window
    b_shifted = tl.load(p_slot + (o_k + 1)[:, None] * s_st_k, mask=(o_k + 1 < K - 1)[:, None] & m_read, other=0.0)
    p_weight = p_w + o_e[None, :] * s_w_e + o_k[:, None] * s_w_k
    b_w = tl.load(p_weight, mask=(o_k < K)[:, None] & m_e[None, :], other=0.0).to(tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(p_bias + o_e, mask=m_e, other=0.0).to(tl.float32)

    b_window = tl.where((o_k == K - 1)[:, None], b_x[None, :], b_window.to(tl.float32))
    b_shifted = tl.where((o_k == K - 2)[:, None], b_x[None, :], b_shifted.to(tl.float32))
    b_y = tl.sum(b_window * b_w, axis=0)
    if HAS_BIAS:
        b_y += b_bias
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)

    # another thread of this program may still be reading the entry this thread overwrites
    tl.debug_barrier()
    m_write = (o_k < K - 1)[:, None] & is_real & m_e[None, :]
    tl.store(p_slot + o_k[:, None] * s_st_k, b_shifted.to(p_slot.dtype.element_ty), mask=m_write)
    return tl.where(is_real, b_y, 0.0)


@triton.jit
def _causal_conv1d_update_kernel(
    p_x, p_w, p_bias, p_state, p_state_indices, p_has_initial_state, p_mask, p_out,
    E, s_x_r, s_x_e, s_w_e, s_w_k, s_st_slot, s_st_e, s_st_k, s_mask, s_o_r, s_o_e,
    K: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INDICES: tl.constexpr,
    HAS_INITIAL_FLAGS: tl.constexpr, HAS_MASK: tl.constexpr, SILU: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """One decode step of request i_r for channels i_e*BLOCK_E.. (`causal_conv1d_update_ref`): window = (slot's
    history [K-1], x), out = act(window . weight + bias), slot <- window[1:]. Padding rows (slot -1) write zeros; a
    row whose has_initial_state flag is False reads a zero history (its request's first token). Without
    HAS_INDICES request i owns slot i; with HAS_MASK a row whose mask is 0 (a padding token of generate()'s batch)
    steps with a zero input, which enters its history as the scan's padding does."""
    i_e, i_r = tl.program_id(0), tl.program_id(1)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    m_e = o_e < E
    if HAS_INDICES:
        slot = tl.load(p_state_indices + i_r)
    else:
        slot = i_r
    is_real = slot >= 0
    reads_history = is_real
    if HAS_INITIAL_FLAGS:
        reads_history = reads_history & (tl.load(p_has_initial_state + i_r) != 0)

    b_x = tl.load(p_x + i_r.to(tl.int64) * s_x_r + o_e * s_x_e, mask=m_e, other=0.0).to(tl.float32)
    if HAS_MASK:
        b_x = tl.where(tl.load(p_mask + i_r * s_mask) != 0, b_x, 0.0)
    p_slot = p_state + slot.to(tl.int64) * s_st_slot + o_e[None, :] * s_st_e
    b_y = conv_update_channels(
        b_x, p_slot, s_st_k, is_real, reads_history, o_e, m_e, p_w, s_w_e, s_w_k, p_bias, K, BLOCK_K, HAS_BIAS, SILU
    )
    tl.store(p_out + i_r.to(tl.int64) * s_o_r + o_e * s_o_e, b_y.to(p_out.dtype.element_ty), mask=m_e)


def launch_causal_conv1d_update(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, state_indices: Tensor | None,
    has_initial_state: Tensor | None, out: Tensor,
    *,
    activation: str | None, padding_mask: Tensor | None = None, block_e: int | None = None,
    num_warps: int | None = None,
) -> None:  # fmt: skip
    """`_causal_conv1d_update_kernel`: one decode step per row of x [R, E] into out [R, E] and conv_state;
    state_indices None: row i owns slot i; padding_mask [R, 1] (0: the row steps with a zero input) or None;
    block_e and num_warps None pick up to 256 channels a program and 4 warps."""
    num_requests, num_channels = x.shape
    block_e = block_e or min(256, next_power_of_2(num_channels))
    num_warps = num_warps or 4
    grid = (cdiv(num_channels, block_e), num_requests)
    _causal_conv1d_update_kernel[grid](
        p_x=x,
        p_w=weight,
        p_bias=bias,
        p_state=conv_state,
        p_state_indices=state_indices,
        p_has_initial_state=has_initial_state,
        p_mask=padding_mask,
        p_out=out,
        E=num_channels,
        **stride_args("x", x, "re"),
        **stride_args("w", weight, "ek"),
        **stride_args("st", conv_state, ("slot", "e", "k")),
        s_mask=padding_mask.stride(0) if padding_mask is not None else 0,
        **stride_args("o", out, "re"),
        K=weight.shape[1],
        BLOCK_K=next_power_of_2(weight.shape[1]),
        HAS_BIAS=bias is not None,
        HAS_INDICES=state_indices is not None,
        HAS_INITIAL_FLAGS=has_initial_state is not None,
        HAS_MASK=padding_mask is not None,
        SILU=activation == "silu",
        BLOCK_E=block_e,
        num_warps=num_warps,
    )
