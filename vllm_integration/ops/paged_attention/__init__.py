"""Paged window attention: sliding-window (or full) causal attention over vLLM's paged KV cache, for packed prefills
and chunked prefills (rows of any query length, one-token rows included; vLLM's prefills run it, its decodes run
../hybrid_decode).

    reference.py   `paged_window_attention_ref`, plain PyTorch, the ground truth (exported here; no Triton needed)
    kernel.py      the attention kernel, built from ../attention_tile.py's steps
    interface.py   launch policy, argument checks and `paged_window_attention`: import it where the kernels run,
                   `from vllm_integration.ops.paged_attention.interface import paged_window_attention`

Tests: tests/vllm_ops/test_paged_attention.py.
"""

from .reference import paged_window_attention_ref

__all__ = ["paged_window_attention_ref"]
