"""The hybrid layer's fused decode step: the request's window attention over vLLM's paged KV cache and the SSM state
update of its one token, in one launch (`hybrid_decode`, what vLLM's decodes run). The state update alone
(`selective_state_update`) and the SSM step both kernels run (`ssm_state_update`) belong to the selective scan:
modeling/ops/selective_scan (decode.py, interface.py, reference.py).

    reference.py   `window_attention_decode_ref`, `hybrid_decode_ref`: plain PyTorch, the ground truth (exported here;
                   no Triton needed)
    kernel.py      the fused kernel: its attention built from ../attention_tile.py's steps, its SSM programs running
                   modeling/ops/selective_scan/decode.py's `ssm_state_update`
    interface.py   launch policy, argument checks and the public function: import it where the kernels run,
                   `from vllm_integration.ops.hybrid_decode.interface import hybrid_decode`

Tests: tests/vllm_ops/test_hybrid_decode.py.
"""

from .reference import hybrid_decode_ref, window_attention_decode_ref

__all__ = ["hybrid_decode_ref", "window_attention_decode_ref"]
