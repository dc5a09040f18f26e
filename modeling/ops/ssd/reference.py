"""Mamba-2's state-space duality (SSD) scan and its gated RMSNorm: the plain-PyTorch references every kernel of this
op is to be tested against, in two forms that compute the same function (tested against each other and a float64
token loop).

Dimension letters (beside modeling/ops/causal_conv1d's): H heads (docs/DESIGN.md's Hs), P channels per head, G groups
of heads sharing B and C (head h reads group h // (H / G)), N state size, L chunk length.

The recurrence (docs/DESIGN.md, "Mamba-2"), per head h of a sequence, with one decay per head and step:
    state_t = exp(dt_t[h] * A[h]) * state_{t-1} + dt_t[h] * x_t[h][:, None] * B_t[g(h)][None, :]     [P, N]
    y_t[h]  = state_t @ C_t[g(h)] + D[h] * x_t[h]                                                     [P]
dt is the step after its bias and softplus (>= 0; 0 leaves the state as it was: padding); the serving references
(`ssd_state_update_ref`, `ssd_varlen_scan_ref`) also take the raw dt with `dt_bias` and `dt_softplus`, as the kernels
vLLM serves with do (the selective scan's rule, `dt_step`). The state is fp32; the output is in x's dtype. A packed
row (`seq_idx`) starts each of its sequences from a zero state; the first one continues `initial_state`.
"""

import itertools

import torch
import torch.nn.functional as F

from ..selective_scan.reference import dt_step


