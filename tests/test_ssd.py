"""Mamba-2's SSD scan references (modeling/ops/ssd) against a float64 token loop written here from docs/DESIGN.md,
against each other (values and gradients), and the gated norm against Transformers' `MambaRMSNormGated` (G = 1);
the kernels against the references (the chunked scan's, the gated norm's and the decode update's Triton kernels, in
Triton's interpreter on CPU machines)."""

import inspect
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import HopperCompileKeys, backward_elements

from modeling.ops import (
    gated_rms_norm_ref,
    ssd_chunk_scan_ref,
    ssd_scan_ref,
    ssd_state_update_ref,
    ssd_varlen_scan_ref,
)

BATCH, LENGTH, HEADS, HEAD_DIM, GROUPS, STATE = 2, 37, 4, 3, 2, 5


def random_inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, LENGTH, HEADS, HEAD_DIM, generator=g)
    dt = torch.rand(BATCH, LENGTH, HEADS, generator=g) * 0.6
    A = -(torch.rand(HEADS, generator=g) * 3 + 0.2)
    B = torch.randn(BATCH, LENGTH, GROUPS, STATE, generator=g)
    C = torch.randn(BATCH, LENGTH, GROUPS, STATE, generator=g)
    D = torch.randn(HEADS, generator=g)
    h0 = torch.randn(BATCH, HEADS, HEAD_DIM, STATE, generator=g)
    seq_idx = torch.zeros(BATCH, LENGTH, dtype=torch.long)
    seq_idx[0, 10:], seq_idx[0, 11:], seq_idx[0, 25:], seq_idx[1, 16:] = 1, 2, 3, 1  # a one-token sequence too
    return [t.to(dtype) for t in (x, dt, A, B, C, D, h0)] + [seq_idx]


def token_loop_float64(x, dt, A, B, C, D, h0, seq_idx):
    """docs/DESIGN.md's recurrence, one token and one head at a time, in float64."""
    x, dt, A, B, C, D = (t.double() for t in (x, dt, A, B, C, D))
    y = torch.empty_like(x)
    final = torch.empty(BATCH, HEADS, HEAD_DIM, STATE, dtype=torch.float64)
    for b in range(BATCH):
        for h in range(HEADS):
            g = h // (HEADS // GROUPS)
            state = torch.zeros(HEAD_DIM, STATE, dtype=torch.float64) if h0 is None else h0[b, h].double()
            for t in range(LENGTH):
                if seq_idx is not None and t > 0 and seq_idx[b, t] != seq_idx[b, t - 1]:
                    state = torch.zeros_like(state)
                state = torch.exp(dt[b, t, h] * A[h]) * state + dt[b, t, h] * torch.outer(x[b, t, h], B[b, t, g])
                y[b, t, h] = state @ C[b, t, g] + D[h] * x[b, t, h]
            final[b, h] = state
    return y, final


