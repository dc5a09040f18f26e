"""Sliding-window attention over vLLM's paged KV cache: the plain-PyTorch reference of the paged window attention
kernels (`paged_window_attention` in interface.py, same signature; tests in tests/vllm_ops/test_paged_attention.py).

Glossary of dimension letters (shared by every op of vllm_integration/ops):
    S  sequences in the batch           T  query tokens of all sequences, packed
    H  query heads                      KVH  key/value heads (GQA: H % KVH == 0, G = H // KVH heads share one)
    D  head dim                         W  window (keys a query sees, itself included)
    NB physical blocks of the cache     P  tokens per block (vLLM's block_size, the page size)
    MB logical blocks per sequence in the block table (its width)

Semantics (docs/DESIGN.md, "Attention"): the query at absolute position t attends to keys s with t - W < s <= t on a
sliding layer (`window=W`), 0 <= s <= t on a full-attention layer (`window=None`); softmax in fp32. Sequence i owns
query rows query_start_loc[i]:query_start_loc[i+1] of `query` and has seq_lens[i] tokens in the cache, its new
tokens included, so its q_len_i queries sit at positions seq_lens[i] - q_len_i .. seq_lens[i] - 1. This covers
prefill (q_len == seq_len), chunked prefill (q_len < seq_len) and decode (q_len == 1) in one batch.

Paged layout (vLLM): token s of sequence i lives in physical block block_table[i, s // P], slot s % P, of
key_cache / value_cache [NB, P, KVH, D]. With a sliding-window KV spec vLLM frees the blocks that fell out of the
window and points their table entries at a null block, so nothing before the window may be read.
"""

import torch


def paged_window_attention_ref(
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
) -> torch.Tensor:
    """Paged (sliding-window) causal attention, one sequence at a time.

    Args:
        query: [T, H, D] packed queries of S sequences, RoPE applied; any strides.
        key_cache, value_cache: [NB, P, KVH, D] paged cache, any strides; the new tokens' K/V already written.
        block_table: [S, MB] int32/int64, logical block j of sequence i -> physical block block_table[i, j].
        query_start_loc: [S + 1] int32/int64, cumulative query counts (query_start_loc[0] == 0).
        seq_lens: [S] int32/int64, tokens in the cache per sequence, new tokens included (>= its query count).
        scale: softmax scale (1/sqrt(D)).
        window: W for a sliding layer (t - W < s <= t), None for full causal attention.
        out: [T, H, D] written in place when given.
        k_scale, v_scale: the scales of an fp8 cache, which holds K / k_scale and V / v_scale (vLLM's
            `kv_cache_dtype="fp8"`); None: 1.

    Returns:
        out [T, H, D] in query's dtype. Rows past query_start_loc[S] (CUDA-graph padding tokens) are zeros, as are
        the rows of sequences with seq_len 0 (no key: the one-token rows that pad a replayed decode graph).
    """
    group = query.shape[1] // key_cache.shape[2]  # query heads per kv head
    if out is None:
        out = torch.empty_like(query)
    out.zero_()
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [q_len]
        # Only keys some query of this sequence can see are gathered: blocks before the window may be freed.
        first_key = 0 if window is None else max(0, seq_len - q_len - window + 1)
        k_pos = torch.arange(first_key, seq_len, device=query.device)  # [L]
        blocks = block_table[i, k_pos // key_cache.shape[1]].long()  # [L]
        slots = k_pos % key_cache.shape[1]
        k = key_cache[blocks, slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = value_cache[blocks, slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        if k_scale is not None:
            k = k * k_scale.float()
        if v_scale is not None:
            v = v * v_scale.float()
        q = query[starts[i] : starts[i + 1]].float()  # [q_len, H, D]

        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, q_len, L]
        visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, L]
        if window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
