"""Decode step of the hybrid layer: plain-PyTorch references of the fused decode kernel (`hybrid_decode` and
`hybrid_decode_ssd` in interface.py, same signatures) and of its attention half (`window_attention_decode_ref`); its
SSM half is the history branch's decode step: Mamba-1's `selective_state_update_ref`
(modeling/ops/selective_scan/reference.py), Mamba-2's `ssd_state_update_ref` (modeling/ops/ssd/reference.py). Tests
in tests/vllm_ops/test_hybrid_decode.py.

Glossary of dimension letters (as in ../paged_attention/reference.py):
    B    decoding requests in the batch (one new token each). `B`, `C` and `D` the tensors are the SSM's projections
         and skip connection, as in docs/DESIGN.md.
    H    query heads          KVH  key/value heads (H % KVH == 0)      G  H / KVH query heads per kv head
    D    head dim             W    sliding window                     P  tokens per KV cache block (page size)
    NB   physical KV blocks   MB   logical blocks per request (block table width)
    E    SSM channels         N    state size per channel     Hs, P  Mamba-2's heads and channels per head (E = Hs P)
The SSM state cache ([slots, E, N]; Mamba-2's [slots, Hs, P, N]) has a row per running request: `slots` is a count
of its own, not B.

Two jobs per decoding request i, both reading one cache and writing one output:
    attention    query i sits at position seq_lens[i] - 1 and attends to the keys s with
                 seq_lens[i] - 1 - W < s <= seq_lens[i] - 1 (exactly W keys once the context is long enough; all keys
                 when the window is None), looked up through the block table: key s of request i lives at
                 key_cache[block_table[i, s // P], s % P]. A request with seq_lens[i] == 0 (CUDA-graph padding) gets
                 zeros.
    SSM update   one step of docs/DESIGN.md's recurrence from the request's state slot, in fp32, written back in
                 place. Mamba-1 (`selective_state_update_ref`): dt = softplus(dt_raw + dt_bias); state =
                 exp(dt * A) * state + dt * u * B; y = state @ C + D * u; out = y * silu(z); a slot index of -1
                 (padding) leaves every slot alone and writes zeros. Mamba-2 (`ssd_state_update_ref`): the same per
                 head, with one dt, A and D per head and B, C of the head's group; no gate (the branch's norm
                 follows); slots are never -1. A row whose has_initial_state flag is False starts from a zero state
                 (a request's first token). (vLLM pads a replayed decode graph with its null block, slot 0, and a
                 False flag: such rows compute from zero and write only the null block, which nothing reads.)
"""

import torch

from modeling.ops.selective_scan import selective_state_update_ref
from modeling.ops.ssd import ssd_state_update_ref

from ..paged_attention.reference import paged_window_attention_ref


def window_attention_decode_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    attn_out: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sliding-window (or full) attention of one query per request over the paged KV cache: the decode case of
    `paged_window_attention_ref` (one query per request), with padding requests (seq_lens 0) zeroed.

    Args:
        query: [B, H, D] (RoPE applied), the token at position seq_lens[i] - 1.
        key_cache, value_cache: [NB, P, KVH, D], any strides.
        block_table: [B, MB] int32/int64, logical block -> physical block; blocks before the window are never touched.
        seq_lens: [B] int32/int64 context length including the new token (whose K/V is already cached); 0 = padding.
        scale: softmax scale.   window: W, or None for full attention.
        attn_out: [B, H, D] written and returned.
        k_scale, v_scale: an fp8 cache's scales, as in `paged_window_attention_ref`.
    """
    real = seq_lens > 0  # [B]
    num_real = int(real.sum())
    query_start_loc = torch.arange(num_real + 1, dtype=torch.int32, device=query.device)  # one query each
    attn_out.zero_()
    attn_out[real] = paged_window_attention_ref(
        query[real], key_cache, value_cache, block_table[real], query_start_loc, seq_lens[real], scale, window,
        attn_out.new_empty(num_real, *attn_out.shape[1:]), k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    return attn_out


def hybrid_decode_ref(
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
    has_initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both halves of a hybrid layer's decode step: `window_attention_decode_ref` then `selective_state_update_ref`
    (see them for the arguments). Reference of `hybrid_decode` (interface.py, same signature), which does both in one
    launch. Returns (attn_out [B, H, D], ssm_out [B, E])."""
    window_attention_decode_ref(
        query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out, k_scale=k_scale, v_scale=v_scale
    )
    selective_state_update_ref(
        ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_out, has_initial_state=has_initial_state
    )
    return attn_out, ssm_out


def hybrid_decode_ssd_ref(
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
) -> torch.Tensor:
    """Both halves of the decode step of a hybrid layer with a Mamba-2 branch: `window_attention_decode_ref` then
    `ssd_state_update_ref` (see them for the arguments). Reference of `hybrid_decode_ssd` (interface.py, same
    signature), which does both in one launch. Returns out [B, Hs, P] (the attention's in attn_out)."""
    window_attention_decode_ref(
        query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out, k_scale=k_scale, v_scale=v_scale
    )
    return ssd_state_update_ref(
        ssm_state, x, dt, A, B, C, D, state_indices, has_initial_state, dt_bias=dt_bias, dt_softplus=dt_softplus,
        out=out,
    )  # fmt: skip
