"""The Triton paged sliding-window attention (vllm_integration/ops/paged_attention) against
`paged_window_attention_ref`, in Triton's interpreter on CPU machines: mixed batches of prefills, chunked prefills
and decodes in vLLM's paged layouts, with everything the kernel must not read (freed blocks, slots before the window
or past the sequence) poisoned with NaN."""

import importlib

import pytest
import torch
from conftest import HopperCompileKeys

from tools.paged_cache import DEVICE, paged_kv_cache
from vllm_integration.ops import paged_window_attention_ref
from vllm_integration.ops.paged_attention.flash import flash_attention_available, flash_paged_window_attention

pytest.importorskip("triton")

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def attention():
    """The kernel, in Triton's interpreter on CPU machines (conftest sets TRITON_INTERPRET before triton loads)."""
    return importlib.import_module("vllm_integration.ops.paged_attention.interface").paged_window_attention


def make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, window, dtype, layout="triton", pad_tokens=0,
               seed=0, cache_dtype=None):  # fmt: skip
    """Packed queries and a poisoned paged cache (`paged_kv_cache`, in `cache_dtype`, default the queries') for
    sequences given as (seq_len, q_len), with vLLM's metadata. `pad_tokens` query rows past the last sequence stand
    for CUDA-graph padding."""
    g = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = [seq_len for seq_len, _ in seqs], [q_len for _, q_len in seqs]
    key_cache, value_cache, block_table = paged_kv_cache(
        seq_lens, window, block_size, num_kv_heads, head_dim, cache_dtype or dtype, layout, g, q_lens=q_lens
    )
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(DEVICE)
    num_tokens = sum(q_lens) + pad_tokens
    # Queries as vLLM slices them out of the fused qkv projection: a strided view.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(DEVICE, dtype)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return query, key_cache, value_cache, block_table, query_start_loc, seq_lens


def poisoned_out(query):
    """An output buffer that is a strided view (rows of a wider buffer), full of NaN: unwritten rows fail."""
    num_tokens, num_heads, head_dim = query.shape
    wide = torch.full((num_tokens, num_heads, head_dim + 8), float("nan"), dtype=query.dtype, device=query.device)
    return wide[..., :head_dim]


def check(attention, batch, window, **kwargs):
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens = batch
    scale = query.shape[-1] ** -0.5
    out = poisoned_out(query)
    result = attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, window, out,
                       **kwargs)  # fmt: skip
    scales = {name: kwargs[name] for name in ("k_scale", "v_scale") if name in kwargs}
    expected = paged_window_attention_ref(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, window, **scales
    )
    assert result is out
    assert torch.isfinite(expected).all(), "the reference read a poisoned slot"
    tol = TOLERANCE[query.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


MIXED = [(37, 37), (45, 9), (23, 1), (50, 1), (0, 0), (17, 17), (33, 2)]  # (seq_len, q_len): every kind, a padding row
CASES = [  # seqs, H, KVH, D, block_size, window, dtype, layout
    (MIXED, 4, 4, 16, 16, 5, torch.float32, "triton"),
    (MIXED, 4, 1, 32, 16, 16, torch.float32, "triton"),
    (MIXED, 6, 2, 16, 32, 11, torch.float32, "flash"),
    (MIXED, 4, 1, 16, 16, 64, torch.float32, "triton"),
    (MIXED, 2, 2, 32, 32, None, torch.float32, "triton"),
    (MIXED, 4, 1, 32, 16, 7, torch.bfloat16, "triton"),
    (MIXED, 8, 2, 16, 16, 20, torch.float16, "flash"),
    (MIXED, 4, 4, 32, 32, None, torch.bfloat16, "triton"),
]


def case_id(case):
    _, heads, kv_heads, head_dim, block_size, window, dtype, layout = case
    return f"H{heads}-KVH{kv_heads}-D{head_dim}-P{block_size}-W{window}-{str(dtype)[6:]}-{layout}"


@pytest.mark.parametrize("seqs,heads,kv_heads,head_dim,block_size,window,dtype,layout", CASES,
                         ids=[case_id(c) for c in CASES])  # fmt: skip
def test_mixed_batch_matches_reference(attention, seqs, heads, kv_heads, head_dim, block_size, window, dtype, layout):
    batch = make_batch(seqs, heads, kv_heads, head_dim, block_size, window, dtype, layout, pad_tokens=3)
    check(attention, batch, window)


TILINGS = [(1, 16), (4, 16), (2, 32), (16, 16)]  # block_q, block_keys: many query blocks and key tiles


@pytest.mark.parametrize("block_q,block_keys", TILINGS, ids=[f"BQ{c[0]}-BK{c[1]}" for c in TILINGS])
@pytest.mark.parametrize("window", [6, 19, None], ids=lambda w: f"W{w}")
def test_tilings_match_reference(attention, block_q, block_keys, window):
    seqs = [(37, 13), (23, 1), (0, 0), (20, 20), (33, 2)]
    batch = make_batch(seqs, 4, 2, 16, 16, window, torch.float32, pad_tokens=2, seed=1)
    check(attention, batch, window, block_q=block_q, block_keys=block_keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_fp8_cache_matches_reference(attention, dtype):
    """vLLM's fp8 KV cache (e4m3 values of K / k_scale and V / v_scale): the kernel reads the values the reference
    dequantizes, with scales far from 1 (a kernel that skipped either would be off by their ratio)."""
    scales = {"k_scale": torch.tensor(0.37, device=DEVICE), "v_scale": torch.tensor(1.9, device=DEVICE)}
    batch = make_batch(MIXED, 4, 2, 32, 16, 11, dtype, pad_tokens=2, seed=4, cache_dtype=torch.float8_e4m3fn)
    check(attention, batch, 11, **scales)


def test_padding_rows_of_a_replayed_decode_graph_are_zeros(attention):
    """vLLM pads a replayed decode graph with one-token rows of seq_len 0 (no key to attend to): zeros, as the
    reference gives them, where a softmax over no key would be 0 / 0 (the Mamba-2 branch's decodes run this kernel)."""
    batch = make_batch([(23, 1), (50, 1), (0, 1), (0, 1)], 4, 2, 16, 16, 9, torch.float32, seed=5)
    check(attention, batch, 9)


def test_permuted_and_shared_tables_and_int64_metadata(attention):
    """A non-contiguous table view (every other row of a bigger table) and int64 metadata."""
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens = make_batch(
        MIXED, 4, 2, 16, 16, 9, torch.float32, seed=3
    )
    wide = torch.full((2 * block_table.shape[0], block_table.shape[1]), -7, dtype=torch.int32, device=DEVICE)
    wide[::2] = block_table
    batch = query, key_cache, value_cache, wide[::2], query_start_loc.long(), seq_lens.long()
    check(attention, batch, 9)


def test_bad_inputs_are_named(attention):
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens = make_batch(
        [(5, 5)], 4, 2, 16, 16, 4, torch.float32
    )
    with pytest.raises(ValueError, match="dtype"):
        attention(query, key_cache.half(), value_cache.half(), block_table, query_start_loc, seq_lens, 0.25, 4)
    with pytest.raises(ValueError, match="kv heads"):
        attention(query[:, :3], key_cache, value_cache, block_table, query_start_loc, seq_lens, 0.25, 4)
    with pytest.raises(ValueError, match="query_start_loc"):
        attention(query, key_cache, value_cache, block_table, query_start_loc[:1], seq_lens, 0.25, 4)
    with pytest.raises(ValueError, match="window"):
        attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, 0.25, 0)
    one = torch.tensor(1.0, device=DEVICE)
    with pytest.raises(ValueError, match="k_scale: scales apply to torch.float8_e4m3fn caches only"):
        attention(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, 0.25, 4, k_scale=one)
    fp8 = key_cache.to(torch.float8_e4m3fn), value_cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="v_scale: expected a one-element fp32 tensor"):
        attention(query, *fp8, block_table, query_start_loc, seq_lens, 0.25, 4, v_scale=one.double())
    e5m2 = key_cache.to(torch.float8_e5m2), value_cache.to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="key_cache: expected the query's dtype"):
        attention(query, *e5m2, block_table, query_start_loc, seq_lens, 0.25, 4)


