"""Triton forward of the Mamba-1 selective scan; `selective_scan_ref` (selective_scan.py) is its reference and has the
same signature. First piece of the Triton issue: forward only, not yet wired into the model (no backward yet).

Each program owns one sequence and a block of BLOCK_E channels, keeps their [BLOCK_E, N] state in fp32 registers
and walks the sequence once: u, dt, z, B, C are read once and y written once, so the kernel moves the minimum bytes.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _selective_scan_fwd_kernel(
    p_u,
    p_dt,
    p_A,
    p_B,
    p_C,
    p_D,
    p_z,
    p_state_in,
    p_y,
    p_state_out,
    T,
    E,
    N,
    s_u_b,
    s_u_t,
    s_bc_b,
    s_bc_t,
    s_state_b,
    HAS_INITIAL_STATE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_b, i_e = tl.program_id(0), tl.program_id(1)
    o_e = i_e * BLOCK_E + tl.arange(0, BLOCK_E)
    o_n = tl.arange(0, BLOCK_N)
    m_e, m_n = o_e < E, o_n < N
    m_en = m_e[:, None] & m_n[None, :]

    b_A = tl.load(p_A + o_e[:, None] * N + o_n[None, :], mask=m_en, other=0.0).to(tl.float32)
    b_D = tl.load(p_D + o_e, mask=m_e, other=0.0).to(tl.float32)
    o_state = i_b * s_state_b + o_e[:, None] * N + o_n[None, :]
    if HAS_INITIAL_STATE:
        b_state = tl.load(p_state_in + o_state, mask=m_en, other=0.0).to(tl.float32)
    else:
        b_state = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)

    for t in range(T):
        o_tok = i_b * s_u_b + t * s_u_t + o_e
        b_u = tl.load(p_u + o_tok, mask=m_e, other=0.0).to(tl.float32)
        b_dt = tl.load(p_dt + o_tok, mask=m_e, other=0.0).to(tl.float32)
        b_z = tl.load(p_z + o_tok, mask=m_e, other=0.0).to(tl.float32)
        o_bc = i_b * s_bc_b + t * s_bc_t + o_n
        b_Bt = tl.load(p_B + o_bc, mask=m_n, other=0.0).to(tl.float32)
        b_Ct = tl.load(p_C + o_bc, mask=m_n, other=0.0).to(tl.float32)

        b_state = tl.exp(b_dt[:, None] * b_A) * b_state + (b_dt * b_u)[:, None] * b_Bt[None, :]
        b_y = tl.sum(b_state * b_Ct[None, :], axis=1) + b_D * b_u
        b_y = b_y * b_z * tl.sigmoid(b_z)
        tl.store(p_y + o_tok, b_y.to(p_y.dtype.element_ty), mask=m_e)

    tl.store(p_state_out + o_state, b_state, mask=m_en)


def selective_scan_fwd_triton(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `selective_scan_ref`: u, dt, z [B, T, E]; A [E, N]; B, C [B, T, N]; D [E]; initial_state
    [B, E, N] fp32 or None. Returns y [B, T, E] in u's dtype and the final state [B, E, N] in fp32, written into
    `out` = (y, final_state) when given."""
    batch_size, seq_len, num_channels = u.shape
    state_size = A.shape[-1]
    assert dt.shape == u.shape == z.shape, (u.shape, dt.shape, z.shape)
    assert B.shape == C.shape == (batch_size, seq_len, state_size), (B.shape, C.shape)
    assert A.shape == (num_channels, state_size) and D.shape == (num_channels,)
    u, dt, z, B, C, A, D = (x.contiguous() for x in (u, dt, z, B, C, A, D))
    if out is None:
        y = torch.empty_like(u)
        final_state = u.new_empty(batch_size, num_channels, state_size, dtype=torch.float32)
    else:
        y, final_state = out
        assert y.shape == u.shape and y.is_contiguous() and final_state.dtype == torch.float32
    if initial_state is not None:
        initial_state = initial_state.float().contiguous()
        assert initial_state.shape == final_state.shape
    # A [E, N] state block of 16 x N fp32 values per program; small channel blocks keep registers and occupancy sane.
    block_e = 16
    grid = (batch_size, triton.cdiv(num_channels, block_e))
    _selective_scan_fwd_kernel[grid](
        u,
        dt,
        A,
        B,
        C,
        D,
        z,
        initial_state if initial_state is not None else final_state,
        y,
        final_state,
        seq_len,
        num_channels,
        state_size,
        u.stride(0),
        u.stride(1),
        B.stride(0),
        B.stride(1),
        final_state.stride(0),
        HAS_INITIAL_STATE=initial_state is not None,
        BLOCK_E=block_e,
        BLOCK_N=triton.next_power_of_2(state_size),
    )
    return y, final_state
