"""Every Triton kernel of the project through the real compiler for sm_90 (tests/compile_for_hopper.py), on any
machine: the kernel tests run in Triton's interpreter on CPU machines, which does not type-check a kernel."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import MAMBA2_BRANCH, tiny_config

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]


def project_kernels() -> set[str]:
    """The names of the kernels the sources define: `def _..._kernel(` right under a `@triton.jit` decorator (which
    may span lines)."""
    names = set()
    for package in ("modeling", "vllm_integration"):
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            for match in re.finditer(r"^def (_\w+_kernel)\(", text, re.MULTILINE):
                decorator = text[: match.start()].rsplit("\n\n", 1)[-1]  # the lines since the last blank one
                if "@triton.jit" in decorator:
                    names.add(match.group(1))
    return names


def test_every_kernel_compiles_for_hopper():
    """Each kernel the sources define compiles down to an sm_90 cubin in at least one real call path (the script
    exits non-zero on the first failure), and the script's cases leave none of them out."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "compile_for_hopper.py")],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    compiled = set(re.findall(r"^COMPILED (\w+)$", done.stdout, re.MULTILINE))
    kernels = project_kernels()
    assert len(kernels) >= 10, f"the kernel scan found only {sorted(kernels)}"
    assert compiled == kernels, f"not compiled: {sorted(kernels - compiled)}; unknown: {sorted(compiled - kernels)}"


LAYER_KERNELS = {  # what one layer's training step launches: (forward, backward), each in launch order
    "mamba1": (
        ["_causal_conv1d_fwd_kernel", "_selective_scan_fwd_kernel", "_selective_scan_chunk_combine_kernel",
         "_selective_scan_fwd_kernel"],
        ["_selective_scan_bwd_kernel", "_selective_scan_chunk_combine_kernel", "_selective_scan_bwd_kernel",
         "_causal_conv1d_bwd_kernel"],
    ),
    "mamba2": (
        ["_causal_conv1d_fwd_kernel", "_ssd_chunk_walk_kernel", "_ssd_outputs_fwd_kernel"],
        ["_ssd_chunk_walk_kernel", "_ssd_chunk_walk_kernel", "_ssd_chunk_bwd_kernel", "_causal_conv1d_bwd_kernel"],
    ),
}  # fmt: skip


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need a torch built with CUDA")
@pytest.mark.parametrize("branch", ["mamba1", "mamba2"])
def test_dynamo_traces_a_training_step_on_the_kernels_into_one_graph(branch):
    """`torch.compile(model.forward, fullgraph=True)` of a training forward on CUDA, as Dynamo traces it on a GPU
    (tests/trace_on_fake_cuda.py: fake CUDA tensors, nothing run): one graph, each layer's branch as one autograd
    function (the fused branch: mamba_inner, mamba2_inner), its Triton kernels in the graph's forward and backward
    bodies. Mamba-2's scan ran its reference inside compiled callers before (the trace then held the conv's kernels
    alone)."""
    config = tiny_config(**(MAMBA2_BRANCH if branch == "mamba2" else {}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "trace_on_fake_cuda.py"), config.to_json_string()],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    traced = json.loads(done.stdout.strip().splitlines()[-1])
    copied = traced.pop("copied")
    layers = config.num_hidden_layers
    forward, backward = LAYER_KERNELS[branch]
    assert traced == {
        "graphs": 1,
        "autograd_functions": layers,
        "forward_kernels": forward * layers,
        "backward_kernels": backward * layers,
    }
    # What the compiled step copies around the launches (arguments Inductor's analysis takes for written, over-
    # approximating: A, Mamba-2's step) is per channel or per head, never an activation of the branch's width.
    activation = 2 * 150 * config.ssm_intermediate_size
    assert copied and all(elements < activation / 4 for _, _, elements in copied), copied
