"""The decode kernels (the selective scan's `selective_state_update`: modeling/ops/selective_scan; the fused
`hybrid_decode`: vllm_integration/ops/hybrid_decode) against their references, in Triton's interpreter on CPU
machines; the paged KV caches are poisoned outside every request's window (tools/paged_cache.py)."""

import importlib

import pytest
import torch
from conftest import HopperCompileKeys

from modeling.ops.selective_scan import selective_scan_ref, selective_state_update_ref
from tools.paged_cache import DEVICE, paged_kv_cache
from vllm_integration.ops import hybrid_decode_ref, hybrid_decode_ssd_ref, window_attention_decode_ref

pytest.importorskip("triton")

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.fixture(scope="module")
def kernels():
    """The fused decode's interface, imported after conftest has set TRITON_INTERPRET on CPU machines."""
    return importlib.import_module("vllm_integration.ops.hybrid_decode.interface")


@pytest.fixture(scope="module")
def scan_kernels():
    """The selective scan's interface (`selective_state_update`), imported as `kernels` is."""
    return importlib.import_module("modeling.ops.selective_scan.interface")


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_ssm_inputs(batch, channels, state, num_slots, dtype, state_dtype, g):
    """Decode-step SSM inputs as vLLM hands them over: u and z are column halves of one [B, 2E] tensor, B and C
    columns of the x_proj output [B, R + 2N], dt the raw dt_proj output (bias not added)."""

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    xz = rand(batch, 2 * channels).to(dtype)
    u, z = xz[:, :channels], xz[:, channels:]
    dbc = rand(batch, 3 + 2 * state).to(dtype)
    B, C = dbc[:, 3 : 3 + state], dbc[:, 3 + state :]
    dt = rand(batch, channels).to(dtype)
    A = -torch.exp(rand(channels, state, scale=0.5))
    D, dt_bias = rand(channels), rand(channels) - 2
    ssm_state = rand(num_slots, channels, state).to(state_dtype)
    return ssm_state, u, dt, A, B, C, D, z, dt_bias


def check_state(state, state_ref, state_before, slots_used, state_dtype):
    """The updated slots match the reference; every other slot is bit-identical to before the call."""
    untouched = [s for s in range(state.shape[0]) if s not in slots_used]
    assert torch.equal(state[untouched], state_before[untouched])
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(state.float(), state_ref.float(), atol=tol, rtol=tol)


SSM_CASES = [  # batch, E, N, dtype, state dtype, block_e
    (5, 40, 16, torch.float32, torch.float32, 16),
    (4, 33, 5, torch.float32, torch.bfloat16, 8),
    (6, 48, 16, torch.bfloat16, torch.float32, None),
    (3, 24, 8, torch.float16, torch.float16, 16),
]


