"""Triton sliding-window attention over vLLM's paged KV cache, for prefill, chunked prefill and decode in one batch;
`paged_window_attention_ref` (paged_attention.py, with the glossary of dimension letters) is its reference and has
the same signature. Forward only (serving).

Work split: one program per (query block, kv head[, split]). A query block holds BLOCK_Q consecutive queries of one
sequence times the G = H / KVH query heads that share the kv head, packed into the BLOCK_M rows of the score tile
(row m = query m // GROUP_PAD, head m % GROUP_PAD), so each K/V tile is read once per kv head and feeds every head of
its group; decode (BLOCK_Q = 1) is the same kernel with the G heads as the rows. The program walks the keys
[first key of its earliest query's window, its last query] in tiles of BLOCK_N, flash-attention style (online
softmax in fp32, exp2 domain): nothing before the window is read, neither the cache nor the block table, so a
decode reads ~W keys whatever the context length, and blocks vLLM freed behind the window are never touched.
Only the tiles at the window edge and at the causal diagonal apply a mask; the tiles between are visible to every
row. Split-K (NUM_SPLITS > 1, picked for decode batches too small to fill the GPU) cuts the key tiles of a query
block into NUM_SPLITS runs whose unnormalised partial outputs `_merge_splits_kernel` combines.

Each key's physical block is looked up per key (`block_table[seq, key // BLOCK_SIZE]`), so BLOCK_N is independent of
the cache's block size, and the caches may have any strides: vLLM's Triton backend hands out views of one tensor
[NB, KVH, BS, 2D] (`kv_cache.transpose(1, 2).split(D, dim=-1)`), the flash layout is [2, NB, BS, KVH, D].
"""

import functools
import math

import torch
import triton
import triton.language as tl

from .triton_utils import num_sms

# Stands for "no window" (full causal attention): larger than any context, small enough that t - W fits int32.
_NO_WINDOW = 1 << 30


