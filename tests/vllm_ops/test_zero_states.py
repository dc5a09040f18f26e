"""`zero_new_states_` (vllm_integration/ops/zero_states) against its reference, in Triton's interpreter on CPU
machines: on vLLM's conv-state layouts (either way round) and an ssm state of a slot larger than one block, with
continuing rows, first tokens and CUDA-graph padding rows on the null block."""

import importlib

import pytest
import torch

from tools.paged_cache import DEVICE, NULL_BLOCK
from vllm_integration.ops import zero_new_states_ref

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def kernels():
    """The interface, imported after conftest has set TRITON_INTERPRET on CPU machines."""
    return importlib.import_module("vllm_integration.ops.zero_states.interface")


STATES = {
    "conv-dim-first": lambda g: torch.randn(9, 40, 3, generator=g),
    "conv-transposed": lambda g: torch.randn(9, 3, 40, generator=g).transpose(-1, -2),  # vLLM's default layout
    "ssm": lambda g: torch.randn(9, 4, 24, 16, generator=g),  # 1536 elements a slot: two blocks
}


@pytest.mark.parametrize("make_state", STATES.values(), ids=STATES.keys())
def test_zeroes_the_first_tokens_slots_only(kernels, make_state):
    g = torch.Generator().manual_seed(0)
    state = make_state(g).to(DEVICE)
    # Rows: continuing (slot 3), a first token (slot 5), continuing (slot 1), a first token (slot 8), two padding
    # rows on the null block.
    slots = torch.tensor([3, 5, 1, 8, NULL_BLOCK, NULL_BLOCK], dtype=torch.int32, device=DEVICE)
    flags = torch.tensor([True, False, True, False, False, False], device=DEVICE)
    expected = zero_new_states_ref(state.clone(), slots, flags, NULL_BLOCK)
    assert expected[[5, 8]].eq(0).all() and not expected[[0, 1, 3]].eq(0).any()
    got = kernels.zero_new_states_(state, slots, flags, NULL_BLOCK)
    assert got is state
    assert torch.equal(state, expected)


def test_refuses_slots_that_are_not_dense(kernels):
    state = torch.randn(9, 4, 8, 16, device=DEVICE)[:, :, :4]  # every slot strided
    with pytest.raises(ValueError, match="one dense block"):
        kernels.zero_new_states_(
            state, torch.tensor([1], device=DEVICE), torch.tensor([False], device=DEVICE), NULL_BLOCK
        )  # fmt: skip
