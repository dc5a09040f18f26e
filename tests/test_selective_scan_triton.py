"""The Triton selective-scan forward against `selective_scan_ref`, in Triton's interpreter on CPU machines."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from modeling.ops import selective_scan_ref

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def scan_fwd():
    """The kernel, in Triton's interpreter on CPU machines (conftest sets TRITON_INTERPRET before triton loads)."""
    return importlib.import_module("modeling.ops.selective_scan_triton").selective_scan_fwd_triton


def random_scan_inputs(batch, seq_len, channels, state, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    u, z = rand(batch, seq_len, channels).to(dtype), rand(batch, seq_len, channels).to(dtype)
    dt = F.softplus(rand(batch, seq_len, channels) - 2).to(dtype)
    A = -torch.exp(rand(channels, state, scale=0.5))
    B, C = rand(batch, seq_len, state).to(dtype), rand(batch, seq_len, state).to(dtype)
    D = rand(channels)
    initial = rand(batch, channels, state)
    return u, dt, A, B, C, D, z, initial


CASES = [  # batch, T, E, N, dtype, with initial state
    (2, 13, 20, 16, torch.float32, False),
    (3, 7, 33, 5, torch.float32, True),
    (1, 1, 16, 16, torch.float32, True),
    (2, 11, 24, 16, torch.bfloat16, True),
    (2, 9, 18, 8, torch.float16, False),
]


@pytest.mark.parametrize(
    "batch,seq_len,channels,state,dtype,with_initial",
    CASES,
    ids=[f"B{c[0]}-T{c[1]}-E{c[2]}-N{c[3]}-{str(c[4])[6:]}-{'init' if c[5] else 'zero'}" for c in CASES],
)
def test_forward_matches_reference(scan_fwd, batch, seq_len, channels, state, dtype, with_initial):
    u, dt, A, B, C, D, z, initial = random_scan_inputs(batch, seq_len, channels, state, dtype)
    initial = initial if with_initial else None
    y_out = torch.full_like(u, float("nan"))  # poisoned: every element must be written
    state_out = torch.full((batch, channels, state), float("nan"), device=u.device)
    y, final = scan_fwd(u, dt, A, B, C, D, z, initial, out=(y_out, state_out))
    y_ref, final_ref = selective_scan_ref(u, dt, A, B, C, D, z, initial)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert y is y_out and final is state_out
    torch.testing.assert_close(y.float(), y_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(final, final_ref, atol=1e-5, rtol=1e-5)