@pytest.mark.parametrize("packed", [False, True], ids=["one-sequence", "packed"])
@pytest.mark.parametrize("with_initial_state", [False, True], ids=["zero-start", "initial-state"])
@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_both_forms_match_a_float64_token_loop(packed, with_initial_state, chunk_size):
    x, dt, A, B, C, D, h0, seq_idx = random_inputs()
    h0 = h0 if with_initial_state else None
    seq_idx = seq_idx if packed else None
    y_want, state_want = token_loop_float64(x, dt, A, B, C, D, h0, seq_idx)
    for name, (y, state) in {
        "recurrent": ssd_scan_ref(x, dt, A, B, C, D, h0, seq_idx),
        "chunked": ssd_chunk_scan_ref(x, dt, A, B, C, D, chunk_size, h0, seq_idx),
    }.items():
        assert y.dtype == x.dtype and state.dtype == torch.float32
        torch.testing.assert_close(y.double(), y_want, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(state.double(), state_want, atol=1e-5, rtol=1e-5, msg=name)


def test_chunked_gradients_match_the_recurrence():
    inputs = random_inputs(seed=1)
    seq_idx = inputs.pop()
    grads = {}
    for name, scan in {
        "recurrent": lambda *a: ssd_scan_ref(*a, seq_idx=seq_idx),
        "chunked": lambda *a: ssd_chunk_scan_ref(*a[:6], 8, a[6], seq_idx),
    }.items():
        leaves = [t.clone().requires_grad_() for t in inputs]
        y, state = scan(*leaves)
        g = torch.Generator().manual_seed(2)
        (
            (y * torch.randn(y.shape, generator=g)).sum() + (state * torch.randn(state.shape, generator=g)).sum()
        ).backward()
        grads[name] = [leaf.grad for leaf in leaves]
        assert all(torch.isfinite(grad).all() for grad in grads[name]), name
    for want, got in zip(grads["recurrent"], grads["chunked"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_recurrent_reference_backward_grows_linearly_with_the_length():
    """As `selective_scan_ref`'s (tests/test_modeling.py): no whole-sequence tensor written at every step of the
    backward, which indexing each token out of the [b, T, H, ...] inputs did."""
    g = torch.Generator().manual_seed(2)
    b, T, H, P, G, N = 2, 256, 2, 4, 1, 4
    x = torch.randn(b, T, H, P, generator=g, requires_grad=True)
    dt = (torch.rand(b, T, H, generator=g) * 0.6).requires_grad_()
    B, C = (torch.randn(b, T, G, N, generator=g, requires_grad=True) for _ in range(2))
    y, _ = ssd_scan_ref(x, dt, -(torch.rand(H, generator=g) + 0.2), B, C, torch.randn(H, generator=g))
    # whole-sequence tensors: x * dt, and B and C per head; the backward writes ~24 of them with unbind, ~580 indexing
    assert backward_elements(y) < 60 * b * T * H * (P + 2 * N)
    assert all(t.grad is not None for t in (x, dt, B, C))


def test_a_zero_step_leaves_the_state_as_it_was():
    x, dt, A, B, C, D, h0, _ = random_inputs(seed=3)
    dt[:, 20:] = 0.0  # padding: the step is zero from here on
    _, state_at_20 = ssd_chunk_scan_ref(x[:, :20], dt[:, :20], A, B[:, :20], C[:, :20], D, 8, h0)
    _, state_at_end = ssd_chunk_scan_ref(x, dt, A, B, C, D, 8, h0)
    torch.testing.assert_close(state_at_end, state_at_20)


def test_decode_update_is_one_step_of_the_scan_in_each_slot():
    x, dt, A, B, C, D, h0, _ = random_inputs(seed=4)
    y_scan, state_scan = ssd_scan_ref(x[:, :1], dt[:, :1], A, B[:, :1], C[:, :1], D, h0)
    y_fresh, state_fresh = ssd_scan_ref(x[:, :1], dt[:, :1], A, B[:, :1], C[:, :1], D)
    # Request 0 continues from slot 3, request 1 (a first token) starts from zero in slot 1 whatever it holds.
    cache = torch.randn(5, *h0.shape[1:])
    cache[3] = h0[0]
    untouched = cache[[0, 2, 4]].clone()
    y = ssd_state_update_ref(
        cache, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D, torch.tensor([3, 1]), torch.tensor([True, False])
    )
    torch.testing.assert_close(y, torch.stack([y_scan[0, 0], y_fresh[1, 0]]))
    torch.testing.assert_close(cache[3], state_scan[0])
    torch.testing.assert_close(cache[1], state_fresh[1])
    torch.testing.assert_close(cache[[0, 2, 4]], untouched)


def test_packed_prefills_continue_from_their_slots():
    x, dt, A, B, C, D, h0, _ = random_inputs(seed=8)
    cu_seqlens, slots, has_initial = torch.tensor([0, 9, 30]), torch.tensor([2, 0]), torch.tensor([True, False])
    cache = torch.randn(3, *h0.shape[1:])
    cache[2] = h0[0]
    out = torch.full((30, HEADS, HEAD_DIM), float("nan"))
    ssd_varlen_scan_ref(
        x[0, :30], dt[0, :30], A, B[0, :30], C[0, :30], D, cache, cu_seqlens, slots, has_initial, 4, out
    )
    first, first_state = ssd_scan_ref(x[:1, :9], dt[:1, :9], A, B[:1, :9], C[:1, :9], D, h0[:1])
    second, second_state = ssd_scan_ref(x[:1, 9:30], dt[:1, 9:30], A, B[:1, 9:30], C[:1, 9:30], D)
    torch.testing.assert_close(out, torch.cat([first[0], second[0]]))
    torch.testing.assert_close(cache[2], first_state[0])
    torch.testing.assert_close(cache[0], second_state[0])


def test_serving_references_take_the_raw_dt_with_its_bias_and_softplus():
    """`dt_bias` and `dt_softplus` (the serving kernels' convention): the step softplus(dt + dt_bias), as passed
    already applied; the decode update also writes into `out`."""
    x, _, A, B, C, D, h0, _ = random_inputs(seed=6)
    g = torch.Generator().manual_seed(7)
    raw_dt, dt_bias = torch.randn(30, HEADS, generator=g), torch.randn(HEADS, generator=g)
    step = F.softplus(raw_dt + dt_bias)
    args = (torch.tensor([0, 9, 30]), torch.tensor([1, 0]), torch.tensor([True, False]), 4)
    caches, outs = [h0.clone() for _ in range(2)], [torch.empty(30, HEADS, HEAD_DIM) for _ in range(2)]
    ssd_varlen_scan_ref(x[0, :30], step, A, B[0, :30], C[0, :30], D, caches[0], *args, outs[0])
    ssd_varlen_scan_ref(
        x[0, :30], raw_dt, A, B[0, :30], C[0, :30], D, caches[1], *args, outs[1], dt_bias=dt_bias, dt_softplus=True
    )
    torch.testing.assert_close(outs[1], outs[0])
    torch.testing.assert_close(caches[1], caches[0])
    slots, out = torch.tensor([1, 0]), torch.full((2, HEADS, HEAD_DIM), float("nan"))
    expected = ssd_state_update_ref(caches[0], x[:, 0], step[:2], A, B[:, 0], C[:, 0], D, slots)
    returned = ssd_state_update_ref(
        caches[1], x[:, 0], raw_dt[:2], A, B[:, 0], C[:, 0], D, slots, dt_bias=dt_bias, dt_softplus=True, out=out
    )
    assert returned is out
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(caches[1], caches[0])


def test_gated_norm_with_one_group_is_transformers_mamba2_norm():
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    g = torch.Generator().manual_seed(5)
    y, z = torch.randn(2, 7, 24, generator=g), torch.randn(2, 7, 24, generator=g)
    # Transformers 5.23 gives its norm groups too (`group_size`); 5.17's normalises over every channel: one group.
    groups = {"group_size": 24} if "group_size" in inspect.signature(MambaRMSNormGated).parameters else {}
    norm = MambaRMSNormGated(24, eps=1e-6, **groups)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g))
    torch.testing.assert_close(gated_rms_norm_ref(y, z, norm.weight, 24, 1e-6), norm(y, z))


def test_gated_norm_normalises_each_group_alone():
    g = torch.Generator().manual_seed(6)
    y, z, weight = torch.randn(3, 24, generator=g), torch.randn(3, 24, generator=g), torch.randn(24, generator=g)
    got = gated_rms_norm_ref(y, z, weight, 8, 1e-6)
    for group in range(3):
        part = slice(8 * group, 8 * group + 8)
        gated = (y[:, part] * F.silu(z[:, part])).double()
        want = gated / torch.sqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-6) * weight[part].double()
        torch.testing.assert_close(got[:, part].double(), want, atol=1e-6, rtol=1e-5)


ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"  # on CPU machines the kernels run in Triton's interpreter


