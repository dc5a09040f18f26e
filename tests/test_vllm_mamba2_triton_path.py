"""The CUDA serving path of the Mamba-2 branch (`HybridTritonAttentionImpl.attend_and_run_branch` with
`Mamba2Branch.triton_ops`: our causal conv, packed-prefill SSD scan and gated norm kernels, the decodes' window
attention and state update in one launch of `hybrid_decode_ssd`) against the reference path (paged attention
reference + `Mamba2Branch.forward` on the PyTorch references), on the batches of tests/test_vllm_triton_path.py: a
mixed step (decodes with a new one-token prompt among them, a chunked prefill continuing its slots and a fresh
prefill) and a uniform-decode step, the metadata from the real builders. On CPU machines the kernels run in Triton's
interpreter."""

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
    SERVING_KERNELS,
    D,
    H,
    W,
    assert_serving_kernels_compile_once,
    host_syncs_raise,
    mixed_step,
    reference_path,
    uniform_decode_step,
)

CONFIG = dict(MAMBA2_BRANCH, num_attention_heads=H, num_key_value_heads=KVH, head_dim=D, sliding_window=W)
E = MAMBA2_BRANCH["ssm_intermediate_size"]
# The SSD kernels multiply fp32 exactly (as the interpreter does), but sum in another order than the references.
TOL = 1e-4 if DEVICE == "cpu" else 5e-4


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
    the branch's state shapes: the hybrid's (what the CUDA path is served with) and Mamba-1's (a different
    decode/prefill split, for the reference path)."""
    from vllm.v1.attention.backends.mamba1_attn import Mamba1AttentionMetadataBuilder
    from vllm_metadata import attention_metadata_builder, ssm_metadata_builder

    from vllm_integration.attention import HybridTritonAttentionMetadataBuilder
    from vllm_integration.history import Mamba2Branch
    from vllm_integration.history.metadata import HybridSSMMetadataBuilder

    config = tiny_config(**CONFIG, architectures=["HybridForCausalLM"])
    attention = attention_metadata_builder(HybridTritonAttentionMetadataBuilder, config, BLOCK, device=DEVICE)
    shapes = Mamba2Branch.state_shapes(config, 1)
    return (
        attention,
        ssm_metadata_builder(HybridSSMMetadataBuilder, shapes, device=DEVICE),
        ssm_metadata_builder(Mamba1AttentionMetadataBuilder, shapes, device=DEVICE),
    )


@pytest.mark.parametrize("step", [mixed_step, uniform_decode_step], ids=["mixed", "uniform-decode"])
def test_triton_path_matches_the_reference_path(branch, metadata_builders, step):
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


def test_serving_kernels_compile_once_whatever_the_number_of_decodes(branch, metadata_builders, monkeypatch):
    """As Mamba-1's (tests/test_vllm_triton_path.py): batches of 0 to 3 decodes before two prefills, their slots and
    lengths sliced past the decodes' by vLLM's metadata; an H100 compiles each prefill and decode kernel of the
    Mamba-2 serving path once for all of them (counted without a GPU)."""
    assert_serving_kernels_compile_once(branch, metadata_builders, monkeypatch, SERVING_KERNELS["mamba2"])


def test_the_profiling_run_writes_zeros_and_touches_no_state(branch, monkeypatch):
    """vLLM's profiling run (no metadata, no caches yet) through the CUDA impl: the branch's output is zeros and no
    state slot is written (nothing of ours tunes itself on a first launch, so nothing runs)."""
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    from vllm_integration.attention import HybridTritonAttentionImpl

    impl = HybridTritonAttentionImpl(H, D, D**-0.5, KVH, alibi_slopes=None, sliding_window=W, kv_cache_dtype="auto")
    num_tokens = 5
    in_proj_output = torch.randn(num_tokens, sum(branch.in_proj_sizes(branch.config, 1)), device=DEVICE)
    ssm_output = torch.full((num_tokens, E), float("nan"), device=DEVICE)
    states = [torch.randn(NUM_SLOTS, *shape, device=DEVICE) for shape in branch.get_state_shape()]
    monkeypatch.setattr(branch, "kv_cache", tuple(state.clone() for state in states))
    with torch.no_grad(), set_forward_context(None, VllmConfig()):
        impl.forward_hybrid(SimpleNamespace(ssm=branch), None, None, None, in_proj_output, None, ssm_output)
    assert ssm_output.eq(0).all()
    assert all(torch.equal(got, state) for got, state in zip(branch.kv_cache, states))
