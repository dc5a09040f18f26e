"""The steps of window attention over vLLM's paged KV cache that the attention kernels are built from, the paged
attention of the prefills (paged_attention/kernel.py) and the fused decode (hybrid_decode/kernel.py):

    attend_key_tile   one online-softmax step (both kernels): a tile of keys and values read through the block table,
                      the scores masked by the window and causality, the rows' running state updated
    merge_partial     one split-K merge step (the fused decode's split-K): a split's partial state folded into the
                      running one

A row's state is (m, l, acc): m the largest score seen, l the sum of exp2(score - m) and acc the sum of
exp2(score - m) * value, unnormalised (the output is acc / l). Scores are in log2 units (the callers fold log2(e) into
qk_scale), so the softmax is exp2. A row that has seen no visible key has m = -inf, l = 0, acc = 0; both steps keep
it so without a NaN.

Paged layout: key s of a sequence lives in physical block block_table[s // P], slot s % P, of key_cache / value_cache
[NB, P, KVH, D] (P = PAGE_SIZE tokens per block), any strides. A tile loads only the keys in [k_first, k_last]: vLLM
frees the blocks behind a sliding window and points their table entries at a null block, so nothing before the
window may be read, neither the cache nor the block table.

Caches in fp8 (vLLM's `kv_cache_dtype="fp8"`, e4m3) hold K / k_scale and V / v_scale: a tile is converted to the
products' dtype as it is loaded (exactly: every e4m3 value is an fp16, bf16 and fp32 value), and the callers apply
the scales, k_scale folded into the scores' scale and v_scale into the output. The products run in the query's dtype
(`query_for_products`), fp16 for a bf16 query over an fp8 cache.

Positions and the window are int32. Full attention passes triton_utils.NO_WINDOW (2**31 - 1, the largest int32) as
its window: it is only ever subtracted from a position >= -1, which stays >= -2**31, and never added to anything, so
no expression overflows.
"""

import triton
import triton.language as tl

# One precision for every attention product. fp32 caches take tf32x3: each operand split into tf32 high and low parts,
# three tensor-core products summed, about fp32's accuracy (plain tf32 errs by ~1e-3, beyond fp32 tolerances) at
# tensor-core speed ("ieee" falls back to FMAs, several times slower where attention is compute-bound: prefill).
# bf16/fp16 operands ignore it.
DOT_PRECISION = tl.constexpr("tf32x3")


@triton.jit
def query_for_products(b_q, p_cache):
    """The query tile in the dtype the attention products run in (the key and value tiles are converted to it): the
    query's own, but fp16 for a bf16 query over an fp8 cache (`p_cache` points into the key cache). Hopper converts a
    pair of e4m3 values to fp16 in one instruction (cvt.rn.f16x2.e4m3x2) and to bf16 only through fp16: Triton 3.6
    adds a conversion per value (two more per pair; four more, through fp32, before sm_90), quarter-rate work that
    grows with the rows of a decode batch. A bf16 query converts exactly within fp16's range (|q| <= 65504; vLLM's
    own fp8 attention quantizes queries to e4m3, |q| <= 448), and fp16 probabilities are finer than bf16's."""
    if p_cache.dtype.element_ty == tl.float8e4nv and b_q.dtype == tl.bfloat16:  # decided at compile time
        b_q = b_q.to(tl.float16)
    return b_q  # one return: a jit function's returns must share one type


@triton.jit
def attend_key_tile(
    b_q,
    b_m,
    b_l,
    b_acc,
    k_start,
    k_first,
    k_last,
    o_qpos,
    window,
    qk_scale,
    p_k,
    p_v,
    p_block_table,
    s_k_block,
    s_k_tok,
    s_k_d,
    s_v_block,
    s_v_tok,
    s_v_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One online-softmax step of the rows b_q [ROWS, BLOCK_D] (queries at positions o_qpos [ROWS]) over the keys
    k_start .. k_start + BLOCK_KEYS - 1, loading only those in [k_first, k_last]. k_first is None where no tile
    starts before the first key (the paged attention's tiles start there; the fused decode's, aligned to multiples
    of BLOCK_KEYS, may start before it), and the bound then costs nothing. p_k, p_v point at the kv head's keys and
    values (in the query's dtype or fp8, see above; b_q comes from `query_for_products`), p_block_table at the
    sequence's block-table row. MASKED tiles hide, per row, the keys outside (query position - window, query
    position]; unmasked tiles must be visible to every row. Returns the rows' updated (m, l, acc)."""
    o_k = k_start + tl.arange(0, BLOCK_KEYS)
    o_d = tl.arange(0, BLOCK_D)
    m_k = o_k <= k_last
    if k_first is not None:
        m_k = m_k & (o_k >= k_first)
    m_kd = m_k[:, None] & (o_d < HEAD_DIM)[None, :]
    # Physical block of every key: a tile may span several cache blocks. int64: block * stride can pass 2**31.
    b_block = tl.load(p_block_table + o_k // PAGE_SIZE, mask=m_k, other=0).to(tl.int64)
    o_slot = o_k % PAGE_SIZE
    p_kt = p_k + (b_block * s_k_block + o_slot * s_k_tok)[:, None] + o_d[None, :] * s_k_d
    b_k = tl.load(p_kt, mask=m_kd, other=0.0).to(b_q.dtype)  # [BLOCK_KEYS, BLOCK_D]
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * qk_scale  # [ROWS, BLOCK_KEYS]
    if MASKED:
        # Subtraction only: o_qpos - window stays >= -2**31 for NO_WINDOW, where o_k + window would overflow.
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
    p_vt = p_v + (b_block * s_v_block + o_slot * s_v_tok)[:, None] + o_d[None, :] * s_v_d
    b_v = tl.load(p_vt, mask=m_kd, other=0.0).to(b_q.dtype)  # [BLOCK_KEYS, BLOCK_D]
    b_acc = tl.dot(b_p.to(b_v.dtype), b_v, acc=b_acc * b_alpha[:, None], input_precision=DOT_PRECISION)
    return b_m_new, b_l, b_acc


@triton.jit
def merge_partial(b_m, b_l, b_acc, b_m_part, b_l_part, b_acc_part):
    """Folds a split's partial state (m, l, acc over its share of the keys) into the running state of the same rows,
    both rescaled to the larger max. m and l broadcast against acc: scalars for one row acc [BLOCK_D], [ROWS, 1] for
    acc [ROWS, BLOCK_D]. Returns the merged (m, l, acc)."""
    b_m_new = tl.maximum(b_m, b_m_part)
    # Either side may have seen no key (m = -inf): a finite reference max keeps exp2 away from -inf - -inf.
    b_m_ref = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    b_alpha = tl.exp2(b_m - b_m_ref)
    b_beta = tl.exp2(b_m_part - b_m_ref)
    return b_m_new, b_l * b_alpha + b_l_part * b_beta, b_acc * b_alpha + b_acc_part * b_beta
