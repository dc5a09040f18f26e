"""The SSM branch's fused training op (`mamba_inner_fn`: one autograd node over the conv and scan kernels and the
GEMMs between them) against its reference (`mamba_inner_ref`) in float64, in Triton's interpreter on CPU machines:
the output and every gradient, with padding, packed rows, several scan chunks, autocast and frozen weights."""

import importlib
import math

import pytest
import torch
from conftest import padded_and_packed_rows

from modeling.ops.mamba_inner import mamba_inner_ref, mamba_inner_step_ref

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-4, torch.bfloat16: 4e-2}
PARAMS = ("conv_weight", "conv_bias", "x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D")


@pytest.fixture(scope="module")
def inner():
    """The kernels' public functions, in Triton's interpreter on CPU machines (conftest sets TRITON_INTERPRET first)."""
    return importlib.import_module("modeling.ops.mamba_inner.interface")


def random_branch(batch, seq_len, channels, state, dt_rank, width=4, seed=0):
    """Float64 inputs and weights at the scales of Mamba's init (random, nothing zero): steps of 1e-3..0.1 through
    dt_proj's bias, A = -(1..N) perturbed."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    dt_init = torch.exp(torch.rand(channels, generator=g, dtype=torch.float64) * math.log(100.0)) * 1e-3
    s4d_real = torch.log(torch.arange(1, state + 1, dtype=torch.float64)).expand(channels, -1)
    return {
        "xz": rand(batch, seq_len, 2 * channels),
        "conv_weight": rand(channels, 1, width, scale=0.5),
        "conv_bias": rand(channels, scale=0.1),
        "x_proj_weight": rand(dt_rank + 2 * state, channels, scale=channels**-0.5),
        "dt_proj_weight": rand(channels, dt_rank, scale=dt_rank**-0.5),
        "dt_proj_bias": dt_init + torch.log(-torch.expm1(-dt_init)),  # softplus^-1
        "A_log": s4d_real + rand(channels, state, scale=0.1),
        "D": rand(channels),
    }


def assert_close_scaled(actual, expected, tol, name):
    scale = expected.abs().max().clamp_min(1.0).item()
    torch.testing.assert_close(
        actual.double().cpu(), expected.cpu(), atol=tol * scale, rtol=tol, msg=lambda m: f"{name}: {m}"
    )


def to_device(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to(DEVICE) if t is not None else None


def run_both(inner, tensors, dtype, padding_mask=None, seq_idx=None, frozen=()):
    """The fused op in `dtype` and the reference in float64 on the same (rounded) values, each backpropagating the
    same random output gradient; returns (fused leaves and y, reference leaves and y)."""
    rounded = {k: v.to(dtype) for k, v in tensors.items()}
    ref_leaves = {k: v.double().requires_grad_(k not in frozen) for k, v in rounded.items()}
    y_ref = mamba_inner_ref(**ref_leaves, padding_mask=padding_mask, seq_idx=seq_idx)
    dy = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (y_ref * dy).sum().backward()

    leaves = {k: v.to(DEVICE).requires_grad_(k not in frozen) for k, v in rounded.items()}
    y = inner.mamba_inner_fn(**leaves, padding_mask=to_device(padding_mask), seq_idx=to_device(seq_idx))
    (y.float() * dy.float().to(DEVICE)).sum().backward()
    return (leaves, y), (ref_leaves, y_ref)


CASES = [  # batch, T, E, N, R, dtype, padding, packed rows; T 80 runs the scan in two chunks of 64
    (2, 13, 16, 8, 4, torch.float32, False, False),
    (2, 19, 24, 16, 3, torch.float32, True, False),
    (2, 21, 16, 8, 4, torch.float32, False, True),
    (1, 80, 8, 4, 2, torch.float32, True, True),
    (2, 17, 16, 16, 4, torch.bfloat16, True, False),
]


@pytest.mark.parametrize(
    "batch,seq_len,channels,state,dt_rank,dtype,padded,packed",
    CASES,
    ids=[
        f"B{c[0]}-T{c[1]}-E{c[2]}-N{c[3]}-R{c[4]}-{str(c[5])[6:]}{'-padded' if c[6] else ''}{'-packed' if c[7] else ''}"
        for c in CASES
    ],
)
def test_output_and_every_gradient_match_the_reference(
    inner, batch, seq_len, channels, state, dt_rank, dtype, padded, packed
):
    tensors = random_branch(batch, seq_len, channels, state, dt_rank)
    padding_mask, seq_idx = padded_and_packed_rows(batch, seq_len, padded, packed)
    (leaves, y), (ref_leaves, y_ref) = run_both(inner, tensors, dtype, padding_mask, seq_idx)

    tol = TOL[dtype]
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert_close_scaled(y, y_ref.detach(), tol, "y")
    for name, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, name
        assert_close_scaled(leaf.grad, ref_leaves[name].grad, tol, f"d{name}")
    if padded:  # padding tokens neither feed the state nor get a gradient through xs
        assert leaves["xz"].grad[0, : seq_len // 3, :channels].abs().max() == 0


def test_frozen_weights_get_no_gradient_and_the_rest_are_unchanged(inner):
    """With x_proj and dt_proj frozen (adapters elsewhere in the layer), their gradients are skipped, not computed:
    the others equal the reference's."""
    tensors = random_branch(2, 11, 16, 8, 4, seed=3)
    frozen = ("x_proj_weight", "dt_proj_weight")
    (leaves, _), (ref_leaves, _) = run_both(inner, tensors, torch.float32, frozen=frozen)
    for name, leaf in leaves.items():
        if name in frozen:
            assert leaf.grad is None, name
        else:
            assert_close_scaled(leaf.grad, ref_leaves[name].grad, TOL[torch.float32], f"d{name}")


