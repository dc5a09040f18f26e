"""The Triton selective scan against its references (`selective_scan_ref`, `selective_scan_varlen_ref`), in Triton's
interpreter on CPU machines: training forward + every gradient (also over packed rows, `seq_idx`), and the serving
prefill with its state cache."""

import importlib
import itertools

import pytest
import torch
import torch.nn.functional as F
from conftest import HopperCompileKeys

from modeling.ops.selective_scan import selective_scan_ref, selective_scan_varlen_ref

triton = pytest.importorskip("triton")
tl = triton.language

from modeling.ops.triton_utils import softplus  # noqa: E402 (needs triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


@pytest.fixture(scope="module")
def scan():
    """The kernels' public functions, in Triton's interpreter on CPU machines (conftest sets TRITON_INTERPRET first)."""
    return importlib.import_module("modeling.ops.selective_scan.interface")


def assert_close_scaled(actual, expected, tol, name):
    """Elementwise closeness with an absolute floor scaled to the tensor's magnitude (gradients sum many terms)."""
    expected = expected.double()
    scale = expected.abs().max().clamp_min(1.0).item()
    torch.testing.assert_close(actual.double(), expected, atol=tol * scale, rtol=tol, msg=lambda m: f"{name}: {m}")


def random_training_inputs(batch, seq_len, channels, state, dtype, seed=0):
    """u and z are halves of one [B, T, 2E] tensor (strided views, as in the model); dt is an fp32 step (the tests of
    dt_softplus pass raw values instead); everything random, nothing zero."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    u, z = rand(batch, seq_len, 2 * channels).chunk(2, dim=-1)
    return {
        "u": u,
        "dt": F.softplus(rand(batch, seq_len, channels) - 1.0),
        "A": -torch.exp(rand(channels, state, scale=0.5)),
        "B": rand(batch, seq_len, state),
        "C": rand(batch, seq_len, state),
        "D": rand(channels),
        "z": z,
        "initial_state": rand(batch, channels, state),
    }


@triton.jit
def _softplus_kernel(p_x, p_y, n, BLOCK: tl.constexpr):
    """The scans' Triton `softplus` applied to a vector."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(p_y + o, softplus(tl.load(p_x + o, mask=o < n)), mask=o < n)


def triton_softplus(x):
    y = torch.full_like(x, float("nan"))
    _softplus_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y


def test_softplus_matches_float64():
    """The scans' softplus (the step of every dt_softplus scan) against torch's in float64 over fp32 inputs, wherever
    the result is a normal fp32 number (x > -87) and across torch's linear threshold (20): relative error within
    1.5e-6, plus |x| * 7e-8 in the exponential tail, where exp(x) is taken as exp2(x * log2(e)) and the product's
    rounding is a relative error of |x| * log2(e) * 2^-24 * ln(2) in the result; exactly 0 at -inf (the model's
    padding steps) and inf at inf."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([
        torch.empty(50_000).uniform_(-87.0, 88.0, generator=g),
        torch.randn(50_000, generator=g) * 3.0,
        torch.tensor([0.0, 1e-7, -1e-7, 19.99, 20.0, 20.01, -20.0, 87.0, -87.0, 1e30]),
    ]).to(DEVICE)  # fmt: skip
    expected = F.softplus(x.double())
    error = (triton_softplus(x).double() - expected).abs() / expected
    bound = 1.5e-6 + 7e-8 * x.double().abs()
    assert (error <= bound).all(), f"worst: x = {x[(error / bound).argmax()].item()}, error {error.max().item():.2e}"
    edges = triton_softplus(torch.tensor([float("-inf"), float("inf")], device=DEVICE))
    assert edges.tolist() == [0.0, float("inf")]


TRAIN_CASES = [  # batch, T, E, N, dtype of u/z/B/C, with initial state, chunk (None: one chunk per sequence), seg,
    # segment checkpoints saved by the forward (else recomputed by the backward), backward block_e (None: block_e)
    (2, 13, 20, 16, torch.float32, False, None, 16, True, None),
    (3, 7, 33, 5, torch.float32, True, None, 16, False, None),
    (1, 1, 16, 16, torch.float32, True, None, 16, True, None),
    (2, 37, 24, 8, torch.float32, True, 16, 4, False, 8),
    (1, 40, 18, 16, torch.float32, False, 8, 8, True, 32),
    (2, 19, 24, 16, torch.bfloat16, True, 8, 4, True, None),
    (2, 9, 18, 8, torch.float16, False, None, 4, False, None),
]


def random_seq_idx(batch, seq_len, row0_starts, dtype, seed=3):
    """[B, T] index of each token's sequence for packed rows: row 0 starts sequences exactly at `row0_starts`
    (chosen per case: inside a chunk, at a chunk start, two in one chunk, length-1 sequences); the other rows at
    random tokens (so rows differ). Indices increase from a random offset per row."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq_len, generator=g) < 0.25
    starts[0] = False
    starts[0, list(row0_starts)] = True
    starts[:, 0] = False
    return (starts.long().cumsum(1) + torch.randint(0, 5, (batch, 1), generator=g)).to(dtype)


