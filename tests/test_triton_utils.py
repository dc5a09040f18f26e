"""The launch toolkit's host-side shape helpers against Triton's own, which they replace in launch paths."""

import pytest

triton = pytest.importorskip("triton")

from modeling.ops.triton_utils import cdiv, launch_power_of_2, next_power_of_2  # after the skip: needs triton


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


def test_launch_power_of_2_is_next_power_of_2_within_its_bounds():
    for n in [*range(-4, 1100), 2**20 - 1, 2**20 + 1]:
        assert launch_power_of_2(n) == max(1, next_power_of_2(n)), n
        assert launch_power_of_2(n, cap=32) == min(32, max(1, next_power_of_2(n))), n
        assert launch_power_of_2(n, floor=64) == max(64, next_power_of_2(n)), n


def test_launch_shapes_from_a_token_count_are_plain_ints_under_dynamic_shapes():
    """Block sizes and warp counts reach kernels as constexpr arguments and `num_warps`, which Dynamo takes only as
    plain ints: with dynamic shapes, those the training launch paths pick from a token count (the conv's row block,
    the Mamba-1 scan's chunk) must come out as ints, guarded by range, one graph for every length in a range. (Before,
    the conv's were SymInts, and compiling a Mamba-2 training step a second time, at another length, failed in
    Dynamo's Triton wrapper.) The graph multiplies x by each pick: a SymInt would enter it as a computed node."""
    import torch

    from modeling.ops.causal_conv1d.interface import _pick_blocks
    from modeling.ops.selective_scan.interface import pick_scan_blocks

    def picks(x):
        block_t, block_e, num_warps = _pick_blocks(96, x.shape[1], 32, 128, per_thread=32)
        blocks = pick_scan_blocks(x.shape[0], x.shape[1], 1536, 16)
        return x * block_t, x * block_e, x * num_warps, x * blocks.chunk, x * blocks.seg

    graphs = []

    def capture(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled = torch.compile(picks, dynamic=True, fullgraph=True, backend=capture)
    for batch, length in ((2, 100), (2, 300), (8, 4096), (8, 4000)):
        x = torch.randn(batch, length)
        for got, want in zip(compiled(x), picks(x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for graph_module in graphs:
        nodes = list(graph_module.graph.nodes)
        x = next(n for n in nodes if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor))
        factors = [n.args[1] for n in nodes if n.op == "call_function" and n.args and n.args[0] is x]
        assert len(factors) == 5 and all(type(factor) is int for factor in factors), graph_module.code
    # (2, 100) and (2, 300) share their picks (rows >= 32, the scan's smallest chunk), and so their graph
    assert len(graphs) == 2, [graph_module.code for graph_module in graphs]
