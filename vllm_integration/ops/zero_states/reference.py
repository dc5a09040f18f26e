"""Reference of `zero_new_states_` (interface.py, same signature).

A decode row r of the state metadata continues from slot state_indices[r] when has_initial_state[r] is True; when it
is False the row is a request's first token, whose slot may hold a finished request's state: zeroed here, so that
kernels which always continue from the slot (vLLM's) start it from zero. vLLM's null block (CUDA-graph padding rows,
flag False) is left alone: vLLM's kernels neither read nor write it.
"""

import torch


def zero_new_states_ref(
    state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    null_block_id: int,
) -> torch.Tensor:
    """state [slots, ...] any strides; state_indices [R] int32/int64; has_initial_state [R] bool; null_block_id:
    vLLM's (`vllm.v1.attention.backends.utils.NULL_BLOCK_ID`; not imported here: the ops import no vLLM). Zeroes
    state[state_indices[r]] for every row r whose flag is False and whose slot is not `null_block_id`, in place;
    every other slot keeps its contents. Returns state."""
    fresh = ~has_initial_state & (state_indices != null_block_id)
    state[state_indices[fresh].long()] = 0
    return state
