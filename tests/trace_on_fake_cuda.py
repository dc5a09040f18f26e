"""Traces the model's training forward on its kernels as Dynamo traces it on a GPU, on a machine without one: run as
`python tests/trace_on_fake_cuda.py CONFIG_JSON` (a `HybridConfig` as JSON text; TRITON_INTERPRET unset: the tests
hand it conftest's `tiny_config`), it prints one JSON line: how many graphs Dynamo made of
`torch.compile(model.forward, fullgraph=True)` (fullgraph: a graph break is an error, printed), how many autograd
functions those graphs hold, and the Triton kernels launched in their forward and backward bodies.

The model and its inputs are CUDA tensors that exist only as fake tensors (shapes, dtypes, devices; no memory), and
Dynamo is told that a Triton-capable GPU is present, so that it takes the kernels' launches as Triton kernels (the
`triton_kernel_wrapper_mutation` operator of the graphs Inductor compiles) rather than as Python to inline. Nothing
runs: the backend records the graph and stops. Needs a torch built with CUDA (the pinned one; no GPU needed). What
this checks is Dynamo's side alone (what it can trace, and that the kernels enter the graph); Inductor's compile of
the kernels and the numbers are the GPU tests' to check (tests/test_modeling_kernels.py, tests/test_ssd.py)."""

import json
import sys
from pathlib import Path

import torch
import torch.utils._triton
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configuration import HybridConfig
from modeling import HybridForCausalLM


class GraphRecorded(Exception):
    pass


def launched_kernels(graph_module: torch.fx.GraphModule) -> list[str]:
    """The names of the Triton kernels a graph launches, in order."""
    return [
        kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
        for node in graph_module.graph.nodes
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_mutation
    ]


def trace(config: HybridConfig) -> dict:
    torch.utils._triton.has_triton = lambda: True
    recorded = {"graphs": 0, "autograd_functions": 0, "forward_kernels": [], "backward_kernels": []}

    def record(graph_module, example_inputs):
        recorded["graphs"] += 1
        for node in graph_module.graph.nodes:
            if node.target is torch.ops.higher_order.autograd_function_apply:
                recorded["autograd_functions"] += 1
                forward_body, backward_body = (getattr(graph_module, arg.target) for arg in node.args[:2])
                recorded["forward_kernels"] += launched_kernels(forward_body)
                recorded["backward_kernels"] += launched_kernels(backward_body)
        raise GraphRecorded

    model = HybridForCausalLM(config).train()
    model.set_attn_implementation("sdpa")
    with FakeTensorMode(), torch.device("cuda"):
        # The weights and tokens as fake CUDA tensors of the same shapes (made empty: random fills need a CUDA
        # generator, which a CPU-only torch build does not have)
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                setattr(module, name, torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype)))
        ids = torch.empty(2, 150, dtype=torch.long)  # three of the Mamba-2 scan's chunks
    try:
        torch.compile(model.forward, backend=record, fullgraph=True)(input_ids=ids, labels=ids)
    except torch._dynamo.exc.BackendCompilerFailed as failure:
        if not isinstance(failure.inner_exception, GraphRecorded):
            raise
    return recorded


if __name__ == "__main__":
    print(json.dumps(trace(HybridConfig.from_dict(json.loads(sys.argv[1])))))
