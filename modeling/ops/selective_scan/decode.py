"""Decode step of the Mamba-1 selective scan: one step per request, from and into the request's slot of the serving
ssm-state cache (public function `selective_state_update` in interface.py; reference `selective_state_update_ref`
in reference.py, with the exact semantics). Inference only: no autograd.

    StateUpdateArgs                 the step's tensors, strides and sizes as ONE kernel argument: Triton passes a
                                    named tuple as one argument whose fields the kernel reads by name, compiled
                                    exactly as separate arguments
    ssm_step                        the recurrence at one token on loaded blocks (@triton.jit), shared with the
                                    fused branch step (modeling/ops/mamba_inner/decode.py)
    ssm_state_update                the step of one request over one block of channels (@triton.jit), the body of
                                    `_selective_state_update_kernel` and of the SSM programs of vLLM's fused decode
                                    (vllm_integration/ops/hybrid_decode), which reaches it as one argument
    _selective_state_update_kernel  the step alone; grid (B, cdiv(E, BLOCK_E))
    state_update_args               the argument checks, building the StateUpdateArgs
    pick_state_update_block_e       the default channel block

The last two are shared by every launcher of `ssm_state_update` (interface.py's and the fused decode's).
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..triton_utils import check_flags, check_index, check_tokens, next_power_of_2, softplus


class StateUpdateArgs(NamedTuple):
    """What `ssm_state_update` reads and writes, for B decoding requests (shapes and meanings in reference.py's
    `selective_state_update_ref`)."""

    ssm_state: torch.Tensor  # [slots, E, N], updated in place
    s_state_slot: int
    s_state_e: int
    s_state_n: int
    state_indices: torch.Tensor  # [B]
    has_initial_state: torch.Tensor  # [B] bool; state_indices stands in (never read) without HAS_INITIAL_FLAGS
    # A row per request, the last dimension contiguous; s_x is the row stride of x.
    u: torch.Tensor  # [B, E]
    dt: torch.Tensor  # [B, E]
    z: torch.Tensor  # [B, E]
    B: torch.Tensor  # [B, N]
    C: torch.Tensor  # [B, N]
    out: torch.Tensor  # [B, E]
    s_u: int
    s_dt: int
    s_z: int
    s_B: int
    s_C: int
    s_out: int
    # Per channel.
    A: torch.Tensor  # [E, N] fp32, contiguous
    D: torch.Tensor  # [E], contiguous
    dt_bias: torch.Tensor  # [E], contiguous
    E: int
    N: int


@triton.jit
def ssm_step(b_state, b_u, b_step, b_A, b_B, b_C, b_D, b_z):
    """The recurrence at one token for a block of channels, all fp32: state [BLOCK_E, BLOCK_N] <- exp(step A) state +
    step u B, y = (state . C + D u) silu(z). Returns (state, y [BLOCK_E])."""
    b_state = tl.exp(b_step[:, None] * b_A) * b_state + (b_step * b_u)[:, None] * b_B[None, :]
    b_y = tl.sum(b_state * b_C[None, :], axis=1) + b_D * b_u
    return b_state, b_y * b_z * tl.sigmoid(b_z)


@triton.jit
def ssm_state_update(
    ssm, i_req, i_eblk, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr
):
    """One SSM step of request `i_req` for channels [i_eblk * BLOCK_E, (i_eblk + 1) * BLOCK_E) (`ssm`: a
    StateUpdateArgs; BLOCK_N >= N, the state size): the body of `selective_state_update` and of the SSM programs of
    `hybrid_decode`. Padding rows (slot < 0) touch no state and write zeros; a row whose has_initial_state flag is
    False starts from a zero state (its request's first token), whatever its slot holds."""
    o_e = i_eblk * BLOCK_E + tl.arange(0, BLOCK_E)
    o_n = tl.arange(0, BLOCK_N)
    m_e, m_n = o_e < ssm.E, o_n < ssm.N
    m_en = m_e[:, None] & m_n[None, :]

    slot = tl.load(ssm.state_indices + i_req).to(tl.int64)
    is_real = slot >= 0
    continues = is_real
    if HAS_INITIAL_FLAGS:
        continues = continues & (tl.load(ssm.has_initial_state + i_req) != 0)
    p_slot = ssm.ssm_state + slot * ssm.s_state_slot + o_e[:, None] * ssm.s_state_e + o_n[None, :] * ssm.s_state_n
    b_state = tl.load(p_slot, mask=m_en & continues, other=0.0).to(tl.float32)

    b_u = tl.load(ssm.u + i_req * ssm.s_u + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_dt = tl.load(ssm.dt + i_req * ssm.s_dt + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_z = tl.load(ssm.z + i_req * ssm.s_z + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_B = tl.load(ssm.B + i_req * ssm.s_B + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_C = tl.load(ssm.C + i_req * ssm.s_C + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_A = tl.load(ssm.A + o_e[:, None] * ssm.N + o_n[None, :], mask=m_en, other=0.0)
    b_D = tl.load(ssm.D + o_e, mask=m_e, other=0.0).to(tl.float32)
    b_dt_bias = tl.load(ssm.dt_bias + o_e, mask=m_e, other=0.0).to(tl.float32)

    b_state, b_y = ssm_step(b_state, b_u, softplus(b_dt + b_dt_bias), b_A, b_B, b_C, b_D, b_z)

    tl.store(p_slot, b_state.to(ssm.ssm_state.dtype.element_ty), mask=m_en & is_real)
    tl.store(ssm.out + i_req * ssm.s_out + o_e, tl.where(is_real, b_y, 0.0).to(ssm.out.dtype.element_ty), mask=m_e)


@triton.jit
def _selective_state_update_kernel(ssm, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr):
    """Kernel of `selective_state_update`. Grid (B, cdiv(E, BLOCK_E))."""
    ssm_state_update(ssm, tl.program_id(0), tl.program_id(1), BLOCK_E, BLOCK_N, HAS_INITIAL_FLAGS)


@functools.cache
def pick_state_update_block_e(num_channels: int, state_size: int) -> int:
    """Channels per SSM program: a [BLOCK_E, N] fp32 state block of about 2048 values (16 per thread at 4 warps)."""
    return min(next_power_of_2(num_channels), max(1, 2048 // next_power_of_2(state_size)))


def state_update_args(
    ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, out, has_initial_state
) -> StateUpdateArgs:
    """Checks the arguments of `selective_state_update` (see `selective_state_update_ref`) and groups them, with their
    strides and sizes, as the kernels take them."""
    if u.dim() != 2:
        raise ValueError(f"u: expected [requests, channels], got {tuple(u.shape)}")
    num_requests, num_channels = u.shape
    state_size = A.shape[-1]
    for name, x in (("u", u), ("dt", dt), ("z", z), ("out", out)):
        check_tokens(name, x, (num_requests, num_channels))
    for name, x in (("B", B), ("C", C)):
        check_tokens(name, x, (num_requests, state_size))
    if not (A.shape == (num_channels, state_size) and A.dtype == torch.float32 and A.is_contiguous()):
        raise ValueError(f"A: expected a contiguous fp32 {(num_channels, state_size)}, got {A.dtype} {tuple(A.shape)}")
    for name, x in (("D", D), ("dt_bias", dt_bias)):
        if not (x.shape == (num_channels,) and x.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous ({num_channels},), got {tuple(x.shape)}")
    if not (ssm_state.dim() == 3 and ssm_state.shape[1:] == (num_channels, state_size)):
        raise ValueError(f"ssm_state: expected [slots, {num_channels}, {state_size}], got {tuple(ssm_state.shape)}")
    if ssm_state.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"ssm_state: expected fp32, bf16 or fp16, got {ssm_state.dtype}")
    check_index("state_indices", state_indices, (num_requests,), like=u)
    if has_initial_state is not None:
        check_flags("has_initial_state", has_initial_state, (num_requests,))
    return StateUpdateArgs(
        *(ssm_state, *ssm_state.stride()),
        state_indices,
        state_indices if has_initial_state is None else has_initial_state,
        *(u, dt, z, B, C, out),
        *(u.stride(0), dt.stride(0), z.stride(0), B.stride(0), C.stride(0), out.stride(0)),
        *(A, D, dt_bias),
        *(num_channels, state_size),
    )