def check_training_against_reference(
    scan, inputs, dtype, seq_idx=None, *, chunk, seg, save_seg_states, bwd_block_e=None, dt_softplus=False
):
    """y, final state and every gradient of `selective_scan_fn` against `selective_scan_ref` in fp64 on the
    kernel's (rounded) input values, the final state's gradient included (and dt_bias's, when `inputs` has one)."""
    low_precision = {"u", "z", "B", "C"}  # the model's bf16 activations; dt, A, D, state stay fp32
    names = [k for k, v in inputs.items() if v is not None]
    kernel_inputs = {k: (inputs[k].to(dtype) if k in low_precision else inputs[k].float()) for k in names}
    ref_inputs = {k: v.detach().double().requires_grad_() for k, v in kernel_inputs.items()}
    y_ref, final_ref = selective_scan_ref(**ref_inputs, seq_idx=seq_idx, dt_softplus=dt_softplus)
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(y_ref.shape, generator=g, dtype=torch.float64)
    d_final = torch.randn(final_ref.shape, generator=g, dtype=torch.float64)
    ((y_ref * dy).sum() + (final_ref * d_final).sum()).backward()

    xz = torch.cat([kernel_inputs["u"], kernel_inputs["z"]], dim=-1).to(DEVICE)  # u, z: strided views again
    leaves = {k: v.detach().to(DEVICE).requires_grad_() for k, v in kernel_inputs.items() if k not in ("u", "z")}
    xz.requires_grad_()
    u, z = xz.chunk(2, dim=-1)
    y, final = scan.selective_scan_fn(
        u=u,
        z=z,
        **leaves,
        seq_idx=seq_idx.to(DEVICE) if seq_idx is not None else None,
        chunk=chunk,
        seg=seg,
        save_seg_states=save_seg_states,
        bwd_block_e=bwd_block_e,
        dt_softplus=dt_softplus,
    )
    ((y.float() * dy.float().to(DEVICE)).sum() + (final * d_final.float().to(DEVICE)).sum()).backward()

    tol = TOL[dtype]
    assert y.dtype == dtype and final.dtype == torch.float32
    assert_close_scaled(y.cpu(), y_ref.detach(), tol, "y")
    assert_close_scaled(final.cpu(), final_ref.detach(), TOL[torch.float32], "final_state")
    du, dz = xz.grad.chunk(2, dim=-1)
    assert_close_scaled(du.cpu(), ref_inputs["u"].grad, tol, "du")
    assert_close_scaled(dz.cpu(), ref_inputs["z"].grad, tol, "dz")
    for name, leaf in leaves.items():
        assert leaf.grad.dtype == leaf.dtype, name
        assert_close_scaled(leaf.grad.cpu(), ref_inputs[name].grad, tol, f"d{name}")


@pytest.mark.parametrize(
    "batch,seq_len,channels,state,dtype,with_initial,chunk,seg,save_seg_states,bwd_block_e",
    TRAIN_CASES,
    ids=[
        f"B{c[0]}-T{c[1]}-E{c[2]}-N{c[3]}-{str(c[4])[6:]}-{'init' if c[5] else 'zero'}-chunk{c[6]}-seg{c[7]}"
        f"-{'saved' if c[8] else 'recomputed'}-bwd_block_e{c[9]}"
        for c in TRAIN_CASES
    ],
)
def test_training_forward_backward(
    scan, batch, seq_len, channels, state, dtype, with_initial, chunk, seg, save_seg_states, bwd_block_e
):
    inputs = random_training_inputs(batch, seq_len, channels, state, dtype)
    if not with_initial:
        inputs["initial_state"] = None
    check_training_against_reference(
        scan, inputs, dtype, chunk=chunk, seg=seg, save_seg_states=save_seg_states, bwd_block_e=bwd_block_e
    )