def split_heads_and_groups(
    xBC: torch.Tensor, intermediate_size: int, num_heads: int, n_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., E + 2GN] (Mamba-2's conv output, or its gradient) as views x [..., Hs, P], B and C [..., G, N]."""
    group_channels = (xBC.shape[-1] - intermediate_size) // 2
    x, B, C = xBC.split([intermediate_size, group_channels, group_channels], dim=-1)
    return x.unflatten(-1, (num_heads, -1)), B.unflatten(-1, (n_groups, -1)), C.unflatten(-1, (n_groups, -1))


def _heads_per_group(num_heads: int, B: torch.Tensor) -> int:
    groups = B.shape[2]
    if num_heads % groups:
        raise ValueError(f"the groups of B and C ({groups}) must divide the heads of x ({num_heads})")
    return num_heads // groups


def _restart_at_sequence_starts(per_token: torch.Tensor, seq_idx: torch.Tensor | None, fill: float) -> torch.Tensor:
    """per_token [b, T, H] with `fill` where a token starts a packed sequence after the row's first (its state
    restarts there); unchanged without `seq_idx`."""
    if seq_idx is None:
        return per_token
    starts = torch.zeros_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return per_token.masked_fill(starts.to(per_token.device)[..., None], fill)


def ssd_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token. x [b, T, H, P], dt [b, T, H], A [H], B and C [b, T, G, N], D [H],
    initial_state [b, H, P, N] or None (zeros), seq_idx [b, T] or None. Returns (y [b, T, H, P] in x's dtype, final
    state [b, H, P, N] fp32)."""
    batch, length, num_heads, head_dim = x.shape
    repeat = _heads_per_group(num_heads, B)
    Bh = B.float().repeat_interleave(repeat, dim=2)  # [b, T, H, N]
    Ch = C.float().repeat_interleave(repeat, dim=2)
    decay = torch.exp(dt.float() * A.float())  # [b, T, H]
    decay = _restart_at_sequence_starts(decay, seq_idx, 0.0)
    xdt = x.float() * dt.float()[..., None]  # [b, T, H, P]
    state = x.new_zeros(batch, num_heads, head_dim, B.shape[-1], dtype=torch.float32)
    if initial_state is not None:
        state = state + initial_state.float()
    ys = []
    # by unbind, not by indexing, as selective_scan_ref (whose comment says why)
    for decay_t, xdt_t, B_t, C_t in zip(decay.unbind(1), xdt.unbind(1), Bh.unbind(1), Ch.unbind(1)):
        state = decay_t[:, :, None, None] * state + xdt_t[..., None] * B_t[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C_t))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape, dtype=torch.float32)
    y = y + D.float()[:, None] * x.float()
    return y.to(x.dtype), state


def _segment_sums(log_decay: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: entry (i, j) = sum of log_decay over (j, i] for j <= i, -inf above the diagonal.
    Built by summing the kept terms only, never by differences of cumulative sums: a -inf (a sequence start) makes
    the entries that cross it -inf (exp 0) and leaves the others exact."""
    length = log_decay.shape[-1]
    terms = log_decay[..., :, None].expand(*log_decay.shape, length)  # (k, j): the term of step k
    strictly_below = torch.ones(length, length, dtype=torch.bool, device=log_decay.device).tril(-1)
    sums = terms.masked_fill(~strictly_below, 0.0).cumsum(dim=-2)  # (i, j): sum over j < k <= i
    on_or_below = torch.ones(length, length, dtype=torch.bool, device=log_decay.device).tril()
    return sums.masked_fill(~on_or_below, float("-inf"))


def ssd_chunk_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same function in SSD's chunked form (the algorithm of the chunked kernels): within each chunk of L tokens
    a masked matrix product (C B^T weighted by the decays between tokens), across chunks a recurrence over the chunks'
    states, itself written as one masked product over the chunks. No Python loop over the input and no branch on
    values: a caller compiled whole traces it (the branch off its kernels: on CPU, with `use_ssm_kernels=False`, with
    heads wider than the kernels take). Same arguments and results as `ssd_scan_ref`, plus the chunk length."""
    batch, length, num_heads, head_dim = x.shape
    repeat = _heads_per_group(num_heads, B)
    groups = B.shape[2]
    pad = (-length) % chunk_size
    chunks = (length + pad) // chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [b, T, ...] -> [b, chunks, L, ...], zero padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(batch, chunks, chunk_size, *t.shape[2:])

    # Heads split as (group, head in group) = (g, r): B and C are read once per group, never repeated per head.
    log_decay = dt.float() * A.float()  # [b, T, H]
    log_decay = _restart_at_sequence_starts(log_decay, seq_idx, float("-inf"))
    log_decay = chunked(log_decay).unflatten(3, (groups, repeat)).permute(0, 1, 3, 4, 2)  # [b, c, G, R, L]
    xdt = chunked(x.float() * dt.float()[..., None]).unflatten(3, (groups, repeat))  # [b, c, L, G, R, P]
    Bc, Cc = chunked(B.float()), chunked(C.float())  # [b, c, L, G, N]; padding decays by 1 and adds 0

    # 1. Within each chunk: y_i += sum_{j <= i} (C_i . B_j) exp(sum_(j, i] log_decay) xdt_j.
    decay_ij = torch.exp(_segment_sums(log_decay))  # [b, c, G, R, L, L]
    scores = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc)[:, :, :, None] * decay_ij
    y = torch.einsum("bcgrls,bcsgrp->bclgrp", scores, xdt)

    # 2. Each chunk's own contribution to the state at its end: sum_j exp(sum_(j, L-1] log_decay) B_j xdt_j.
    #    Products of two operands only, here and below: with opt_einsum installed (the CUDA images ship it), a
    #    three-operand einsum plans its order from concrete sizes, and under torch.compile that pins the batch and the
    #    number of chunks of every compiled variant.
    decay_to_end = decay_ij[..., -1, :].permute(0, 1, 4, 2, 3)[..., None]  # [b, c, L, G, R, 1]
    chunk_states = torch.einsum("bclgn,bclgrp->bcgrpn", Bc, xdt * decay_to_end)

    # 3. Across chunks: the state entering chunk c is sum_{k < c} (decay over chunks k+1..c-1) chunk_states[k], plus
    #    the initial state decayed over chunks 0..c-1: a segment sum over the chunks' total log-decays, with the
    #    initial state as chunk "-1". Row `chunks` is the final state.
    initial = x.new_zeros(batch, 1, groups, repeat, head_dim, B.shape[-1], dtype=torch.float32)
    if initial_state is not None:
        initial = initial + initial_state.float().reshape(initial.shape)
    states = torch.cat([initial, chunk_states], dim=1)  # [b, c+1, G, R, P, N]
    chunk_log_decay = F.pad(log_decay.sum(-1).permute(0, 2, 3, 1), (1, 0))  # [b, G, R, c+1]: 0, then chunks
    carried = torch.exp(_segment_sums(chunk_log_decay))  # [b, G, R, c+1, c+1]
    entering = torch.einsum("bgrij,bjgrpn->bigrpn", carried, states)  # [b, c+1, G, R, P, N]
    # Over [0, i]: the decay over (0, i] times the first step's. From decay_ij rather than a cumsum along the chunk,
    # which Inductor's split-scan codegen (torch 2.11) fails to compile at L = 256 with one group.
    decay_from_start = decay_ij[..., 0] * torch.exp(log_decay[..., :1])  # [b, c, G, R, L]
    from_state = torch.einsum("bclgn,bcgrpn->bclgrp", Cc, entering[:, :-1])
    y = y + from_state * decay_from_start.permute(0, 1, 4, 2, 3)[..., None]

    y = y.reshape(batch, chunks * chunk_size, num_heads, head_dim)[:, :length]
    y = y + D.float()[:, None] * x.float()
    return y.to(x.dtype), entering[:, -1].reshape(batch, num_heads, head_dim, -1)


def ssd_state_update_ref(
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
    """One decode step per request, its state slot updated in place. state_cache [slots, H, P, N], x [R, H, P],
    dt [R, H] (the step, or see dt_bias [H] / dt_softplus: `dt_step`), B and C [R, G, N]; state_indices [R] (None:
    request i owns slot i); has_initial_state [R] bool (False: the request's first token, from a zero state whatever
    its slot holds; None: every request continues). Tensor code, no branch on the values. Returns y [R, H, P] in x's
    dtype (written into `out` when given)."""
    repeat = _heads_per_group(x.shape[1], B[:, None])
    Bh = B.float().repeat_interleave(repeat, dim=1)  # [R, H, N]
    Ch = C.float().repeat_interleave(repeat, dim=1)
    rows = torch.arange(x.shape[0], device=x.device) if state_indices is None else state_indices.long()
    state = state_cache[rows].float()
    if has_initial_state is not None:
        state = state * has_initial_state[:, None, None, None].to(state.dtype)
    step = dt_step(dt, dt_bias, dt_softplus)  # [R, H]
    decay = torch.exp(step * A.float())
    state = decay[..., None, None] * state + (x.float() * step[..., None])[..., None] * Bh[:, :, None]
    state_cache[rows] = state.to(state_cache.dtype)
    y = torch.einsum("rhpn,rhn->rhp", state, Ch) + D.float()[:, None] * x.float()
    if out is None:
        return y.to(x.dtype)
    return out.copy_(y)


def ssd_varlen_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int,
    out: torch.Tensor | None = None,
    *,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
) -> torch.Tensor:
    """Packed prefills, each continuing from (or starting) its state slot and leaving its final state there; a loop
    over sequences of `ssd_chunk_scan_ref`. x [T, H, P], dt [T, H] (the step, or see dt_bias [H] / dt_softplus:
    `dt_step`), B and C [T, G, N], state_cache [slots, H, P, N], cu_seqlens [S+1] (sequence s owns rows
    cu[s]..cu[s+1]-1), state_indices [S], has_initial_state [S] bool. Returns out [T, H, P] in x's dtype (rows past
    cu_seqlens[-1] are left as they were)."""
    out = torch.empty_like(x) if out is None else out
    dt = dt_step(dt, dt_bias, dt_softplus)
    bounds = cu_seqlens.tolist()
    for s, (start, end) in enumerate(itertools.pairwise(bounds)):
        slot = int(state_indices[s])
        initial = state_cache[slot][None] if bool(has_initial_state[s]) else None
        rows = slice(start, end)
        y, final = ssd_chunk_scan_ref(
            x[None, rows], dt[None, rows], A, B[None, rows], C[None, rows], D, min(chunk_size, end - start), initial
        )
        out[rows] = y[0]
        state_cache[slot] = final[0].to(state_cache.dtype)
    return out


def gated_rms_norm_ref(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """Mamba-2's output norm: rmsnorm(y * silu(z)) over each group of `group_size` channels, times `weight`, in fp32,
    returned in y's dtype. y, z [..., E]; weight [E]."""
    gated = y.float() * F.silu(z.float())
    groups = gated.unflatten(-1, (-1, group_size))
    normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.flatten(-2) * weight.float()).to(y.dtype)