def test_autocast_runs_the_projections_in_the_autocast_dtype(inner):
    """fp32 weights under bf16 autocast (Trainer's bf16=True): x_proj and dt_proj run in bf16 as the modules would,
    and the weights' gradients come back fp32, close to the float64 reference."""
    tensors = random_branch(2, 12, 16, 8, 4, seed=5)
    xz = tensors["xz"].to(torch.bfloat16).to(DEVICE).requires_grad_()  # in_proj's output under autocast
    weights = {k: v.float().to(DEVICE).requires_grad_() for k, v in tensors.items() if k != "xz"}
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = inner.mamba_inner_fn(xz, **weights)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()

    ref = {k: v.detach().double().requires_grad_() for k, v in {"xz": xz, **weights}.items()}
    mamba_inner_ref(**ref).sum().backward()
    assert_close_scaled(y.detach(), mamba_inner_ref(**ref).detach(), TOL[torch.bfloat16], "y")
    for name, weight in weights.items():
        assert weight.grad.dtype == torch.float32, name
        assert_close_scaled(weight.grad, ref[name].grad, TOL[torch.bfloat16], f"d{name}")


def test_no_grad_forward_saves_no_scan_checkpoints(inner, monkeypatch):
    """Without a backward to come (evaluation), the scan writes no segment checkpoints."""
    scan = importlib.import_module("modeling.ops.selective_scan.interface")
    seen = []
    original = scan.selective_scan_fwd

    def recording(*args, **kwargs):
        seen.append(next(x for x in args if isinstance(x, scan.ScanBlocks)).save_seg_states)
        return original(*args, **kwargs)

    monkeypatch.setattr(inner, "selective_scan_fwd", recording)
    tensors = {k: v.float().to(DEVICE).requires_grad_() for k, v in random_branch(1, 9, 8, 4, 2).items()}
    with torch.no_grad():
        inner.mamba_inner_fn(**tensors)
    inner.mamba_inner_fn(**tensors)
    assert seen == [False, True]


def test_rejects_bad_shapes_by_name(inner):
    tensors = {k: v.float() for k, v in random_branch(1, 5, 8, 4, 2).items()}
    with pytest.raises(ValueError, match="xz must be"):
        inner.mamba_inner_fn(**{**tensors, "xz": tensors["xz"][..., :-1]})
    with pytest.raises(ValueError, match="x_proj_weight must be"):
        inner.mamba_inner_fn(**{**tensors, "x_proj_weight": tensors["x_proj_weight"][:-1]})
    with pytest.raises(ValueError, match="conv_weight must be"):
        inner.mamba_inner_fn(**{**tensors, "conv_weight": tensors["conv_weight"][:, 0]})
    with pytest.raises(ValueError, match="padding_mask must be"):
        inner.mamba_inner_fn(**tensors, padding_mask=torch.ones(1, 4))


# ---------------------------------------------------------------------------------------------------------------------
# The decode step on the caches: `mamba_inner_step` (two launches) against `mamba_inner_step_ref`, and the step
# reference against the sequence reference
# ---------------------------------------------------------------------------------------------------------------------


def weights_of(tensors: dict) -> dict:
    return {k: v for k, v in tensors.items() if k != "xz"}


