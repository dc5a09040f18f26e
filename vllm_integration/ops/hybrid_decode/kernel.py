"""Triton kernel of the hybrid layer's fused decode step (launcher in interface.py; references, with the glossary and
the exact semantics, in reference.py):

    _hybrid_decode_kernel   ONE launch for a batch of decoding requests: the sliding-window attention over vLLM's
                            paged KV cache AND the SSM state update. Inference only: no autograd.

Its SSM programs run the history branch's decode step: Mamba-1's `ssm_state_update` (modeling/ops/selective_scan/
decode.py, the body of the standalone `selective_state_update` too) or, with SSD set, Mamba-2's `ssd_state_step`
(modeling/ops/ssd/decode.py, the body of `ssd_state_update`); its attention is built from the steps of
../attention_tile.py, as the paged window attention is. The kernel takes each half's tensors, strides and sizes as one
named tuple (`DecodeAttentionArgs` here, `StateUpdateArgs` or `SSDUpdateArgs` from the decode modules: Triton passes
a named tuple as one argument whose fields the kernel reads by name, compiled exactly as separate arguments), so the
SSM half reaches its step as one argument.

Grid of `_hybrid_decode_kernel` (1-D, sized from shapes and host ints only, so it is CUDA-graph safe):

    pid in [0, B * KVH * splits)                attention: request i, kv head h, split s (s fastest, then h, then i)
    pid in [B * KVH * splits, ... + B * SB)     SSM update: request i, its block b of SB: Mamba-1, channel block b
                                                (SB = cdiv(E, BLOCK_E)); Mamba-2 (SSD), head b // PB, head channel
                                                block b % PB (SB = H * PB, PB = cdiv(P, BLOCK_E))

The attention programs come first: they are the long ones, and the short SSM programs then fill the SMs while the
last attention programs drain. An attention program packs the G query heads of its kv head into one [BLOCK_G, D]
tile (padded to 16 rows for tl.dot), so each key/value of the window is read once for all of them, and streams its
share of the window in tiles of BLOCK_KEYS keys (`attend_key_tile`).

Split-K: with splits > 1 the window's tiles are shared out between that many programs per (request, kv head), for
enough programs to keep HBM busy when B * KVH is small. Each writes its partial state (max, sum, unnormalised output)
to a fp32 workspace and increments a per-(request, kv head) counter; the program that arrives last merges the
partials (`merge_partial`), writes the output and resets the counter to zero, all in the same launch. The number of
splits is a runtime argument, not a constant of the compilation: it follows the batch size, and a constant would
compile a variant per value while serving, each a stall of seconds. The counter must be zero before the launch: the
launcher zeroes a fresh one unless it is handed a persistent zeroed `counters` buffer (which the kernel leaves zeroed,
so one buffer serves launch after launch on one stream: the next layer, the next CUDA-graph replay).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from modeling.ops.selective_scan.decode import ssm_state_update
from modeling.ops.ssd.decode import ssd_state_step

from ..attention_tile import attend_key_tile, merge_partial, query_for_products


class DecodeAttentionArgs(NamedTuple):
    """What the attention programs of `_hybrid_decode_kernel` read and write (shapes and meanings in reference.py's
    `window_attention_decode_ref`), with the split-K workspace."""

    query: torch.Tensor  # [B, H, D], head dim contiguous
    s_q_req: int
    s_q_head: int
    key_cache: torch.Tensor  # [NB, P, KVH, D], in the query's dtype or fp8
    s_k_block: int
    s_k_tok: int
    s_k_head: int
    s_k_d: int
    value_cache: torch.Tensor  # [NB, P, KVH, D]
    s_v_block: int
    s_v_tok: int
    s_v_head: int
    s_v_d: int
    block_table: torch.Tensor  # [B, MB]
    s_table_req: int
    seq_lens: torch.Tensor  # [B]
    out: torch.Tensor  # [B, H, D], head dim contiguous
    s_o_req: int
    s_o_head: int
    part_o: torch.Tensor  # split-K partial outputs [B * KVH, splits, G, D] fp32
    part_ml: torch.Tensor  # split-K partial maxima and sums [B * KVH, splits, 2, G] fp32
    counters: torch.Tensor  # [>= B * KVH] int32 arrivals per (request, kv head), zero between launches
    qk_scale: float  # softmax scale times log2(e)
    window: int  # W, or NO_WINDOW
    KVH: int
    G: int


# One compilation for every batch size and split count: the split count only picks SPLIT_K (split or not).
@triton.jit(do_not_specialize=["num_attn_programs", "num_splits"])
def _hybrid_decode_kernel(
    attn,
    ssm,
    p_k_scale,
    p_v_scale,
    num_attn_programs,
    num_ssm_blocks,
    num_splits,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_INITIAL_FLAGS: tl.constexpr,
    SSD: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
):
    """Kernel of `hybrid_decode` and `hybrid_decode_ssd` (`attn`: a DecodeAttentionArgs, `ssm`: a StateUpdateArgs,
    or with SSD an SSDUpdateArgs); grid in the module docstring. BLOCK_KEYS is the attention's key tile, BLOCK_E and
    BLOCK_N the SSM's channel block (Mamba-2: of a head's channels) and state size; HAS_INDICES, HAS_DT_BIAS and
    DT_SOFTPLUS are `ssd_state_step`'s (Mamba-1's step always has all three).
    p_k_scale, p_v_scale: an fp8 KV cache's scales (one fp32 each; attention_tile.py), None for other caches.

    An attention program serves the G query heads of one kv head of one request against its split's tiles of the
    request's window. Tiles are aligned to multiples of BLOCK_KEYS positions; keys outside the window
    [seq_len - W, seq_len) are masked and never loaded, so blocks freed before the window (null blocks) are never
    read."""
    pid = tl.program_id(0)
    if pid >= num_attn_programs:  # the SSM programs, after the attention ones
        i_prog = pid - num_attn_programs
        i_req, i_block = i_prog // num_ssm_blocks, i_prog % num_ssm_blocks
        if SSD:
            head_blocks = tl.cdiv(ssm.P, BLOCK_E)
            ssd_state_step(
                ssm, i_req, i_block // head_blocks, i_block % head_blocks, BLOCK_E, BLOCK_N, HAS_INDICES,
                HAS_INITIAL_FLAGS, HAS_DT_BIAS, DT_SOFTPLUS, False, False,  # no padding rows in vLLM's batch; A given
            )  # fmt: skip
        else:
            ssm_state_update(ssm, i_req, i_block, BLOCK_E, BLOCK_N, HAS_INITIAL_FLAGS)
        return

    i_split = pid % num_splits
    i_kvh = (pid // num_splits) % attn.KVH
    i_req = pid // (num_splits * attn.KVH)

    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_g, m_d = o_g < attn.G, o_d < HEAD_DIM
    m_gd = m_g[:, None] & m_d[None, :]
    o_heads = i_kvh * attn.G + o_g  # query heads served by kv head i_kvh
    p_q = attn.query + i_req.to(tl.int64) * attn.s_q_req + o_heads[:, None] * attn.s_q_head + o_d[None, :]
    b_q = query_for_products(tl.load(p_q, mask=m_gd, other=0.0), attn.key_cache)

    # The request's one query sits at position seq_len - 1: the position of every row (head) of the tile.
    seq_len = tl.load(attn.seq_lens + i_req)
    o_qpos = tl.zeros([BLOCK_G], dtype=seq_len.dtype) + (seq_len - 1)
    start = tl.maximum(seq_len - attn.window, 0)
    # This split owns a contiguous run of the tiles that hold [start, seq_len).
    tile_lo = start // BLOCK_KEYS
    tile_hi = tl.cdiv(seq_len, BLOCK_KEYS)
    tiles_per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
    split_lo = tile_lo + i_split * tiles_per_split
    split_hi = tl.minimum(split_lo + tiles_per_split, tile_hi)

    p_table_row = attn.block_table + i_req.to(tl.int64) * attn.s_table_req
    p_k_head = attn.key_cache + i_kvh * attn.s_k_head
    p_v_head = attn.value_cache + i_kvh * attn.s_v_head
    b_m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_G], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    qk_scale = attn.qk_scale
    if p_k_scale is not None:  # an fp8 cache holds K / k_scale
        qk_scale = qk_scale * tl.load(p_k_scale)
    for i_t in tl.range(split_lo, split_hi):
        b_m, b_l, b_acc = attend_key_tile(
            b_q, b_m, b_l, b_acc, i_t * BLOCK_KEYS, start, seq_len - 1, o_qpos, attn.window, qk_scale,
            p_k_head, p_v_head, p_table_row, attn.s_k_block, attn.s_k_tok, attn.s_k_d,
            attn.s_v_block, attn.s_v_tok, attn.s_v_d, HEAD_DIM, BLOCK_D, BLOCK_KEYS, PAGE_SIZE, MASKED=True,
        )  # fmt: skip
    if p_v_scale is not None:  # an fp8 cache holds V / v_scale (the split partials are linear in acc)
        b_acc = b_acc * tl.load(p_v_scale)

    p_out = attn.out + i_req.to(tl.int64) * attn.s_o_req + o_heads[:, None] * attn.s_o_head + o_d[None, :]
    if not SPLIT_K:
        # An empty window (seq_len == 0: CUDA-graph padding) has b_l == 0 and b_acc == 0: it writes zeros.
        b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
        tl.store(p_out, b_o.to(attn.out.dtype.element_ty), mask=m_gd)
    else:
        # Partials of (request, kv head) are [splits, G, D] (output) and [splits, 2, G] (max, sum), fp32.
        G = attn.G
        i_pair = i_req * attn.KVH + i_kvh
        p_part_o_pair = attn.part_o + i_pair.to(tl.int64) * num_splits * G * HEAD_DIM
        p_part_ml_pair = attn.part_ml + i_pair.to(tl.int64) * num_splits * 2 * G
        o_gd = o_g[:, None] * HEAD_DIM + o_d[None, :]
        tl.store(p_part_o_pair + i_split * G * HEAD_DIM + o_gd, b_acc, mask=m_gd)
        tl.store(p_part_ml_pair + i_split * 2 * G + o_g, b_m, mask=m_g)
        tl.store(p_part_ml_pair + i_split * 2 * G + G + o_g, b_l, mask=m_g)
        # Release: the barrier orders every thread's partial stores before the counter increment (acq_rel, gpu
        # scope); the last program's acquire then sees all the splits' partials (loaded bypassing L1: .cg).
        tl.debug_barrier()
        n_before = tl.atomic_add(attn.counters + i_pair, 1, sem="acq_rel", scope="gpu")
        if n_before == num_splits - 1:
            tl.store(attn.counters + i_pair, 0)  # every split has arrived: ready for the next launch
            b_m_all = tl.full([BLOCK_G, 1], float("-inf"), dtype=tl.float32)
            b_l_all = tl.zeros([BLOCK_G, 1], dtype=tl.float32)
            b_acc_all = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
            for i_part in tl.range(0, num_splits):
                p_ml = p_part_ml_pair + i_part * 2 * G + o_g
                b_m_part = tl.load(p_ml, mask=m_g, other=float("-inf"), cache_modifier=".cg")
                b_l_part = tl.load(p_ml + G, mask=m_g, other=0.0, cache_modifier=".cg")
                p_acc = p_part_o_pair + i_part * G * HEAD_DIM + o_gd
                b_acc_part = tl.load(p_acc, mask=m_gd, other=0.0, cache_modifier=".cg")
                b_m_all, b_l_all, b_acc_all = merge_partial(
                    b_m_all, b_l_all, b_acc_all, b_m_part[:, None], b_l_part[:, None], b_acc_part
                )
            # Padding requests (seq_len == 0) have no keys in any split: l == 0, acc == 0, zeros written.
            b_o = b_acc_all / tl.where(b_l_all > 0, b_l_all, 1.0)
            tl.store(p_out, b_o.to(attn.out.dtype.element_ty), mask=m_gd)
