"""The causal depthwise conv1d's public functions (references with the same signatures in reference.py): argument
checks, launch policy and autograd around the launchers of forward.py and backward.py.

    causal_conv1d_fn           training: [B, T, E] -> [B, T, E], autograd (grads for x, weight, bias); rows may pack
                               several sequences (`seq_idx`, padding-free training).
    causal_conv1d_fwd / _bwd   the training forward and backward alone, with their launch shapes (tests, benchmarks).
    causal_conv1d_varlen_fwd   serving prefills: packed [T, E] sequences continuing from / updating the conv cache.
    causal_conv1d_update       serving decode: one token per request, CUDA-graph safe.

The serving functions take the cache after the op's own tensors and before the batch description:
(inputs, weights, conv_state, [cu_seqlens,] state_indices, ...), as the scan's `selective_scan_varlen_fwd` does.
"""

import torch

from ..triton_utils import cdiv, check_flags, check_index, launch_power_of_2, next_power_of_2
from .backward import launch_causal_conv1d_bwd
from .forward import launch_causal_conv1d_fwd, launch_causal_conv1d_update, launch_varlen_conv_state
from .reference import check_activation


def _pick_blocks(num_channels: int, num_rows: int, max_block_t: int, max_block_e: int, per_thread: int):
    """(BLOCK_T, BLOCK_E, num_warps) for a [BLOCK_T, BLOCK_E] tile with about `per_thread` elements per thread.

    The forward: [32, 128] tiles (128 channels, 256 B of bf16, a tile row) of 4 warps, 32 elements per thread; 4 warps
    beat 8 and 16 in the H200 sweep (`bench_kernels.py --only sweep`, BENCHMARKS.md). The backward, which holds pre's
    K x tiles, g and dx at once: [8, 64] tiles of ONE warp, 16 elements per thread, whose row sums (dweight, dbias)
    are then shuffles within the warp: 0.158 ms against 0.278 ms for [16, 128] tiles of 4 warps at B 2 x T 4096 x E
    2048 on an H100 (BENCHMARKS.md)."""
    block_e = launch_power_of_2(num_channels, cap=max_block_e)
    block_t = launch_power_of_2(num_rows, cap=max_block_t)  # an int even where num_rows is a SymInt (dynamic shapes)
    num_warps = max(1, min(16, block_t * block_e // (32 * per_thread)))
    return block_t, block_e, num_warps


# ---------------------------------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------------------------------


def _check_weights(weight: torch.Tensor, bias: torch.Tensor | None, num_channels: int) -> int:
    if weight.dim() != 2 or weight.shape[0] != num_channels:
        raise ValueError(
            f"weight must be [E={num_channels}, K] (squeeze the nn.Conv1d weight), got {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (num_channels,):
        raise ValueError(f"bias must be [E={num_channels}], got {tuple(bias.shape)}")
    return weight.shape[1]


def _check_training_inputs(x, weight, bias, initial_history, seq_idx) -> int:
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, E], got {tuple(x.shape)}")
    batch_size, seq_len, num_channels = x.shape
    width = _check_weights(weight, bias, num_channels)
    if initial_history is not None and initial_history.shape != (batch_size, num_channels, width - 1):
        raise ValueError(
            f"initial_history must be [B, E, K-1] = {(batch_size, num_channels, width - 1)}, "
            f"got {tuple(initial_history.shape)}"
        )
    if seq_idx is not None:
        check_index("seq_idx", seq_idx, (batch_size, seq_len), like=x)
    return width


def _check_conv_state(conv_state: torch.Tensor, num_channels: int, width: int) -> None:
    if conv_state.dim() != 3 or conv_state.shape[1:] != (num_channels, width - 1):
        raise ValueError(
            f"conv_state must be [slots, E, K-1] = [slots, {num_channels}, {width - 1}] (pass a transposed view of a "
            f"[slots, K-1, E] cache), got {tuple(conv_state.shape)}"
        )


def _check_out(out: torch.Tensor | None, x: torch.Tensor, name: str = "out") -> torch.Tensor:
    """An output of x's shape, dtype and device (any strides): `out` checked, or a new contiguous one if None."""
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(f"{name} must be {tuple(x.shape)} {x.dtype} on {x.device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}")  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Training: [B, T, E], autograd
# ---------------------------------------------------------------------------------------------------------------------


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_history: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    seq_idx: torch.Tensor | None = None,
    block_t: int | None = None,
    block_e: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Forward of `causal_conv1d_fn`: x [B, T, E] (any strides: the `xs` half of the in_proj output is read in place),
    weight [E, K], bias [E] or None, initial_history [B, E, K-1] or None, seq_idx [B, T] int32/int64 or None.
    Returns y [B, T, E] contiguous in x.dtype (written into `out` when given)."""
    check_activation(activation)
    _check_training_inputs(x, weight, bias, initial_history, seq_idx)
    batch_size, seq_len, num_channels = x.shape
    out = _check_out(out, x)
    if x.numel() == 0:
        return out
    if initial_history is None:
        default_t, default_e, default_warps = _pick_blocks(num_channels, seq_len, 32, 128, per_thread=32)
    else:  # the history [B, E, K-1] is strided along E, a 64-bit pointer per element: fewer elements per thread
        default_t, default_e, default_warps = _pick_blocks(num_channels, seq_len, 16, 128, per_thread=4)
    launch_causal_conv1d_fwd(
        x,
        weight,
        bias,
        initial_history,
        out,
        activation=activation,
        block_t=block_t or default_t,
        block_e=block_e or default_e,
        num_warps=num_warps or default_warps,
        seq_idx=seq_idx,
    )
    return out


def causal_conv1d_bwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dy: torch.Tensor,
    activation: str | None = "silu",
    initial_history: torch.Tensor | None = None,
    *,
    seq_idx: torch.Tensor | None = None,
    block_t: int | None = None,
    block_e: int | None = None,
    num_warps: int | None = None,
    rows_per_program: int | None = None,
    dx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Backward of `causal_conv1d_fn` (the forward's arguments, and dy [B, T, E]): returns (dx [B, T, E] in x.dtype,
    dweight [E, K] in weight.dtype, dbias [E] in bias.dtype or None). dx: where to write it ([B, T, E] in x's dtype,
    any strides: e.g. a column range of the gradient of the wider tensor x was cut from), or None for a new
    contiguous tensor.

    dweight and dbias are sums over B and T. Each program writes fp32 partial sums for its (batch row, row range,
    channel block) and torch adds them up: deterministic (fp32 atomics would make every run differ in the last bits)
    and cheap, since each program walks `rows_per_program` rows (default: enough programs to fill the GPU a few times
    over, about 1024) so the partials stay a few MB at most.
    """
    check_activation(activation)
    _check_training_inputs(x, weight, bias, initial_history, seq_idx)
    if dy.shape != x.shape:
        raise ValueError(f"dy must be {tuple(x.shape)}, got {tuple(dy.shape)}")
    dx = _check_out(dx, x, "dx")
    batch_size, seq_len, num_channels = x.shape
    default_t, default_e, default_warps = _pick_blocks(num_channels, seq_len, 8, 64, per_thread=16)
    block_t, block_e = block_t or max(default_t, next_power_of_2(weight.shape[1] - 1)), block_e or default_e
    if activation == "silu" and block_t < weight.shape[1] - 1:
        raise ValueError(f"block_t ({block_t}) must be at least K - 1 = {weight.shape[1] - 1} with silu (a row "
                         "block's g is read back with the K - 1 rows after it)")  # fmt: skip
    if rows_per_program is None:
        num_e_blocks = cdiv(num_channels, block_e)
        num_row_ranges = max(1, min(cdiv(seq_len, block_t), cdiv(1024, batch_size * num_e_blocks)))
        rows_per_program = cdiv(cdiv(seq_len, num_row_ranges), block_t) * block_t
    if rows_per_program % block_t:
        raise ValueError(f"rows_per_program ({rows_per_program}) must be a multiple of block_t ({block_t})")
    return launch_causal_conv1d_bwd(
        x,
        weight,
        bias,
        initial_history,
        dy,
        activation=activation,
        rows_per_program=rows_per_program,
        block_t=block_t,
        block_e=block_e,
        num_warps=num_warps or default_warps,
        seq_idx=seq_idx,
        dx=dx,
    )


class CausalConv1dFunction(torch.autograd.Function):
    """Autograd of the training conv. Saves only x (and the weights, history and seq_idx): the backward recomputes the
    pre-activation. No gradient for the history or seq_idx."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, initial_history, seq_idx):
        ctx.save_for_backward(x, weight, bias, initial_history, seq_idx)
        ctx.activation = activation
        return causal_conv1d_fwd(x, weight, bias, activation, initial_history, seq_idx=seq_idx)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, initial_history, seq_idx = ctx.saved_tensors
        dx, dweight, dbias = causal_conv1d_bwd(x, weight, bias, dy, ctx.activation, initial_history, seq_idx=seq_idx)
        return dx, dweight, dbias, None, None, None


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_history: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv1d for training, same contract as `causal_conv1d_ref`.

    x: [B, T, E], any strides (the `xs` half of `in_proj(h).chunk(2, -1)` is read in place, not copied);
    weight: [E, K]; bias: [E] or None; activation: None or "silu"; initial_history: [B, E, K-1] the inputs before
    x[:, 0] (a chunk continuing from the Transformers cache) or None for zeros. It gets NO gradient: the backward
    treats it as a constant (a cache entry), whatever its requires_grad.
    seq_idx: [B, T] contiguous int32 or int64 (mamba_ssm's convention), the index of the sequence each token belongs
    to, for padding-free training on rows that pack several sequences; None: one sequence per row. A tap reads only
    inputs of its output token's sequence (zeros elsewhere) and the history belongs to the row's first sequence (it
    feeds token t only if seq_idx[t] == seq_idx[0]); the backward follows the same rule, so each sequence's output, dx
    and its share of dweight / dbias are those of the sequence run alone. Only equality is compared, as in the
    reference: the indices need not start at 0 or increase, but each sequence must be one contiguous run of its row.
    No gradient.
    Returns y [B, T, E] contiguous in x.dtype, differentiable in x, weight and bias (fp32 accumulation).
    """
    return CausalConv1dFunction.apply(x, weight, bias, activation, initial_history, seq_idx)


# ---------------------------------------------------------------------------------------------------------------------
# Serving: packed prefills and decode, against the conv-state cache [slots, E, K-1] (any strides)
# ---------------------------------------------------------------------------------------------------------------------


def causal_conv1d_varlen_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    *,
    block_t: int | None = None,
    block_e: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Packed prefills, same contract as `causal_conv1d_varlen_ref`: x [T, E] (any strides: rows of the in_proj
    output), weight [E, K], bias [E] or None, conv_state [slots, E, K-1] any strides (updated in place), cu_seqlens
    [S+1] and state_indices [S] int32 or int64 (-1 = padding sequence), has_initial_state [S] bool. Returns out
    [T, E].

    Two launches: the conv reads every history it needs, then `_varlen_conv_state_kernel` writes the new ones. (In one
    launch a sequence's history is read by the program of each row block holding one of its first K-1 rows, so no
    program could know when overwriting it is safe.) No host synchronisation: rows find their sequence on the device.
    """
    check_activation(activation)
    if x.dim() != 2:
        raise ValueError(f"x must be [T, E], got {tuple(x.shape)}")
    num_tokens, num_channels = x.shape
    width = _check_weights(weight, bias, num_channels)
    _check_conv_state(conv_state, num_channels, width)
    num_seqs = state_indices.shape[0]
    check_index("cu_seqlens", cu_seqlens, (num_seqs + 1,), like=x)
    check_index("state_indices", state_indices, (num_seqs,), like=x)
    check_flags("has_initial_state", has_initial_state, (num_seqs,))
    out = _check_out(out, x)
    if num_seqs == 0 or num_channels == 0:
        return out.zero_()
    default_t, default_e, default_warps = _pick_blocks(num_channels, num_tokens, 16, 128, per_thread=16)
    block_e, num_warps = block_e or default_e, num_warps or default_warps
    batch = {"cu_seqlens": cu_seqlens, "state_indices": state_indices, "has_initial_state": has_initial_state}
    if num_tokens:
        launch_causal_conv1d_fwd(
            x,
            weight,
            bias,
            conv_state,
            out,
            activation=activation,
            block_t=block_t or default_t,
            block_e=block_e,
            num_warps=num_warps,
            **batch,
        )
    launch_varlen_conv_state(x, conv_state, **batch, block_e=block_e, num_warps=num_warps)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    *,
    has_initial_state: torch.Tensor | None = None,
    block_e: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Decode step, same contract as `causal_conv1d_update_ref`: x [R, E] (any strides), weight [E, K], bias [E] or
    None, conv_state [slots, E, K-1] any strides (updated in place), state_indices [R] int32 or int64 (-1 = padding
    row: output zeros, no state touched), has_initial_state [R] bool or None (False: a zero history). Returns out
    [R, E]. CUDA-graph safe: shape checks only, grid from shapes, no host sync. Slots of one call must be distinct
    (vLLM gives each running request its own), except padding rows on vLLM's null block, whose results nobody reads.
    Under torch.compile it is one opaque op (`torch.ops.hybrid_ssm.causal_conv1d_update`), so a compiled decode step
    keeps it in its graph."""
    out = _check_out(out, x)
    update = torch.ops.hybrid_ssm.causal_conv1d_update if torch.compiler.is_compiling() else _causal_conv1d_update
    update(x, weight, bias, conv_state, state_indices, activation, out, has_initial_state, block_e, num_warps)
    return out


def _causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str | None,
    out: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    block_e: int | None,
    num_warps: int | None,
) -> None:
    check_activation(activation)
    if x.dim() != 2:
        raise ValueError(f"x must be [R, E], got {tuple(x.shape)}")
    num_requests, num_channels = x.shape
    width = _check_weights(weight, bias, num_channels)
    _check_conv_state(conv_state, num_channels, width)
    check_index("state_indices", state_indices, (num_requests,), like=x)
    if has_initial_state is not None:
        check_flags("has_initial_state", has_initial_state, (num_requests,))
    if x.numel() == 0:
        return
    launch_causal_conv1d_update(
        x,
        weight,
        bias,
        conv_state,
        state_indices,
        has_initial_state,
        out,
        activation=activation,
        block_e=block_e,
        num_warps=num_warps,
    )


# Eager calls launch directly; a compiled graph calls the op, which dispatches to the same launch (its fake
# writes nothing: the op only mutates its arguments).
torch.library.custom_op(
    "hybrid_ssm::causal_conv1d_update", _causal_conv1d_update, mutates_args=("conv_state", "out")
).register_fake(lambda *args: None)
