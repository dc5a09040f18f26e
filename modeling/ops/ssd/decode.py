"""Decode step of Mamba-2's SSD recurrence: one step per request, from and into the request's slot of a state cache,
in one launch (reference `ssd_state_update_ref` in reference.py, with the exact semantics). Inference only: no
autograd.

    SSDUpdateArgs              the step's tensors, strides and sizes as ONE kernel argument (a named tuple: Triton
                               compiles its fields as separate arguments), built and checked by `ssd_update_args`
    ssd_state_step             one (request, head, block of head channels) (@triton.jit): the state tile
                               [BLOCK_P, N] in registers, its decay, input and readout; the body of
                               `_ssd_state_update_kernel` (grid (R, H, cdiv(P, BLOCK_P))) and of the SSM programs
                               of vLLM's fused decode (vllm_integration/ops/hybrid_decode)
    ssd_state_update           the checks and the launch; under torch.compile one opaque custom op
                               (`torch.ops.hybrid_ssm.ssd_state_update`), so a compiled decode step keeps it in its
                               graph

Why a kernel: the reference gathers every request's [H, P, N] state out of the cache and scatters it back around a
dozen elementwise ops, each a launch and, on the host, a dispatch; generate()'s decode step runs it in every layer.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..triton_utils import cdiv, check_flags, check_index, check_tokens, next_power_of_2, softplus


class SSDUpdateArgs(NamedTuple):
    """What `ssd_state_step` reads and writes for R decoding requests (shapes in `ssd_state_update`)."""

    state: torch.Tensor  # [slots, H, P, N], updated in place
    s_state_slot: int
    s_state_h: int
    s_state_p: int
    s_state_n: int
    x: torch.Tensor  # [R, H, P]
    s_x_r: int
    s_x_h: int
    dt: torch.Tensor  # [R, H]
    s_dt_r: int
    dt_bias: torch.Tensor  # [H]; A stands in (never read) without HAS_DT_BIAS
    A: torch.Tensor  # [H] fp32; with A_IS_LOG, A_log [H] (A = -exp(A_log)) in any float dtype
    D: torch.Tensor  # [H]
    B: torch.Tensor  # [R, G, N]
    s_B_r: int
    s_B_g: int
    C: torch.Tensor  # [R, G, N]
    s_C_r: int
    s_C_g: int
    out: torch.Tensor  # [R, H, P]
    s_out_r: int
    s_out_h: int
    state_indices: torch.Tensor  # [R]; dt stands in without HAS_INDICES (request i owns slot i)
    has_initial: torch.Tensor  # [R] bool; dt stands in without HAS_INITIAL_FLAGS
    H: int
    P: int
    N: int
    heads_per_group: int
    padding_mask: torch.Tensor  # [R], 0 for a padding row; dt stands in without HAS_MASK
    s_mask_r: int


@triton.jit
def ssd_state_step(
    ssd, i_r, i_h, i_p, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_INDICES: tl.constexpr,
    HAS_INITIAL_FLAGS: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_MASK: tl.constexpr,
    A_IS_LOG: tl.constexpr,
):  # fmt: skip
    """Request `i_r`, head `i_h`, head channels [i_p * BLOCK_P, (i_p + 1) * BLOCK_P) (`ssd`: an SSDUpdateArgs): the
    state steps by exp(dt A) h + dt x B^T, and y = h C + D x from the fp32 state (the stored one is rounded to the
    cache's dtype). B and C are the head's group's (heads_per_group consecutive heads share one). A request whose
    has_initial flag is False starts from a zero state, whatever its slot holds. HAS_MASK: a padding row
    (padding_mask 0) steps by zero, its state stays as it was (what a step of -inf before softplus does); A_IS_LOG:
    `ssd.A` holds A_log and A = -exp(A_log) is taken here (no launch for it on the host)."""
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_p, m_n = o_p < ssd.P, o_n < ssd.N
    m_pn = m_p[:, None] & m_n[None, :]
    if HAS_INDICES:
        slot = tl.load(ssd.state_indices + i_r).to(tl.int64)
    else:
        slot = i_r.to(tl.int64)
    m_read = m_pn
    if HAS_INITIAL_FLAGS:
        m_read = m_read & (tl.load(ssd.has_initial + i_r) != 0)
    p_slot = (
        ssd.state + slot * ssd.s_state_slot + i_h * ssd.s_state_h
        + o_p[:, None] * ssd.s_state_p + o_n[None, :] * ssd.s_state_n
    )  # fmt: skip
    b_h = tl.load(p_slot, mask=m_read, other=0.0).to(tl.float32)
    b_dt = tl.load(ssd.dt + i_r * ssd.s_dt_r + i_h).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(ssd.dt_bias + i_h).to(tl.float32)
    if DT_SOFTPLUS:
        b_dt = softplus(b_dt)
    if HAS_MASK:
        b_dt = tl.where(tl.load(ssd.padding_mask + i_r * ssd.s_mask_r) != 0, b_dt, 0.0)
    b_A = tl.load(ssd.A + i_h).to(tl.float32)
    if A_IS_LOG:
        b_A = -tl.exp(b_A)
    b_D = tl.load(ssd.D + i_h).to(tl.float32)
    b_x = tl.load(ssd.x + i_r * ssd.s_x_r + i_h * ssd.s_x_h + o_p, mask=m_p, other=0.0).to(tl.float32)
    i_g = i_h // ssd.heads_per_group
    b_B = tl.load(ssd.B + i_r * ssd.s_B_r + i_g * ssd.s_B_g + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_C = tl.load(ssd.C + i_r * ssd.s_C_r + i_g * ssd.s_C_g + o_n, mask=m_n, other=0.0).to(tl.float32)

    b_h = tl.exp(b_dt * b_A) * b_h + (b_x * b_dt)[:, None] * b_B[None, :]
    tl.store(p_slot, b_h.to(ssd.state.dtype.element_ty), mask=m_pn)
    b_y = tl.sum(b_h * b_C[None, :], axis=1) + b_D * b_x
    tl.store(ssd.out + i_r * ssd.s_out_r + i_h * ssd.s_out_h + o_p, b_y.to(ssd.out.dtype.element_ty), mask=m_p)


@triton.jit
def _ssd_state_update_kernel(
    ssd, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_INDICES: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_MASK: tl.constexpr, A_IS_LOG: tl.constexpr,
):  # fmt: skip
    """Kernel of `ssd_state_update` and of the Mamba-2 branch's decode step. Grid (R, H, cdiv(P, BLOCK_P))."""
    ssd_state_step(
        ssd,
        tl.program_id(0),
        tl.program_id(1),
        tl.program_id(2),
        BLOCK_P,
        BLOCK_N,
        HAS_INDICES,
        HAS_INITIAL_FLAGS,
        HAS_DT_BIAS,
        DT_SOFTPLUS,
        HAS_MASK,
        A_IS_LOG,
    )


def pick_ssd_block_p(head_dim: int, state_size: int) -> int:
    """Head channels per SSM program: a [BLOCK_P, N] fp32 state tile of about 2048 values (16 per thread at 4 warps,
    as Mamba-1's `pick_state_update_block_e`; 16 channels at N 128), which keeps the fused decode's register count,
    the larger of its two halves', at its attention's."""
    return min(next_power_of_2(head_dim), max(1, 2048 // next_power_of_2(state_size)))


def ssd_state_update(
    state_cache: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`ssd_state_update_ref`'s contract and result: state_cache [slots, H, P, N] (fp32, bf16 or fp16, any strides)
    updated in place; x [R, H, P] and B, C [R, G, N] (rows and heads/groups strided, the last dimension contiguous:
    views of the conv's output), dt [R, H]; A, D [H] (A fp32), dt_bias [H] or None; state_indices [R] int32/int64
    (None: request i owns slot i); has_initial_state [R] bool or None. Returns y [R, H, P] in x's dtype (into `out`
    when given). One launch, no host sync: CUDA-graph safe."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    update = torch.ops.hybrid_ssm.ssd_state_update if torch.compiler.is_compiling() else _ssd_state_update
    update(state_cache, x, dt, A, B, C, D, state_indices, has_initial_state, dt_bias, dt_softplus, out)
    return out


def check_heads_and_state_cache(A, D, dt_bias, state_cache, num_heads: int, head_dim: int, state_size: int) -> None:
    """What every op over the state slots takes of the heads and the cache: A (fp32), D and dt_bias (or None)
    contiguous [H], and state_cache [slots, H, P, N] in fp32, bf16 or fp16."""
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t is not None and not (t.shape == (num_heads,) and t.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous ({num_heads},), got {tuple(t.shape)}")
    if A.dtype != torch.float32:
        raise ValueError(f"A: expected fp32, got {A.dtype}")
    if state_cache.dim() != 4 or state_cache.shape[1:] != (num_heads, head_dim, state_size):
        raise ValueError(
            f"state_cache: expected [slots, {num_heads}, {head_dim}, {state_size}], got {tuple(state_cache.shape)}"
        )
    if state_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"state_cache: expected fp32, bf16 or fp16, got {state_cache.dtype}")


def ssd_update_args(
    state_cache, x, dt, A, B, C, D, state_indices, has_initial_state, dt_bias, out
) -> SSDUpdateArgs:  # fmt: skip
    """Checks the arguments of `ssd_state_update` and groups them, with their strides and sizes, as the kernels take
    them (`_ssd_state_update_kernel`'s launcher and vLLM's fused decode)."""
    if x.dim() != 3:
        raise ValueError(f"x: expected [requests, heads, head_dim], got {tuple(x.shape)}")
    num_requests, num_heads, head_dim = x.shape
    if B.dim() != 3 or B.shape[0] != num_requests or B.shape[1] == 0 or num_heads % B.shape[1] != 0:
        raise ValueError(f"B: expected [{num_requests}, groups dividing {num_heads}, N], got {tuple(B.shape)}")
    num_groups, state_size = B.shape[1:]
    for name, t in (("B", B), ("C", C)):
        check_tokens(name, t, (num_requests, num_groups, state_size))
    check_tokens("x", x, (num_requests, num_heads, head_dim))
    check_tokens("out", out, (num_requests, num_heads, head_dim))
    check_tokens("dt", dt, (num_requests, num_heads))
    check_heads_and_state_cache(A, D, dt_bias, state_cache, num_heads, head_dim, state_size)
    if state_indices is not None:
        check_index("state_indices", state_indices, (num_requests,), like=x)
    elif state_cache.shape[0] < num_requests:
        raise ValueError(
            f"state_cache: {state_cache.shape[0]} slots for {num_requests} requests without state_indices"
        )
    if has_initial_state is not None:
        check_flags("has_initial_state", has_initial_state, (num_requests,))
    return SSDUpdateArgs(
        state_cache, *state_cache.stride(), x, *x.stride()[:2], dt, dt.stride(0),
        dt_bias if dt_bias is not None else A, A, D, B, *B.stride()[:2], C, *C.stride()[:2], out, *out.stride()[:2],
        state_indices if state_indices is not None else dt, has_initial_state if has_initial_state is not None else dt,
        num_heads, head_dim, state_size, num_heads // num_groups, dt, 0,
    )  # fmt: skip


def _ssd_state_update(
    state_cache: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    out: torch.Tensor,
) -> None:
    ssd = ssd_update_args(state_cache, x, dt, A, B, C, D, state_indices, has_initial_state, dt_bias, out)
    if x.shape[0] == 0:  # an empty grid is not a valid launch
        return
    launch_ssd_state_update(
        ssd, x.shape[0], has_indices=state_indices is not None, has_initial_flags=has_initial_state is not None,
        has_dt_bias=dt_bias is not None, dt_softplus=dt_softplus,
    )  # fmt: skip


def launch_ssd_state_update(
    ssd: SSDUpdateArgs, num_requests: int, *, has_indices: bool, has_initial_flags: bool, has_dt_bias: bool,
    dt_softplus: bool, has_mask: bool = False, a_is_log: bool = False,
) -> None:  # fmt: skip
    """`_ssd_state_update_kernel` over checked arguments (`ssd_update_args`'s or a caller's own), num_requests >= 1.
    has_mask: `ssd.padding_mask` holds the rows' padding mask; a_is_log: `ssd.A` holds A_log (the branch's decode
    step, modeling/ops/mamba2_inner)."""
    block_p = pick_ssd_block_p(ssd.P, ssd.N)
    _ssd_state_update_kernel[(num_requests, ssd.H, cdiv(ssd.P, block_p))](
        ssd, BLOCK_P=block_p, BLOCK_N=next_power_of_2(ssd.N), HAS_INDICES=has_indices,
        HAS_INITIAL_FLAGS=has_initial_flags, HAS_DT_BIAS=has_dt_bias, DT_SOFTPLUS=dt_softplus, HAS_MASK=has_mask,
        A_IS_LOG=a_is_log,
    )  # fmt: skip


# Eager calls launch directly; a compiled graph calls the op, which dispatches to the same launch (its fake writes
# nothing: the op only mutates its arguments).
torch.library.custom_op(
    "hybrid_ssm::ssd_state_update", _ssd_state_update, mutates_args=("state_cache", "out")
).register_fake(lambda *args: None)