def scan_inputs(seed, batch, length, heads, head_dim, groups, state, dtype=torch.float32):
    """The scan's inputs as the branch hands them: x, B and C views of one conv output [b, T, H*P + 2*G*N] in the
    activations' dtype, the step in fp32 (zero here and there: padding), an initial state and packed rows (a
    sequence starting at a chunk boundary, one of a single token, one at the row's last token)."""
    g = torch.Generator().manual_seed(seed)
    conv_out = torch.randn(batch, length, heads * head_dim + 2 * groups * state, generator=g)
    x = conv_out[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
    B, C = conv_out[..., heads * head_dim :].unflatten(-1, (2, groups, state)).unbind(2)
    dt = torch.rand(batch, length, heads, generator=g) * 0.6
    dt[:, 3] = 0.0
    A, D = -(torch.rand(heads, generator=g) * 3 + 0.2), torch.randn(heads, generator=g)
    h0 = torch.randn(batch, heads, head_dim, state, generator=g)
    seq_idx = torch.zeros(batch, length, dtype=torch.int32)
    for start in (5, 6, 16, length - 1):
        seq_idx[0, start:] += 1
    seq_idx[-1, length // 2 :] = 7
    return {
        "x": x.to(DEVICE, dtype), "dt": dt.to(DEVICE), "A": A.to(DEVICE), "B": B.to(DEVICE, dtype),
        "C": C.to(DEVICE, dtype), "D": D.to(DEVICE), "initial_state": h0.to(DEVICE), "seq_idx": seq_idx.to(DEVICE),
    }  # fmt: skip


SCAN_SHAPES = {  # (batch, length, heads, head_dim, groups, state, chunk)
    "partial-chunks": (2, 37, 4, 3, 2, 5, 16),
    "one-group": (2, 40, 4, 16, 1, 16, 16),
    "model-tile": (1, 150, 2, 24, 2, 32, 64),
}


SCAN_CASES = {  # (with_initial_state, packed, dtype): every case in fp32, the model's case in bf16
    "zero-start-one-sequence-fp32": (False, False, torch.float32),
    "initial-state-one-sequence-fp32": (True, False, torch.float32),
    "zero-start-packed-fp32": (False, True, torch.float32),
    "initial-state-packed-fp32": (True, True, torch.float32),
    "initial-state-packed-bf16": (True, True, torch.bfloat16),
}


@pytest.mark.parametrize(("with_initial_state", "packed", "dtype"), SCAN_CASES.values(), ids=SCAN_CASES.keys())
@pytest.mark.parametrize("shape", SCAN_SHAPES.values(), ids=SCAN_SHAPES.keys())
def test_the_triton_scan_is_the_reference(shape, with_initial_state, packed, dtype):
    """modeling/ops/ssd/interface.py, the Mamba-2 branch's training scan on CUDA: outputs and final state, then the
    gradients of every input (the initial state's too) from the output's and the final state's, against autograd
    through the reference in fp32 on the same (bf16-rounded) inputs. fp32 products are exact, bf16 operands round."""
    from modeling.ops.ssd.interface import ssd_chunk_scan_fn

    *dims, chunk = shape
    inputs = scan_inputs(1, *dims, dtype=dtype)
    seq_idx = inputs.pop("seq_idx")
    seq_idx = seq_idx if packed else None
    if not with_initial_state:
        del inputs["initial_state"]
    g = torch.Generator().manual_seed(2)
    dy = torch.randn(inputs["x"].shape, generator=g).to(DEVICE)
    dstate = torch.randn(*inputs["x"].shape[:1], *inputs["x"].shape[2:], inputs["B"].shape[-1], generator=g)

    def outputs_and_grads(scan, as_float):
        leaves = {k: (v.float() if as_float else v).detach().clone().requires_grad_() for k, v in inputs.items()}
        y, state = scan(**leaves, seq_idx=seq_idx)
        ((y.float() * dy).sum() + (state * dstate.to(DEVICE)).sum()).backward()
        return y, state, {k: v.grad for k, v in leaves.items()}

    y, state, grads = outputs_and_grads(partial(ssd_chunk_scan_fn, chunk_size=chunk), as_float=False)
    want_y, want_state, want_grads = outputs_and_grads(partial(ssd_chunk_scan_ref, chunk_size=chunk), as_float=True)
    assert y.dtype == dtype and state.dtype == torch.float32
    exact = dtype == torch.float32
    for got, want in ((y.float(), want_y), (state, want_state)):
        # fp32: both sides sum the same products in other orders, each rounding at ~1e-7 of the largest term (the
        # H100 put 1.2e-5 between them at an output of 0.07 where outputs reach 21)
        tolerance = {"atol": 2e-6 * want.abs().max().item(), "rtol": 1e-5} if exact else {"atol": 5e-2, "rtol": 2e-2}
        torch.testing.assert_close(got, want, **tolerance)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        want = want_grads[name]
        assert grad.dtype == inputs[name].dtype, name
        # bf16: a relative error over the whole tensor (sums of many rounded products, some near zero)
        error = ((grad.float() - want).norm() / want.norm()).item()
        if name == "A" and not exact:
            # A head's dA sums dg_t dt_t over every token, terms that largely cancel (one case: 0.61 against terms
            # summing to 291 in size, where the state's bf16 operands moved it by 0.2): measured against the terms
            terms = (want_grads["dt"] * inputs["dt"]).abs().sum((0, 1)) / inputs["A"].abs()
            error = ((grad - want).abs() / terms).max().item()
            assert error < 2e-3, (name, error)
            continue
        assert error < (1e-5 if exact else 1e-2), (name, error)


def test_the_triton_scan_gives_the_same_function_at_other_launch_shapes():
    """The launch shapes a benchmark sweeps (`SSDBlocks`): blocks smaller than P and N (several programs a head in the
    walk and the outputs, several N blocks in the backward) give the default's outputs and gradients; an unknown
    knob is refused."""
    from modeling.ops.ssd.interface import ssd_chunk_scan_fn

    inputs = scan_inputs(6, 1, 40, 2, 32, 1, 32)
    seq_idx = inputs.pop("seq_idx")
    results = []
    for blocks in ({}, {"walk_p": 16, "walk_n": 16, "out_p": 16, "out_n": 16, "bwd_n": 16, "bwd_warps": 4}):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
        y, state = ssd_chunk_scan_fn(**leaves, seq_idx=seq_idx, chunk_size=16, **blocks)
        (y.sum() + state.square().sum()).backward()
        results.append([y, state, *(leaf.grad for leaf in leaves.values())])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="block_e"):
        ssd_chunk_scan_fn(**inputs, block_e=32)


def test_the_triton_scan_takes_a_gradient_from_the_final_state_alone():
    """A loss of the final state only (the output unused): the backward starts from a zero output gradient."""
    from modeling.ops.ssd.interface import ssd_chunk_scan_fn

    inputs = scan_inputs(3, 1, 40, 2, 8, 1, 16)
    seq_idx = inputs.pop("seq_idx")
    grads = []
    for scan in (partial(ssd_chunk_scan_fn, chunk_size=16), partial(ssd_chunk_scan_ref, chunk_size=16)):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
        scan(**leaves, seq_idx=seq_idx)[1].square().sum().backward()
        grads.append([leaf.grad for leaf in leaves.values()])
    for got, want in zip(*grads, strict=True):  # None from autograd: the final state does not depend on D
        torch.testing.assert_close(got, torch.zeros_like(got) if want is None else want, atol=1e-5, rtol=1e-5)


def test_the_triton_scan_writes_every_output(monkeypatch):
    """Outputs poisoned with NaN before the kernels write them (every allocation the launchers make), at a length
    that leaves the last chunk partial: nothing of it may be left unwritten."""
    from modeling.ops.ssd.interface import ssd_chunk_scan_fn

    def poisoned(allocate):
        def allocate_poisoned(*args, **kwargs):
            tensor = allocate(*args, **kwargs)
            return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

        return allocate_poisoned

    for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty")):
        monkeypatch.setattr(owner, name, poisoned(getattr(owner, name)))
    inputs = scan_inputs(4, 2, 37, 4, 3, 2, 5)
    leaves = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}
    y, state = ssd_chunk_scan_fn(**leaves, chunk_size=16)
    (y.sum() + state.sum()).backward()
    for name, tensor in {"y": y, "state": state, **{k: v.grad for k, v in leaves.items() if v.requires_grad}}.items():
        assert torch.isfinite(tensor).all(), name


