"""The hybrid layer's decode step: the SSM state update of one token per request, alone (`selective_state_update`)
or fused with the request's window attention over vLLM's paged KV cache in one launch (`hybrid_decode`, what vLLM's
decodes run).

    reference.py   `selective_state_update_ref`, `window_attention_decode_ref`, `hybrid_decode_ref`: plain PyTorch,
                   the ground truth (exported here; no Triton needed)
    kernel.py      `ssm_state_update` (the SSM step both kernels run), the standalone and the fused kernels; the fused
                   decode's attention is built from ../attention_tile.py's steps
    interface.py   launch policy, argument checks and the public functions: import it where the kernels run,
                   `from vllm_integration.ops.hybrid_decode.interface import hybrid_decode, selective_state_update`

Tests: tests/vllm_ops/test_hybrid_decode.py.
"""

from .reference import hybrid_decode_ref, selective_state_update_ref, window_attention_decode_ref

__all__ = ["hybrid_decode_ref", "selective_state_update_ref", "window_attention_decode_ref"]
