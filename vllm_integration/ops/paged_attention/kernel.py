"""Triton kernel of the paged window attention (launcher and launch policy in interface.py, reference in
reference.py): one program per (query block, kv head).

Work split: a query block holds BLOCK_Q consecutive queries of one sequence times the G = H / KVH query heads that
share the kv head, packed into the BLOCK_M rows of the score tile (row m = query m // GROUP_PAD, head m % GROUP_PAD),
so each K/V tile is read once per kv head and feeds every head of its group. The program walks the keys [first key
of its earliest query's window, its last query] in tiles of BLOCK_KEYS (`attend_key_tile`, attention_tile.py):
nothing before the window is read, so a query block reads about W + BLOCK_Q keys whatever the context length, and
blocks vLLM freed behind the window are never touched. Only the tiles at the window edge and at the causal diagonal
apply a mask; the tiles between are visible to every row.

Each key's physical block is looked up per key, so BLOCK_KEYS is independent of the cache's page size, and the caches
may have any strides: vLLM's Triton backend hands out views of one tensor [NB, KVH, P, 2D]
(`kv_cache.transpose(1, 2).split(D, dim=-1)`), the flash layout is [2, NB, P, KVH, D].
"""

import triton
import triton.language as tl

from ..attention_tile import attend_key_tile, query_for_products


