"""The launch toolkit's host-side shape helpers against Triton's own, which they replace in launch paths."""

import pytest

triton = pytest.importorskip("triton")

from modeling.ops.triton_utils import cdiv, next_power_of_2  # after the skip: needs triton


def test_cdiv_is_tritons():
    for a in range(-3, 300):
        for b in (1, 2, 3, 7, 16, 64, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


def test_next_power_of_2_is_tritons():
    for n in [*range(-4, 1100), 2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_the_helpers_stay_symbolic_under_dynamic_shapes():
    """Dynamo traces the training launch paths; with dynamic shapes their token counts are SymInts. The helpers must
    keep them symbolic (one graph for every length), as Triton's do, not specialise on each value."""
    import torch
    from torch._dynamo.utils import counters

    def blocks(x):
        return x.new_zeros(next_power_of_2(cdiv(x.shape[0], 3))) + 1

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(blocks, dynamic=True, fullgraph=True, backend="eager")
    for length in (5, 17, 100, 101, 300):
        assert compiled(torch.randn(length)).shape[0] == triton.next_power_of_2(triton.cdiv(length, 3))
    assert counters["stats"]["unique_graphs"] == 1
