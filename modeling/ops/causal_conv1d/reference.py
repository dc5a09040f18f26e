"""Causal depthwise conv1d of the SSM branch: the plain-PyTorch references every kernel of this op is tested against
(the Triton kernels are behind interface.py, one reference per public kernel function, same signatures).

Glossary of dimension letters (one meaning per letter across modeling/ops):
    B  batch                     T  time (tokens of one sequence, or of a packed batch)
    E  SSM channels              K  conv kernel width (taps); a sequence's history is its last K-1 inputs
    S  sequences of a packed batch, delimited by `cu_seqlens` [S+1] (sequence s owns rows cu[s]..cu[s+1]-1)
    R  decode requests (one token each)
    slots  rows of the serving conv-state cache, one per running request

The op (docs/DESIGN.md, "SSM history branch"), per channel e and token t of a sequence:
    y_t = act(bias + sum_{k<K} weight[e, k] * x_{t-K+1+k})        act = silu or identity
where x_{t'} for t' < 0 is taken from the history (the previous K-1 inputs; zeros at the start of a sequence).
The weight is stored [E, K] (vLLM's layout; the Transformers `nn.Conv1d` weight is [E, 1, K]: callers squeeze it).
"""

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu")


def check_activation(activation: str | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _depthwise_causal(
    padded: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation
) -> torch.Tensor:
    """padded [B, E, K-1+T] (history then inputs) -> [B, E, T], in padded's dtype."""
    y = F.conv1d(
        padded,
        weight[:, None, :].to(padded.dtype),
        None if bias is None else bias.to(padded.dtype),
        groups=padded.shape[1],
    )
    return F.silu(y) if activation == "silu" else y


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_history: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv over a batch of sequences, token-major layout (reference of `causal_conv1d_fn`).

    Args:
        x: [B, T, E] inputs, any strides.
        weight: [E, K]. bias: [E] or None.
        activation: None or "silu".
        initial_history: [B, E, K-1] the K-1 inputs before x[:, 0] (a chunk continuing from a cache); None = zeros.
        seq_idx: [B, T] integer index of the sequence each token belongs to, for rows that pack several sequences
            (mamba_ssm's convention): a tap reads only inputs of its own token's sequence, zeros elsewhere; the
            history belongs to the row's first sequence. None: one sequence per row.

    Returns:
        y: [B, T, E] in x.dtype. Math in fp32 (fp64 for fp64 inputs), differentiable in x, weight, bias and history.
    """
    check_activation(activation)
    compute_dtype = torch.promote_types(x.dtype, torch.float32)
    batch_size, _, num_channels = x.shape
    width = weight.shape[-1]
    x_t = x.to(compute_dtype).transpose(1, 2)  # [B, E, T]
    if initial_history is None:
        history = x_t.new_zeros(batch_size, num_channels, width - 1)
    else:
        history = initial_history.to(compute_dtype)
    padded = torch.cat([history, x_t], dim=-1)  # [B, E, K-1+T]: left-padded with the history
    if seq_idx is None:
        y = _depthwise_causal(padded, weight, bias, activation)  # [B, E, T]
        return y.transpose(1, 2).to(x.dtype)
    # Tap by tap, each input masked unless it belongs to the output token's sequence.
    seq_len = x.shape[1]
    padded_seq = torch.cat([seq_idx[:, :1].expand(-1, width - 1), seq_idx], dim=-1)  # [B, K-1+T]
    y = torch.zeros_like(x_t) if bias is None else bias.to(compute_dtype)[:, None].expand_as(x_t).clone()
    for k in range(width):
        same_sequence = (padded_seq[:, k : k + seq_len] == seq_idx)[:, None, :]  # [B, 1, T]
        y = y + weight[:, k, None].to(compute_dtype) * padded[..., k : k + seq_len] * same_sequence
    y = F.silu(y) if activation == "silu" else y
    return y.transpose(1, 2).to(x.dtype)


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed prefills continuing from (and updating) the serving conv-state cache (reference of
    `causal_conv1d_varlen_fwd`); a loop over sequences.

    Args:
        x: [T, E] packed sequences, any strides.
        weight: [E, K]. bias: [E] or None.
        conv_state: [slots, E, K-1] in the cache dtype, any strides; updated in place: each sequence's slot receives
            the last K-1 entries of (history, its inputs), so a sequence shorter than K-1 keeps part of its history.
        cu_seqlens: [S+1] int32 or int64, sequence s owns rows cu_seqlens[s]..cu_seqlens[s+1]-1; rows past cu_seqlens[-1]
            are padding.
        state_indices: [S] int32 or int64 slot per sequence; -1 marks a padding sequence (no state read or written).
        has_initial_state: [S] bool; False means the history is zeros whatever the slot holds.
        out: [T, E] written in place when given.

    Returns:
        out [T, E] in x.dtype; rows of padding sequences and rows past cu_seqlens[-1] are zeros.
    """
    check_activation(activation)
    width = weight.shape[-1]
    out = torch.empty_like(x) if out is None else out
    out.zero_()
    bounds = cu_seqlens.tolist()
    for seq, (slot, continues) in enumerate(zip(state_indices.tolist(), has_initial_state.tolist())):
        if slot < 0:
            continue
        seq_x = x[bounds[seq] : bounds[seq + 1]].float().T  # [E, T]
        history = conv_state[slot].float() if continues else seq_x.new_zeros(seq_x.shape[0], width - 1)
        padded = torch.cat([history, seq_x], dim=-1)  # [E, K-1+T]
        if seq_x.shape[1]:  # an empty sequence only rewrites its history
            out[bounds[seq] : bounds[seq + 1]] = _depthwise_causal(padded[None], weight.float(), bias, activation)[0].T
        conv_state[slot] = padded[:, padded.shape[1] - (width - 1) :].to(conv_state.dtype)
    return out


def write_slots_(cache: torch.Tensor, rows: torch.Tensor, state_indices: torch.Tensor) -> None:
    """cache[state_indices[r]] = rows[r] for every row r whose slot is >= 0, in place, without a host sync or a branch
    on the indices (so that a decode step exports and compiles as one graph); padding rows (-1) change nothing.

    Exact with repeated destinations: a padding row is clamped to slot 0 and writes there what slot 0 ends up holding
    (the real row's new value if one names slot 0, else its current value), so every write to a slot carries the same
    value and their order does not matter. A slot named by several real rows takes the last one's (rows of one step
    name distinct slots, as the kernels assume).

    Args:
        cache: [slots, ...] any strides. rows: [R, ...] the new contents. state_indices: [R] int32 or int64.
    """
    num_slots, num_rows = cache.shape[0], rows.shape[0]
    real = state_indices >= 0  # [R]
    slots = state_indices.clamp(min=0).long()  # [R]
    # The row whose value each slot receives, -1 for none; padding rows aim at the spare entry `num_slots`.
    writer = torch.full((num_slots + 1,), -1, dtype=torch.long, device=cache.device)
    writer.scatter_reduce_(0, torch.where(real, slots, num_slots), torch.arange(num_rows, device=cache.device), "amax")
    source = writer[slots]  # [R]
    keeps = (source < 0).view(-1, *[1] * (cache.dim() - 1))  # [R, 1, ...]: a padding row on a slot nobody writes
    cache[slots] = torch.where(keeps, cache[slots], rows[source.clamp(min=0)].to(cache.dtype))


def causal_conv1d_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    *,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step per request (reference of `causal_conv1d_update`). Tensor code throughout, no branch on the
    indices' values: a decode step on it exports (`torch.export`) and compiles as one graph.

    Args:
        x: [R, E] the new token of each request, any strides.
        weight: [E, K]. bias: [E] or None.
        conv_state: [slots, E, K-1], any strides; the request's slot is shifted by one and receives x (in place).
        state_indices: [R] int32 or int64 slot per request (distinct slots); -1 marks a padding row (output zeros, no
            state touched).
        out: [R, E] written in place when given.
        has_initial_state: [R] bool; False: the request's first token (its history is zeros whatever the slot
            holds; the slot is written as usual). None: every request continues from its slot.

    Returns:
        out [R, E] in x.dtype.
    """
    check_activation(activation)
    out = torch.empty_like(x) if out is None else out
    valid = state_indices >= 0  # [R]
    history = conv_state[state_indices.clamp(min=0).long()].float()  # [R, E, K-1]; a padding row reads slot 0, unused
    if has_initial_state is not None:
        history = torch.where(has_initial_state[:, None, None], history, 0.0)
    window = torch.cat([history, x[:, :, None].float()], dim=-1)  # [R, E, K]
    y = _depthwise_causal(window, weight.float(), bias, activation)[..., 0]  # [R, E]
    out.copy_(torch.where(valid[:, None], y, 0.0))
    write_slots_(conv_state, window[..., 1:], state_indices)
    return out
