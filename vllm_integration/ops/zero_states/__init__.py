"""Zeroing the state slots of requests' first tokens among the decode rows (`zero_new_states_`), what the Mamba-2
branch runs before vLLM's conv update (its conv state slots): that kernel continues every row from its slot, while
the hybrid's state metadata serves a one-token prompt as a decode row flagged to start from zero
(history/metadata.py). The fused decode reads the flags itself, so the ssm state needs no zeroing.

    reference.py   `zero_new_states_ref`, plain PyTorch, the ground truth (exported here; no Triton needed)
    kernel.py      the kernel: one program per (row, block of the slot), writing only where the flag is False
    interface.py   checks and `zero_new_states_`: import it where the kernels run,
                   `from vllm_integration.ops.zero_states.interface import zero_new_states_`

Tests: tests/vllm_ops/test_zero_states.py.
"""

from .reference import zero_new_states_ref

__all__ = ["zero_new_states_ref"]
