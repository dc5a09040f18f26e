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
    seq_idx: torch.Tensor | None = None,
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
        seq_idx: [B, T] integer index of the sequence each token belongs to, for rows that pack several sequences
            (padding-free training; mamba_ssm's convention). Where it changes between two tokens the state restarts
            from zero; the initial state belongs to the row's first sequence. `None`: one sequence per row.

    Returns:
        y: [B, T, E] in `u.dtype`, and the final state [B, E, N] in fp32 (that of the row's last sequence).
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
    if seq_idx is not None:
        # A sequence's first token starts from zero: nothing of the previous sequence's state is carried into it.
        continues = torch.ones_like(seq_idx, dtype=torch.bool)
        continues[:, 1:] = seq_idx[:, 1:] == seq_idx[:, :-1]
        decay = decay * continues[:, :, None, None]
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


def selective_scan_varlen_ref(
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    out: torch.Tensor,
    *,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Serving prefill over packed sequences, continuing each from its state-cache slot; reference of
    `selective_scan_varlen_fwd` (selective_scan_triton.py), same signature.

    Args:
        u, z: [T_total, E] packed tokens of all sequences.
        dt: [T_total, E] RAW dt_proj output without its bias: the step is `softplus(dt + dt_bias)` in fp32.
        A: [E, N]; B, C: [T_total, N]; D, dt_bias: [E].
        cu_seqlens: [S + 1] int32, sequence i is tokens `cu_seqlens[i]:cu_seqlens[i + 1]`.
        ssm_state: [num_slots, E, N] state cache, updated in place (each sequence's final state, in its dtype).
        state_indices: [S] int32 slot of each sequence; -1 marks a padding sequence, which is skipped (its tokens
            get zeros in `out`, no slot is read or written).
        has_initial_state: [S] bool; False starts from zero whatever the slot holds; None: all False.
        out: [T_total, E] written with `y * silu(z)`.
        max_seq_len: the kernel's launch hint (the longest sequence); the reference loops over `cu_seqlens`.

    Returns:
        `out`.
    """
    step = F.softplus(dt.float() + dt_bias.float())  # [T_total, E]
    starts = cu_seqlens.tolist()
    slots = state_indices.tolist()
    continues_from_slot = has_initial_state.tolist() if has_initial_state is not None else [False] * len(slots)
    for i, (slot, continues) in enumerate(zip(slots, continues_from_slot)):
        tokens = slice(starts[i], starts[i + 1])
        if slot < 0:
            out[tokens] = 0
            continue
        initial = ssm_state[slot][None].float() if continues else None
        y, state = selective_scan_ref(
            u[None, tokens], step[None, tokens], A, B[None, tokens], C[None, tokens], D, z[None, tokens], initial
        )
        out[tokens] = y[0].to(out.dtype)
        ssm_state[slot] = state[0].to(ssm_state.dtype)
    return out
