"""vLLM's paged KV cache with random contents, for the kernels that read it: the kernel tests
(tests/vllm_ops/test_paged_attention.py, test_hybrid_decode.py) poison every slot no query may see with NaN, so that
a kernel that reads one fails; the kernel benchmark (scripts/bench_kernels.py) keeps those slots finite, for anchors
that load whole tiles and mask them (FlashAttention 3, vLLM's unified attention)."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NULL_BLOCK = 0  # vLLM points freed and unused table entries at a null block


def paged_kv_cache(seq_lens, window, page_size, num_kv_heads, head_dim, dtype, layout, g, q_lens=None, *,
                   device=DEVICE, poison=True):  # fmt: skip
    """Key and value caches [NB, P, KVH, D] and a block table [S, MB] int32, on `device`, for sequences of seq_lens
    tokens whose last q_lens tokens are the queries (one each when None: a decode batch). Random values are drawn
    from the generator `g` on its own device (a CPU generator gives the same cache on every device).

    Physical blocks are handed out in a random order (block 0 is the null block). Blocks wholly before the window of
    a sequence's first query are "freed": their table entries point at the null block (`window` None: none are).
    The table has a spare column (entries past a sequence's end, on the null block). With `poison`, every cache slot
    no query may see (before that window, past the sequence, the null block, blocks nobody owns) holds NaN.
    `dtype` torch.float8_e4m3fn gives an fp8 cache (vLLM's `kv_cache_dtype="fp8"`).
    `layout`: "triton" = vLLM's Triton backend views `kv.transpose(1, 2).split(D, -1)` of one [NB, KVH, P, 2D]
    tensor; "flash" = [2, NB, P, KVH, D].
    """
    q_lens = [1] * len(seq_lens) if q_lens is None else q_lens
    blocks_per_seq = [-(-seq_len // page_size) for seq_len in seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = 1 + sum(blocks_per_seq) + 3  # null block, the sequences' blocks, blocks nobody owns
    # An fp8 cache is filled and poisoned in fp32, then converted (NaN is an e4m3 value).
    fill_dtype = torch.float32 if dtype == torch.float8_e4m3fn else dtype
    # Views are taken on the device: moving a view would make it contiguous.
    if layout == "triton":
        shape = (num_blocks, num_kv_heads, page_size, 2 * head_dim)
    else:
        shape = (2, num_blocks, page_size, num_kv_heads, head_dim)
    kv = torch.randn(shape, generator=g, device=g.device).to(device, fill_dtype)
    key_cache, value_cache = _views(kv, layout, head_dim)
    visible = torch.zeros(num_blocks, page_size, dtype=torch.bool)
    block_table = torch.full((len(seq_lens), max_blocks), NULL_BLOCK, dtype=torch.int32)
    physical = (torch.randperm(num_blocks - 1, generator=g, device=g.device) + 1).tolist()
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        first_key = 0 if window is None else max(0, seq_len - q_len - window + 1)
        for j in range(blocks_per_seq[i]):
            block = physical.pop()
            if (j + 1) * page_size <= first_key:
                continue  # freed: the table entry stays on the null block
            block_table[i, j] = block
            if poison:
                slots = torch.arange(page_size) + j * page_size
                visible[block] = (slots >= first_key) & (slots < seq_len)
    if poison:
        key_cache[~visible.to(device)] = float("nan")
        value_cache[~visible.to(device)] = float("nan")
    if fill_dtype != dtype:
        key_cache, value_cache = _views(kv.to(dtype), layout, head_dim)
    return key_cache, value_cache, block_table.to(device)


def _views(kv, layout, head_dim):
    if layout == "triton":
        return kv.transpose(1, 2).split(head_dim, dim=-1)
    return kv[0], kv[1]
