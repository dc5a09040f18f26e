"""`zero_new_states_`: checks and launch of the kernel (kernel.py); same signature as `zero_new_states_ref`
(reference.py)."""

import torch

from modeling.ops.triton_utils import cdiv, check_flags, check_index

from .kernel import _zero_new_states_kernel

BLOCK = 1024


def slot_rows(state: torch.Tensor) -> torch.Tensor:
    """state [slots, ...] viewed as [slots, elements of a slot], each slot one dense block whatever the order of its
    dimensions (vLLM's conv state is [.., C, K-1] or its transpose); raises ValueError where a slot is not dense."""
    inner = sorted(range(1, state.dim()), key=state.stride, reverse=True)
    try:
        return state.permute(0, *inner).view(state.shape[0], -1)
    except RuntimeError as error:
        raise ValueError(f"state: each slot must be one dense block, got strides {state.stride()}") from error


def zero_new_states_(
    state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    null_block_id: int,
) -> torch.Tensor:
    """`zero_new_states_ref`'s contract (each slot of `state` a dense block). The grid depends on shapes only, and
    nothing is read on the host: CUDA-graph safe. Returns state."""
    num_rows = state_indices.shape[0]
    check_index("state_indices", state_indices, (num_rows,), like=state)
    check_flags("has_initial_state", has_initial_state, (num_rows,))
    rows = slot_rows(state)
    if num_rows == 0:  # an empty grid is not a valid launch
        return state
    grid = (num_rows, cdiv(rows.shape[1], BLOCK))
    _zero_new_states_kernel[grid](
        rows, state_indices, has_initial_state, rows.stride(0), rows.shape[1], null_block_id, BLOCK=BLOCK
    )
    return state