def test_the_step_reference_steps_through_what_the_sequence_reference_computes():
    """`mamba_inner_step_ref` token by token from zero caches gives `mamba_inner_ref` over the whole sequence, left
    padding included (its padding positions' outputs are nobody's: the step writes zeros there). Float64 inputs;
    the decode references take the step and the state in fp32, hence fp32's tolerance."""
    batch, seq_len, channels, state, dt_rank = 3, 9, 12, 5, 3
    tensors = random_branch(batch, seq_len, channels, state, dt_rank, seed=7)
    padding_mask = torch.ones(batch, seq_len, dtype=torch.long)
    padding_mask[1, :4] = 0
    want = mamba_inner_ref(**tensors, padding_mask=padding_mask)

    conv_state = torch.zeros(batch, channels, 3, dtype=torch.float64)
    ssm_state = torch.zeros(batch, channels, state, dtype=torch.float64)
    steps = [
        mamba_inner_step_ref(tensors["xz"][:, t : t + 1], **weights_of(tensors), conv_state=conv_state,
                             ssm_state=ssm_state, padding_mask=padding_mask[:, t : t + 1])
        for t in range(seq_len)
    ]  # fmt: skip
    got = torch.cat(steps, dim=1)
    real = padding_mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert got[~real].abs().max() == 0


STEP_CASES = [  # dtype, ssm state dtype, conv bias, padding mask dtype (None: no mask), small blocks
    (torch.float32, torch.float32, True, None, False),
    (torch.float32, torch.float32, False, torch.long, True),
    (torch.bfloat16, torch.float32, True, torch.bool, True),
    (torch.bfloat16, torch.bfloat16, True, torch.float32, False),
]


@pytest.mark.parametrize(
    "dtype,state_dtype,conv_bias,mask_dtype,small_blocks",
    STEP_CASES,
    ids=[f"{str(c[0])[6:]}-state_{str(c[1])[6:]}{'-bias' if c[2] else ''}-mask_{str(c[3])[6:]}"
         f"{'-small_blocks' if c[4] else ''}" for c in STEP_CASES],
)  # fmt: skip
def test_the_step_kernels_follow_the_step_reference(
    inner, monkeypatch, dtype, state_dtype, conv_bias, mask_dtype, small_blocks
):
    """Three decode steps on the kernels and on the float64 reference from the same random caches: the outputs,
    the conv history and the state after each step. The caches are strided views (the rows of a wider buffer, the
    state's last two dimensions swapped; the caches one row longer than the batch), xz a view of a wider output;
    R and N are not powers of two. With small blocks every loop of the kernels takes several steps, the last one
    partial: E = 72 in conv programs of 16 channels (five x_proj shares, summed two at a time), x_proj's 17 rows
    eight at a time (the next eight requested before the current ones are summed). The token dimension of xz, the
    mask and the output is read through row strides (the mask's is not 1)."""
    decode = importlib.import_module("modeling.ops.mamba_inner.decode")
    if small_blocks:
        monkeypatch.setattr(decode, "pick_step_blocks", lambda *args: decode.StepBlocks(e1=16, j=8, e2=16, p=2))
    batch, channels, state, dt_rank, steps = 3, 72, 6, 5, 3
    tensors = random_branch(batch, steps, channels, state, dt_rank, seed=11)
    if not conv_bias:
        tensors["conv_bias"] = None
    g = torch.Generator().manual_seed(12)
    conv_state = torch.randn(batch, channels, 3, generator=g, dtype=torch.float64)
    ssm_state = torch.randn(batch, channels, state, generator=g, dtype=torch.float64)
    # the mask a column of a wider one (row stride 3), as generate() passes the last column of its growing mask;
    # read with a row stride of 1 it would be [1, 1, 1]
    wide_mask = torch.tensor([[0, 1, 1], [1, 0, 1], [0, 1, 0]], dtype=mask_dtype) if mask_dtype is not None else None
    padding_mask = wide_mask[:, 1:2] if mask_dtype is not None else None

    rounded = {k: v.to(dtype) if v is not None else None for k, v in tensors.items()}
    weights = {k: v.to(DEVICE) if v is not None else None for k, v in weights_of(rounded).items()}
    ref_weights = {k: v.double() if v is not None else None for k, v in weights_of(rounded).items()}
    conv_buffer = torch.full((batch + 1, 2, channels, 3), float("nan"), dtype=dtype, device=DEVICE)
    conv_cache = conv_buffer[:, 1]
    conv_cache[:batch].copy_(conv_state)
    state_buffer = torch.full((batch + 1, state, channels), float("nan"), dtype=state_dtype, device=DEVICE)
    ssm_cache = state_buffer.transpose(1, 2)
    ssm_cache[:batch].copy_(ssm_state)
    ref_conv, ref_ssm = conv_cache[:batch].double().cpu(), ssm_cache[:batch].double().cpu()

    tol = TOL[dtype]
    state_tol = max(tol, TOL[state_dtype])  # bf16 activations (u, B, C, the step) reach the state too
    for t in range(steps):
        wide = torch.randn(batch, 1, 2 * channels + 8, generator=g).to(DEVICE, dtype)  # NaN-free around xz
        xz = wide[..., 4 : 4 + 2 * channels]
        xz.copy_(rounded["xz"][:, t : t + 1])
        device_mask = wide_mask.to(DEVICE)[:, 1:2] if padding_mask is not None else None  # the view on the device
        out = inner.mamba_inner_step(xz, **weights, conv_state=conv_cache, ssm_state=ssm_cache,
                                     padding_mask=device_mask)  # fmt: skip
        want = mamba_inner_step_ref(xz.double().cpu(), **ref_weights, conv_state=ref_conv, ssm_state=ref_ssm,
                                    padding_mask=padding_mask)  # fmt: skip
        assert out.shape == (batch, 1, channels) and out.dtype == dtype
        assert_close_scaled(out, want, tol, f"y at step {t}")
        assert_close_scaled(conv_cache[:batch], ref_conv, tol, f"conv history after step {t}")
        assert_close_scaled(ssm_cache[:batch], ref_ssm, state_tol, f"state after step {t}")
        # Nothing outside the batch's rows of the caches' views is written.
        assert conv_buffer[:, 0].isnan().all() and conv_buffer[batch].isnan().all()
        assert state_buffer[batch].isnan().all()
    if padding_mask is not None:  # the padding row's state is the one it started with, its output zeros
        assert_close_scaled(ssm_cache[1], ssm_state[1], TOL[state_dtype], "the padding row's state")
        assert out[1].abs().max() == 0


