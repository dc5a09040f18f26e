"""`hybrid_decode` (a Mamba-1 branch) and `hybrid_decode_ssd` (Mamba-2): the launch policy, argument checks and
launch of the fused decode kernel (kernel.py); same signatures as `hybrid_decode_ref` and `hybrid_decode_ssd_ref`
(reference.py). The SSM half is checked and sized by its branch's decode helpers, shared with the standalone state
updates: Mamba-1's `state_update_args` and `pick_state_update_block_e` (modeling/ops/selective_scan/decode.py),
Mamba-2's `ssd_update_args` and `pick_ssd_block_p` (modeling/ops/ssd/decode.py).
"""

import math

import torch

from modeling.ops.selective_scan.decode import pick_state_update_block_e, state_update_args
from modeling.ops.ssd.decode import pick_ssd_block_p, ssd_update_args
from modeling.ops.triton_utils import (
    cdiv,
    check_index,
    check_table,
    check_tokens,
    next_power_of_2,
    num_sms,
    window_or_unbounded,
)

from ..paged_attention.interface import check_paged_cache
from .kernel import DecodeAttentionArgs, _hybrid_decode_kernel


def _pick_attention_config(
    num_requests: int, num_kv_heads: int, head_dim: int, max_keys: int, device: torch.device
) -> dict:
    """Launch defaults of `hybrid_decode`'s attention: key tiles [BLOCK_KEYS, D] of 16 KiB in bf16 at D = 128.
    Split-K only when there are fewer than two (request, kv head) pairs per SM: then about four programs per SM, each
    split keeping at least four tiles of the window (below that the merge costs more than the parallelism brings)."""
    block_keys = 64 if head_dim >= 128 else 128
    pairs = max(1, num_requests * num_kv_heads)
    sms = num_sms(device)
    splits = 1
    if pairs < 2 * sms:
        splits = max(1, min(cdiv(4 * sms, pairs), cdiv(max_keys, block_keys) // 4))
    return {"block_keys": block_keys, "num_splits": splits, "num_warps": 4, "num_stages": 2}


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    block_keys: int | None = None,
    num_splits: int | None = None,
    block_e: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    counters: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode step of a hybrid layer with a Mamba-1 branch in one launch: window attention over the paged KV cache
    and the SSM state update. Same contract as `hybrid_decode_ref`:

        query [B, H, D] (RoPE applied; head stride free, head dim contiguous); key_cache, value_cache [NB, P, KVH, D]
        with any strides (e.g. vLLM's Triton layout `kv_cache.transpose(1, 2).split(D, dim=-1)`); block_table
        [B, MB] int32/int64 (rows contiguous); seq_lens [B] int32/int64 (0 = padding row: zeros written); scale;
        window W or None; attn_out [B, H, D] (head dim contiguous); the SSM arguments as in `selective_state_update`
        (modeling.ops.selective_scan.interface).
        An fp8 e4m3 cache holds K / k_scale and V / v_scale (one-element fp32 tensors, read on the device; None: 1).

    Tuning (defaults from `_pick_attention_config` / `pick_state_update_block_e`): block_keys keys per tile, num_splits
    programs per (request, kv head), block_e channels per SSM program, num_warps, num_stages. `counters`: an int32
    buffer of at least B * KVH zeros, left zeroed by the kernel; pass a persistent one to avoid zeroing a fresh one
    (a memset launch) on every call when num_splits > 1. The grid depends only on shapes and host ints: CUDA-graph
    safe. Returns (attn_out, ssm_out)."""
    if u.dim() != 2 or u.shape[0] != query.shape[0]:
        raise ValueError(f"u: expected {query.shape[0]} rows (one per decoding request), got {tuple(u.shape)}")
    ssm = state_update_args(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_out, has_initial_state)
    block_e = block_e or pick_state_update_block_e(ssm.E, ssm.N)
    ssm_launch = {"BLOCK_E": block_e, "SSD": False, "HAS_INDICES": True, "HAS_DT_BIAS": True, "DT_SOFTPLUS": True}
    _launch(
        query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out, ssm,
        cdiv(ssm.E, block_e), ssm_launch, has_initial_state, k_scale=k_scale, v_scale=v_scale,
        block_keys=block_keys, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, counters=counters,
    )  # fmt: skip
    return attn_out, ssm_out


def hybrid_decode_ssd(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    attn_out: torch.Tensor,
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    block_keys: int | None = None,
    num_splits: int | None = None,
    block_p: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode step of a hybrid layer with a Mamba-2 branch in one launch: the window attention of `hybrid_decode`
    (its first eight arguments and tuning, the same) and Mamba-2's state update, whose arguments after the attention's
    are `ssd_state_update`'s (modeling/ops/ssd/decode.py; x [B, Hs, P], dt [B, Hs] raw, B and C [B, G, N], out
    [B, Hs, P]), so that binding the attention's leaves a function of the update's signature. Reference:
    `hybrid_decode_ssd_ref`. block_p: head channels per SSM program. Returns out (attention output in attn_out)."""
    ssd = ssd_update_args(ssm_state, x, dt, A, B, C, D, state_indices, has_initial_state, dt_bias, out)
    if x.shape[0] != query.shape[0]:
        raise ValueError(f"x: expected {query.shape[0]} rows (one per decoding request), got {tuple(x.shape)}")
    block_p = block_p or pick_ssd_block_p(ssd.P, ssd.N)
    ssm_launch = {"BLOCK_E": block_p, "SSD": True, "HAS_INDICES": state_indices is not None,
                  "HAS_DT_BIAS": dt_bias is not None, "DT_SOFTPLUS": dt_softplus}  # fmt: skip
    _launch(
        query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out, ssd,
        ssd.H * cdiv(ssd.P, block_p), ssm_launch, has_initial_state, k_scale=k_scale, v_scale=v_scale,
        block_keys=block_keys, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages, counters=counters,
    )  # fmt: skip
    return out


def _launch(
    query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out, ssm, num_ssm_blocks, ssm_launch,
    has_initial_state, *, k_scale, v_scale, block_keys, num_splits, num_warps, num_stages, counters,
) -> None:  # fmt: skip
    """Checks the attention's arguments, picks its launch shape and launches the fused kernel with the SSM half
    `ssm` (checked by its own step's helpers; its N sizes the state tile), `num_ssm_blocks` SSM programs per request
    and its constexprs."""
    num_requests, num_heads, head_dim = query.shape
    check_tokens("query", query, (num_requests, num_heads, head_dim))
    check_paged_cache(key_cache, value_cache, query, k_scale, v_scale)
    check_tokens("attn_out", attn_out, tuple(query.shape))
    check_table("block_table", block_table, num_requests, like=query)
    check_index("seq_lens", seq_lens, (num_requests,), like=query)
    window = window_or_unbounded(window)

    num_kv_heads, page_size = key_cache.shape[2], key_cache.shape[1]
    max_keys = block_table.shape[1] * page_size
    config = _pick_attention_config(num_requests, num_kv_heads, head_dim, min(window, max_keys), query.device)
    block_keys = block_keys or config["block_keys"]
    splits = num_splits or config["num_splits"]
    group = num_heads // num_kv_heads
    if not (block_keys >= 16 and block_keys & (block_keys - 1) == 0):
        raise ValueError(f"block_keys: expected a power of two >= 16, got {block_keys}")
    if num_requests == 0:  # an empty grid is not a valid launch
        return

    num_pairs = num_requests * num_kv_heads
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
                f"counters: expected a contiguous int32 buffer of at least {num_pairs} zeros on {query.device}, got "
                f"{counters.dtype} {tuple(counters.shape)} on {counters.device}"
            )
    else:  # never dereferenced: without split-K the programs write attn_out directly
        part_o = part_ml = counters = attn_out
    attn = DecodeAttentionArgs(
        *(query, *query.stride()[:2]),
        *(key_cache, *key_cache.stride()),
        *(value_cache, *value_cache.stride()),
        *(block_table, block_table.stride(0)),
        seq_lens,
        *(attn_out, *attn_out.stride()[:2]),
        *(part_o, part_ml, counters),
        scale * math.log2(math.e),  # softmax in base 2
        window,
        *(num_kv_heads, group),
    )
    num_attn_programs = num_pairs * splits
    _hybrid_decode_kernel[(num_attn_programs + num_requests * num_ssm_blocks,)](
        attn,
        ssm,
        k_scale,
        v_scale,
        num_attn_programs,
        num_ssm_blocks,
        splits,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        SPLIT_K=splits > 1,
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_KEYS=block_keys,
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_N=next_power_of_2(ssm.N),
        HAS_INITIAL_FLAGS=has_initial_state is not None,
        num_warps=num_warps or config["num_warps"],
        num_stages=num_stages or config["num_stages"],
        **ssm_launch,
    )