def test_training_backward_writes_dz_and_dBC_into_given_views(scan):
    """dz and dBC given as column ranges of wider gradients (the branch's xz gradient, whose other half the conv
    writes; x_proj's output gradient [d dt_low, dB, dC], whose first columns a GEMM writes): every output of a
    backward with fresh ones, bit for bit, every element of the ranges written, nothing outside them touched (the
    backward's other outputs are checked against the reference above)."""
    inputs = random_training_inputs(2, 21, 24, 8, torch.float32, seed=4)
    inputs["dt_bias"] = torch.rand(24, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    u, dt, A, B, C, D, z, h0, dt_bias = (
        inputs[k].float().to(DEVICE) for k in ("u", "dt", "A", "B", "C", "D", "z", "initial_state", "dt_bias")
    )
    blocks = scan.pick_scan_blocks(2, 21, 24, 8, chunk=8, seg=4, bwd_block_e=8)
    _, _, residuals = scan.selective_scan_fwd(u, dt, A, B, C, D, z, h0, None, dt_bias, True, blocks)
    dy = torch.randn(2, 21, 24, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    expected = scan.selective_scan_bwd(u, dt, A, B, C, D, z, h0, None, dt_bias, True, blocks, residuals, dy, None)
    wider = torch.full((2, 21, 48), float("nan"), device=DEVICE)  # poisoned
    wider_BC = torch.full((2, 21, 5 + 16), float("nan"), device=DEVICE)  # 5 columns of d dt_low, then dB and dC
    given = scan.selective_scan_bwd(
        u, dt, A, B, C, D, z, h0, None, dt_bias, True, blocks, residuals, dy, None, wider[..., 24:], wider_BC[..., 5:]
    )
    assert given[6].data_ptr() == wider[..., 24:].data_ptr()
    assert (given[3].data_ptr(), given[4].data_ptr()) == (wider_BC[..., 5:].data_ptr(), wider_BC[..., 13:].data_ptr())
    for name, actual, fresh in zip(("du", "ddt", "dA", "dB", "dC", "dD", "dz", "dh0", "d_dt_bias"), given, expected):
        torch.testing.assert_close(actual, fresh, atol=0, rtol=0, msg=lambda m: f"{name}: {m}")
    assert wider[..., :24].isnan().all() and wider_BC[..., :5].isnan().all()
    with pytest.raises(ValueError, match="dz must be"):
        scan.selective_scan_bwd(
            u, dt, A, B, C, D, z, h0, None, dt_bias, True, blocks, residuals, dy, None, wider.transpose(1, 2)[:, :24]
        )
    for bad in (wider_BC[..., 6:], wider_BC.double()[..., 5:]):  # a column short; another dtype than B's
        with pytest.raises(ValueError, match="dBC must be"):
            scan.selective_scan_bwd(u, dt, A, B, C, D, z, h0, None, dt_bias, True, blocks, residuals, dy, None, None,
                                    bad)  # fmt: skip


def test_the_kernels_take_A_log_in_place_of_A(scan):
    """With A_is_log the kernels read A_log and take A = -exp(A_log) themselves (the fused branch op's path), giving
    the outputs and gradients of a launch on A, and A_log's gradient dA * A in place of dA. Three chunks (the
    combine reads A too), fp32, dt_bias and softplus as the model runs them."""
    inputs = random_training_inputs(2, 21, 24, 8, torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    A_log = (torch.randn(24, 8, generator=g, dtype=torch.float64) * 0.5).float().to(DEVICE)
    dt_bias = torch.rand(24, generator=g, dtype=torch.float64).float().to(DEVICE)
    u, dt, B, C, D, z = (inputs[k].float().to(DEVICE) for k in ("u", "dt", "B", "C", "D", "z"))
    A = -torch.exp(A_log)
    blocks = scan.pick_scan_blocks(2, 21, 24, 8, chunk=8, seg=4, bwd_block_e=8)
    dy = torch.randn(2, 21, 24, generator=g).to(DEVICE)
    y, final, residuals = scan.selective_scan_fwd(u, dt, A, B, C, D, z, None, None, dt_bias, True, blocks)
    y_log, final_log, residuals_log = scan.selective_scan_fwd(
        u, dt, A_log, B, C, D, z, None, None, dt_bias, True, blocks, A_is_log=True
    )
    torch.testing.assert_close(y_log, y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final_log, final, atol=1e-5, rtol=1e-5)
    grads = scan.selective_scan_bwd(u, dt, A, B, C, D, z, None, None, dt_bias, True, blocks, residuals, dy, None)
    grads_log = scan.selective_scan_bwd(
        u, dt, A_log, B, C, D, z, None, None, dt_bias, True, blocks, residuals_log, dy, None, A_is_log=True
    )
    names = ("du", "ddt", "dA", "dB", "dC", "dD", "dz", "dh0", "d_dt_bias")
    for name, actual, expected in zip(names, grads_log, grads):
        if name == "dA":
            expected = expected * A  # A_log's gradient
        if expected is None:
            assert actual is None, name
            continue
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")


PACKED_CASES = [  # as TRAIN_CASES, then row 0's sequence starts and seq_idx's dtype; with chunk 8, row 0 has a
    # reset inside chunk 0, one exactly at chunk 1's start and two more in chunk 1 (token 11 alone: a length-1
    # sequence), then (T26, T19) a chunk without a reset and (T21, T26) a length-1 last sequence; resets also fall
    # on segment starts (seg 4). Rows other than 0 start sequences at random tokens.
    (2, 13, 20, 16, torch.float32, False, None, 16, True, None, (1, 5, 6, 12), torch.int64),
    (3, 7, 33, 5, torch.float32, True, None, 4, False, None, (4,), torch.int64),
    (2, 21, 24, 8, torch.float32, True, 8, 4, False, 8, (3, 8, 11, 12, 20), torch.int32),
    (2, 26, 18, 16, torch.float32, False, 8, 8, True, None, (3, 8, 11, 12, 25), torch.int64),
    (2, 19, 24, 16, torch.bfloat16, True, 8, 4, True, None, (2, 8, 11, 12), torch.int32),
    (2, 9, 18, 8, torch.bfloat16, False, None, 4, False, None, (3, 4), torch.int64),
]


@pytest.mark.parametrize(
    "batch,seq_len,channels,state,dtype,with_initial,chunk,seg,save_seg_states,bwd_block_e,row0_starts,idx_dtype",
    PACKED_CASES,
    ids=[
        f"B{c[0]}-T{c[1]}-E{c[2]}-N{c[3]}-{str(c[4])[6:]}-{'init' if c[5] else 'zero'}-chunk{c[6]}-seg{c[7]}"
        f"-{'saved' if c[8] else 'recomputed'}-bwd_block_e{c[9]}-starts{'_'.join(map(str, c[10]))}-{str(c[11])[6:]}"
        for c in PACKED_CASES
    ],
)
def test_training_packed_rows(
    scan,
    batch,
    seq_len,
    channels,
    state,
    dtype,
    with_initial,
    chunk,
    seg,
    save_seg_states,
    bwd_block_e,
    row0_starts,
    idx_dtype,
):
    """Rows packing several sequences (`seq_idx`): the state restarts at every sequence start, forward and
    backward, in every launch mode; the reference does the same with the same seq_idx."""
    inputs = random_training_inputs(batch, seq_len, channels, state, dtype, seed=4)
    if not with_initial:
        inputs["initial_state"] = None
    seq_idx = random_seq_idx(batch, seq_len, row0_starts, idx_dtype)
    check_training_against_reference(
        scan,
        inputs,
        dtype,
        seq_idx,
        chunk=chunk,
        seg=seg,
        save_seg_states=save_seg_states,
        bwd_block_e=bwd_block_e,
    )


DT_CASES = [  # batch, T, E, N, dtype, chunk, seg, saved checkpoints, dt_bias given, dt_softplus, row 0's sequence
    # starts (None: no seq_idx)
    (2, 13, 20, 16, torch.float32, None, 16, True, True, True, None),
    (2, 37, 24, 8, torch.float32, 16, 4, False, True, True, None),
    (2, 19, 24, 16, torch.bfloat16, 8, 4, True, False, True, None),
    (1, 21, 18, 8, torch.float32, 8, 4, True, True, False, None),
    (2, 21, 24, 8, torch.float32, 8, 4, False, True, True, (3, 8, 11, 12, 20)),
]


@pytest.mark.parametrize(
    "batch,seq_len,channels,state,dtype,chunk,seg,save_seg_states,with_bias,dt_softplus,row0_starts",
    DT_CASES,
    ids=[
        f"B{c[0]}-T{c[1]}-E{c[2]}-N{c[3]}-{str(c[4])[6:]}-chunk{c[5]}-seg{c[6]}-{'saved' if c[7] else 'recomputed'}"
        f"-{'dt_bias' if c[8] else 'no_bias'}-{'softplus' if c[9] else 'linear'}"
        f"-{'starts' + '_'.join(map(str, c[10])) if c[10] else 'one_seq'}"
        for c in DT_CASES
    ],
)
def test_training_dt_bias_and_softplus(
    scan, batch, seq_len, channels, state, dtype, chunk, seg, save_seg_states, with_bias, dt_softplus, row0_starts
):
    """mamba's dt contract (dt_bias, dt_softplus), forward and backward: the step is softplus(dt + dt_bias) or
    dt + dt_bias, and dt and dt_bias get the gradients of that step; with softplus, dt covers its pass-through
    (> 20) and underflow regions."""
    inputs = random_training_inputs(batch, seq_len, channels, state, dtype, seed=9)
    g = torch.Generator().manual_seed(10)
    if dt_softplus:  # raw dt_proj outputs
        inputs["dt"] = torch.randn(batch, seq_len, channels, generator=g, dtype=torch.float64) - 1.0
        inputs["dt"][0, 0, :3] = torch.tensor([30.0, -30.0, 19.5])
    if with_bias:  # positive, so that dt + dt_bias stays a positive step without softplus too
        inputs["dt_bias"] = torch.rand(channels, generator=g, dtype=torch.float64) * 0.5
    seq_idx = random_seq_idx(batch, seq_len, row0_starts, torch.int64) if row0_starts else None
    check_training_against_reference(
        scan, inputs, dtype, seq_idx, chunk=chunk, seg=seg, save_seg_states=save_seg_states, dt_softplus=dt_softplus
    )


# The combine computes exp2(inf * 0) = NaN for the zero entry of A, then selects decay 0 instead; NumPy (the
# interpreter) warns about the discarded NaN.
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("save_seg_states", [True, False], ids=["saved", "recomputed"])
def test_training_packed_rows_equal_sequences_alone(scan, save_seg_states):
    """A packed row computes exactly its sequences run alone: y and the input gradients are theirs concatenated,
    dA and dD their sums, the final state (and its gradient's effect) the last sequence's, the initial state (and
    its gradient) the first's. One entry of A is 0: a chunk with a reset must pass no carry (no NaN) even there."""
    batch, seq_len, channels, state, chunk, seg = 2, 17, 16, 8, 8, 4
    inputs = {k: v.float() for k, v in random_training_inputs(batch, seq_len, channels, state, None, seed=5).items()}
    inputs["u"], inputs["z"] = inputs["u"].contiguous(), inputs["z"].contiguous()
    inputs["A"][3, 2] = 0.0
    seq_idx = random_seq_idx(batch, seq_len, (4, 8, 10, 11, 16), torch.int64, seed=6)
    g = torch.Generator().manual_seed(7)
    dy = torch.randn(batch, seq_len, channels, generator=g)
    d_final = torch.randn(batch, channels, state, generator=g)
    launch = {"chunk": chunk, "seg": seg, "save_seg_states": save_seg_states}

    packed = {k: v.clone().to(DEVICE).requires_grad_() for k, v in inputs.items()}
    y, final = scan.selective_scan_fn(**packed, seq_idx=seq_idx.to(DEVICE), **launch)
    ((y * dy.to(DEVICE)).sum() + (final * d_final.to(DEVICE)).sum()).backward()

    alone = {k: v.clone().to(DEVICE).requires_grad_() for k, v in inputs.items()}
    y_alone, final_alone, loss = torch.empty_like(y), torch.empty_like(final), 0.0
    for b in range(batch):
        bounds = torch.nonzero(seq_idx[b, 1:] != seq_idx[b, :-1]).flatten().add(1).tolist()
        bounds = [0, *bounds, seq_len]
        for i, (start, end) in enumerate(itertools.pairwise(bounds)):
            tokens = (slice(b, b + 1), slice(start, end))
            y_i, final_i = scan.selective_scan_fn(
                *(alone[k][tokens] for k in ("u", "dt")),
                alone["A"],
                *(alone[k][tokens] for k in ("B", "C")),
                alone["D"],
                alone["z"][tokens],
                alone["initial_state"][b : b + 1] if i == 0 else None,
                **launch,
            )
            y_alone[tokens] = y_i.detach()
            loss = loss + (y_i * dy[tokens].to(DEVICE)).sum()
            if end == seq_len:
                final_alone[b] = final_i[0].detach()
                loss = loss + (final_i[0] * d_final[b].to(DEVICE)).sum()
    loss.backward()

    tol = 1e-5
    assert_close_scaled(y.detach().cpu(), y_alone.cpu(), tol, "y")
    assert_close_scaled(final.detach().cpu(), final_alone.cpu(), tol, "final_state")
    for name in inputs:
        assert torch.isfinite(packed[name].grad).all(), name
        assert_close_scaled(packed[name].grad.cpu(), alone[name].grad.cpu(), tol, f"d{name}")


@pytest.mark.parametrize("save_seg_states", [True, False], ids=["saved", "recomputed"])
def test_training_keeps_one_set_of_states_for_backward(scan, save_seg_states):
    """Besides its inputs the training scan keeps the segment checkpoints, or, when it does not save them, the chunk
    start states the backward recomputes them from; never both (each is fp32 [B, *, E, N])."""
    batch, seq_len, channels, state, chunk, seg = 2, 40, 24, 16, 8, 4
    inputs = {
        k: v.float().to(DEVICE).requires_grad_()
        for k, v in random_training_inputs(batch, seq_len, channels, state, torch.float32).items()
    }
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y, _ = scan.selective_scan_fn(**inputs, chunk=chunk, seg=seg, save_seg_states=save_seg_states)
    states = sorted(tuple(t.shape) for t in saved if t.dim() == 4)
    expected = (
        (batch, seq_len // seg, channels, state) if save_seg_states else (batch, seq_len // chunk, channels, state)
    )
    assert states == [expected], states
    y.sum().backward()  # the backward runs from what was kept (its values: test_training_forward_backward)
    assert all(torch.isfinite(inputs[name].grad).all() for name in inputs)


def test_training_rejects_bad_shapes(scan):
    inputs = {k: v.float() for k, v in random_training_inputs(1, 5, 8, 4, torch.float32).items()}
    with pytest.raises(ValueError, match="B"):
        scan.selective_scan_fn(**{**inputs, "B": inputs["B"][:, :, :3]})
    with pytest.raises(ValueError, match="initial_state"):
        scan.selective_scan_fn(**{**inputs, "initial_state": inputs["initial_state"][:, :4]})
    with pytest.raises(ValueError, match="chunk"):
        scan.selective_scan_fn(**inputs, chunk=12)


def test_training_rejects_bad_seq_idx(scan):
    inputs = {k: v.float() for k, v in random_training_inputs(2, 5, 8, 4, torch.float32).items()}
    seq_idx = torch.tensor([[0, 0, 1, 1, 2], [0, 1, 1, 1, 1]])
    for bad in (seq_idx[:, :4], seq_idx[:1], seq_idx.flatten(), seq_idx.float(), seq_idx.bool()):
        with pytest.raises(ValueError, match="seq_idx"):
            scan.selective_scan_fn(**inputs, seq_idx=bad)


VARLEN_CASES = [  # sequence lengths, cache dtype, chunk (None: one chunk per sequence), has_initial_state given,
    # dt contract (serving's "bias+softplus": raw dt, softplus(dt + dt_bias); "step": dt is the step), index dtype
    ([5, 1, 13, 7], torch.float32, None, True, "bias+softplus", torch.int32),
    ([5, 1, 13, 7], torch.bfloat16, None, True, "bias+softplus", torch.int32),
    ([9, 1, 23], torch.float32, 8, True, "bias+softplus", torch.int32),
    ([17, 3, 1, 8], torch.bfloat16, 4, True, "bias+softplus", torch.int64),
    ([6, 11], torch.float32, 4, False, "bias+softplus", torch.int32),
    ([9, 1, 23], torch.float32, 8, True, "step", torch.int64),
]


@pytest.mark.parametrize(
    "lengths,cache_dtype,chunk,with_flags,dt_mode,idx_dtype",
    VARLEN_CASES,
    ids=[
        f"L{'-'.join(map(str, c[0]))}-cache_{str(c[1])[6:]}-chunk{c[2]}-{'flags' if c[3] else 'no_flags'}-{c[4]}"
        f"-{str(c[5])[6:]}"
        for c in VARLEN_CASES
    ],
)
def test_varlen_prefill_matches_reference(scan, lengths, cache_dtype, chunk, with_flags, dt_mode, idx_dtype):
    channels, state, num_slots = 24, 8, 9
    g = torch.Generator().manual_seed(2)
    total = sum(lengths)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(DEVICE)

    xz = rand(total, 2 * channels).to(torch.bfloat16)
    u, z = xz.chunk(2, dim=-1)  # strided views, like the in_proj output
    dt = rand(total, channels) - 1.0  # raw dt_proj output: softplus(dt + dt_bias) happens in the kernel
    dt[0, :3] = torch.tensor([30.0, -30.0, 19.5])  # softplus's pass-through and underflow regions
    dt_bias = rand(channels, scale=0.5)
    A = -torch.exp(rand(channels, state, scale=0.5))
    B, C = rand(total, state).to(torch.bfloat16), rand(total, state).to(torch.bfloat16)
    D = rand(channels)
    # A padding sequence (-1) is appended; slots are permuted and the cache is a strided view of a bigger tensor.
    lengths = lengths + [2]
    seqs = len(lengths)
    xz = torch.cat([xz, rand(2, 2 * channels).to(torch.bfloat16)])
    u, z = xz.chunk(2, dim=-1)
    dt = torch.cat([dt, rand(2, channels)])
    B, C = torch.cat([B, B[:2]]), torch.cat([C, C[:2]])
    cu_seqlens = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(idx_dtype)
    slots = torch.randperm(num_slots, generator=g)[: seqs - 1].tolist() + [-1]
    state_indices = torch.tensor(slots, dtype=idx_dtype, device=DEVICE)
    if dt_mode == "step":  # the step itself, as training passes it
        dt, dt_args = F.softplus(dt), {}
    else:
        dt_args = {"dt_bias": dt_bias, "dt_softplus": True}
    # Mixed flags; None means no sequence continues from its slot.
    has_initial_state = torch.tensor([i % 2 == 0 for i in range(seqs)], device=DEVICE) if with_flags else None
    big_cache = rand(num_slots, 2, channels, state).to(cache_dtype)
    cache = big_cache[:, 1]  # [num_slots, E, N], slot stride 2 * E * N
    cache_ref = cache.clone()

    out = torch.full((u.shape[0], channels), float("nan"), dtype=torch.bfloat16, device=DEVICE)  # poisoned
    out_ref = torch.empty_like(out)
    args = (u, dt, A, B, C, D, z)
    other_half = big_cache[:, 0].clone()
    result = scan.selective_scan_varlen_fwd(
        *args, cache, cu_seqlens, state_indices, has_initial_state, out, **dt_args, chunk=chunk, block_e=16
    )
    selective_scan_varlen_ref(*args, cache_ref, cu_seqlens, state_indices, has_initial_state, out_ref, **dt_args)

    assert result is out
    torch.testing.assert_close(out.float(), out_ref.float(), atol=3e-2, rtol=3e-2)
    assert (out[cu_seqlens[-2] :] == 0).all(), "padding tokens get zeros"
    used = [s for s in slots if s >= 0]
    untouched = [s for s in range(num_slots) if s not in used]
    assert torch.equal(cache[untouched], cache_ref[untouched]), "slots of no sequence must not change"
    assert torch.equal(big_cache[:, 0], other_half), "the cache view must not write outside itself"
    state_tol = 1e-4 if cache_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(cache[used].float(), cache_ref[used].float(), atol=state_tol, rtol=state_tol)


def test_varlen_rejects_bad_shapes(scan):
    channels, state = 8, 4
    u = torch.randn(6, channels)
    args = {
        "u": u,
        "dt": u.clone(),
        "A": -torch.ones(channels, state),
        "B": torch.randn(6, state),
        "C": torch.randn(6, state),
        "D": torch.ones(channels),
        "z": u.clone(),
        "dt_bias": torch.zeros(channels),
        "cu_seqlens": torch.tensor([0, 6], dtype=torch.int32),
        "ssm_state": torch.zeros(2, channels, state),
        "state_indices": torch.tensor([0], dtype=torch.int32),
        "has_initial_state": torch.tensor([True]),
        "out": torch.empty(6, channels),
    }
    with pytest.raises(ValueError, match="ssm_state"):
        scan.selective_scan_varlen_fwd(**{**args, "ssm_state": torch.zeros(2, channels, state + 1)})
    with pytest.raises(ValueError, match="out"):
        scan.selective_scan_varlen_fwd(**{**args, "out": torch.empty(5, channels)})
    # The launcher below the op: slots to read initial states from, and no flags saying which sequences read one
    # (the kernel would load the flags through an absent pointer).
    forward = importlib.import_module("modeling.ops.selective_scan.forward")
    with pytest.raises(ValueError, match="has_initial_state"):
        forward.launch_selective_scan_fwd(
            *(args[name] for name in ("u", "dt", "A", "B", "C", "D", "z", "out")), args["ssm_state"], args["ssm_state"],
            blocks=scan.pick_scan_blocks(1, 6, channels, state), max_seq_len=6, cu_seqlens=args["cu_seqlens"],
            state_indices=args["state_indices"],
        )  # fmt: skip


def test_varlen_compiles_once_for_every_chunk_length(scan, monkeypatch):
    """Serving picks the chunk length from each batch's shape: one compilation of the chunked forward serves every
    length (a variant per length would stall serving for seconds), and every length computes the reference's y and
    final states."""
    channels, state, lengths = 24, 8, [150, 9, 70]
    g = torch.Generator().manual_seed(8)
    total = sum(lengths)
    u, dt, z = (torch.randn(total, channels, generator=g).to(DEVICE) for _ in range(3))
    B, C = (torch.randn(total, state, generator=g).to(DEVICE) for _ in range(2))
    A = -torch.exp(torch.randn(channels, state, generator=g) * 0.5).to(DEVICE)
    D, dt_bias = (torch.randn(channels, generator=g).to(DEVICE) for _ in range(2))
    cu_seqlens = torch.tensor([0] + lengths, device=DEVICE).cumsum(0).to(torch.int32)
    state_indices = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    has_initial_state = torch.tensor([True, False, True], device=DEVICE)
    cache = torch.randn(3, channels, state, generator=g).to(DEVICE)
    args = (u, dt, A, B, C, D, z)
    dt_args = {"dt_bias": dt_bias, "dt_softplus": True}
    cache_ref, out_ref = cache.clone(), torch.empty_like(u)
    selective_scan_varlen_ref(*args, cache_ref, cu_seqlens, state_indices, has_initial_state, out_ref, **dt_args)
    forward = importlib.import_module("modeling.ops.selective_scan.forward")
    compile_keys = HopperCompileKeys(
        monkeypatch, forward._selective_scan_fwd_kernel, forward._selective_scan_chunk_combine_kernel
    )

    def run(chunk):
        out, slots = torch.full_like(u, float("nan")), cache.clone()
        scan.selective_scan_varlen_fwd(
            *args, slots, cu_seqlens, state_indices, has_initial_state, out, **dt_args, chunk=chunk
        )
        torch.testing.assert_close(out, out_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(slots, cache_ref, atol=1e-4, rtol=1e-4)

    run(16)  # chunks of 16 steps and more (the default is 64 and up): a chunked launch at every length below
    compiled = compile_keys.counts()  # the forward kernel twice, for its two stages (forward.py)
    assert compiled == {"_selective_scan_fwd_kernel": 2, "_selective_scan_chunk_combine_kernel": 1}, compiled
    for chunk in (32, 64, 128, 16):
        run(chunk)
    assert compile_keys.counts() == compiled
