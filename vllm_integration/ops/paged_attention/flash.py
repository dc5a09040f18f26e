"""The prefills' window attention on vLLM's FlashAttention 3 (`vllm.vllm_flash_attn`), where it runs: Hopper GPUs,
fp16/bf16 queries and a cache in the same dtype. vLLM's FlashAttention backend keeps its KV cache in the Triton
backend's layout ([num_blocks, KVH, block_size, 2D], split into K and V views the same way), so FA3 reads our cache
as it is. Same contract as `paged_window_attention` (interface.py) for prefill batches, paired with
`paged_window_attention_ref` in tests/vllm_ops/test_paged_attention.py.

Unlike our kernel, FA3 loads whole key tiles and masks scores: slots outside a query's window may be read (vLLM's
cache holds finite values there: zeros from allocation or other tokens' KV), never weighted.
"""

import functools

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def flash_attention_available(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `flash_paged_window_attention` runs here for queries of `dtype` and `head_dim` (the cache in the same
    dtype): a CUDA device of compute capability 9.x and a vLLM build with FA3."""
    if dtype not in FLASH_DTYPES or head_dim % 8 or head_dim > 256 or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        from vllm.vllm_flash_attn.flash_attn_interface import is_fa_version_supported
    except ImportError:
        return False
    return is_fa_version_supported(3)


def flash_paged_window_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    """`paged_window_attention`'s arguments (int32 metadata, the cache in the query's dtype); max_query_len and
    max_seq_len are required (FA3 sizes its grid from them). Query t of a sequence sees keys t - W < s <= t: FA3's
    window (W - 1, 0), with the causal diagonal at the sequence's last key."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=query_start_loc, max_seqlen_q=max_query_len,
        seqused_k=seq_lens, max_seqlen_k=max_seq_len, softmax_scale=scale, causal=True,
        window_size=None if window is None else [window - 1, 0], block_table=block_table, fa_version=3,
    )  # fmt: skip
    return out
