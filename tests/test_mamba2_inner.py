"""The Mamba-2 branch's fused training op (`mamba2_inner_fn`: one autograd node over the conv and chunked-scan
kernels and the gated norm) against its reference (`mamba2_inner_ref`), in Triton's interpreter on CPU machines: the
output and every gradient, with padding, packed rows, several scan chunks, groups, bf16 and autocast; the norm's
written-out backward against autograd in float64; and the branch's fused path against its module path."""

import importlib
import math

import pytest
import torch
from conftest import MAMBA2_BRANCH, padded_and_packed_rows, tiny_config

from modeling.ops import gated_rms_norm_bwd_ref, gated_rms_norm_ref, mamba2_inner_ref

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

    def conv_bwd(x, weight, bias, dy, activation, seq_idx=None):
        _, vjp = torch.func.vjp(lambda *a: causal_conv1d_ref(*a, activation, seq_idx=seq_idx), x, weight, bias)
        return vjp(dy)

    def scan_fwd(x, dt, A, B, C, D, initial, segments, chunk_size, blocks, with_final_state=True):
        return ssd_chunk_scan_ref(x, dt, A, B, C, D, chunk_size)[0], None

    def scan_bwd(x, dt, A, B, C, D, initial, segments, dy, dfinal, chunk_size, blocks):
        _, vjp = torch.func.vjp(lambda *a: ssd_chunk_scan_ref(*a, chunk_size)[0], x, dt, A, B, C, D)
        return (*vjp(dy), None)

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
