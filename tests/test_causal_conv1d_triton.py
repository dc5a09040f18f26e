"""The Triton causal conv1d kernels against their references (modeling/ops/causal_conv1d/), in Triton's interpreter
on CPU machines: training forward and backward, packed serving prefills and decode steps with the conv-state cache."""

import importlib

import pytest
import torch

from modeling.ops.causal_conv1d import causal_conv1d_ref, causal_conv1d_update_ref, causal_conv1d_varlen_ref

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def ops():
    """The kernels' public functions, in Triton's interpreter on CPU machines (conftest sets TRITON_INTERPRET before
    triton)."""
    return importlib.import_module("modeling.ops.causal_conv1d.interface")


def xs_half(rows: tuple[int, ...], channels: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """The xs half of an in_proj output [..., 2E]: a strided view (stride 2E between tokens), as the model has it."""
    xz = torch.randn(*rows, 2 * channels, generator=gen).to(DEVICE, dtype)
    return xz[..., :channels]


def conv_params(channels, width, dtype, with_bias, gen):
    weight = (torch.randn(channels, width, generator=gen) * 0.5).to(DEVICE, dtype)
    bias = torch.randn(channels, generator=gen).to(DEVICE, dtype) if with_bias else None
    return weight, bias


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


# ---------------------------------------------------------------------------------------------------------------------
# Training: causal_conv1d_fn
# ---------------------------------------------------------------------------------------------------------------------

TRAIN_CASES = [  # batch, T, E, K, dtype, weight dtype, bias, activation, history, (block_t, block_e) or None
    (2, 13, 19, 4, torch.float32, torch.float32, True, "silu", False, (8, 8)),  # T % block, E odd, several blocks
    (3, 2, 16, 4, torch.float32, torch.float32, True, "silu", True, None),  # T < K-1: history reaches the last row
    (2, 3, 24, 4, torch.bfloat16, torch.bfloat16, False, None, True, (2, 16)),
    (2, 21, 19, 3, torch.float16, torch.float16, True, "silu", True, (8, 16)),
    (1, 17, 33, 4, torch.bfloat16, torch.float32, True, "silu", False, None),  # fp32 weights, bf16 activations
    (2, 9, 10, 2, torch.float32, torch.float32, False, None, False, None),
]
TRAIN_IDS = [
    f"B{c[0]}-T{c[1]}-E{c[2]}-K{c[3]}-{str(c[4])[6:]}-w{str(c[5])[6:]}-{'bias' if c[6] else 'nobias'}-"
    f"{c[7] or 'linear'}-{'hist' if c[8] else 'zero'}-{'x'.join(map(str, c[9])) if c[9] else 'default'}"
    for c in TRAIN_CASES
]


def train_inputs(batch, seq_len, channels, width, dtype, w_dtype, with_bias, with_history, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = xs_half((batch, seq_len), channels, dtype, gen)
    weight, bias = conv_params(channels, width, w_dtype, with_bias, gen)
    history = torch.randn(batch, channels, width - 1, generator=gen).to(DEVICE, dtype) if with_history else None
    return x, weight, bias, history


@pytest.mark.parametrize("batch,seq_len,channels,width,dtype,w_dtype,with_bias,activation,with_history,blocks",
                         TRAIN_CASES, ids=TRAIN_IDS)  # fmt: skip
def test_forward_matches_reference(
    ops, batch, seq_len, channels, width, dtype, w_dtype, with_bias, activation, with_history, blocks
):
    x, weight, bias, history = train_inputs(batch, seq_len, channels, width, dtype, w_dtype, with_bias, with_history)
    assert x.stride(1) == 2 * channels  # the strided xs view is read in place
    block_t, block_e = blocks or (None, None)
    out = torch.full((batch, seq_len, channels), float("nan"), device=DEVICE, dtype=dtype)  # poisoned
    y = ops.causal_conv1d_fwd(x, weight, bias, activation, history, out=out, block_t=block_t, block_e=block_e)
    assert y is out
    assert_close(y, causal_conv1d_ref(x, weight, bias, activation, history), dtype)
    # the public autograd entry point gives the same forward
    torch.testing.assert_close(ops.causal_conv1d_fn(x, weight, bias, activation, history), y, atol=0, rtol=0)


@pytest.mark.parametrize("batch,seq_len,channels,width,dtype,w_dtype,with_bias,activation,with_history,blocks",
                         TRAIN_CASES, ids=TRAIN_IDS)  # fmt: skip
def test_backward_matches_autograd_through_reference(
    ops, batch, seq_len, channels, width, dtype, w_dtype, with_bias, activation, with_history, blocks
):
    x, weight, bias, history = train_inputs(batch, seq_len, channels, width, dtype, w_dtype, with_bias, with_history)
    dy = torch.randn(batch, seq_len, channels, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)

    leaves = [t.detach().requires_grad_() for t in (x, weight, bias) if t is not None]
    ops.causal_conv1d_fn(*leaves[:2], leaves[2] if with_bias else None, activation, history).backward(dy)

    ref_leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias) if t is not None]
    ref_history = history.double() if history is not None else None
    y_ref = causal_conv1d_ref(*ref_leaves[:2], ref_leaves[2] if with_bias else None, activation, ref_history)
    y_ref.backward(dy.double())

    for name, leaf, ref_leaf in zip(("dx", "dweight", "dbias"), leaves, ref_leaves):
        assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, name
        assert_close(leaf.grad, ref_leaf.grad, leaf.dtype)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_backward_sums_partials_of_many_programs(ops, activation):
    """Several row ranges per sequence, several row blocks per range and several channel blocks: the dweight / dbias
    partials of every program are summed, and every dx row is written once."""
    x, weight, bias, history = train_inputs(2, 23, 21, 4, torch.float32, torch.float32, True, True, seed=3)
    dy = torch.randn(2, 23, 21, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    dx, dweight, dbias = ops.causal_conv1d_bwd(
        x, weight, bias, dy, activation, history, block_t=4, block_e=8, rows_per_program=8
    )
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    causal_conv1d_ref(*leaves, activation, history.double()).backward(dy.double())
    for grad, leaf in zip((dx, dweight, dbias), leaves):
        assert_close(grad, leaf.grad, torch.float32)


def test_backward_writes_dx_into_a_given_view(ops):
    """dx given as a column range of a wider gradient (the branch's xz gradient, whose other half the scan writes):
    the values of a fresh dx, every element of the range written, nothing outside it touched."""
    x, weight, bias, history = train_inputs(2, 23, 21, 4, torch.float32, torch.float32, True, True, seed=5)
    dy = torch.randn(2, 23, 21, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    expected = ops.causal_conv1d_bwd(x, weight, bias, dy, "silu", history, block_t=4, block_e=8, rows_per_program=8)
    wider = torch.full((2, 23, 2 * 21), float("nan"), device=DEVICE)  # poisoned
    given = ops.causal_conv1d_bwd(
        x, weight, bias, dy, "silu", history, block_t=4, block_e=8, rows_per_program=8, dx=wider[..., :21]
    )
    assert given[0].data_ptr() == wider.data_ptr()
    for actual, fresh in zip(given, expected):
        torch.testing.assert_close(actual, fresh, atol=0, rtol=0)
    assert wider[..., 21:].isnan().all()
    with pytest.raises(ValueError, match="dx must be"):
        ops.causal_conv1d_bwd(x, weight, bias, dy, "silu", history, dx=wider[..., :20])


@pytest.mark.parametrize("split", [2, 9], ids=["first-chunk-shorter-than-K-1", "first-chunk-long"])
def test_chunks_continuing_from_history_match_one_pass(ops, split):
    x, weight, bias, _ = train_inputs(2, 14, 12, 4, torch.float32, torch.float32, True, False, seed=5)
    padded = torch.cat([x.new_zeros(2, 3, 12), x], dim=1)  # [B, K-1+T, E]: the zero history, then the inputs
    history = padded[:, split : split + 3].transpose(1, 2)  # [B, E, K-1]: the 3 inputs before x[:, split]
    first = ops.causal_conv1d_fn(x[:, :split], weight, bias, "silu")
    second = ops.causal_conv1d_fn(x[:, split:], weight, bias, "silu", initial_history=history)
    assert_close(torch.cat([first, second], dim=1), ops.causal_conv1d_fn(x, weight, bias, "silu"), torch.float32)


# Packed rows (seq_idx): each row's sequence lengths, summing to T. Boundaries inside a tile and on a tile boundary
# (row 8 with block_t 8), sequences of 1 and 2 tokens (< K-1: a tap reaches back past the previous sequence), rows of
# one batch cut differently, and a row holding one sequence.
PACKED_CASES = [  # E, K, dtype, bias, activation, history, (block_t, block_e) or None, lengths per row, seq_idx dtype
    (19, 4, torch.float32, True, "silu", True, (8, 8), [[1, 2, 5, 5], [6, 1, 6]], torch.int32),
    (19, 4, torch.float32, False, None, False, (8, 8), [[3, 5, 2, 7], [17]], torch.int64),
    (24, 4, torch.bfloat16, True, "silu", True, (8, 16), [[2, 1, 1, 9, 3], [9, 7]], torch.int64),
    (16, 3, torch.bfloat16, False, None, True, None, [[4, 1, 5], [2, 8]], torch.int32),
    (12, 2, torch.float32, False, "silu", True, (4, 8), [[1, 1, 1, 6], [5, 4]], torch.int32),
]
PACKED_IDS = [
    f"E{c[0]}-K{c[1]}-{str(c[2])[6:]}-{'bias' if c[3] else 'nobias'}-{c[4] or 'linear'}-{'hist' if c[5] else 'zero'}-"
    f"{'x'.join(map(str, c[6])) if c[6] else 'default'}-{'_'.join('.'.join(map(str, row)) for row in c[7])}"
    for c in PACKED_CASES
]


def packed_seq_idx(lengths: list[list[int]], dtype: torch.dtype = torch.int32, first: int = 0) -> torch.Tensor:
    """seq_idx [B, T] of rows packing sequences of the given lengths, numbered first, first+1, .. along each row."""
    rows = [torch.repeat_interleave(torch.arange(len(row)) + first, torch.tensor(row)) for row in lengths]
    return torch.stack(rows).to(DEVICE, dtype)


@pytest.mark.parametrize("channels,width,dtype,with_bias,activation,with_history,blocks,lengths,idx_dtype",
                         PACKED_CASES, ids=PACKED_IDS)  # fmt: skip
def test_packed_rows_match_reference(
    ops, channels, width, dtype, with_bias, activation, with_history, blocks, lengths, idx_dtype
):
    """Forward and dx / dweight / dbias of rows packing several sequences, against the reference with the same
    seq_idx (fp64 for the gradients); the launchers at the case's tiles, the autograd entry point at its defaults."""
    batch, seq_len = len(lengths), sum(lengths[0])
    x, weight, bias, history = train_inputs(batch, seq_len, channels, width, dtype, dtype, with_bias, with_history, 10)
    seq_idx = packed_seq_idx(lengths, idx_dtype)
    dy = torch.randn(batch, seq_len, channels, generator=torch.Generator().manual_seed(11)).to(DEVICE, dtype)
    block_t, block_e = blocks or (None, None)

    out = torch.full((batch, seq_len, channels), float("nan"), device=DEVICE, dtype=dtype)  # poisoned
    y = ops.causal_conv1d_fwd(
        x, weight, bias, activation, history, out, seq_idx=seq_idx, block_t=block_t, block_e=block_e
    )
    assert_close(y, causal_conv1d_ref(x, weight, bias, activation, history, seq_idx), dtype)
    grads = ops.causal_conv1d_bwd(
        x, weight, bias, dy, activation, history, seq_idx=seq_idx, block_t=block_t, block_e=block_e
    )

    leaves = [t.detach().requires_grad_() for t in (x, weight, bias) if t is not None]
    y_fn = ops.causal_conv1d_fn(*leaves[:2], leaves[2] if with_bias else None, activation, history, seq_idx)
    torch.testing.assert_close(y_fn, y, atol=0, rtol=0)
    y_fn.backward(dy)

    ref_leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias) if t is not None]
    ref_history = history.double() if history is not None else None
    ref_bias = ref_leaves[2] if with_bias else None
    causal_conv1d_ref(*ref_leaves[:2], ref_bias, activation, ref_history, seq_idx).backward(dy.double())
    for name, grad, leaf, ref_leaf in zip(("dx", "dweight", "dbias"), grads, leaves, ref_leaves):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, name
        assert_close(grad, ref_leaf.grad, leaf.dtype)
        assert_close(leaf.grad, ref_leaf.grad, leaf.dtype)