def test_the_step_is_one_op_in_a_compiled_graph(inner):
    """Under `torch.compile(fullgraph=True)` (as generate() compiles a static-cache decode step) the step enters the
    graph as its custom op, no graph break, and updates both caches and writes y as in eager mode."""
    tensors = {k: v.float().to(DEVICE) for k, v in random_branch(2, 1, 16, 4, 2, seed=13).items()}
    g = torch.Generator().manual_seed(14)
    caches = {"conv_state": torch.randn(2, 16, 3, generator=g), "ssm_state": torch.randn(2, 16, 4, generator=g)}
    eager_caches = {k: v.clone().to(DEVICE) for k, v in caches.items()}
    compiled_caches = {k: v.clone().to(DEVICE) for k, v in caches.items()}
    eager = inner.mamba_inner_step(**tensors, **eager_caches)
    step = torch.compile(inner.mamba_inner_step, fullgraph=True, backend="aot_eager")
    compiled = step(**tensors, **compiled_caches)
    torch.testing.assert_close(compiled, eager)
    for name, cache in compiled_caches.items():
        torch.testing.assert_close(cache, eager_caches[name])
        assert not torch.equal(cache.cpu(), caches[name]), name  # the compiled call did update the cache


def test_the_step_rejects_bad_arguments_by_name(inner):
    tensors = {k: v.float() for k, v in random_branch(2, 1, 8, 4, 2).items()}
    caches = {"conv_state": torch.zeros(2, 8, 3), "ssm_state": torch.zeros(2, 8, 4)}
    xz = tensors.pop("xz")
    with pytest.raises(ValueError, match="xz must be"):
        inner.mamba_inner_step(xz[:, 0], **tensors, **caches)
    with pytest.raises(ValueError, match="xz: the last dimension must be contiguous"):
        inner.mamba_inner_step(xz.transpose(0, 2).contiguous().transpose(0, 2), **tensors, **caches)
    with pytest.raises(ValueError, match="dt_proj_weight must be"):
        inner.mamba_inner_step(xz, **{**tensors, "dt_proj_weight": tensors["dt_proj_weight"][:-1]}, **caches)
    with pytest.raises(ValueError, match="ssm_state: expected"):
        inner.mamba_inner_step(xz, **tensors, **{**caches, "ssm_state": torch.zeros(1, 8, 4)})
    with pytest.raises(ValueError, match="padding_mask: expected"):
        inner.mamba_inner_step(xz, **tensors, **caches, padding_mask=torch.ones(2))
