"""The hybrid layer's fused decode step: the request's window attention over vLLM's paged KV cache and the history
branch's state update of its one token, in one launch (`hybrid_decode` for a Mamba-1 branch, `hybrid_decode_ssd` for
Mamba-2: what vLLM's decodes run). The state updates alone and the SSM steps the kernels share belong to the
branches' ops: `selective_state_update` / `ssm_state_update` in modeling/ops/selective_scan, `ssd_state_update` /
`ssd_state_step` in modeling/ops/ssd.

    reference.py   `window_attention_decode_ref`, `hybrid_decode_ref`, `hybrid_decode_ssd_ref`: plain PyTorch, the
                   ground truth (exported here; no Triton needed)
    kernel.py      the fused kernel: its attention built from ../attention_tile.py's steps, its SSM programs running
                   the branch's step
    interface.py   launch policy, argument checks and the public functions: import it where the kernels run,
                   `from vllm_integration.ops.hybrid_decode.interface import hybrid_decode, hybrid_decode_ssd`

Tests: tests/vllm_ops/test_hybrid_decode.py.
"""

from .reference import hybrid_decode_ref, hybrid_decode_ssd_ref, window_attention_decode_ref

__all__ = ["hybrid_decode_ref", "hybrid_decode_ssd_ref", "window_attention_decode_ref"]