@pytest.mark.parametrize(
    "batch,channels,state,dtype,state_dtype,block_e",
    SSM_CASES,
    ids=[f"B{c[0]}-E{c[1]}-N{c[2]}-{dtype_id(c[3])}-state_{dtype_id(c[4])}-blockE{c[5]}" for c in SSM_CASES],
)
def test_selective_state_update_matches_reference(scan_kernels, batch, channels, state, dtype, state_dtype, block_e):
    g = torch.Generator().manual_seed(batch * channels)
    num_slots = batch + 4
    ssm_state, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(
        batch, channels, state, num_slots, dtype, state_dtype, g
    )
    # Permuted slots, row 1 is CUDA-graph padding.
    state_indices = torch.randperm(num_slots, generator=g)[:batch].to(torch.int32).to(DEVICE)
    state_indices[1] = -1
    before = ssm_state.clone()
    state_ref = ssm_state.clone()
    out = torch.full_like(u, float("nan"))  # poisoned: every element must be written
    out_ref = torch.empty_like(u)

    result = scan_kernels.selective_state_update(
        ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, out, block_e=block_e
    )
    selective_state_update_ref(state_ref, u, dt, A, B, C, D, z, dt_bias, state_indices, out_ref)

    assert result is out
    torch.testing.assert_close(out.float(), out_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    check_state(ssm_state, state_ref, before, set(state_indices.tolist()), state_dtype)


def test_selective_state_update_strided_state(scan_kernels):
    """The state cache may be a strided view (e.g. one half of a larger per-slot buffer)."""
    g = torch.Generator().manual_seed(7)
    batch, channels, state, num_slots = 3, 20, 16, 5
    _, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(
        batch, channels, state, num_slots, torch.float32, torch.float32, g
    )
    backing = torch.randn(num_slots, channels, 2 * state, generator=g).to(DEVICE)
    strided = backing[:, :, 1::2]  # [slots, E, N] with element stride 2 and slot stride 2EN
    state_ref = strided.clone()
    state_indices = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    backing_before = backing.clone()
    out, out_ref = torch.full_like(u, float("nan")), torch.empty_like(u)
    scan_kernels.selective_state_update(strided, u, dt, A, B, C, D, z, dt_bias, state_indices, out)
    selective_state_update_ref(state_ref, u, dt, A, B, C, D, z, dt_bias, state_indices, out_ref)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(strided, state_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(backing[:, :, 0::2], backing_before[:, :, 0::2])  # the other half is not touched
    assert torch.equal(backing[[1, 3]], backing_before[[1, 3]])


DECODE_CASES = [  # dtype, head dim, page, (H, KVH), window, layout, state dtype, block_keys, splits
    (torch.float32, 16, 16, (4, 4), 7, "triton", torch.float32, 16, 1),
    (torch.bfloat16, 32, 32, (8, 2), 20, "triton", torch.bfloat16, 16, 3),
    (torch.float16, 16, 16, (8, 2), None, "flash", torch.float32, 16, 2),
    (torch.float32, 32, 16, (8, 2), 100, "triton", torch.bfloat16, 16, 4),
    (torch.bfloat16, 16, 32, (4, 4), 5, "flash", torch.float32, None, None),
    (torch.float32, 24, 16, (6, 2), 33, "triton", torch.float32, 32, 2),
]


def decode_id(case) -> str:
    dtype, head_dim, page, (heads, kv_heads), window, layout, state_dtype, block_keys, splits = case
    return (
        f"{dtype_id(dtype)}-D{head_dim}-P{page}-H{heads}kv{kv_heads}-W{window}-{layout}-state_{dtype_id(state_dtype)}"
        f"-bk{block_keys}-split{splits}"
    )


@pytest.mark.parametrize(
    "dtype,head_dim,page_size,heads,window,layout,state_dtype,block_keys,splits",
    DECODE_CASES,
    ids=[decode_id(c) for c in DECODE_CASES],
)
def test_hybrid_decode_matches_reference(
    kernels, dtype, head_dim, page_size, heads, window, layout, state_dtype, block_keys, splits
):
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(head_dim * page_size + num_heads)
    # Contexts of odd lengths, a single-token one, and a CUDA-graph padding row (seq_len 0, slot -1) at index 2.
    seq_lens = [37, 1, 0, 64, 23, 50]
    batch, channels, state, num_slots = len(seq_lens), 40, 16, 9
    key_cache, value_cache, block_table = paged_kv_cache(
        seq_lens, window, page_size, num_kv_heads, head_dim, dtype, layout, g
    )
    qkv = torch.randn(batch, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    query = qkv[:, :num_heads]  # [B, H, D] view with vLLM's fused-projection row stride
    ssm_state, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(
        batch, channels, state, num_slots, dtype, state_dtype, g
    )
    state_indices = torch.tensor([7, 2, -1, 5, 0, 3], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    state_before, state_ref = ssm_state.clone(), ssm_state.clone()
    attn_out = torch.full_like(query, float("nan"))  # poisoned: every element must be written
    ssm_out = torch.full_like(u, float("nan"))
    attn_ref, ssm_ref = torch.empty_like(query), torch.empty_like(u)

    result = kernels.hybrid_decode(
        *(query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out),
        *(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_out),
        block_keys=block_keys,
        num_splits=splits,
        block_e=16,
    )
    hybrid_decode_ref(
        *(query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_ref),
        *(state_ref, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_ref),
    )

    assert result[0] is attn_out and result[1] is ssm_out
    torch.testing.assert_close(attn_out.float(), attn_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(ssm_out.float(), ssm_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(attn_out[2], torch.zeros_like(attn_out[2])) and torch.equal(ssm_out[2], torch.zeros_like(u[2]))
    check_state(ssm_state, state_ref, state_before, set(state_indices.tolist()), state_dtype)


@pytest.mark.parametrize("splits", [1, 3], ids=lambda n: f"split{n}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_hybrid_decode_reads_an_fp8_cache(kernels, dtype, splits):
    """vLLM's fp8 KV cache (e4m3 values of K / k_scale and V / v_scale, scales far from 1) through the fused decode,
    against the reference's dequantized attention, split-K or not; the SSM half as with any cache."""
    g = torch.Generator().manual_seed(17 + splits)
    seq_lens = [37, 1, 0, 64, 23]
    batch, channels, state, num_slots = len(seq_lens), 24, 8, 7
    key_cache, value_cache, block_table = paged_kv_cache(seq_lens, 20, 16, 2, 32, torch.float8_e4m3fn, "triton", g)
    query = torch.randn(batch, 8, 32, generator=g).to(DEVICE, dtype)
    ssm_state, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(
        batch, channels, state, num_slots, dtype, torch.float32, g
    )
    state_indices = torch.tensor([6, 2, -1, 5, 0], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scales = {"k_scale": torch.tensor(2.3, device=DEVICE), "v_scale": torch.tensor(0.45, device=DEVICE)}
    state_ref = ssm_state.clone()
    attn_out, ssm_out = torch.full_like(query, float("nan")), torch.full_like(u, float("nan"))
    attn_ref, ssm_ref = torch.empty_like(query), torch.empty_like(u)
    kernels.hybrid_decode(
        *(query, key_cache, value_cache, block_table, seq_lens, query.shape[-1] ** -0.5, 20, attn_out),
        *(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_out),
        num_splits=splits,
        **scales,
    )
    hybrid_decode_ref(
        *(query, key_cache, value_cache, block_table, seq_lens, query.shape[-1] ** -0.5, 20, attn_ref),
        *(state_ref, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_ref),
        **scales,
    )
    torch.testing.assert_close(attn_out.float(), attn_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(ssm_out.float(), ssm_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(ssm_state, state_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["selective_state_update", "hybrid_decode"])
def test_first_token_rows_start_from_a_zero_state(kernels, scan_kernels, fused):
    """Rows flagged as a request's first token (has_initial_state False: a one-token prompt in a CUDA-graph decode
    batch) ignore their stale slot: their output is the scan over that one token from a zero state, and the slot
    then holds that scan's state; the other rows continue from their slots as before."""
    g = torch.Generator().manual_seed(11)
    # Rows 1 and 4: one-token prompts. Row 2: CUDA-graph padding as vLLM pads a replayed decode batch (seq_len 0,
    # the null block's slot 0, flag False): zero attention, and whatever it computes lands in the null block only.
    seq_lens = [37, 1, 0, 64, 1]
    batch, channels, state, num_slots = len(seq_lens), 40, 16, 9
    ssm_state, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(
        batch, channels, state, num_slots, torch.float32, torch.float32, g
    )
    state_indices = torch.tensor([7, 2, 0, 5, 8], dtype=torch.int32, device=DEVICE)
    has_initial_state = torch.tensor([True, False, False, True, False], device=DEVICE)
    state_ref = ssm_state.clone()
    ssm_out = torch.full_like(u, float("nan"))
    if fused:
        key_cache, value_cache, block_table = paged_kv_cache(seq_lens, 24, 16, 2, 16, torch.float32, "triton", g)
        query = torch.randn(batch, 4, 16, generator=g).to(DEVICE)
        seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        attn_out = torch.full_like(query, float("nan"))
        kernels.hybrid_decode(
            *(query, key_cache, value_cache, block_table, seq_lens, 16**-0.5, 24, attn_out),
            *(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_out),
            has_initial_state=has_initial_state,
        )
        attn_ref = window_attention_decode_ref(
            query, key_cache, value_cache, block_table, seq_lens, 16**-0.5, 24, torch.empty_like(query)
        )
        torch.testing.assert_close(attn_out, attn_ref, atol=1e-5, rtol=1e-5)
        assert (attn_out[2] == 0).all()
    else:
        scan_kernels.selective_state_update(
            ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_out, has_initial_state=has_initial_state
        )
    ssm_ref = selective_state_update_ref(
        state_ref, u, dt, A, B, C, D, z, dt_bias, state_indices, torch.empty_like(u),
        has_initial_state=has_initial_state,
    )  # fmt: skip
    torch.testing.assert_close(ssm_out, ssm_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm_state, state_ref, atol=1e-5, rtol=1e-5)
    # Independently: the flagged rows are a one-token scan from zero.
    first = [1, 4]
    step = torch.nn.functional.softplus(dt[first] + dt_bias)
    y, final = selective_scan_ref(u[first, None], step[:, None], A, B[first, None], C[first, None], D, z[first, None])
    torch.testing.assert_close(ssm_out[first], y[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm_state[state_indices[first].long()], final, atol=1e-5, rtol=1e-5)


def captured(step) -> torch.cuda.CUDAGraph:
    """`step` captured into a CUDA graph, as vLLM captures its full decode graph: run once on a side stream first,
    which compiles the kernel outside the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def next_decode_step(per_row, has_initial_state, inputs, g) -> None:
    """What the next step of the 4-row decode batch writes into the captured buffers: rows 0 and 3 swap (their block
    table rows, context lengths and slots: `per_row`), the one-token prompt of row 1 now continues, new inputs."""
    for buffer in per_row:
        buffer.copy_(buffer[[3, 1, 2, 0]])
    has_initial_state.copy_(torch.tensor([True, True, False, False], device=DEVICE))
    for buffer in inputs:
        buffer.copy_(torch.randn(buffer.shape, generator=g).to(DEVICE))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_hybrid_decode_replays_from_a_cuda_graph(kernels):
    """What vLLM's full decode graph does with the fused decode: captured once for a batch of 4 rows (one of them
    padding on the null block's slot 0), then replayed after new tokens, slots, context lengths and first-token flags
    were written into the same buffers. Every replay equals the reference run eagerly on the same inputs."""
    g = torch.Generator().manual_seed(21)
    window, scale = 24, 16**-0.5
    lengths = [37, 1, 0, 64]
    key_cache, value_cache, block_table = paged_kv_cache(lengths, window, 16, 2, 16, torch.float32, "triton", g)
    query = torch.randn(4, 4, 16, generator=g).to(DEVICE)
    ssm_state, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(4, 40, 16, 9, torch.float32, torch.float32, g)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    state_indices = torch.tensor([7, 2, 0, 5], dtype=torch.int32, device=DEVICE)
    has_initial_state = torch.tensor([True, False, False, True], device=DEVICE)
    attn_out, ssm_out = torch.empty_like(query), torch.empty_like(u)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)

    def step():
        kernels.hybrid_decode(
            *(query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out),
            *(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_out),
            num_splits=2,
            counters=counters,
            has_initial_state=has_initial_state,
        )

    graph = captured(step)

    for replay in range(2):
        if replay:
            next_decode_step((block_table, seq_lens, state_indices), has_initial_state, (query, u, dt, z, B, C), g)
        state_ref = ssm_state.clone()
        attn_ref, ssm_ref = hybrid_decode_ref(
            *(query, key_cache, value_cache, block_table, seq_lens, scale, window, torch.empty_like(query)),
            *(state_ref, u, dt, A, B, C, D, z, dt_bias, state_indices, torch.empty_like(u)),
            has_initial_state=has_initial_state,
        )
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(attn_out, attn_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ssm_out, ssm_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ssm_state, state_ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(counters, torch.zeros_like(counters))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_hybrid_decode_ssd_replays_from_a_cuda_graph(kernels):
    """The Mamba-2 fused decode in vLLM's full decode graph, as `test_hybrid_decode_replays_from_a_cuda_graph` checks
    Mamba-1's: captured once for 4 rows (one padding row on the null block's slot 0), replayed after new tokens,
    slots, context lengths and first-token flags were written into the same buffers; each replay equals the
    reference run eagerly on the same inputs."""
    g = torch.Generator().manual_seed(22)
    window, scale, heads, groups, head_dim, state = 24, 16**-0.5, 4, 2, 12, 8
    lengths = [37, 1, 0, 64]
    key_cache, value_cache, block_table = paged_kv_cache(lengths, window, 16, 2, 16, torch.float32, "triton", g)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    query, x, dt = rand(4, 4, 16), rand(4, heads, head_dim), rand(4, heads)
    B, C = rand(4, groups, state), rand(4, groups, state)
    A, D, dt_bias = -torch.exp(rand(heads) * 0.5), rand(heads), rand(heads) - 2
    ssm_state = rand(9, heads, head_dim, state)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    state_indices = torch.tensor([7, 2, 0, 5], dtype=torch.int32, device=DEVICE)
    has_initial_state = torch.tensor([True, False, False, True], device=DEVICE)
    attn_out, out = torch.empty_like(query), torch.empty_like(x)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    update = {"dt_bias": dt_bias, "dt_softplus": True}

    def step():
        kernels.hybrid_decode_ssd(
            *(query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out),
            *(ssm_state, x, dt, A, B, C, D, state_indices, has_initial_state),
            **update, out=out, num_splits=2, counters=counters,
        )  # fmt: skip

    graph = captured(step)

    for replay in range(2):
        if replay:
            next_decode_step((block_table, seq_lens, state_indices), has_initial_state, (query, x, dt, B, C), g)
        state_ref, attn_ref, out_ref = ssm_state.clone(), torch.empty_like(query), torch.empty_like(x)
        hybrid_decode_ssd_ref(
            *(query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_ref),
            *(state_ref, x, dt, A, B, C, D, state_indices, has_initial_state),
            **update, out=out_ref,
        )  # fmt: skip
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(attn_out, attn_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ssm_state, state_ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(counters, torch.zeros_like(counters))


def test_hybrid_decode_does_not_recompile_across_batch_sizes_and_split_counts(kernels, monkeypatch):
    """Serving hands the fused decode every batch size, and the batch size picks the split count: one compilation
    with split-K and one without serve them all (a variant per value would stall serving for seconds each)."""
    g = torch.Generator().manual_seed(5)
    window, num_heads, num_kv_heads, head_dim = 24, 4, 2, 16

    def launch(batch, splits):
        lengths = [40] * batch  # the same block-table width (a specialized stride) for every batch
        key_cache, value_cache, block_table = paged_kv_cache(
            lengths, window, 16, num_kv_heads, head_dim, torch.float32, "triton", g
        )
        query = torch.randn(batch, num_heads, head_dim, generator=g).to(DEVICE)
        ssm_state, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(batch, 32, 16, batch, torch.float32,
                                                                     torch.float32, g)  # fmt: skip
        state_indices = torch.arange(batch, dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        attn_out = torch.full_like(query, float("nan"))
        kernels.hybrid_decode(
            *(query, key_cache, value_cache, block_table, seq_lens, head_dim**-0.5, window, attn_out),
            *(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, torch.empty_like(u)),
            num_splits=splits,
        )
        attn_ref = window_attention_decode_ref(
            query, key_cache, value_cache, block_table, seq_lens, head_dim**-0.5, window, torch.empty_like(query)
        )
        torch.testing.assert_close(attn_out, attn_ref, atol=1e-5, rtol=1e-5)

    kernel = importlib.import_module("vllm_integration.ops.hybrid_decode.kernel")._hybrid_decode_kernel
    compile_keys = HopperCompileKeys(monkeypatch, kernel)
    launch(1, 2)
    launch(1, 1)
    compiled = compile_keys.counts()
    assert compiled == {kernel.__name__: 2}, compiled  # with split-K and without
    for batch, splits in [(3, 3), (6, 2), (2, 5), (5, 1), (7, 4), (16, 1)]:
        launch(batch, splits)
    assert compile_keys.counts() == compiled


def test_hybrid_decode_split_counters_reset(kernels):
    """With split-K a persistent counter buffer comes back zeroed, so a second launch (a CUDA-graph replay, the next
    layer) merges its splits correctly too."""
    g = torch.Generator().manual_seed(3)
    seq_lens, window, num_heads, num_kv_heads, head_dim = [29, 45, 12], 24, 4, 2, 16
    key_cache, value_cache, block_table = paged_kv_cache(
        seq_lens, window, 16, num_kv_heads, head_dim, torch.float32, "triton", g
    )
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=g).to(DEVICE)
    ssm_state, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(3, 16, 4, 4, torch.float32, torch.float32, g)
    state_indices = torch.tensor([1, 3, 0], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    counters = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    attn_ref = window_attention_decode_ref(
        query, key_cache, value_cache, block_table, seq_lens, scale, window, torch.empty_like(query)
    )
    for _ in range(2):
        attn_out = torch.full_like(query, float("nan"))
        kernels.hybrid_decode(
            *(query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out),
            *(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, torch.empty_like(u)),
            block_keys=16,
            num_splits=3,
            counters=counters,
        )
        assert torch.equal(counters, torch.zeros_like(counters))
        torch.testing.assert_close(attn_out, attn_ref, atol=1e-5, rtol=1e-5)


def test_hybrid_decode_takes_int64_metadata_and_a_strided_table(kernels):
    """Index tensors as triton_utils' policy has them: slots, lengths and the block table int32 or int64, the table
    a row-strided view (every other row of a wider one)."""
    g = torch.Generator().manual_seed(9)
    lengths, window, num_heads, num_kv_heads, head_dim = [37, 1, 0, 20], 12, 4, 2, 16
    key_cache, value_cache, block_table = paged_kv_cache(
        lengths, window, 16, num_kv_heads, head_dim, torch.float32, "triton", g
    )
    wide = torch.full((2 * len(lengths), block_table.shape[1]), -7, dtype=torch.int64, device=DEVICE)
    wide[::2] = block_table
    query = torch.randn(len(lengths), num_heads, head_dim, generator=g).to(DEVICE)
    ssm_state, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(4, 24, 8, 6, torch.float32, torch.float32, g)
    state_indices = torch.tensor([4, 0, -1, 2], dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int64, device=DEVICE)
    scale, state_ref = head_dim**-0.5, ssm_state.clone()
    attn_out, ssm_out = torch.full_like(query, float("nan")), torch.full_like(u, float("nan"))
    kernels.hybrid_decode(
        *(query, key_cache, value_cache, wide[::2], seq_lens, scale, window, attn_out),
        *(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, ssm_out),
        num_splits=2,
    )
    attn_ref, ssm_ref = hybrid_decode_ref(
        *(query, key_cache, value_cache, block_table, seq_lens, scale, window, torch.empty_like(query)),
        *(state_ref, u, dt, A, B, C, D, z, dt_bias, state_indices, torch.empty_like(u)),
    )
    torch.testing.assert_close(attn_out, attn_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm_out, ssm_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm_state, state_ref, atol=1e-5, rtol=1e-5)


def test_bad_inputs_name_the_tensor(kernels, scan_kernels):
    g = torch.Generator().manual_seed(0)
    ssm_state, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(2, 16, 4, 3, torch.float32, torch.float32, g)
    out = torch.empty_like(u)
    with pytest.raises(ValueError, match="state_indices"):  # slots are int32 or int64
        scan_kernels.selective_state_update(
            ssm_state, u, dt, A, B, C, D, z, dt_bias, torch.tensor([0.0, 1.0], device=DEVICE), out
        )
    with pytest.raises(ValueError, match="ssm_state"):
        scan_kernels.selective_state_update(
            ssm_state[:, :8],
            u,
            dt,
            A,
            B,
            C,
            D,
            z,
            dt_bias,
            torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            out,
        )
    key_cache, value_cache, block_table = paged_kv_cache([5, 9], None, 16, 2, 16, torch.float32, "flash", g)
    query = torch.randn(2, 4, 16, generator=g).to(DEVICE)
    with pytest.raises(ValueError, match="value_cache"):
        kernels.hybrid_decode(
            *(
                query,
                key_cache,
                value_cache.half(),
                block_table,
                torch.tensor([5, 9], dtype=torch.int32, device=DEVICE),
            ),
            *(0.25, None, torch.empty_like(query)),
            *(ssm_state, u, dt, A, B, C, D, z, dt_bias, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), out),
        )


def test_softplus_of_raw_dt(scan_kernels):
    """dt is the raw dt_proj output: the kernel adds the bias and takes softplus, including the linear region
    above 20 and tiny steps far below zero."""
    g = torch.Generator().manual_seed(1)
    ssm_state, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(4, 16, 4, 4, torch.float32, torch.float32, g)
    dt = torch.tensor([-30.0, -8.0, 0.5, 25.0], device=DEVICE)[:, None].expand(4, 16).contiguous()
    A = A / 30  # keep exp(dt * A) away from 0 for the large steps, so the state still carries information
    state_indices = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEVICE)
    state_ref = ssm_state.clone()
    out, out_ref = torch.full_like(u, float("nan")), torch.empty_like(u)
    scan_kernels.selective_state_update(ssm_state, u, dt, A, B, C, D, z, dt_bias * 0, state_indices, out)
    selective_state_update_ref(state_ref, u, dt, A, B, C, D, z, dt_bias * 0, state_indices, out_ref)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ssm_state, state_ref, atol=1e-5, rtol=1e-5)


def test_empty_batch_launches_nothing(kernels):
    """A step without decodes (all tokens are prefills) returns the empty outputs without a launch."""
    g = torch.Generator().manual_seed(2)
    ssm_state, u, dt, A, B, C, D, z, dt_bias = random_ssm_inputs(0, 16, 4, 3, torch.float32, torch.float32, g)
    state_before = ssm_state.clone()
    key_cache, value_cache, block_table = paged_kv_cache([5], 4, 16, 2, 16, torch.float32, "flash", g)
    query = torch.empty(0, 4, 16, device=DEVICE)
    no_ints = torch.empty(0, dtype=torch.int32, device=DEVICE)
    attn_out, ssm_out = kernels.hybrid_decode(
        *(query, key_cache, value_cache, block_table[:0], no_ints, 0.25, 4, torch.empty_like(query)),
        *(ssm_state, u, dt, A, B, C, D, z, dt_bias, no_ints, torch.empty_like(u)),
    )
    assert attn_out.shape == (0, 4, 16) and ssm_out.shape == (0, 16)
    assert torch.equal(ssm_state, state_before)


SSD_DECODE_CASES = [  # dtype, state dtype, (Hs, G, P, N), block_p, splits
    (torch.float32, torch.float32, (4, 2, 12, 8), None, 1),
    (torch.bfloat16, torch.float32, (6, 3, 20, 16), 8, 3),
    (torch.bfloat16, torch.bfloat16, (4, 1, 16, 8), 16, 2),
]


@pytest.mark.parametrize(
    "dtype,state_dtype,ssm_shape,block_p,splits",
    SSD_DECODE_CASES,
    ids=[f"{dtype_id(c[0])}-state_{dtype_id(c[1])}-Hs{c[2][0]}G{c[2][1]}P{c[2][2]}N{c[2][3]}-bp{c[3]}-split{c[4]}"
         for c in SSD_DECODE_CASES],
)  # fmt: skip
def test_hybrid_decode_ssd_matches_reference(kernels, dtype, state_dtype, ssm_shape, block_p, splits):
    """The fused decode with a Mamba-2 branch (`hybrid_decode_ssd`) against its reference: the window attention as in
    `hybrid_decode`, and Mamba-2's state update with heads sharing their group's B and C, dt's bias and softplus,
    one first-token row (has_initial_state False: from a zero state) and one CUDA-graph padding row on vLLM's null
    block (slot 0, seq_len 0, flag False: it computes from zero and writes only the null block). Outputs poisoned
    (NaN); slots no request names are left bit-identical; head channels split into programs (block_p below P, the
    last block partial)."""
    num_heads, num_kv_heads, head_dim, page_size, window = 8, 2, 16, 16, 20
    ssm_heads, groups, ssm_head_dim, state = ssm_shape
    g = torch.Generator().manual_seed(ssm_heads * ssm_head_dim + state)
    seq_lens = [37, 1, 0, 64, 23]
    batch, num_slots = len(seq_lens), 8
    key_cache, value_cache, block_table = paged_kv_cache(
        seq_lens, window, page_size, num_kv_heads, head_dim, dtype, "triton", g
    )

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    query = rand(batch, num_heads, head_dim).to(dtype)
    # x, B and C: column views of the conv's output [B, E + 2GN], as the branch splits it.
    xbc = rand(batch, ssm_heads * ssm_head_dim + 2 * groups * state).to(dtype)
    x = xbc[:, : ssm_heads * ssm_head_dim].unflatten(-1, (ssm_heads, ssm_head_dim))
    B = xbc[:, ssm_heads * ssm_head_dim : -groups * state].unflatten(-1, (groups, state))
    C = xbc[:, -groups * state :].unflatten(-1, (groups, state))
    dt = rand(batch, ssm_heads).to(dtype)
    A, D, dt_bias = -torch.exp(rand(ssm_heads, scale=0.5)), rand(ssm_heads), rand(ssm_heads) - 2
    ssm_state = rand(num_slots, ssm_heads, ssm_head_dim, state).to(state_dtype)
    state_indices = torch.tensor([7, 2, 0, 5, 3], dtype=torch.int32, device=DEVICE)
    has_initial = torch.tensor([True, False, False, True, True], device=DEVICE)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    state_before, state_ref = ssm_state.clone(), ssm_state.clone()
    attn_out, attn_ref = torch.full_like(query, float("nan")), torch.empty_like(query)
    out, out_ref = torch.full_like(x, float("nan")), torch.empty_like(x)
    update = {"dt_bias": dt_bias, "dt_softplus": True}

    result = kernels.hybrid_decode_ssd(
        *(query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_out),
        *(ssm_state, x, dt, A, B, C, D, state_indices, has_initial),
        **update, out=out, num_splits=splits, block_p=block_p,
    )  # fmt: skip
    hybrid_decode_ssd_ref(
        *(query, key_cache, value_cache, block_table, seq_lens, scale, window, attn_ref),
        *(state_ref, x, dt, A, B, C, D, state_indices, has_initial),
        **update, out=out_ref,
    )  # fmt: skip

    assert result is out
    torch.testing.assert_close(attn_out.float(), attn_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.float(), out_ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(attn_out[2], torch.zeros_like(attn_out[2]))
    check_state(ssm_state, state_ref, state_before, set(state_indices.tolist()), state_dtype)
