"""Paged window attention: sliding-window (or full) causal attention over vLLM's paged KV cache, for prefill,
chunked prefill and decode rows in one batch (vLLM's prefills run it).

    reference.py   `paged_window_attention_ref`, plain PyTorch, the ground truth (exported here; no Triton needed)
    kernel.py      the attention kernel and the split-K merge, built from ../attention_tile.py's steps
    interface.py   launch policy, argument checks and `paged_window_attention`: import it where the kernels run,
                   `from vllm_integration.ops.paged_attention.interface import paged_window_attention`

Tests: tests/vllm_ops/test_paged_attention.py.
"""

from .reference import paged_window_attention_ref

__all__ = ["paged_window_attention_ref"]
