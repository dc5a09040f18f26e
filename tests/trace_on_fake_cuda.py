"""Traces the model's training forward on its kernels as Dynamo traces it on a GPU, on a machine without one: run as
`python tests/trace_on_fake_cuda.py CONFIG_JSON` (a `HybridConfig` as JSON text; TRITON_INTERPRET unset: the tests
hand it conftest's `tiny_config`), it prints one JSON line: how many graphs Dynamo made of
`torch.compile(model.forward, fullgraph=True)` (fullgraph: a graph break is an error, printed), how many autograd
functions those graphs hold, the Triton kernels launched in their forward and backward bodies, and the tensors that
functionalizing those launches copies: every argument that Inductor's analysis of a kernel (its Triton IR, compiled
here for an sm_90 target) says the kernel may write is cloned before the launch, unless it is a buffer allocated in
the graph, which Inductor writes in place. Those copies are data movement the compiled step pays on every step.

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
import triton
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from triton.backends.compiler import GPUTarget

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


class HopperTarget:
    """Triton's driver as Inductor's mutation analysis asks it, on a machine without a GPU: the target to lower a
    kernel to Triton IR for."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


ALLOCATIONS = ("empty.memory_format", "new_empty.default", "empty_like.default")


def copied_arguments(body: torch.fx.GraphModule) -> list[tuple[str, str, int]]:
    """(kernel, argument, elements) of each tensor that functionalizing `body`'s launches clones and Inductor cannot
    write in place: one the analysis says the kernel may write that is not a buffer allocated in the body."""
    placeholders = [node for node in body.graph.nodes if node.op == "placeholder"]
    values = [node.meta.get("example_value") for node in placeholders]
    values = [value.detach() if isinstance(value, torch.Tensor) else value for value in values]
    with next(value.fake_mode for value in values if isinstance(value, torch.Tensor)):
        functional = make_fx(torch.func.functionalize(body, remove="mutations_and_views"))(*values)
    copied = []
    for node in functional.graph.nodes:
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
            for name in node.kwargs["tensors_to_clone"]:
                source = node.kwargs["kwargs"][name]
                if str(source.target).removeprefix("aten.") not in ALLOCATIONS:
                    copied.append((kernel, name, source.meta["val"].numel()))
    return copied


def trace(config: HybridConfig) -> dict:
    torch.utils._triton.has_triton = lambda: True
    triton.runtime.driver.set_active(HopperTarget())
    recorded = {"graphs": 0, "autograd_functions": 0, "forward_kernels": [], "backward_kernels": [], "copied": []}

    def record(graph_module, example_inputs):
        recorded["graphs"] += 1
        for node in graph_module.graph.nodes:
            if node.target is torch.ops.higher_order.autograd_function_apply:
                recorded["autograd_functions"] += 1
                forward_body, backward_body = (getattr(graph_module, arg.target) for arg in node.args[:2])
                recorded["forward_kernels"] += launched_kernels(forward_body)
                recorded["backward_kernels"] += launched_kernels(backward_body)
                recorded["copied"] += copied_arguments(forward_body) + copied_arguments(backward_body)
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
