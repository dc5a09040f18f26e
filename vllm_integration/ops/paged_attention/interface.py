"""`paged_window_attention`: the launch policy, argument checks and launch of the paged window attention kernel
(kernel.py); same signature as `paged_window_attention_ref` (reference.py). Forward only (serving's prefills).
"""

import functools
import math

import torch

from modeling.ops.triton_utils import check_index, check_table, check_tokens, next_power_of_2, window_or_unbounded

from .kernel import _paged_window_attention_kernel


@functools.cache
def _pick_blocks(dtype: torch.dtype, head_dim: int, group: int) -> dict[str, int]:
    """Default launch configuration (H200-minded): block_q, block_keys, num_warps, num_stages.

    Query blocks of 128 or 256 rows (fewer when the head dim is large), flash-attention style: with GQA packing
    (4 heads or more per kv head) 256 rows x 64 keys is the fastest tile at D = 128; without it 128 rows stays the
    default. fp32 takes smaller tiles (its tf32x3 products need three times the registers). The tiles do not depend
    on the query lengths, so one compilation serves every prefill batch, vLLM's warm-up batch of two-token prompts
    included: tiles sized to the longest query would compile a variant per power of two while serving, each a
    multi-second stall, where fixed tiles only leave rows masked in batches of short queries (short batches anyway).
    """
    block_d = next_power_of_2(head_dim)
    group_pad = next_power_of_2(group)
    if dtype == torch.float32:
        block_m, block_keys, num_stages = (64 if block_d <= 64 else 32), (32 if block_d <= 128 else 16), 2
    else:
        block_m = 256 if group_pad >= 4 else 128
        block_m, block_keys, num_stages = (block_m, 64, 3) if block_d <= 128 else (64, 32, 3)
    block_q = max(1, block_m // group_pad)
    num_warps = 8 if block_q * group_pad >= 128 or block_d >= 256 else 4
    return {"block_q": block_q, "block_keys": block_keys, "num_warps": num_warps, "num_stages": num_stages}


# vLLM's fp8 KV cache (`kv_cache_dtype="fp8"` / "fp8_e4m3" on CUDA): values stored as x / scale, one fp32 scale per
# tensor (the layer's k_scale and v_scale).
FP8_CACHE_DTYPE = torch.float8_e4m3fn


def check_paged_cache(key_cache, value_cache, query, k_scale=None, v_scale=None) -> None:
    """key_cache and value_cache [NB, P, KVH, D] (any strides) in the dtype of query [rows, H, D] (H % KVH == 0), or
    in fp8 e4m3 with their scales k_scale, v_scale (one-element fp32 tensors on the query's device; None reads 1)."""
    num_heads, head_dim = query.shape[1:]
    if not (key_cache.dim() == 4 and key_cache.shape[3] == head_dim):
        raise ValueError(f"key_cache: expected [blocks, page, kv heads, {head_dim}], got {tuple(key_cache.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache: expected key_cache's shape {tuple(key_cache.shape)}, got {value_cache.shape}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dtype not in (query.dtype, FP8_CACHE_DTYPE):
            raise ValueError(
                f"{name}: expected the query's dtype {query.dtype} or {FP8_CACHE_DTYPE}, got {cache.dtype}"
            )
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache: expected key_cache's dtype {key_cache.dtype}, got {value_cache.dtype}")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if key_cache.dtype != FP8_CACHE_DTYPE:
            raise ValueError(f"{name}: scales apply to {FP8_CACHE_DTYPE} caches only, got a {key_cache.dtype} cache")
        if not (scale.numel() == 1 and scale.dtype == torch.float32 and scale.device == query.device):
            raise ValueError(
                f"{name}: expected a one-element fp32 tensor on {query.device}, got {scale.dtype} "
                f"{tuple(scale.shape)} on {scale.device}"
            )
    if num_heads % key_cache.shape[2]:
        raise ValueError(f"query: {num_heads} heads is not a multiple of the cache's {key_cache.shape[2]} kv heads")


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    block_q: int | None = None,
    block_keys: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Paged sliding-window (or full) causal attention; same contract as `paged_window_attention_ref`.

    Args:
        query: [T, H, D] packed queries of S sequences (RoPE applied), head dim contiguous.
        key_cache, value_cache: [NB, P, KVH, D] in query's dtype or fp8 e4m3, any strides (views of vLLM's packed
            cache).
        block_table: [S, MB] int32/int64, rows contiguous; entries for blocks outside every query's window are never
            read.
        query_start_loc: [S + 1] int32/int64; seq_lens: [S] int32/int64, context lengths including the new tokens.
        scale: softmax scale; window: W (query t sees keys t - W < s <= t) or None for full attention.
        out: [T, H, D] in query's dtype, head dim contiguous; allocated when None.
        k_scale, v_scale: an fp8 cache's scales (it holds K / k_scale and V / v_scale), one-element fp32 tensors read
            on the device (CUDA-graph safe); None: 1.
        max_query_len, max_seq_len: host-side bounds from vLLM's metadata, unused here: FlashAttention 3 needs them
            (`flash_paged_window_attention`, flash.py), and the serving prefill makes one call to either.
        block_q, block_keys, num_warps, num_stages: launch configuration overrides (`_pick_blocks` fills the rest):
            queries per program, keys per tile.

    Returns out: attention rows for every query; rows past query_start_loc[S] (CUDA-graph padding) are zeros, as
    are the rows of sequences with seq_len 0 (the one-token rows that pad a replayed decode graph).
    No host synchronisation: safe to capture in a CUDA graph.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    check_tokens("query", query, (num_tokens, num_heads, head_dim))
    check_paged_cache(key_cache, value_cache, query, k_scale, v_scale)
    if num_seqs < 1:
        raise ValueError("seq_lens: expected at least one sequence")
    check_index("seq_lens", seq_lens, (num_seqs,), like=query)
    check_index("query_start_loc", query_start_loc, (num_seqs + 1,), like=query)
    check_table("block_table", block_table, num_seqs, like=query)
    window = window_or_unbounded(window)
    if out is None:
        out = torch.empty_like(query)
    check_tokens("out", out, tuple(query.shape))
    if out.dtype != query.dtype:
        raise ValueError(f"out: expected the query's dtype {query.dtype}, got {out.dtype}")

    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    config = _pick_blocks(query.dtype, head_dim, group)
    overrides = {"block_q": block_q, "block_keys": block_keys, "num_warps": num_warps, "num_stages": num_stages}
    config.update({key: value for key, value in overrides.items() if value is not None})
    block_q, block_keys = config["block_q"], config["block_keys"]
    if not (block_q >= 1 and block_q & (block_q - 1) == 0):
        raise ValueError(f"block_q: expected a power of two, got {block_q}")
    if not (block_keys >= 16 and block_keys & (block_keys - 1) == 0):
        raise ValueError(f"block_keys: expected a power of two >= 16, got {block_keys}")
    group_pad = next_power_of_2(group)
    block_d = next_power_of_2(head_dim)
    block_m = max(16, block_q * group_pad)  # tl.dot needs 16 rows

    # Query blocks: sequence i's start at query_start_loc[i] // block_q + i, so T // block_q + S bound them all.
    num_qblocks = num_tokens // block_q + num_seqs
    _paged_window_attention_kernel[(num_qblocks, num_kv_heads)](
        *(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out),
        *(k_scale, v_scale),
        *(num_seqs, num_tokens, window),
        scale * math.log2(math.e),  # softmax in base 2
        *query.stride()[:2],
        *key_cache.stride(),
        *value_cache.stride(),
        block_table.stride(0),
        *out.stride()[:2],
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=key_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_KEYS=block_keys,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return out
