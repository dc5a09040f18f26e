"""Mamba-1 selective scan: the plain-PyTorch reference every kernel of this op is tested against.

Glossary of dimension letters:
    B  batch            T  time (tokens)
    E  SSM channels     N  state size per channel

The recurrence (DESIGN.md, "SSM history branch"), per channel e and time t, in fp32:
    state_t = exp(dt_t * A) * state_{t-1} + (dt_t * u_t) * B_t
    y_t     = (state_t @ C_t + D * u_t) * silu(z_t)
"""

import torch
import torch.nn.functional as F


def selective_scan_ref(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan over a batch of sequences, token-major layout.

    Args:
        u:  [B, T, E] conv output (after silu), any float dtype.
        dt: [B, T, E] step sizes, already `softplus(dt_proj(...))`; a zero step leaves the state untouched.
        A:  [E, N] negative decay rates (`-exp(A_log)`).
        B:  [B, T, N] input projection of the state.
        C:  [B, T, N] output projection of the state.
        D:  [E] skip connection.
        z:  [B, T, E] gate.
        initial_state: [B, E, N] fp32 state before the first token; `None` means zeros.

    Returns:
        y: [B, T, E] in `u.dtype`, and the final state [B, E, N] in fp32.
    """
    batch_size, seq_len, num_channels = u.shape
    u_f, dt_f, B_f, C_f = u.float(), dt.float(), B.float(), C.float()
    A_f = A.float()
    if initial_state is None:
        state = u.new_zeros(batch_size, num_channels, A.shape[-1], dtype=torch.float32)
    else:
        state = initial_state.float()

    # Everything but the recurrence itself is computed for all steps at once.
    decay = torch.exp(dt_f[..., None] * A_f)  # [B, T, E, N]
    drive = (dt_f * u_f)[..., None] * B_f[:, :, None, :]  # [B, T, E, N]
    states = []
    for t in range(seq_len):
        state = decay[:, t] * state + drive[:, t]
        states.append(state)
    if seq_len > 0:
        y = torch.einsum("bten,btn->bte", torch.stack(states, dim=1), C_f)  # [B, T, E]
    else:
        y = u_f.new_zeros(batch_size, 0, num_channels)
    y = (y + D.float() * u_f) * F.silu(z.float())
    return y.to(u.dtype), state