def test_packed_row_equals_sequences_run_alone(ops):
    """The property packing must have: a packed row's output and dx are those of its sequences each run alone through
    the kernel (concatenated; the row's history goes with its first sequence), and dweight / dbias are the sums over
    the sequences run alone. seq_idx numbered from 3, as int64."""
    lengths = [[2, 1, 7, 5], [9, 6]]
    channels, width, seq_len = 20, 4, 15
    x, weight, bias, history = train_inputs(2, seq_len, channels, width, torch.float32, torch.float32, True, True, 12)
    dy = torch.randn(2, seq_len, channels, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    seq_idx = packed_seq_idx(lengths, torch.int64, first=3)

    leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
    y = ops.causal_conv1d_fn(*leaves, "silu", history, seq_idx)
    y.backward(dy)

    weight_alone, bias_alone = weight.detach().requires_grad_(), bias.detach().requires_grad_()
    for row, row_lengths in enumerate(lengths):
        start = 0
        for seq, length in enumerate(row_lengths):
            rows = slice(start, start + length)
            x_alone = x[row : row + 1, rows].detach().requires_grad_()
            seq_history = history[row : row + 1] if seq == 0 else None
            y_alone = ops.causal_conv1d_fn(x_alone, weight_alone, bias_alone, "silu", seq_history)
            y_alone.backward(dy[row : row + 1, rows])
            torch.testing.assert_close(y[row : row + 1, rows], y_alone, atol=0, rtol=0)
            torch.testing.assert_close(leaves[0].grad[row : row + 1, rows], x_alone.grad, atol=0, rtol=0)
            start += length
    assert_close(leaves[1].grad, weight_alone.grad, torch.float32)
    assert_close(leaves[2].grad, bias_alone.grad, torch.float32)


# ---------------------------------------------------------------------------------------------------------------------
# Serving: packed prefills and decode steps against the conv-state cache
# ---------------------------------------------------------------------------------------------------------------------


def conv_state_cache(num_slots, channels, width, dtype, layout, gen):
    """The conv-state cache as the kernels get it: [slots, E, K-1], either stored so or a transposed view of vLLM's
    [slots, K-1, E] storage."""
    if layout == "slot-E-K":
        return torch.randn(num_slots, channels, width - 1, generator=gen).to(DEVICE, dtype)
    return torch.randn(num_slots, width - 1, channels, generator=gen).to(DEVICE, dtype).transpose(1, 2)


# Rows: seq 0 [0, 7), seq 1 [7, 9) of length 2 < K-1 straddles the first 8-row block, seq 2 (padding, length 1),
# seq 3 long and fresh, seq 4 empty, seq 5 of length K-1, seq 6 fresh of length 2, seqs 7 and 8 of one token
# (continuing, fresh); rows 46.. are padding tokens.
SEQ_LENS = [7, 2, 1, 29, 0, 3, 2, 1, 1]
SLOTS = [7, 2, -1, 4, 9, 0, 5, 1, 3]  # permuted, non-contiguous; slots 6 and 8 belong to no sequence
HAS_INITIAL = [True, True, True, False, True, True, False, True, False]
PAD_TOKENS = 3

VARLEN_CASES = [  # dtype, K, conv-state layout, (block_t, block_e) or None, dtype of cu_seqlens and state_indices
    (torch.float32, 4, "slot-K-E", (8, 8), torch.int32),
    (torch.bfloat16, 4, "slot-E-K", (8, 16), torch.int32),
    (torch.float16, 3, "slot-K-E", None, torch.int64),
    (torch.float32, 5, "slot-K-E", (8, 8), torch.int32),  # wider than vLLM's conv kernels take
]


@pytest.mark.parametrize(
    "dtype,width,layout,blocks,idx_dtype",
    VARLEN_CASES,
    ids=[
        f"{str(c[0])[6:]}-K{c[1]}-{c[2]}-{'x'.join(map(str, c[3])) if c[3] else 'default'}-{str(c[4])[6:]}"
        for c in VARLEN_CASES
    ],
)
def test_varlen_matches_reference(ops, dtype, width, layout, blocks, idx_dtype):
    gen = torch.Generator().manual_seed(6)
    channels, num_slots = 19, 10
    cu_seqlens = torch.tensor([0, *torch.tensor(SEQ_LENS).cumsum(0).tolist()], dtype=idx_dtype, device=DEVICE)
    num_tokens = int(cu_seqlens[-1]) + PAD_TOKENS
    x = xs_half((num_tokens,), channels, dtype, gen)
    weight, bias = conv_params(channels, width, dtype, True, gen)
    conv_state = conv_state_cache(num_slots, channels, width, dtype, layout, gen)
    state_indices = torch.tensor(SLOTS, dtype=idx_dtype, device=DEVICE)
    has_initial_state = torch.tensor(HAS_INITIAL, device=DEVICE)
    state_before, state_ref = conv_state.clone(), conv_state.clone()

    out = torch.full((num_tokens, channels), float("nan"), device=DEVICE, dtype=dtype)  # poisoned
    block_t, block_e = blocks or (None, None)
    result = ops.causal_conv1d_varlen_fwd(
        x, weight, bias, conv_state, cu_seqlens, state_indices, has_initial_state, "silu", out,
        block_t=block_t, block_e=block_e,
    )  # fmt: skip
    out_ref = causal_conv1d_varlen_ref(
        x, weight, bias, state_ref, cu_seqlens, state_indices, has_initial_state, "silu"
    )
    assert result is out
    assert_close(out, out_ref, dtype)
    padding_rows = torch.cat([torch.arange(9, 10), torch.arange(num_tokens - PAD_TOKENS, num_tokens)])
    assert (out[padding_rows] == 0).all()
    # the whole cache: updated slots hold exactly the reference's new histories, every other slot is untouched
    assert torch.equal(conv_state, state_ref)
    untouched = [slot for slot in range(num_slots) if slot not in SLOTS]
    assert torch.equal(conv_state[untouched], state_before[untouched])


DECODE_CASES = [  # dtype, K, conv-state layout, block_e or None, dtype of state_indices
    (torch.float32, 4, "slot-K-E", 8, torch.int32),
    (torch.bfloat16, 4, "slot-E-K", None, torch.int64),
    (torch.float16, 2, "slot-K-E", 16, torch.int32),
    (torch.float32, 5, "slot-K-E", 8, torch.int32),  # wider than vLLM's conv kernels take
]


@pytest.mark.parametrize(
    "dtype,width,layout,block_e,idx_dtype",
    DECODE_CASES,
    ids=[f"{str(c[0])[6:]}-K{c[1]}-{c[2]}-{c[3] or 'default'}-{str(c[4])[6:]}" for c in DECODE_CASES],
)
def test_update_matches_reference(ops, dtype, width, layout, block_e, idx_dtype):
    gen = torch.Generator().manual_seed(7)
    channels, num_slots = 21, 9
    x = xs_half((5,), channels, dtype, gen)
    weight, bias = conv_params(channels, width, dtype, True, gen)
    conv_state = conv_state_cache(num_slots, channels, width, dtype, layout, gen)
    state_indices = torch.tensor([6, -1, 2, 8, 0], dtype=idx_dtype, device=DEVICE)  # row 1: CUDA-graph padding
    state_before, state_ref = conv_state.clone(), conv_state.clone()

    out = torch.full((5, channels), float("nan"), device=DEVICE, dtype=dtype)  # poisoned
    result = ops.causal_conv1d_update(x, weight, bias, conv_state, state_indices, "silu", out, block_e=block_e)
    out_ref = causal_conv1d_update_ref(x, weight, bias, state_ref, state_indices, "silu")
    assert result is out
    assert_close(out, out_ref, dtype)
    assert (out[1] == 0).all()
    assert torch.equal(conv_state, state_ref)
    untouched = [1, 3, 4, 5, 7]
    assert torch.equal(conv_state[untouched], state_before[untouched])


def test_update_first_token_reads_a_zero_history(ops):
    """Rows flagged as a request's first token (has_initial_state False: a one-token prompt in a CUDA-graph decode
    batch) ignore whatever their slot holds: their output is the training forward over that one token, and the slot
    then holds zeros and the token; flagged-True rows continue from their slot as before."""
    gen = torch.Generator().manual_seed(9)
    channels, width, num_slots = 21, 4, 9
    x = xs_half((5,), channels, torch.float32, gen)
    weight, bias = conv_params(channels, width, torch.float32, True, gen)
    conv_state = conv_state_cache(num_slots, channels, width, torch.float32, "slot-E-K", gen)
    state_indices = torch.tensor([6, -1, 2, 8, 0], dtype=torch.int32, device=DEVICE)
    has_initial_state = torch.tensor([True, False, False, True, False], device=DEVICE)
    state_ref = conv_state.clone()

    out = torch.full((5, channels), float("nan"), device=DEVICE)
    ops.causal_conv1d_update(
        x, weight, bias, conv_state, state_indices, "silu", out, has_initial_state=has_initial_state
    )
    out_ref = causal_conv1d_update_ref(
        x, weight, bias, state_ref, state_indices, "silu", has_initial_state=has_initial_state
    )
    assert_close(out, out_ref, torch.float32)
    assert torch.equal(conv_state, state_ref)
    first_tokens = [2, 4]
    alone = ops.causal_conv1d_fn(x[first_tokens][:, None], weight, bias, "silu")[:, 0]  # each token as a sequence
    assert_close(out[first_tokens], alone, torch.float32)
    slots = state_indices[first_tokens].long()
    assert (conv_state[slots][..., :-1] == 0).all() and torch.equal(conv_state[slots][..., -1], x[first_tokens])
    assert (out[1] == 0).all()  # padding row


def test_prefill_then_decode_matches_training_forward(ops):
    """Serving == training: two requests prefilled in chunks (the second chunk continuing from the cache), then decoded
    token by token, give the conv output of one pass over each whole sequence."""
    gen = torch.Generator().manual_seed(8)
    channels, width, total = 12, 4, 9
    x = xs_half((2, total), channels, torch.float32, gen)
    weight, bias = conv_params(channels, width, torch.float32, True, gen)
    expected = ops.causal_conv1d_fn(x, weight, bias, "silu")  # [2, total, E]

    conv_state = torch.randn(4, width - 1, channels, generator=gen).to(DEVICE).transpose(1, 2)  # stale slots
    slots = torch.tensor([3, 1], dtype=torch.int32, device=DEVICE)
    outputs = [[], []]
    for start, end, continues in ((0, 2, False), (2, 5, True)):  # chunked prefill: 2 tokens, then 3 more
        cu_seqlens = torch.tensor([0, end - start, 2 * (end - start)], dtype=torch.int32, device=DEVICE)
        packed = torch.cat([x[0, start:end], x[1, start:end]])
        has_initial = torch.tensor([continues, continues], device=DEVICE)
        out = ops.causal_conv1d_varlen_fwd(packed, weight, bias, conv_state, cu_seqlens, slots, has_initial, "silu")
        for seq in range(2):
            outputs[seq].append(out[seq * (end - start) : (seq + 1) * (end - start)])
    for t in range(5, total):
        out = ops.causal_conv1d_update(x[:, t], weight, bias, conv_state, slots, "silu")
        for seq in range(2):
            outputs[seq].append(out[seq : seq + 1])
    served = torch.stack([torch.cat(chunks) for chunks in outputs])
    assert_close(served, expected, torch.float32)


# ---------------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------------


def test_bad_inputs_name_the_tensor(ops):
    gen = torch.Generator().manual_seed(9)
    x = xs_half((4,), 8, torch.float32, gen)
    weight, bias = conv_params(8, 4, torch.float32, True, gen)
    conv_state = torch.zeros(3, 8, 3, device=DEVICE)
    slots = torch.tensor([0, 1, 2, -1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        ops.causal_conv1d_fn(x[None], weight[:, None, :], bias)
    with pytest.raises(ValueError, match="activation"):
        ops.causal_conv1d_fn(x[None], weight, bias, "relu")
    with pytest.raises(ValueError, match="initial_history"):
        ops.causal_conv1d_fn(x[None], weight, bias, "silu", conv_state[:1, :, :2])
    with pytest.raises(ValueError, match="conv_state"):
        ops.causal_conv1d_update(x, weight, bias, conv_state.transpose(1, 2), slots)
    for bad_slots in (slots.float(), torch.stack([slots, slots], dim=1)[:, 0]):  # not an index dtype; strided
        with pytest.raises(ValueError, match="state_indices"):
            ops.causal_conv1d_update(x, weight, bias, conv_state, bad_slots)
    cu_seqlens = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="has_initial_state"):
        ops.causal_conv1d_varlen_fwd(x, weight, bias, conv_state, cu_seqlens, slots[:1], slots[:1])


def test_bad_seq_idx_is_named(ops):
    gen = torch.Generator().manual_seed(14)
    x = xs_half((2, 6), 8, torch.float32, gen)
    weight, bias = conv_params(8, 4, torch.float32, True, gen)
    seq_idx = packed_seq_idx([[2, 4], [6]])
    dy = torch.ones_like(x)
    for bad in (seq_idx[:, :5], seq_idx[0], seq_idx[:, :, None], seq_idx.float(), seq_idx.bool()):
        with pytest.raises(ValueError, match="seq_idx"):
            ops.causal_conv1d_fn(x, weight, bias, "silu", None, bad)
        with pytest.raises(ValueError, match="seq_idx"):
            ops.causal_conv1d_bwd(x, weight, bias, dy, "silu", seq_idx=bad)