def gated_rms_norm_bwd_ref(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, dout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `gated_rms_norm_ref` (same arguments, and dout, the output's gradient), written out for ops
    that run the norm inside their own autograd (mamba2_inner): with g = y silu(z) and n = g / rms(g) per group,
    dg = (dn - n mean(dn n)) / rms(g) where dn = dout weight, dweight = sum of dout n over the tokens. In fp32; returns
    (dy in y's dtype, dz in z's dtype, dweight [E] in weight's dtype)."""
    y32, z32, dout32 = y.float(), z.float(), dout.float()
    gate = torch.sigmoid(z32)
    silu_z = z32 * gate
    groups = (y32 * silu_z).unflatten(-1, (-1, group_size))
    inv_rms = torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    normed = groups * inv_rms
    dweight = (dout32 * normed.flatten(-2)).reshape(-1, weight.shape[0]).sum(0)
    dnormed = (dout32 * weight.float()).unflatten(-1, (-1, group_size))
    dgated = (inv_rms * (dnormed - normed * (dnormed * normed).mean(-1, keepdim=True))).flatten(-2)
    dy = dgated * silu_z
    dz = dgated * y32 * gate * (1 + z32 * (1 - gate))  # silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))
    return dy.to(y.dtype), dz.to(z.dtype), dweight.to(weight.dtype)