def test_prefill_compiles_once_for_every_query_length(attention, monkeypatch):
    """Serving hands the prefill path batches whose longest query is anything from 2 tokens (vLLM's warm-up batch)
    to a whole chunk: one compilation serves them all (a variant per length would stall serving for seconds)."""
    from vllm_integration.ops.paged_attention.kernel import _paged_window_attention_kernel as kernel

    compile_keys = HopperCompileKeys(monkeypatch, kernel)

    def run(seqs):  # block-table widths 4, 5 and 20 (a specialized stride): never 1 or a multiple of 16
        batch = make_batch(seqs, 4, 1, 32, 16, 16, torch.bfloat16)
        check(attention, batch, 16, max_query_len=max(q for _, q in seqs), max_seq_len=max(s for s, _ in seqs))

    run([(40, 2), (9, 2)])
    for seqs in ([(37, 37), (45, 9)], [(23, 5), (50, 17)], [(300, 130), (40, 1)], [(33, 3), (41, 40)]):
        run(seqs)
    counts = compile_keys.counts()
    assert all(count == 1 for count in counts.values()), counts


@pytest.mark.skipif(
    not flash_attention_available(torch.bfloat16, 128), reason="FlashAttention 3: Hopper GPUs and vLLM's FA3 build"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("window", [7, 200, None], ids=lambda w: f"W{w}")
def test_flash_prefill_matches_reference(window, dtype):
    """vLLM's FlashAttention 3 over our cache (the prefills' attention on Hopper) against the reference: whole and
    chunked prefills, 80-token pages (a hybrid's page size, not a power of two), GQA 4. FA3 loads whole key tiles
    and masks them, so the slots no query may see hold large finite values instead of NaN: weighting one fails."""
    seqs = [(300, 300), (450, 90), (230, 17), (50, 50), (1000, 129), (161, 2)]
    query, key_cache, value_cache, block_table, query_start_loc, seq_lens = make_batch(
        seqs, 16, 4, 128, 80, window, dtype, seed=5
    )
    scale = query.shape[-1] ** -0.5
    expected = paged_window_attention_ref(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, window
    )
    assert torch.isfinite(expected).all(), "the reference read a poisoned slot"
    key_cache.nan_to_num_(nan=40.0)
    value_cache.nan_to_num_(nan=-40.0)
    out = torch.full_like(query, float("nan"))
    result = flash_paged_window_attention(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, scale, window, out,
        max_query_len=max(q for _, q in seqs), max_seq_len=max(s for s, _ in seqs),
    )  # fmt: skip
    assert result is out
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
