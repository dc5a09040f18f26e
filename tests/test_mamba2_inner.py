"""The Mamba-2 branch's fused training op (`mamba2_inner_fn`: one autograd node over the conv and chunked-scan
kernels and the gated norm) against its reference (`mamba2_inner_ref`), in Triton's interpreter on CPU machines: the
output and every gradient, with padding, packed rows, several scan chunks, groups, bf16 and autocast; the norm's
written-out backward against autograd in float64; and the branch's fused path against its module path. Its decode
step on the caches (`mamba2_inner_step`) against `mamba2_inner_step_ref`, and that against the sequence reference."""

import importlib
import math

import pytest
import torch
from conftest import MAMBA2_BRANCH, DispatchedOps, padded_and_packed_rows, tiny_config

from modeling.ops import gated_rms_norm_bwd_ref, gated_rms_norm_ref, mamba2_inner_ref, mamba2_inner_step_ref

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-4, torch.bfloat16: 5e-2}


@pytest.fixture(scope="module")
def inner():
    """The kernels' public function, in Triton's interpreter on CPU machines (conftest sets TRITON_INTERPRET first)."""
    return importlib.import_module("modeling.ops.mamba2_inner.interface")


@pytest.mark.parametrize("groups", [1, 3])
def test_the_norms_written_out_backward_is_autograds(groups):
    """`gated_rms_norm_bwd_ref` against autograd through `gated_rms_norm_ref` on the same float64 inputs: both
    compute in fp32 (`.float()`), in other orders, and return float64."""
    g = torch.Generator().manual_seed(0)
    y, z, dout = (torch.randn(2, 7, 12, generator=g, dtype=torch.float64) for _ in range(3))
    weight = torch.randn(12, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (y, z, weight)]
    out = gated_rms_norm_ref(*leaves[:2], leaves[2], 12 // groups, 1e-5)
    want = torch.autograd.grad(out, leaves, dout)
    got = gated_rms_norm_bwd_ref(y, z, weight, 12 // groups, 1e-5, dout)
    for name, a, b in zip(("dy", "dz", "dweight"), got, want):
        assert a.dtype == torch.float64 and a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def random_branch(batch, seq_len, heads, head_dim, groups, state, width=4, seed=0):
    """Inputs and weights at the scales of the Mamba-2 init (random, nothing zero): steps of 1e-3..0.1 through
    dt_bias, A = -(1..16)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    intermediate = heads * head_dim
    conv_channels = intermediate + 2 * groups * state
    dt_init = torch.exp(torch.rand(heads, generator=g) * math.log(100.0)) * 1e-3
    return {
        "zxbcdt": rand(batch, seq_len, intermediate + conv_channels + heads),
        "conv_weight": rand(conv_channels, 1, width, scale=0.5),
        "conv_bias": rand(conv_channels, scale=0.1),
        "dt_bias": dt_init + torch.log(-torch.expm1(-dt_init)),  # softplus^-1
        "A_log": torch.log(torch.rand(heads, generator=g) * 15 + 1),
        "D": rand(heads),
        "norm_weight": 1 + rand(intermediate, scale=0.1),
    }


def assert_close_scaled(actual, expected, tol, name):
    scale = expected.abs().max().clamp_min(1.0).item()
    torch.testing.assert_close(
        actual.double().cpu(), expected.double().cpu(), atol=tol * scale, rtol=tol, msg=lambda m: f"{name}: {m}"
    )


def to_device(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to(DEVICE) if t is not None else None


CASES = [  # batch, T, heads, head dim, groups, N, dtype, padding, packed rows; T 80 runs the scan in two chunks of 64
    (2, 13, 2, 16, 1, 16, torch.float32, False, False),
    (2, 19, 4, 8, 2, 8, torch.float32, True, False),
    (2, 21, 2, 16, 1, 8, torch.float32, False, True),
    (1, 80, 2, 8, 2, 16, torch.float32, True, True),
    (2, 17, 2, 16, 1, 16, torch.bfloat16, True, False),
]


@pytest.mark.parametrize(
    "batch,seq_len,heads,head_dim,groups,state,dtype,padded,packed",
    CASES,
    ids=[
        f"B{c[0]}-T{c[1]}-H{c[2]}x{c[3]}-G{c[4]}-N{c[5]}-{str(c[6])[6:]}{'-padded' if c[7] else ''}"
        f"{'-packed' if c[8] else ''}"
        for c in CASES
    ],
)
def test_output_and_every_gradient_match_the_reference(
    inner, batch, seq_len, heads, head_dim, groups, state, dtype, padded, packed
):
    tensors = {k: v.to(dtype) for k, v in random_branch(batch, seq_len, heads, head_dim, groups, state).items()}
    padding_mask, seq_idx = padded_and_packed_rows(batch, seq_len, padded, packed)

    ref_leaves = {k: v.double().requires_grad_() for k, v in tensors.items()}
    want = mamba2_inner_ref(**ref_leaves, n_groups=groups, eps=1e-5, padding_mask=padding_mask, seq_idx=seq_idx)
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (want * dout).sum().backward()

    leaves = {k: v.to(DEVICE).requires_grad_() for k, v in tensors.items()}
    got = inner.mamba2_inner_fn(
        **leaves, n_groups=groups, eps=1e-5, padding_mask=to_device(padding_mask), seq_idx=to_device(seq_idx)
    )
    (got.float() * dout.float().to(DEVICE)).sum().backward()

    tol = TOL[dtype]
    assert got.dtype == dtype and got.shape == want.shape == (batch, seq_len, heads * head_dim)
    assert_close_scaled(got, want.detach(), tol, "out")
    for name, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape, name
        assert_close_scaled(leaf.grad, ref_leaves[name].grad, tol, f"d{name}")
    if padded:  # padding tokens neither feed the state nor get a gradient through xBC or dt
        pad = leaves["zxbcdt"].grad[0, : seq_len // 3, heads * head_dim :]
        assert pad.abs().max() == 0


def test_autocast_gives_fp32_weights_their_gradients_in_fp32(inner):
    """fp32 weights under bf16 autocast (Trainer's bf16=True): in_proj's output comes in bf16, the output leaves in
    bf16 and every weight's gradient comes back in fp32, close to the reference's."""
    tensors = random_branch(2, 12, 2, 16, 1, 8, seed=5)
    zxbcdt = tensors.pop("zxbcdt").to(torch.bfloat16).to(DEVICE).requires_grad_()
    weights = {k: v.to(DEVICE).requires_grad_() for k, v in tensors.items()}
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = inner.mamba2_inner_fn(zxbcdt, **weights, n_groups=1, eps=1e-5)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()

    ref = {k: v.detach().double().requires_grad_() for k, v in {"zxbcdt": zxbcdt, **weights}.items()}
    want = mamba2_inner_ref(**ref, n_groups=1, eps=1e-5)
    want.sum().backward()
    assert_close_scaled(out.detach(), want.detach(), TOL[torch.bfloat16], "out")
    for name, weight in weights.items():
        assert weight.grad.dtype == torch.float32, name
        assert_close_scaled(weight.grad, ref[name].grad, TOL[torch.bfloat16], f"d{name}")


def test_rejects_bad_shapes_by_name(inner):
    tensors = random_branch(1, 5, 2, 8, 1, 4)
    args = {"n_groups": 1, "eps": 1e-5}
    with pytest.raises(ValueError, match="zxbcdt must be"):
        inner.mamba2_inner_fn(**{**tensors, "zxbcdt": tensors["zxbcdt"][..., :-1]}, **args)
    with pytest.raises(ValueError, match="dt_bias must be"):
        inner.mamba2_inner_fn(**{**tensors, "dt_bias": tensors["dt_bias"][:1]}, **args)
    with pytest.raises(ValueError, match="conv_weight's 24 channels must be E \\+ 2GN"):
        inner.mamba2_inner_fn(**tensors, n_groups=3, eps=1e-5)
    with pytest.raises(ValueError, match="conv_weight must be"):
        inner.mamba2_inner_fn(**{**tensors, "conv_weight": tensors["conv_weight"][:, 0]}, **args)
    with pytest.raises(ValueError, match="padding_mask must be"):
        inner.mamba2_inner_fn(**tensors, **args, padding_mask=torch.ones(1, 4))


@pytest.mark.parametrize("on_kernels", [False, True], ids=["references", "kernels"])
def test_the_branch_computes_with_its_fused_op_what_its_module_path_does(monkeypatch, on_kernels):
    """`Mamba2Branch` without a cache runs the fused op (the reference off the kernels); a hook on its conv sends it
    down the module path (as an adapter would). Both give the same output and the same gradient to every parameter
    and to the input, with padding."""
    from modeling import HybridForCausalLM
    from modeling.history import mamba2

    inner_calls = []
    for name in ("mamba2_inner_fn", "mamba2_inner_ref"):
        original = getattr(mamba2, name)
        monkeypatch.setattr(mamba2, name, lambda *a, _f=original, **k: inner_calls.append(_f.__name__) or _f(*a, **k))
    monkeypatch.setattr(mamba2.Mamba2Branch, "_on_kernels", lambda self, hidden: on_kernels)
    torch.manual_seed(0)
    config = tiny_config(**{**MAMBA2_BRANCH, "ssm_chunk_size": 16})
    branch = HybridForCausalLM(config).model.layers[0].self_attn.ssm.to(DEVICE, torch.float32)
    torch.nn.init.normal_(branch.out_proj.weight, std=0.1)  # W_out starts at zero
    hidden = torch.randn(2, 23, config.hidden_size, device=DEVICE)
    padding_mask = torch.ones(2, 23, dtype=torch.long, device=DEVICE)
    padding_mask[1, :6] = 0

    results = []
    for hooked in (False, True):
        hook = branch.conv1d.register_forward_hook(lambda *a: None) if hooked else None
        leaf = hidden.clone().requires_grad_()
        branch.zero_grad(set_to_none=True)
        out = branch(leaf, padding_mask=padding_mask)
        out.square().sum().backward()
        results.append((out.detach(), leaf.grad, {n: p.grad.clone() for n, p in branch.named_parameters()}))
        if hook is not None:
            hook.remove()
    assert inner_calls == ["mamba2_inner_fn" if on_kernels else "mamba2_inner_ref"]
    (fused, d_fused, grads_fused), (modules, d_modules, grads_modules) = results
    # fp32 both ways, summed in other orders (the kernels' backward, the norm's written out)
    assert_close_scaled(fused, modules, 1e-5, "out")
    assert_close_scaled(d_fused, d_modules, 1e-5, "d hidden")
    for name, grad in grads_fused.items():
        assert_close_scaled(grad, grads_modules[name], 1e-4, f"d {name}")


def test_under_torch_compile_every_gradient_is_the_references(inner, monkeypatch):
    """`torch.compile(fullgraph=True)` traces the op's autograd function whole wherever Dynamo can trace its kernels'
    launches (CUDA); here the conv's and the scan's launches are swapped for their references (gradients by
    `torch.func.vjp`) so that it does on CPU too, the norm taking its own compiled path. That path returned the
    reference's fp32 `.to()` of itself, to which Dynamo (torch 2.11) gives a zero output gradient: every weight of
    the branch got a zero gradient."""
    from modeling.ops import causal_conv1d_ref, ssd_chunk_scan_ref

    def conv_fwd(x, weight, bias, activation, seq_idx=None):  # token-major, as the kernel writes it
        return causal_conv1d_ref(x, weight, bias, activation, seq_idx=seq_idx).contiguous()

    def conv_bwd(x, weight, bias, dy, activation, seq_idx=None, dx=None):
        assert dx is None, "under torch.compile the conv's gradient is a buffer of its own, not a view of zxbcdt's"
        _, vjp = torch.func.vjp(lambda *a: causal_conv1d_ref(*a, activation, seq_idx=seq_idx), x, weight, bias)
        return vjp(dy)

    def scan_fwd(x, dt, A, B, C, D, initial, segments, chunk_size, blocks, with_final_state=True):
        return ssd_chunk_scan_ref(x, dt, A, B, C, D, chunk_size)[0], None

    def scan_bwd(x, dt, A, B, C, D, initial, segments, dy, dfinal, chunk_size, blocks):  # dx, dB, dC side by side
        _, vjp = torch.func.vjp(lambda *a: ssd_chunk_scan_ref(*a, chunk_size)[0], x, dt, A, B, C, D)
        dx, ddt, dA, dB, dC, dD = vjp(dy)
        return torch.cat([dx.flatten(-2), dB.flatten(-2), dC.flatten(-2)], dim=-1), ddt, dA, dD, None

    for name, stand_in in [
        ("causal_conv1d_fwd", conv_fwd), ("causal_conv1d_bwd", conv_bwd),
        ("ssd_chunk_scan_fwd", scan_fwd), ("ssd_chunk_scan_bwd", scan_bwd),
    ]:  # fmt: skip
        monkeypatch.setattr(inner, name, stand_in)
    tensors = random_branch(2, 9, 4, 8, 2, 8, seed=3)
    dout = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(4))

    ref_leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
    (mamba2_inner_ref(**ref_leaves, n_groups=2, eps=1e-5) * dout).sum().backward()

    leaves = {k: v.clone().requires_grad_() for k, v in tensors.items()}
    compiled = torch.compile(
        lambda t: inner.mamba2_inner_fn(**t, n_groups=2, eps=1e-5), fullgraph=True, backend="eager"
    )
    (compiled(leaves) * dout).sum().backward()
    for name, leaf in leaves.items():
        assert_close_scaled(leaf.grad, ref_leaves[name].grad, TOL[torch.float32], f"d{name}")


# ---------------------------------------------------------------------------------------------------------------------
# The decode step on the caches: `mamba2_inner_step` (three launches) against `mamba2_inner_step_ref`, and the step
# reference against the sequence reference
# ---------------------------------------------------------------------------------------------------------------------


def zero_caches(batch, heads, head_dim, groups, state, width=4, dtype=torch.float64):
    conv_channels = heads * head_dim + 2 * groups * state
    return {
        "conv_state": torch.zeros(batch, conv_channels, width - 1, dtype=dtype),
        "ssm_state": torch.zeros(batch, heads, head_dim, state, dtype=dtype),
    }


def test_the_step_reference_steps_through_what_the_sequence_reference_computes():
    """`mamba2_inner_step_ref` token by token from zero caches gives `mamba2_inner_ref` over the whole sequence,
    left padding included (a padding position's output is nobody's). Float64 inputs; the decode references take the
    step and the state in fp32, hence fp32's tolerance."""
    batch, seq_len, heads, head_dim, groups, state = 3, 9, 4, 4, 2, 5
    tensors = {k: v.double() for k, v in random_branch(batch, seq_len, heads, head_dim, groups, state, seed=7).items()}
    padding_mask = torch.ones(batch, seq_len, dtype=torch.long)
    padding_mask[1, :4] = 0
    zxbcdt = tensors.pop("zxbcdt")
    want = mamba2_inner_ref(zxbcdt, **tensors, n_groups=groups, eps=1e-5, padding_mask=padding_mask)

    caches = zero_caches(batch, heads, head_dim, groups, state)
    steps = [
        mamba2_inner_step_ref(zxbcdt[:, t : t + 1], **tensors, n_groups=groups, eps=1e-5, **caches,
                              padding_mask=padding_mask[:, t : t + 1])
        for t in range(seq_len)
    ]  # fmt: skip
    got = torch.cat(steps, dim=1)
    real = padding_mask.bool()
    assert got.shape == want.shape and got.dtype == torch.float64
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)


STEP_CASES = [  # dtype, ssm state dtype, groups, conv bias, padding mask dtype (None: no mask)
    (torch.float32, torch.float32, 1, True, None),
    (torch.float32, torch.float32, 3, False, torch.long),
    (torch.bfloat16, torch.float32, 3, True, torch.bool),
    (torch.bfloat16, torch.bfloat16, 1, True, torch.float32),
]


@pytest.mark.parametrize(
    "dtype,state_dtype,groups,conv_bias,mask_dtype",
    STEP_CASES,
    ids=[f"{str(c[0])[6:]}-state_{str(c[1])[6:]}-G{c[2]}{'-bias' if c[3] else ''}-mask_{str(c[4])[6:]}"
         for c in STEP_CASES],
)  # fmt: skip
def test_the_step_kernels_follow_the_step_reference(inner, dtype, state_dtype, groups, conv_bias, mask_dtype):
    """Three decode steps on the kernels and on the float64 reference from the same random caches: the outputs,
    the conv history and the state after each step. The caches are strided views (the rows of a wider buffer, the
    state's last two dimensions swapped; the caches one row longer than the batch, that row never written), zxbcdt a
    view of a wider output, the mask a column of a wider one; heads of 6 channels, N 5, three groups of two heads."""
    batch, heads, head_dim, state, steps = 3, 6, 6, 5, 3
    tensors = random_branch(batch, steps, heads, head_dim, groups, state, seed=11)
    if not conv_bias:
        tensors["conv_bias"] = None
    g = torch.Generator().manual_seed(12)
    conv_channels = heads * head_dim + 2 * groups * state
    conv_state = torch.randn(batch, conv_channels, 3, generator=g, dtype=torch.float64)
    ssm_state = torch.randn(batch, heads, head_dim, state, generator=g, dtype=torch.float64)
    wide_mask = torch.tensor([[0, 1, 1], [1, 0, 1], [0, 1, 0]], dtype=mask_dtype) if mask_dtype is not None else None

    rounded = {k: v.to(dtype) if v is not None else None for k, v in tensors.items()}
    zxbcdt_all = rounded.pop("zxbcdt")
    weights = {k: v.to(DEVICE) if v is not None else None for k, v in rounded.items()}
    ref_weights = {k: v.double() if v is not None else None for k, v in rounded.items()}
    conv_buffer = torch.full((batch + 1, 2, conv_channels, 3), float("nan"), dtype=dtype, device=DEVICE)
    conv_cache = conv_buffer[:, 1]
    conv_cache[:batch].copy_(conv_state)
    state_buffer = torch.full((batch + 1, heads, state, head_dim), float("nan"), dtype=state_dtype, device=DEVICE)
    ssm_cache = state_buffer.transpose(2, 3)
    ssm_cache[:batch].copy_(ssm_state)
    ref_conv, ref_ssm = conv_cache[:batch].double().cpu(), ssm_cache[:batch].double().cpu()
    args = {"n_groups": groups, "eps": 1e-5}

    tol = TOL[dtype]
    state_tol = max(tol, TOL[state_dtype])
    for t in range(steps):
        width = zxbcdt_all.shape[-1]
        wide = torch.randn(batch, 1, width + 8, generator=g).to(DEVICE, dtype)  # NaN-free around zxbcdt
        zxbcdt = wide[..., 4 : 4 + width]
        zxbcdt.copy_(zxbcdt_all[:, t : t + 1])
        mask = wide_mask[:, t : t + 1] if wide_mask is not None else None
        out = inner.mamba2_inner_step(zxbcdt, **weights, **args, conv_state=conv_cache, ssm_state=ssm_cache,
                                      padding_mask=to_device(mask))  # fmt: skip
        want = mamba2_inner_step_ref(zxbcdt.double().cpu(), **ref_weights, **args, conv_state=ref_conv,
                                     ssm_state=ref_ssm, padding_mask=mask)  # fmt: skip
        assert out.shape == (batch, 1, heads * head_dim) and out.dtype == dtype
        real = mask[:, 0].bool() if mask is not None else torch.ones(batch, dtype=torch.bool)
        assert_close_scaled(out[real.to(DEVICE)], want[real], tol, f"y at step {t}")
        assert_close_scaled(conv_cache[:batch], ref_conv, tol, f"conv history after step {t}")
        assert_close_scaled(ssm_cache[:batch], ref_ssm, state_tol, f"state after step {t}")
        # Nothing outside the batch's rows of the caches' views is written.
        assert conv_buffer[:, 0].isnan().all() and conv_buffer[batch].isnan().all()
        assert state_buffer[batch].isnan().all()
    if wide_mask is not None:  # row 0's first token and row 2's first and last are padding: row 0 steps twice
        assert not torch.equal(ssm_cache[0].double().cpu(), ssm_state[0].to(state_dtype).double())


def test_a_padding_token_enters_the_history_as_zeros_and_leaves_the_state(inner):
    """A step whose token is padding shifts a zero into the row's conv history and leaves its state exactly as it
    was, on the kernels as in the reference; the other row steps."""
    tensors = {k: v.float() for k, v in random_branch(2, 1, 4, 8, 2, 8, seed=15).items()}
    g = torch.Generator().manual_seed(16)
    conv_state = torch.randn(2, 64, 3, generator=g).to(DEVICE)
    ssm_state = torch.randn(2, 4, 8, 8, generator=g).to(DEVICE)
    before = (conv_state.clone(), ssm_state.clone())
    zxbcdt = tensors.pop("zxbcdt").to(DEVICE)
    weights = {k: v.to(DEVICE) for k, v in tensors.items()}
    mask = torch.tensor([[1], [0]], device=DEVICE)
    inner.mamba2_inner_step(zxbcdt, **weights, n_groups=2, eps=1e-5, conv_state=conv_state, ssm_state=ssm_state,
                            padding_mask=mask)  # fmt: skip
    assert torch.equal(ssm_state[1], before[1][1])
    assert torch.equal(conv_state[1, :, :2], before[0][1, :, 1:]) and conv_state[1, :, 2].abs().max() == 0
    assert not torch.equal(ssm_state[0], before[1][0])


def test_the_step_is_one_op_in_a_compiled_graph(inner):
    """Under `torch.compile(fullgraph=True)` (as generate() compiles a static-cache decode step) the step enters the
    graph as its custom op, no graph break, and updates both caches and writes its output as in eager mode."""
    tensors = {k: v.float().to(DEVICE) for k, v in random_branch(2, 1, 2, 8, 1, 4, seed=13).items()}
    g = torch.Generator().manual_seed(14)
    caches = {"conv_state": torch.randn(2, 24, 3, generator=g), "ssm_state": torch.randn(2, 2, 8, 4, generator=g)}
    eager_caches = {k: v.clone().to(DEVICE) for k, v in caches.items()}
    compiled_caches = {k: v.clone().to(DEVICE) for k, v in caches.items()}
    eager = inner.mamba2_inner_step(**tensors, n_groups=1, eps=1e-5, **eager_caches)
    step = torch.compile(inner.mamba2_inner_step, fullgraph=True, backend="aot_eager")
    compiled = step(**tensors, n_groups=1, eps=1e-5, **compiled_caches)
    torch.testing.assert_close(compiled, eager)
    for name, cache in compiled_caches.items():
        torch.testing.assert_close(cache, eager_caches[name])
        assert not torch.equal(cache.cpu(), caches[name]), name  # the compiled call did update the cache


def test_the_step_rejects_bad_arguments_by_name(inner):
    tensors = {k: v.float() for k, v in random_branch(2, 1, 2, 8, 1, 4).items()}
    caches = {"conv_state": torch.zeros(2, 24, 3), "ssm_state": torch.zeros(2, 2, 8, 4)}
    zxbcdt = tensors.pop("zxbcdt")
    args = {"n_groups": 1, "eps": 1e-5}
    with pytest.raises(ValueError, match="zxbcdt must be"):
        inner.mamba2_inner_step(zxbcdt[..., :-1], **tensors, **args, **caches)
    with pytest.raises(ValueError, match="zxbcdt must be \\[B, 1"):
        inner.mamba2_inner_step(zxbcdt.expand(2, 2, -1), **tensors, **args, **caches)
    with pytest.raises(ValueError, match="D must be"):
        inner.mamba2_inner_step(zxbcdt, **{**tensors, "D": tensors["D"][:1]}, **args, **caches)
    with pytest.raises(ValueError, match="ssm_state: expected"):
        inner.mamba2_inner_step(zxbcdt, **tensors, **args, **{**caches, "ssm_state": torch.zeros(2, 2, 4, 8)})
    with pytest.raises(ValueError, match="conv_state: expected"):
        inner.mamba2_inner_step(zxbcdt, **tensors, **args, **{**caches, "conv_state": torch.zeros(1, 24, 3)})
    with pytest.raises(ValueError, match="padding_mask: expected"):
        inner.mamba2_inner_step(zxbcdt, **tensors, **args, **caches, padding_mask=torch.ones(2))


def test_the_step_runs_no_aten_op_between_its_launches(inner, monkeypatch):
    """The decode step with a padding mask and bf16 weights: on the host only its outputs' allocations and views of
    its inputs, then its three launches. The padding (a zero conv input, a zero step), row i's cache row and A =
    -exp(A_log) are the kernels' work: an aten op here is a launch more per layer in a CUDA graph and an op more in
    every dynamic-cache generate() step. The launches run outside the count (on CPU machines the interpreter copies
    tensors with aten ops of its own), each counted once."""
    from torch.utils._python_dispatch import _disable_current_modes
    from triton.runtime import interpreter, jit

    launches = []
    for cls in (interpreter.InterpretedFunction, jit.JITFunction):
        original = cls.run

        def run(self, *args, _original=original, **kwargs):
            launches.append(getattr(self, "fn", self).__name__)
            with _disable_current_modes():
                return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "run", run)

    batch, heads, head_dim, groups, state = 3, 6, 6, 3, 5
    tensors = {
        k: v.to(DEVICE, torch.bfloat16) for k, v in random_branch(batch, 1, heads, head_dim, groups, state).items()
    }
    zxbcdt = tensors.pop("zxbcdt")
    conv_channels = heads * head_dim + 2 * groups * state
    conv_state = torch.randn(batch, conv_channels, 3, device=DEVICE, dtype=torch.bfloat16)
    ssm_state = torch.randn(batch, heads, head_dim, state, device=DEVICE)
    mask = torch.tensor([[1], [0], [1]], device=DEVICE)
    with DispatchedOps() as counter:
        inner.mamba2_inner_step(zxbcdt, **tensors, n_groups=groups, eps=1e-5, conv_state=conv_state,
                                ssm_state=ssm_state, padding_mask=mask)  # fmt: skip
    allowed = {"empty", "new_empty", "view", "slice", "select", "as_strided", "t", "transpose"}
    assert len(launches) == 3, launches
    assert set(counter.ops) <= allowed, sorted(set(counter.ops) - allowed)
