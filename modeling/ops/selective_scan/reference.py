"""Mamba-1 selective scan: the plain-PyTorch references every kernel of this op is tested against (the Triton kernels
are behind interface.py, one reference per public kernel function, same signatures).

Glossary of dimension letters (one meaning per letter across modeling/ops):
    B  batch (of a decode step: the decoding requests, one new token each)
    T  time (tokens of one sequence, or of a packed batch)
    E  SSM channels     N  state size per channel
    S  sequences of a packed batch, delimited by `cu_seqlens` [S+1] (sequence s owns tokens cu[s]..cu[s+1]-1)
    slots  rows of the serving ssm-state cache, one per running request

The recurrence (docs/DESIGN.md, "SSM history branch"), per channel e and time t, in fp32:
    state_t = exp(dt_t * A) * state_{t-1} + (dt_t * u_t) * B_t
    y_t     = (state_t @ C_t + D * u_t) * silu(z_t)
The step dt_t comes from the `dt` argument as in mamba_ssm (delta_bias, delta_softplus):
    step = softplus(dt + dt_bias) if dt_softplus else dt (+ dt_bias if given);
the decode step (`selective_state_update_ref`, a scan of length one per request) always takes softplus(dt + dt_bias).
"""

import torch
import torch.nn.functional as F

from ..causal_conv1d.reference import write_slots_


def dt_step(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool) -> torch.Tensor:
    """The step of the recurrence from the `dt` argument, in fp32 (the module docstring's rule)."""
    step = dt.float()
    if dt_bias is not None:
        step = step + dt_bias.float()
    return F.softplus(step) if dt_softplus else step


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
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selective scan over a batch of sequences, token-major layout (reference of `selective_scan_fn`).

    Args:
        u:  [B, T, E] conv output (after silu), any float dtype.
        dt: [B, T, E] step sizes: the step is `dt` itself, or see dt_bias / dt_softplus (the model passes
            `dt_proj(...)` with dt_softplus=True); a zero step leaves the state untouched.
        A:  [E, N] negative decay rates (`-exp(A_log)`).
        B:  [B, T, N] input projection of the state.
        C:  [B, T, N] output projection of the state.
        D:  [E] skip connection.
        z:  [B, T, E] gate.
        initial_state: [B, E, N] fp32 state before the first token; `None` means zeros.
        seq_idx: [B, T] integer index of the sequence each token belongs to, for rows that pack several sequences
            (padding-free training; mamba_ssm's convention). Where it changes between two tokens the state restarts
            from zero; the initial state belongs to the row's first sequence. `None`: one sequence per row.
        dt_bias: [E] added to dt (mamba_ssm's delta_bias), or None.
        dt_softplus: step = softplus(dt (+ dt_bias)) (mamba_ssm's delta_softplus).

    Returns:
        y: [B, T, E] in `u.dtype`, and the final state [B, E, N] in fp32 (that of the row's last sequence).
    """
    batch_size, seq_len, num_channels = u.shape
    u_f, dt_f, B_f, C_f = u.float(), dt_step(dt, dt_bias, dt_softplus), B.float(), C.float()
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
    # The steps by unbind, not by indexing: the backward of `decay[:, t]` writes its gradient into zeros of the whole
    # [B, T, E, N] tensor at every step (quadratic in T: minutes for one CPU training step at T 1024), unbind's stacks
    # the steps' gradients once.
    states = []
    for decay_t, drive_t in zip(decay.unbind(1), drive.unbind(1)):
        state = decay_t * state + drive_t
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
    ssm_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    out: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Serving prefill over packed sequences, continuing each from its state-cache slot; reference of
    `selective_scan_varlen_fwd`, same signature. The cache comes after the op's own tensors and before the batch
    description, as in `causal_conv1d_varlen_ref`.

    Args:
        u, z: [T, E] packed tokens of all sequences.
        dt: [T, E] step sizes, as in `selective_scan_ref` (serving passes the raw dt_proj output without its bias,
            with dt_bias and dt_softplus=True: the step is `softplus(dt + dt_bias)` in fp32).
        A: [E, N]; B, C: [T, N]; D: [E].
        ssm_state: [slots, E, N] state cache, updated in place (each sequence's final state, in its dtype).
        cu_seqlens: [S + 1] int32 or int64, sequence s is tokens `cu_seqlens[s]:cu_seqlens[s + 1]`.
        state_indices: [S] int32 or int64 slot of each sequence; -1 marks a padding sequence, which is skipped (its
            tokens get zeros in `out`, no slot is read or written).
        has_initial_state: [S] bool; False starts from zero whatever the slot holds; None: all False.
        out: [T, E] written with `y * silu(z)`; None: a new tensor in u's dtype.
        dt_bias: [E] or None; dt_softplus: as in `selective_scan_ref`.
        max_seq_len: the kernel's launch hint (the longest sequence); the reference loops over `cu_seqlens`.

    Returns:
        `out`.
    """
    out = torch.empty(u.shape, dtype=u.dtype, device=u.device) if out is None else out
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
            *(x[None, tokens] for x in (u, dt)),
            A,
            *(x[None, tokens] for x in (B, C)),
            D,
            z[None, tokens],
            initial,
            dt_bias=dt_bias,
            dt_softplus=dt_softplus,
        )
        out[tokens] = y[0].to(out.dtype)
        ssm_state[slot] = state[0].to(ssm_state.dtype)
    return out


def selective_state_update_ref(
    ssm_state: torch.Tensor,
    u: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    out: torch.Tensor,
    *,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One selective-scan step per decoding request, reading and writing its state slot. Reference of
    `selective_state_update` (interface.py, same signature).

    Args:
        ssm_state: [slots, E, N] state cache (fp32, bf16 or fp16), updated in place for the slots in `state_indices`.
        u:  [B, E] conv output (after silu).
        dt: [B, E] raw `dt_proj` output WITHOUT its bias: the step is `softplus(dt + dt_bias)`, in fp32.
        A:  [E, N] fp32 negative decay rates.   B, C: [B, N] projections of the state.
        D:  [E] skip connection.   z: [B, E] gate.   dt_bias: [E].
        state_indices: [B] int32/int64 slot of each request (distinct slots); -1 marks a padding row.
        out: [B, E] written with `y * silu(z)` (zeros for padding rows) and returned.
        has_initial_state: [B] bool; False: the request's first token, which starts from a zero state whatever its
            slot holds (the slot is written as usual). None: every request continues from its slot.
    """
    valid = state_indices >= 0  # [B]
    # Every row runs (tensor code, no branch on the indices: a decode step exports and compiles as one graph); a
    # padding row reads slot 0, and neither its output nor its state is kept.
    initial_state = ssm_state[state_indices.clamp(min=0).long()].float()  # [B, E, N]
    if has_initial_state is not None:
        initial_state = torch.where(has_initial_state[:, None, None], initial_state, 0.0)
    step = F.softplus(dt.float() + dt_bias.float())  # [B, E]
    # A decode is a scan of length one: [B, E] -> [B, 1, E] (and [B, N] -> [B, 1, N]).
    y, state = selective_scan_ref(
        u[:, None], step[:, None], A, B[:, None], C[:, None], D, z[:, None], initial_state=initial_state
    )
    out.copy_(torch.where(valid[:, None], y[:, 0], 0.0))
    write_slots_(ssm_state, state, state_indices)
    return out
