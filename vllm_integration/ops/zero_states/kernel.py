"""Triton kernel of `zero_new_states_` (launcher in interface.py, reference in reference.py). Grid (rows, blocks of
BLOCK elements of one slot): a program whose row continues (or sits on the null block) returns at once, so a step
without first tokens writes nothing."""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["s_slot", "slot_numel", "null_block_id"])
def _zero_new_states_kernel(p_state, p_indices, p_flags, s_slot, slot_numel, null_block_id, BLOCK: tl.constexpr):
    """p_state: the state viewed as [slots, slot_numel] rows of stride s_slot (each slot dense); p_indices [R] slots,
    p_flags [R] bool."""
    i_row, i_blk = tl.program_id(0), tl.program_id(1)
    if tl.load(p_flags + i_row) != 0:
        return
    slot = tl.load(p_indices + i_row).to(tl.int64)
    if slot == null_block_id:
        return
    o_elem = i_blk * BLOCK + tl.arange(0, BLOCK)
    b_zero = tl.zeros([BLOCK], dtype=p_state.dtype.element_ty)
    tl.store(p_state + slot * s_slot + o_elem, b_zero, mask=o_elem < slot_numel)