@triton.jit
def _attend_key_tile(
    b_q,
    b_acc,
    b_m,
    b_l,
    p_k,
    p_v,
    p_bt,
    s_k_blk,
    s_k_tok,
    s_v_blk,
    s_v_tok,
    k_start,
    k_last,
    o_qpos,
    window,
    qk_scale,
    S_K_D: tl.constexpr,
    S_V_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One online-softmax step of `_paged_window_attention_kernel` over keys k_start .. k_start + BLOCK_N - 1 (those
    past k_last are not loaded). MASKED tiles hide, per row, the keys outside (query position - window, query
    position]; unmasked tiles are visible to every row. Scores are in log2 units (qk_scale includes log2(e))."""
    o_k = k_start + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    m_k = o_k <= k_last
    m_kd = m_k[:, None] & (o_d < HEAD_DIM)[None, :]
    # Physical block of every key: a tile may span several cache blocks. int64: block * stride can pass 2^31.
    b_blk = tl.load(p_bt + o_k // BLOCK_SIZE, mask=m_k, other=0).to(tl.int64)
    o_slot = o_k % BLOCK_SIZE
    p_kt = p_k + (b_blk * s_k_blk + o_slot * s_k_tok)[:, None] + o_d[None, :] * S_K_D
    b_k = tl.load(p_kt, mask=m_kd, other=0.0)  # [BLOCK_N, BLOCK_D]
    # tf32x3: fp32 caches get ~fp32 products on tensor cores (plain tf32 errs by ~1e-3, "ieee" falls back to FMAs);
    # bf16/fp16 operands ignore it.
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision="tf32x3") * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        m_visible = (o_k[None, :] <= o_qpos[:, None]) & (o_k[None, :] > o_qpos[:, None] - window)
        b_s = tl.where(m_visible, b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
    if MASKED:
        # A row that has seen no visible key yet keeps max -inf; subtracting 0 makes its exp2 terms 0, not NaN.
        b_m_sub = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    else:
        b_m_sub = b_m_new
    b_p = tl.exp2(b_s - b_m_sub[:, None])
    b_alpha = tl.exp2(b_m - b_m_sub)
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    p_vt = p_v + (b_blk * s_v_blk + o_slot * s_v_tok)[:, None] + o_d[None, :] * S_V_D
    b_v = tl.load(p_vt, mask=m_kd, other=0.0)  # [BLOCK_N, BLOCK_D]
    b_acc = tl.dot(b_p.to(b_v.dtype), b_v, acc=b_acc * b_alpha[:, None], input_precision="tf32x3")
    return b_acc, b_m_new, b_l


# One compilation for every batch shape. Serving passes the prefill rows' block table and lengths as slices past the
# decode rows, so their alignment changes with the number of decodes: not specialized on.
@triton.jit(
    do_not_specialize=["num_seqs", "num_tokens", "window"], do_not_specialize_on_alignment=["p_bt", "p_seq_lens"]
)
def _paged_window_attention_kernel(
    p_q,
    p_k,
    p_v,
    p_bt,
    p_qsl,
    p_seq_lens,
    p_o,
    p_part_acc,
    p_part_m,
    p_part_l,
    num_seqs,
    num_tokens,
    num_heads,
    window,
    qk_scale,
    s_q_tok,
    s_q_head,
    s_k_blk,
    s_k_tok,
    s_k_head,
    s_v_blk,
    s_v_tok,
    s_v_head,
    s_bt_seq,
    s_o_tok,
    s_o_head,
    S_Q_D: tl.constexpr,
    S_K_D: tl.constexpr,
    S_V_D: tl.constexpr,
    S_O_D: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Kernel of `paged_window_attention` (reference: `paged_window_attention_ref`). Grid (query blocks, KVH,
    NUM_SPLITS). Query blocks are numbered per sequence: sequence i's first block is
    query_start_loc[i] // BLOCK_Q + i (an upper bound on the blocks before it, so the grid needs no device lengths),
    or query_start_loc[i] when BLOCK_Q == 1. With NUM_SPLITS == 1 it writes out [T, H, D] (zeros for rows past
    query_start_loc[S]); otherwise unnormalised partials for `_merge_splits_kernel`."""
    i_blk, i_kvh, i_split = tl.program_id(0), tl.program_id(1), tl.program_id(2)

    # 1. Sequence of this query block: the last one whose first block is <= i_blk (binary search).
    i_lo, i_hi = 0, num_seqs
    while i_lo + 1 < i_hi:
        i_mid = (i_lo + i_hi) // 2
        first_blk_mid = tl.load(p_qsl + i_mid)
        if BLOCK_Q > 1:
            first_blk_mid = first_blk_mid // BLOCK_Q + i_mid
        if first_blk_mid <= i_blk:
            i_lo = i_mid
        else:
            i_hi = i_mid
    i_seq = i_lo
    bos, eos = tl.load(p_qsl + i_seq), tl.load(p_qsl + i_seq + 1)
    q_len = eos - bos
    i_qblk = i_blk - bos  # query block within the sequence
    if BLOCK_Q > 1:
        i_qblk = i_blk - (bos // BLOCK_Q + i_seq)

    # 2. Rows: BLOCK_Q queries x GROUP_PAD heads of kv head i_kvh (padding heads and queries masked out).
    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    o_qi = i_qblk * BLOCK_Q + o_m // GROUP_PAD  # query index within the sequence
    o_head = i_kvh * GROUP + o_m % GROUP_PAD
    m_rowslot = (o_m // GROUP_PAD < BLOCK_Q) & (o_m % GROUP_PAD < GROUP)
    m_row = m_rowslot & (o_qi < q_len)
    o_tok = (bos + o_qi).to(tl.int64)
    # CUDA-graph padding tokens past the last sequence's queries: written as zeros by the last sequence's blocks.
    m_pad_row = m_rowslot & (o_qi >= q_len) & (o_tok < num_tokens) & (i_seq == num_seqs - 1)
    p_o_rows = p_o + (o_tok * s_o_tok + o_head * s_o_head)[:, None] + o_d[None, :] * S_O_D
    if i_qblk * BLOCK_Q >= q_len:
        if NUM_SPLITS == 1:
            b_zero = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            tl.store(p_o_rows, b_zero.to(p_o.dtype.element_ty), mask=m_pad_row[:, None] & m_d[None, :])
        return

    # 3. Key range: the earliest query's window start .. the last query, cut into tiles of BLOCK_N keys.
    seq_len = tl.load(p_seq_lens + i_seq)
    ctx_len = seq_len - q_len
    o_qpos = ctx_len + o_qi
    q_first = ctx_len + i_qblk * BLOCK_Q
    q_last = ctx_len + tl.minimum(i_qblk * BLOCK_Q + BLOCK_Q, q_len) - 1
    k_first = tl.maximum(q_first - window + 1, 0)
    num_tiles = tl.cdiv(q_last - k_first + 1, BLOCK_N)
    # Tiles [0, j_window) hold keys the window hides from some row (those <= q_last - window), tiles
    # [j_causal, num_tiles) keys causality hides from some row (those > q_first); the tiles between need no mask.
    j_window = tl.minimum(tl.cdiv(tl.maximum(q_last - window + 1 - k_first, 0), BLOCK_N), num_tiles)
    j_causal = tl.maximum((q_first - k_first + 1) // BLOCK_N, j_window)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    j_begin = i_split * tiles_per_split
    j_end = tl.minimum(j_begin + tiles_per_split, num_tiles)

    # 4. Online softmax over the key tiles.
    p_q_rows = p_q + (o_tok * s_q_tok + o_head * s_q_head)[:, None] + o_d[None, :] * S_Q_D
    b_q = tl.load(p_q_rows, mask=m_row[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    p_k_head = p_k + i_kvh * s_k_head
    p_v_head = p_v + i_kvh * s_v_head
    p_bt_seq = p_bt + i_seq.to(tl.int64) * s_bt_seq
    for j in tl.range(j_begin, tl.minimum(j_end, j_window)):
        b_acc, b_m, b_l = _attend_key_tile(
            b_q, b_acc, b_m, b_l, p_k_head, p_v_head, p_bt_seq, s_k_blk, s_k_tok, s_v_blk, s_v_tok,
            k_first + j * BLOCK_N, q_last, o_qpos, window, qk_scale,
            S_K_D, S_V_D, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, MASKED=True,
        )  # fmt: skip
    for j in tl.range(tl.maximum(j_begin, j_window), tl.minimum(j_end, j_causal)):
        b_acc, b_m, b_l = _attend_key_tile(
            b_q, b_acc, b_m, b_l, p_k_head, p_v_head, p_bt_seq, s_k_blk, s_k_tok, s_v_blk, s_v_tok,
            k_first + j * BLOCK_N, q_last, o_qpos, window, qk_scale,
            S_K_D, S_V_D, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, MASKED=False,
        )  # fmt: skip
    for j in tl.range(tl.maximum(j_begin, j_causal), j_end):
        b_acc, b_m, b_l = _attend_key_tile(
            b_q, b_acc, b_m, b_l, p_k_head, p_v_head, p_bt_seq, s_k_blk, s_k_tok, s_v_blk, s_v_tok,
            k_first + j * BLOCK_N, q_last, o_qpos, window, qk_scale,
            S_K_D, S_V_D, HEAD_DIM, BLOCK_D, BLOCK_N, BLOCK_SIZE, MASKED=True,
        )  # fmt: skip

    # 5. Output rows, or this split's partial (a split without keys for a row leaves m = -inf, l = 0 there).
    if NUM_SPLITS == 1:
        b_o = tl.where(m_row[:, None], b_acc / b_l[:, None], 0.0)
        tl.store(p_o_rows, b_o.to(p_o.dtype.element_ty), mask=(m_row | m_pad_row)[:, None] & m_d[None, :])
    else:
        o_part = (o_tok * num_heads + o_head) * NUM_SPLITS + i_split  # [BLOCK_M] rows of [T, H, NUM_SPLITS]
        p_part_rows = p_part_acc + o_part[:, None] * HEAD_DIM + o_d[None, :]
        tl.store(p_part_rows, b_acc, mask=m_row[:, None] & m_d[None, :])
        tl.store(p_part_m + o_part, b_m, mask=m_row)
        tl.store(p_part_l + o_part, b_l, mask=m_row)


@triton.jit
def _merge_splits_kernel(
    p_part_acc,
    p_part_m,
    p_part_l,
    p_qsl,
    p_o,
    num_seqs,
    num_heads,
    s_o_tok,
    s_o_head,
    S_O_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    """Combines the NUM_SPLITS partials of `_paged_window_attention_kernel` ([T, H, NUM_SPLITS, D] unnormalised
    outputs, [T, H, NUM_SPLITS] row maxima (log2 units) and sums) into out [T, H, D]. Grid (T, H); tokens past
    query_start_loc[S] (CUDA-graph padding) get zeros."""
    i_tok, i_head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < HEAD_DIM
    p_o_row = p_o + i_tok * s_o_tok + i_head * s_o_head + o_d * S_O_D
    if i_tok >= tl.load(p_qsl + num_seqs):
        tl.store(p_o_row, tl.zeros([BLOCK_D], dtype=tl.float32).to(p_o.dtype.element_ty), mask=m_d)
        return
    o_split = tl.arange(0, BLOCK_SPLITS)
    m_split = o_split < NUM_SPLITS
    o_part = (i_tok * num_heads + i_head) * NUM_SPLITS + o_split
    b_m = tl.load(p_part_m + o_part, mask=m_split, other=float("-inf"))
    b_l = tl.load(p_part_l + o_part, mask=m_split, other=0.0)
    b_acc = tl.load(p_part_acc + o_part[:, None] * HEAD_DIM + o_d[None, :], mask=m_split[:, None] & m_d[None, :])
    # Some split saw a visible key (the query itself), so the maximum is finite; key-less splits weigh 0.
    b_w = tl.exp2(b_m - tl.max(b_m, 0))
    b_o = tl.sum(b_acc * b_w[:, None], 0) / tl.sum(b_l * b_w, 0)
    tl.store(p_o_row, b_o.to(p_o.dtype.element_ty), mask=m_d)


@functools.cache
def _pick_blocks(
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    num_seqs: int,
    num_kv_heads: int,
    window: int | None,
    max_query_len: int | None,
    max_seq_len: int | None,
    device: torch.device,
) -> dict[str, int]:
    """Default launch configuration (H200-minded): block_q, block_n, num_splits, num_warps, num_stages.

    Decode batches (max_query_len == 1) take one query per program with its GQA heads as the rows, BLOCK_N = 64,
    and split the keys when sequences x kv heads would leave the GPU half idle. Everything else takes 128-row
    query blocks (fewer when the head dim is large), flash-attention style; fp32 takes smaller tiles (its tf32x3
    products need three times the registers). The prefill tiles do not depend on the query lengths: one compilation
    serves every prefill batch, vLLM's warm-up batch of two-token prompts included (tiles sized to the longest query
    compiled a variant per power of two while serving, each a multi-second stall; short queries now leave most of
    a tile's rows masked, in batches that are short anyway).
    """
    block_d = triton.next_power_of_2(head_dim)
    group_pad = triton.next_power_of_2(group)
    if max_query_len == 1:
        block_n = 64 if block_d <= 128 else 32
        keys = min(window or _NO_WINDOW, max_seq_len or _NO_WINDOW)  # longest key range of one query
        max_splits = 16 if keys == _NO_WINDOW else max(1, min(16, triton.cdiv(keys, 2 * block_n)))
        num_splits = min(max_splits, triton.cdiv(2 * num_sms(device), num_seqs * num_kv_heads))
        return {"block_q": 1, "block_n": block_n, "num_splits": num_splits, "num_warps": 4, "num_stages": 3}
    if dtype == torch.float32:
        block_m, block_n, num_stages = (64 if block_d <= 64 else 32), (32 if block_d <= 128 else 16), 2
    else:
        # Measured on the H200 at D = 128, GQA 4 (`bench_kernels.py --only sweep`, 2 x 8192 tokens, W = 4096,
        # 2026-11-29): 256 rows (block_q 64) x 64 keys 2.16 ms, 128 x 64 2.80 ms, 128 x 128 2.52 ms, 128 x 32 3.61.
        # Without GQA packing (fewer rows share each K tile) 128 rows stays the default: not measured.
        block_m = 256 if group_pad >= 4 else 128
        block_m, block_n, num_stages = (block_m, 64, 3) if block_d <= 128 else (64, 32, 3)
    block_q = max(1, block_m // group_pad)
    num_warps = 8 if block_q * group_pad >= 128 or block_d >= 256 else 4
    return {"block_q": block_q, "block_n": block_n, "num_splits": 1, "num_warps": num_warps, "num_stages": num_stages}


def paged_window_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Paged sliding-window (or full) causal attention; same contract as `paged_window_attention_ref`.

    Args:
        query: [T, H, D] packed queries of S sequences (RoPE applied), any strides.
        key_cache, value_cache: [NB, BS, KVH, D] in query's dtype, any strides (views of vLLM's packed cache).
        block_table: [S, MB] int32; entries for blocks outside every query's window are never read.
        query_start_loc: [S + 1] int32; seq_lens: [S] int32, context lengths including the new tokens.
        scale: softmax scale; window: W (query t sees keys t - W < s <= t) or None for full attention.
        out: [T, H, D] in query's dtype, any strides; allocated when None.
        max_query_len, max_seq_len: host-side bounds (vLLM's metadata carries them) that only steer the default
            configuration: max_query_len == 1 selects the decode configuration (and split-K).
        block_q, block_n, num_splits, num_warps, num_stages: launch configuration overrides (`_pick_blocks` fills
            the rest): queries per program, keys per tile, programs per query block over its keys.

    Returns out: attention rows for every query; rows past query_start_loc[S] (CUDA-graph padding) are zeros.
    No host synchronisation: safe to capture in a CUDA graph (the split-K workspace is allocated per call).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    if not (key_cache.dim() == 4 and key_cache.shape[3] == head_dim):
        raise ValueError(f"key_cache: expected [blocks, page, kv heads, {head_dim}], got {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache: shape {tuple(value_cache.shape)} differs from key_cache's")
    if not (key_cache.dtype == value_cache.dtype == query.dtype):
        raise ValueError(
            f"key_cache/value_cache dtype {key_cache.dtype}/{value_cache.dtype} != query dtype {query.dtype}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of cache kv heads {num_kv_heads}")
    if not (num_seqs >= 1 and query_start_loc.shape == (num_seqs + 1,)):
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} for seq_lens {tuple(seq_lens.shape)}")
    if not (block_table.dim() == 2 and block_table.shape[0] == num_seqs):
        raise ValueError(f"block_table: expected [{num_seqs}, max_blocks], got {tuple(block_table.shape)}")
    for name, tensor in (("block_table", block_table), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous() and block_table.stride(1) == 1):
        raise ValueError("query_start_loc, seq_lens and block_table rows must be contiguous")
    if window is not None and window < 1:
        raise ValueError(f"window: expected None or >= 1, got {window}")
    if out is None:
        out = torch.empty_like(query)
    if not (out.shape == query.shape and out.dtype == query.dtype):
        raise ValueError(f"out: expected {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}")

    group = num_heads // num_kv_heads
    config = _pick_blocks(
        query.dtype, head_dim, group, num_seqs, num_kv_heads, window, max_query_len, max_seq_len, query.device
    )
    overrides = {
        "block_q": block_q,
        "block_n": block_n,
        "num_splits": num_splits,
        "num_warps": num_warps,
        "num_stages": num_stages,
    }
    config.update({key: value for key, value in overrides.items() if value is not None})
    block_q, block_n, num_splits = config["block_q"], config["block_n"], config["num_splits"]
    if not (block_q >= 1 and block_q & (block_q - 1) == 0):
        raise ValueError(f"block_q {block_q} must be a power of two")
    if not (block_n >= 16 and block_n & (block_n - 1) == 0):
        raise ValueError(f"block_n {block_n} must be a power of two >= 16")
    group_pad = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(head_dim)
    block_m = max(16, block_q * group_pad)  # tl.dot needs 16 rows

    # Query blocks: sequence i's start at query_start_loc[i] // block_q + i, so T // block_q + S bound them all.
    num_qblocks = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    if num_splits > 1:
        part_acc = query.new_empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32)
        part_m = query.new_empty(num_tokens, num_heads, num_splits, dtype=torch.float32)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    _paged_window_attention_kernel[(num_qblocks, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        out,
        part_acc,
        part_m,
        part_l,
        num_seqs,
        num_tokens,
        num_heads,
        window if window is not None else _NO_WINDOW,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        S_Q_D=query.stride(2),
        S_K_D=key_cache.stride(3),
        S_V_D=value_cache.stride(3),
        S_O_D=out.stride(2),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_acc,
            part_m,
            part_l,
            query_start_loc,
            out,
            num_seqs,
            num_heads,
            out.stride(0),
            out.stride(1),
            S_O_D=out.stride(2),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            num_warps=4 if block_d >= 128 else 1,
        )
    return out