# One compilation for every batch shape. Serving passes the prefill rows' block table and lengths as slices past the
# decode rows, so their alignment changes with the number of decodes: not specialized on.
@triton.jit(
    do_not_specialize=["num_seqs", "num_tokens", "window"],
    do_not_specialize_on_alignment=["p_block_table", "p_seq_lens"],
)
def _paged_window_attention_kernel(
    p_q,
    p_k,
    p_v,
    p_block_table,
    p_query_start_loc,
    p_seq_lens,
    p_o,
    p_k_scale,
    p_v_scale,
    num_seqs,
    num_tokens,
    window,
    qk_scale,
    s_q_tok,
    s_q_head,
    s_k_block,
    s_k_tok,
    s_k_head,
    s_k_d,
    s_v_block,
    s_v_tok,
    s_v_head,
    s_v_d,
    s_table_seq,
    s_o_tok,
    s_o_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
):
    """Kernel of `paged_window_attention` (reference: `paged_window_attention_ref`). Grid (query blocks, KVH).
    Query blocks are numbered per sequence: sequence i's first block is query_start_loc[i] // BLOCK_Q + i (an upper
    bound on the blocks before it, so the grid needs no device lengths). Writes out [T, H, D], zeros for rows past
    query_start_loc[S]. The head dim of q and out is contiguous. p_k_scale, p_v_scale: an fp8 cache's scales (one
    fp32 each), None for other caches."""
    i_blk, i_kvh = tl.program_id(0), tl.program_id(1)

    # 1. Sequence of this query block: the last one whose first block is <= i_blk (binary search).
    i_lo, i_hi = 0, num_seqs
    while i_lo + 1 < i_hi:
        i_mid = (i_lo + i_hi) // 2
        first_blk_mid = tl.load(p_query_start_loc + i_mid) // BLOCK_Q + i_mid
        if first_blk_mid <= i_blk:
            i_lo = i_mid
        else:
            i_hi = i_mid
    i_seq = i_lo
    bos, eos = tl.load(p_query_start_loc + i_seq), tl.load(p_query_start_loc + i_seq + 1)
    q_len = eos - bos
    i_qblk = i_blk - (bos // BLOCK_Q + i_seq)  # query block within the sequence

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
    p_o_rows = p_o + (o_tok * s_o_tok + o_head * s_o_head)[:, None] + o_d[None, :]
    if i_qblk * BLOCK_Q >= q_len:
        b_zero = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        tl.store(p_o_rows, b_zero.to(p_o.dtype.element_ty), mask=m_pad_row[:, None] & m_d[None, :])
        return

    # 3. Key range: the earliest query's window start .. the last query, cut into tiles of BLOCK_KEYS keys.
    seq_len = tl.load(p_seq_lens + i_seq)
    ctx_len = seq_len - q_len
    o_qpos = ctx_len + o_qi
    q_first = ctx_len + i_qblk * BLOCK_Q
    q_last = ctx_len + tl.minimum(i_qblk * BLOCK_Q + BLOCK_Q, q_len) - 1
    k_first = tl.maximum(q_first - window + 1, 0)
    num_tiles = tl.cdiv(q_last - k_first + 1, BLOCK_KEYS)
    # Tiles [0, j_window) hold keys the window hides from some row (those <= q_last - window), tiles
    # [j_causal, num_tiles) keys causality hides from some row (those > q_first); the tiles between need no mask.
    j_window = tl.minimum(tl.cdiv(tl.maximum(q_last - window + 1 - k_first, 0), BLOCK_KEYS), num_tiles)
    j_causal = tl.maximum((q_first - k_first + 1) // BLOCK_KEYS, j_window)

    # 4. Online softmax over the key tiles.
    p_q_rows = p_q + (o_tok * s_q_tok + o_head * s_q_head)[:, None] + o_d[None, :]
    b_q = tl.load(p_q_rows, mask=m_row[:, None] & m_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    b_q = query_for_products(b_q, p_k)
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    p_k_head = p_k + i_kvh * s_k_head
    p_v_head = p_v + i_kvh * s_v_head
    p_table_row = p_block_table + i_seq.to(tl.int64) * s_table_seq
    if p_k_scale is not None:  # an fp8 cache holds K / k_scale
        qk_scale = qk_scale * tl.load(p_k_scale)
    for j in tl.range(0, j_window):
        b_m, b_l, b_acc = attend_key_tile(
            b_q, b_m, b_l, b_acc, k_first + j * BLOCK_KEYS, None, q_last, o_qpos, window, qk_scale,
            p_k_head, p_v_head, p_table_row, s_k_block, s_k_tok, s_k_d, s_v_block, s_v_tok, s_v_d,
            HEAD_DIM, BLOCK_D, BLOCK_KEYS, PAGE_SIZE, MASKED=True,
        )  # fmt: skip
    for j in tl.range(j_window, j_causal):
        b_m, b_l, b_acc = attend_key_tile(
            b_q, b_m, b_l, b_acc, k_first + j * BLOCK_KEYS, None, q_last, o_qpos, window, qk_scale,
            p_k_head, p_v_head, p_table_row, s_k_block, s_k_tok, s_k_d, s_v_block, s_v_tok, s_v_d,
            HEAD_DIM, BLOCK_D, BLOCK_KEYS, PAGE_SIZE, MASKED=False,
        )  # fmt: skip
    for j in tl.range(j_causal, num_tiles):
        b_m, b_l, b_acc = attend_key_tile(
            b_q, b_m, b_l, b_acc, k_first + j * BLOCK_KEYS, None, q_last, o_qpos, window, qk_scale,
            p_k_head, p_v_head, p_table_row, s_k_block, s_k_tok, s_k_d, s_v_block, s_v_tok, s_v_d,
            HEAD_DIM, BLOCK_D, BLOCK_KEYS, PAGE_SIZE, MASKED=True,
        )  # fmt: skip

    if p_v_scale is not None:  # an fp8 cache holds V / v_scale
        b_acc = b_acc * tl.load(p_v_scale)

    # 5. Output rows (zeros for the CUDA-graph padding rows this block covers, and for rows that saw no key: the
    #    one-token rows of seq_len 0 that pad a replayed decode graph, where l is 0).
    b_o = tl.where(m_row[:, None] & (b_l[:, None] > 0), b_acc / b_l[:, None], 0.0)
    tl.store(p_o_rows, b_o.to(p_o.dtype.element_ty), mask=(m_row | m_pad_row)[:, None] & m_d[None, :])