def test_the_triton_scan_refuses_what_it_cannot_compute():
    from modeling.ops.ssd.interface import ssd_chunk_scan_fn

    inputs = scan_inputs(5, 1, 20, 4, 8, 2, 16)
    x, dt, A, B, C, D = (inputs[k] for k in ("x", "dt", "A", "B", "C", "D"))
    with pytest.raises(ValueError, match="groups of B and C"):
        ssd_chunk_scan_fn(x[:, :, :3], dt[:, :, :3], A[:3], B, C, D[:3])
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunk_scan_fn(x, dt, A, B, C, D, chunk_size=48)
    with pytest.raises(ValueError, match="dt: expected"):
        ssd_chunk_scan_fn(x, dt[:, :-1], A, B, C, D)
    with pytest.raises(ValueError, match="initial_state"):
        ssd_chunk_scan_fn(x, dt, A, B, C, D, initial_state=torch.zeros(1, 4, 8, 15, device=DEVICE))
    with pytest.raises(ValueError, match="seq_idx"):
        ssd_chunk_scan_fn(x, dt, A, B, C, D, seq_idx=torch.zeros(1, 20, device=DEVICE))
    wide = torch.randn(1, 20, 1, 256, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        ssd_chunk_scan_fn(wide, dt[..., :1], A[:1], B[:, :, :1], C[:, :, :1], D[:1])


def test_the_forward_stores_the_states_in_the_inputs_dtype_and_gives_the_same_outputs():
    """The training forward stores the states entering the chunks in x's dtype (bf16 here), not fp32: the outputs
    kernel rounds them to it for its products anyway, so y is bit for bit the y computed from fp32 states."""
    from modeling.ops.ssd.forward import launch_ssd_chunk_walk, launch_ssd_outputs_fwd, pick_ssd_blocks
    from modeling.ops.ssd.interface import ssd_chunk_scan_fwd

    inputs = scan_inputs(21, 2, 150, 2, 24, 2, 32, dtype=torch.bfloat16)
    x, dt, A, B, C, D, h0 = (inputs[k] for k in ("x", "dt", "A", "B", "C", "D", "initial_state"))
    blocks = pick_ssd_blocks(24, 32)
    y, _ = ssd_chunk_scan_fwd(x, dt, A, B, C, D, h0, None, 64, blocks)
    states, _ = launch_ssd_chunk_walk(x, dt, A, B, None, h0, 64, blocks, reverse=False, with_end=False)
    assert states.dtype == torch.float32 and states.abs().max() > 1
    y_fp32_states = torch.full_like(x, float("nan"))
    launch_ssd_outputs_fwd(x, dt, A, B, C, D, None, states, y_fp32_states, 64, blocks)
    assert torch.equal(y, y_fp32_states)


# Packed prefills: a sequence continuing its slot across two tiles of 64, one of a single token (fresh), one
# continuing with fewer tokens than a tile, a long fresh one; three padding tokens after them.
VARLEN_LENGTHS, VARLEN_SLOTS, VARLEN_INITIAL = [70, 1, 9, 133], [4, 0, 6, 2], [True, False, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32-state", "bf16-state"])
@pytest.mark.parametrize(
    "tile, split_walk",
    [(64, False), (16, False), (128, False), (32, True), (64, True), (128, True)],
    ids=["64", "16", "128", "32-split", "64-split", "128-split"],
)
def test_the_varlen_triton_scan_is_the_reference(dtype, cache_dtype, tile, split_walk):
    """modeling/ops/ssd/varlen.py, the served Mamba-2 prefills: outputs (poisoned first; padding rows left as they
    were) and the whole state cache (the sequences' slots hold their final states, every other slot is untouched)
    against `ssd_varlen_scan_ref` on the same inputs, the raw dt with its bias and softplus, 4 heads in 2 groups, in
    the kernels' chunks of 64 tokens (the default), 16 and 128, and with the walk split in two kernels."""
    from modeling.ops.ssd.interface import ssd_varlen_scan_fwd

    heads, head_dim, groups, state = 4, 16, 2, 32
    num_tokens = sum(VARLEN_LENGTHS) + 3
    inputs = scan_inputs(9, 1, num_tokens, heads, head_dim, groups, state, dtype=dtype)
    x, B, C = (inputs[k][0] for k in ("x", "B", "C"))
    g = torch.Generator().manual_seed(10)
    dt = (torch.randn(num_tokens, heads, generator=g) * 0.5).to(DEVICE, dtype)
    dt_bias = (torch.randn(heads, generator=g) * 0.5 - 1).to(DEVICE)
    cache = torch.randn(8, heads, head_dim, state, generator=g).to(DEVICE, cache_dtype)
    bounds = torch.tensor([0, *torch.tensor(VARLEN_LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor(VARLEN_SLOTS, dtype=torch.int32, device=DEVICE)
    has_initial = torch.tensor(VARLEN_INITIAL, device=DEVICE)
    args = (x, dt, inputs["A"], B, C, inputs["D"])
    seqs = (bounds, slots, has_initial, 16)
    got_cache, want_cache, poisoned = cache.clone(), cache.clone(), torch.full_like(x, float("nan"))
    if ON_GPU:  # no host sync: a device tensor read on the host raises
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = ssd_varlen_scan_fwd(
            *args, got_cache, *seqs, poisoned, dt_bias=dt_bias, dt_softplus=True, tile=tile, split_walk=split_walk
        )
    finally:
        if ON_GPU:
            torch.cuda.set_sync_debug_mode("default")
    want = ssd_varlen_scan_ref(
        *args, want_cache, *seqs, torch.full_like(x, float("nan")), dt_bias=dt_bias, dt_softplus=True
    )
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}
    torch.testing.assert_close(got[: bounds[-1]].float(), want[: bounds[-1]].float(), **tolerance)
    assert got[bounds[-1] :].isnan().all()
    if cache_dtype == torch.float32:
        torch.testing.assert_close(got_cache, want_cache, **tolerance)
    else:  # both round the same fp32 final state to bf16, summed in other orders: one bf16 step apart at most
        torch.testing.assert_close(got_cache.float(), want_cache.float(), atol=tolerance["atol"], rtol=1e-2)
    untouched = [slot for slot in range(8) if slot not in VARLEN_SLOTS]
    assert torch.equal(got_cache[untouched], cache[untouched])


@pytest.mark.parametrize("split_walk", [False, True], ids=["walk", "split-walk"])
def test_the_varlen_triton_scan_serves_any_number_of_prefills_from_one_compilation(monkeypatch, split_walk):
    """Batches of 1, 2, 5 and 16 prefills (lengths 1 to 150, so that chunks of one sequence and single-token sequences
    alternate), their slots at the alignments vLLM hands them: each chunk's program finds its sequence (a binary
    search over their first chunks) and the results are the reference's, and an H100 compiles each kernel once for
    all these batches (no launch constant, specialized integer or alignment depends on the step's batch: a new
    compilation would stall serving)."""
    from modeling.ops.ssd import varlen
    from modeling.ops.ssd.interface import ssd_varlen_scan_fwd

    heads, head_dim, groups, state = 2, 16, 1, 16
    walk = (
        (varlen._ssd_varlen_chunk_states_kernel, varlen._ssd_varlen_state_pass_kernel)
        if split_walk
        else (varlen._ssd_varlen_walk_kernel,)
    )
    compile_keys = HopperCompileKeys(monkeypatch, *walk, varlen._ssd_varlen_outputs_kernel)
    g = torch.Generator().manual_seed(11)
    for num_seqs in (1, 2, 5, 16):
        lengths = torch.randint(1, 151, (num_seqs,), generator=g)
        lengths[1::3] = 1
        num_tokens = int(lengths.sum())
        inputs = scan_inputs(12 + num_seqs, 1, num_tokens, heads, head_dim, groups, state)
        x, B, C = (inputs[k][0] for k in ("x", "B", "C"))
        dt = (torch.randn(num_tokens, heads, generator=g) * 0.5).to(DEVICE)
        cache = torch.randn(num_seqs + 2, heads, head_dim, state, generator=g).to(DEVICE)
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(DEVICE, torch.int32)
        # The slots past those of `num_seqs % 4` decodes, as vLLM's Mamba metadata slices them: 16-byte aligned or not.
        decodes = num_seqs % 4
        slots = torch.randperm(num_seqs + 2, generator=g)[:num_seqs].to(DEVICE, torch.int32)
        slots = torch.cat([torch.full((decodes,), -1, dtype=torch.int32, device=DEVICE), slots])[decodes:]
        seqs = (bounds, slots, (torch.rand(num_seqs, generator=g) < 0.5).to(DEVICE), 16)
        args = (x, dt, inputs["A"], B, C, inputs["D"])
        got_cache, want_cache = cache.clone(), cache.clone()
        got = ssd_varlen_scan_fwd(
            *args, got_cache, *seqs, torch.full_like(x, float("nan")), dt_softplus=True, split_walk=split_walk
        )
        want = ssd_varlen_scan_ref(*args, want_cache, *seqs, dt_softplus=True)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_cache, want_cache, atol=1e-4, rtol=1e-4)
    counts = compile_keys.counts()
    assert all(count == 1 for count in counts.values()), f"variants for batches of 1, 2, 5 and 16 prefills: {counts}"


def test_the_varlen_triton_scan_refuses_what_it_cannot_compute():
    from modeling.ops.ssd.interface import ssd_varlen_scan_fwd

    inputs = scan_inputs(5, 1, 20, 4, 8, 2, 16)
    x, B, C = (inputs[k][0] for k in ("x", "B", "C"))
    dt, A, D = inputs["dt"][0], inputs["A"], inputs["D"]
    cache = torch.zeros(3, 4, 8, 16, device=DEVICE)
    bounds, slots = torch.tensor([0, 20], device=DEVICE), torch.tensor([1], device=DEVICE)
    seqs = (bounds, slots, torch.tensor([True], device=DEVICE))
    with pytest.raises(ValueError, match="groups of B and C"):
        ssd_varlen_scan_fwd(x[:, :3], dt[:, :3], A[:3], B, C, D[:3], cache[:, :3], *seqs, 16)
    with pytest.raises(ValueError, match="dt: expected"):
        ssd_varlen_scan_fwd(x, dt[:, :-1], A, B, C, D, cache, *seqs, 16)
    with pytest.raises(ValueError, match="A: expected fp32"):
        ssd_varlen_scan_fwd(x, dt, A.double(), B, C, D, cache, *seqs, 16)
    with pytest.raises(ValueError, match="state_cache: expected fp32, bf16 or fp16"):
        ssd_varlen_scan_fwd(x, dt, A, B, C, D, cache.double(), *seqs, 16)
    with pytest.raises(ValueError, match="state_cache: expected \\[slots"):
        ssd_varlen_scan_fwd(x, dt, A, B, C, D, cache[..., :15], *seqs, 16)
    with pytest.raises(ValueError, match="has_initial_state"):
        ssd_varlen_scan_fwd(x, dt, A, B, C, D, cache, *seqs[:2], torch.tensor([1], device=DEVICE), 16)
    with pytest.raises(ValueError, match="tile: expected a power of two from 16 to 128 tokens, got 48"):
        ssd_varlen_scan_fwd(x, dt, A, B, C, D, cache, *seqs, 16, tile=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups, group_size", [(1, 24), (3, 20), (2, 1)], ids=["G1", "G3-odd", "G2-size1"])
def test_the_norm_kernels_match_the_reference_and_write_every_output(monkeypatch, dtype, groups, group_size):
    """The gated norm's Triton kernels (modeling/ops/ssd/gated_norm.py) against the references in fp32: the output,
    the written-out backward's dy, dz and dweight, and the autograd of `gated_rms_norm` against autograd through the
    reference; z a column view of a wider tensor (as in_proj's output hands it), group sizes that are not powers of
    two, every output allocation poisoned with NaN before the kernels write it."""
    from modeling.ops.ssd.gated_norm import gated_rms_norm, gated_rms_norm_bwd

    g = torch.Generator().manual_seed(groups)
    channels = groups * group_size
    y = torch.randn(3, 11, channels, generator=g).to(dtype).to(DEVICE)
    z = torch.randn(3, 11, channels + 7, generator=g).to(dtype).to(DEVICE)[..., 3 : 3 + channels]
    weight = torch.randn(channels, generator=g).to(DEVICE)
    dout = torch.randn(3, 11, channels, generator=g).to(dtype).to(DEVICE)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    fp32 = [t.float() for t in (y, z, weight)]

    leaves = [t.detach().requires_grad_() for t in (y, z, weight)]
    out = gated_rms_norm(*leaves, group_size, 1e-5)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    ref_leaves = [t.detach().requires_grad_() for t in fp32]
    ref_out = gated_rms_norm_ref(*ref_leaves, group_size, 1e-5)
    want = [ref_out, *torch.autograd.grad(ref_out, ref_leaves, dout.float())]
    for name, a, b in zip(("out", "dy", "dz", "dweight"), got, want, strict=True):
        assert a.dtype == (weight.dtype if name == "dweight" else dtype), name
        torch.testing.assert_close(a.float(), b, **tol, msg=lambda m, name=name: f"{name}: {m}")
    written_out = gated_rms_norm_bwd(y, z, weight, group_size, 1e-5, dout)
    for name, a, b in zip(("dy", "dz", "dweight"), written_out, got[1:], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    # dz written into a given column range of a wider (poisoned) gradient, as the fused branch's backward passes it:
    # every element of the range, nothing outside it
    wider = torch.full((3, 11, channels + 7), float("nan"), dtype=dtype, device=DEVICE)
    given = gated_rms_norm_bwd(y, z, weight, group_size, 1e-5, dout, wider[..., 3 : 3 + channels])
    assert given[1].data_ptr() == wider[..., 3:].data_ptr()
    torch.testing.assert_close(given[1], got[2], atol=0, rtol=0)
    assert wider[..., :3].isnan().all() and wider[..., 3 + channels :].isnan().all()
    with pytest.raises(ValueError, match="dz must be"):
        gated_rms_norm_bwd(y, z, weight, group_size, 1e-5, dout, wider[..., :channels].transpose(0, 1))
    # A weight viewed with a stride (the kernels index it by channel) and the refused double backward.
    strided = torch.stack([weight, weight.neg()], -1)[:, 0]
    torch.testing.assert_close(gated_rms_norm(y, z, strided, group_size, 1e-5), got[0], atol=0, rtol=0)
    cotangent = dout.detach().requires_grad_()
    first = torch.autograd.grad(gated_rms_norm(*leaves, group_size, 1e-5), leaves[0], cotangent, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        first[0].sum().backward()


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_the_norm_traces_inside_a_compiled_caller(grad):
    """generate() with a static cache compiles the whole decode step on CUDA, and `torch.compile(model)` a training
    step, with the Mamba-2 branch's norm called inside that graph: Dynamo refused the norm's dynamic-shape marks
    ("Attempt to trace forbidden callable maybe_mark_dynamic", H200) and config patches there. Inside a compiled
    caller it must trace under fullgraph to the reference's values and, with grad, its gradients."""
    from modeling.ops.ssd.gated_norm import gated_rms_norm

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(6)
    y, z = (torch.randn(BATCH, LENGTH, HEADS * HEAD_DIM, generator=g) for _ in range(2))
    weight = torch.randn(HEADS * HEAD_DIM, generator=g)
    cotangent = torch.randn(y.shape, generator=g)

    def outputs_and_gradients(norm):
        inputs = [t.detach().requires_grad_(grad) for t in (y, z, weight)]
        with torch.set_grad_enabled(grad):
            normed = norm(*inputs, HEAD_DIM, 1e-6)
        if not grad:
            return [normed]
        return [normed, *torch.autograd.grad(normed, inputs, cotangent)]

    got = outputs_and_gradients(torch.compile(gated_rms_norm, fullgraph=True, backend="aot_eager"))
    want = outputs_and_gradients(gated_rms_norm_ref)
    for got_tensor, want_tensor in zip(got, want, strict=True):
        torch.testing.assert_close(got_tensor, want_tensor, atol=1e-5, rtol=1e-5)


def test_the_norms_autograd_function_traced_whole_keeps_its_gradients():
    """`GatedRMSNormFunction` traced by Dynamo, forward and backward (fp32): its forward returns the compiled path's
    result, which was the reference's `.to()` of itself, and Dynamo (torch 2.11) gives such an output a zero
    gradient. The gradients must be autograd's through the reference."""
    from modeling.ops.ssd.gated_norm import GatedRMSNormFunction

    g = torch.Generator().manual_seed(8)
    tensors = [torch.randn(BATCH, LENGTH, HEADS * HEAD_DIM, generator=g) for _ in range(2)]
    tensors.append(torch.randn(HEADS * HEAD_DIM, generator=g))
    cotangent = torch.randn(tensors[0].shape, generator=g)
    compiled = torch.compile(GatedRMSNormFunction.apply, fullgraph=True, backend="eager")
    got_leaves, want_leaves = ([t.clone().requires_grad_() for t in tensors] for _ in range(2))
    got = torch.autograd.grad(compiled(*got_leaves, HEAD_DIM, 1e-6), got_leaves, cotangent)
    want = torch.autograd.grad(gated_rms_norm_ref(*want_leaves, HEAD_DIM, 1e-6), want_leaves, cotangent)
    for name, got_grad, want_grad in zip(("dy", "dz", "dweight"), got, want, strict=True):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.skipif(
    not ON_GPU, reason="Dynamo traces Triton launches on CUDA only (the interpreter's are opaque to it)"
)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_triton_scan_traces_inside_a_compiled_training_caller(backend):
    """`torch.compile(model)` / `Trainer(torch_compile=True)` with the Mamba-2 branch: Dynamo traces the scan's
    autograd function and its launches under fullgraph (tests/test_kernels_compile.py checks the trace on CPU), with
    the reference's outputs and gradients, packed rows and an initial state included; and what the compiled graph
    saves for the backward is the scan's inputs, a fraction of what the same graph around the plain reference saves
    (the [L, L] products of every chunk)."""
    from modeling.ops.ssd.forward import CHUNK
    from modeling.ops.ssd.interface import ssd_chunk_scan_fn

    torch._dynamo.reset()
    inputs = scan_inputs(8, 2, 4 * CHUNK + 9, 4, 16, 2, 16)
    seq_idx = inputs.pop("seq_idx")
    names = list(inputs)
    g = torch.Generator().manual_seed(9)
    dy = torch.randn(inputs["x"].shape, generator=g).to(DEVICE)
    dstate = torch.randn(inputs["initial_state"].shape, generator=g).to(DEVICE)

    def run(scan):
        saved = []
        leaves = [t.detach().clone().requires_grad_() for t in inputs.values()]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
            y, state = scan(*leaves)
        ((y * dy).sum() + (state * dstate).sum()).backward()
        return [y, state, *(leaf.grad for leaf in leaves)], sum(saved)

    def kernels(*leaves):
        return ssd_chunk_scan_fn(*leaves[:6], initial_state=leaves[6], seq_idx=seq_idx)

    def reference(*leaves):
        return ssd_chunk_scan_ref(*leaves[:6], CHUNK, initial_state=leaves[6], seq_idx=seq_idx)

    got, kernel_bytes = run(torch.compile(kernels, fullgraph=True, backend=backend))
    want, _ = run(reference)
    _, reference_bytes = run(torch.compile(reference, fullgraph=True, backend=backend))
    for name, got_tensor, want_tensor in zip(["y", "final state", *names], got, want, strict=True):
        torch.testing.assert_close(got_tensor, want_tensor, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert kernel_bytes < reference_bytes / 4, (kernel_bytes, reference_bytes)


def decode_case(seed, rows, heads, head_dim, groups, state, slots, cache_dtype, input_dtype):
    """One decode step's inputs, the inputs as views of one conv output [R, H*P + 2*G*N] as the model hands them."""
    g = torch.Generator().manual_seed(seed)
    conv_out = torch.randn(rows, heads * head_dim + 2 * groups * state, generator=g).to(DEVICE, input_dtype)
    x = conv_out[:, : heads * head_dim].unflatten(-1, (heads, head_dim))
    B, C = conv_out[:, heads * head_dim :].unflatten(-1, (2, groups, state)).unbind(1)
    return {
        "state_cache": (torch.randn(slots, heads, head_dim, state, generator=g) * 2).to(DEVICE, cache_dtype),
        "x": x, "dt": (torch.randn(rows, heads, generator=g) * 0.8).to(DEVICE), "B": B, "C": C,
        "A": -(torch.rand(heads, generator=g) * 3 + 0.2).to(DEVICE), "D": torch.randn(heads, generator=g).to(DEVICE),
    }  # fmt: skip


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32-state", "bf16-state"])
@pytest.mark.parametrize("slots_given", [False, True], ids=["row-owns-slot", "state-indices"])
@pytest.mark.parametrize("raw_dt", [False, True], ids=["step", "raw-dt-bias-softplus"])
@pytest.mark.parametrize("shape", [(3, 4, 12, 2, 16), (2, 2, 80, 1, 10)], ids=["groups-2", "P80-N10"])
def test_the_decode_kernel_is_its_reference(cache_dtype, slots_given, raw_dt, shape):
    """`ssd_state_update` (one launch) against `ssd_state_update_ref`: y and every slot of the cache, requests in
    their own slots (None) or scattered over the cache with a first token among them (has_initial_state False,
    whatever its slot holds), heads sharing B and C by groups, head_dim beyond one block of 64, N no power of two,
    bf16 inputs over an fp32 or bf16 cache, the raw dt with its bias and softplus."""
    from modeling.ops.ssd.decode import ssd_state_update

    rows, heads, head_dim, groups, state = shape
    case = decode_case(1, rows, heads, head_dim, groups, state, rows + 3, cache_dtype, torch.bfloat16)
    kwargs = {}
    if raw_dt:
        kwargs = {"dt_bias": torch.randn(heads, generator=torch.Generator().manual_seed(2)).to(DEVICE),
                  "dt_softplus": True}  # fmt: skip
    else:
        case["dt"] = F.softplus(case["dt"])
    positional = [case[k] for k in ("x", "dt", "A", "B", "C", "D")]
    if slots_given:
        slots = torch.randperm(rows + 3, generator=torch.Generator().manual_seed(3))[:rows].to(DEVICE, torch.int32)
        has_initial = torch.ones(rows, dtype=torch.bool, device=DEVICE)
        has_initial[-1] = False
        positional += [slots, has_initial]
    cache, expected_cache = case["state_cache"].clone(), case["state_cache"].clone()
    out = torch.full((rows, heads, head_dim), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    returned = ssd_state_update(cache, *positional, out=out, **kwargs)
    expected = ssd_state_update_ref(expected_cache, *positional, **kwargs)
    assert returned is out and out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)  # both round y to bf16
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if cache_dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(cache.float(), expected_cache.float(), **tolerance)  # the untouched slots too


def test_the_decode_kernel_refuses_what_it_cannot_read():
    from modeling.ops.ssd.decode import ssd_state_update

    case = decode_case(4, 2, 4, 8, 2, 16, 2, torch.float32, torch.float32)
    args = [case["state_cache"], *(case[k] for k in ("x", "dt", "A", "B", "C", "D"))]
    for position, bad, message in (
        (1, case["x"].transpose(1, 2).contiguous().transpose(1, 2), "x: the last dimension must be contiguous"),
        (3, case["A"].double(), "A: expected fp32"),
        (4, case["B"][:, :1].expand(-1, 3, -1), "B: expected"),
        (0, case["state_cache"][:1], "1 slots for 2 requests"),
    ):
        with pytest.raises(ValueError, match=message):
            ssd_state_update(*args[:position], bad, *args[position + 1 :])


def test_the_decode_kernel_is_one_op_in_a_compiled_graph():
    """Under `torch.compile(fullgraph=True)` (as generate() compiles a static-cache decode step) the decode update
    enters the graph as its custom op, no graph break, and updates the cache and writes y as in eager mode."""
    from modeling.ops.ssd.decode import ssd_state_update

    case = decode_case(5, 2, 4, 8, 2, 16, 2, torch.float32, torch.float32)
    args = [case[k] for k in ("x", "dt", "A", "B", "C", "D")]
    caches = [case["state_cache"].clone() for _ in range(2)]
    eager = ssd_state_update(caches[0], *args)
    compiled = torch.compile(ssd_state_update, fullgraph=True, backend="aot_eager")(caches[1], *args)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(caches[1], caches[0])
    assert not torch.equal(caches[1], case["state_cache"])  # the compiled call did update the cache
