"""Decode step of Mamba-2's SSD recurrence: one step per request, from and into the request's slot of a state cache,
in one launch (reference `ssd_state_update_ref` in reference.py, with the exact semantics). Inference only: no
autograd.

    _ssd_state_update_kernel   one (request, head, block of head channels): the state tile [BLOCK_P, N] in registers,
                               its decay, input and readout; grid (R, H, cdiv(P, BLOCK_P))
    ssd_state_update           the checks and the launch; under torch.compile one opaque custom op
                               (`torch.ops.hybrid_ssm.ssd_state_update`), so a compiled decode step keeps it in its
                               graph

Why a kernel: the reference gathers every request's [H, P, N] state out of the cache and scatters it back around a
dozen elementwise ops, each a launch and, on the host, a dispatch; generate()'s decode step runs it in every layer.
"""

import torch
import triton
import triton.language as tl

from ..triton_utils import check_flags, check_index, check_tokens, softplus


@triton.jit
def _ssd_state_update_kernel(
    p_state, p_x, p_dt, p_dt_bias, p_A, p_B, p_C, p_D, p_out, p_state_indices, p_has_initial,
    s_state_slot, s_state_h, s_state_p, s_state_n, s_x_r, s_x_h, s_dt_r, s_B_r, s_B_g, s_C_r, s_C_g, s_out_r, s_out_h,
    P, N, heads_per_group,
    HAS_INDICES: tl.constexpr, HAS_INITIAL_FLAGS: tl.constexpr, HAS_DT_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Request `i_r`, head `i_h`, head channels [i_p * BLOCK_P, (i_p + 1) * BLOCK_P): the state steps by
    exp(dt A) h + dt x B^T, and y = h C + D x from the fp32 state (the stored one is rounded to the cache's dtype).
    B and C are the head's group's (heads_per_group consecutive heads share one). A request whose has_initial flag is
    False starts from a zero state, whatever its slot holds."""
    i_r, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_p = i_p * BLOCK_P + tl.arange(0, BLOCK_P)
    o_n = tl.arange(0, BLOCK_N)
    m_p, m_n = o_p < P, o_n < N
    m_pn = m_p[:, None] & m_n[None, :]

    if HAS_INDICES:
        slot = tl.load(p_state_indices + i_r).to(tl.int64)
    else:
        slot = i_r.to(tl.int64)
    m_read = m_pn
    if HAS_INITIAL_FLAGS:
        m_read = m_read & (tl.load(p_has_initial + i_r) != 0)
    p_slot = p_state + slot * s_state_slot + i_h * s_state_h + o_p[:, None] * s_state_p + o_n[None, :] * s_state_n
    b_h = tl.load(p_slot, mask=m_read, other=0.0).to(tl.float32)

    b_dt = tl.load(p_dt + i_r * s_dt_r + i_h).to(tl.float32)
    if HAS_DT_BIAS:
        b_dt += tl.load(p_dt_bias + i_h).to(tl.float32)
    if DT_SOFTPLUS:
        b_dt = softplus(b_dt)
    b_A = tl.load(p_A + i_h).to(tl.float32)
    b_D = tl.load(p_D + i_h).to(tl.float32)
    b_x = tl.load(p_x + i_r * s_x_r + i_h * s_x_h + o_p, mask=m_p, other=0.0).to(tl.float32)
    i_g = i_h // heads_per_group
    b_B = tl.load(p_B + i_r * s_B_r + i_g * s_B_g + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_C = tl.load(p_C + i_r * s_C_r + i_g * s_C_g + o_n, mask=m_n, other=0.0).to(tl.float32)

    b_h = tl.exp(b_dt * b_A) * b_h + (b_x * b_dt)[:, None] * b_B[None, :]
    tl.store(p_slot, b_h.to(p_state.dtype.element_ty), mask=m_pn)
    b_y = tl.sum(b_h * b_C[None, :], axis=1) + b_D * b_x
    tl.store(p_out + i_r * s_out_r + i_h * s_out_h + o_p, b_y.to(p_out.dtype.element_ty), mask=m_p)


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
    if state_indices is not None:
        check_index("state_indices", state_indices, (num_requests,), like=x)
    elif state_cache.shape[0] < num_requests:
        raise ValueError(
            f"state_cache: {state_cache.shape[0]} slots for {num_requests} requests without state_indices"
        )
    if has_initial_state is not None:
        check_flags("has_initial_state", has_initial_state, (num_requests,))
    if num_requests == 0:  # an empty grid is not a valid launch
        return
    block_p = min(triton.next_power_of_2(head_dim), 64)
    _ssd_state_update_kernel[(num_requests, num_heads, triton.cdiv(head_dim, block_p))](
        state_cache, x, dt, dt_bias if dt_bias is not None else A, A, B, C, D, out,
        state_indices if state_indices is not None else dt, has_initial_state if has_initial_state is not None else dt,
        *state_cache.stride(), *x.stride()[:2], dt.stride(0), *B.stride()[:2], *C.stride()[:2], *out.stride()[:2],
        head_dim, state_size, num_heads // num_groups,
        HAS_INDICES=state_indices is not None, HAS_INITIAL_FLAGS=has_initial_state is not None,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus,
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(state_size),
    )  # fmt: skip


# Eager calls launch directly; a compiled graph calls the op, which dispatches to the same launch (its fake writes
# nothing: the op only mutates its arguments).
torch.library.custom_op(
    "hybrid_ssm::ssd_state_update", _ssd_state_update, mutates_args=("state_cache", "out")
).register_fake(lambda *args: None)
