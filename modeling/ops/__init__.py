"""Sequence-mixing ops of the hybrid model. Each op has a plain-PyTorch reference (`*_ref`) that runs anywhere and is
the ground truth for its Triton kernel in the `*_triton` module beside it:

    causal_conv1d       training conv (fwd/bwd), varlen prefill conv and decode update over a conv state cache
    selective_scan      training scan (fwd/bwd) and varlen prefill scan over an ssm state cache
    paged_attention     window attention over vLLM's paged KV cache (prefill, chunked prefill, decode)
    hybrid_decode       decode: the single-token state update, and the fused window attention + state update

vLLM's decodes run `hybrid_decode` (one launch); its prefills run `paged_window_attention`, which also handles
decode rows (its split-K decode setting is what the benchmark's "separate launches" anchor times).

The `*_triton` modules import Triton; import them where the kernels are used (CUDA, or Triton's interpreter).
"""

from .causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref, causal_conv1d_varlen_ref
from .hybrid_decode import hybrid_decode_ref, selective_state_update_ref
from .paged_attention import paged_window_attention_ref
from .selective_scan import selective_scan_ref, selective_scan_varlen_ref

__all__ = [
    "causal_conv1d_ref",
    "causal_conv1d_update_ref",
    "causal_conv1d_varlen_ref",
    "hybrid_decode_ref",
    "paged_window_attention_ref",
    "selective_scan_ref",
    "selective_scan_varlen_ref",
    "selective_state_update_ref",
]
