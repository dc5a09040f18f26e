"""The Mamba-1 selective scan's public functions (references with the same signatures in reference.py): argument
checks, launch policy and autograd around the launchers of forward.py and backward.py, and the decode kernel of
decode.py.

    selective_scan_fn           training: [B, T, E], autograd (gradients for every input, the final state's too);
                                rows may pack several sequences (`seq_idx`, padding-free training)
    selective_scan_varlen_fwd   serving prefills: packed [T, E] sequences continuing from / updating the state cache
    selective_state_update      decode steps: one token per request [B, E], from and into its state cache slot

The two scans take the step as mamba_ssm does: `dt_bias` (None) and `dt_softplus` (False) keywords, the step being
softplus(dt + dt_bias) if dt_softplus else dt (+ dt_bias if given). The model's training path passes dt_proj's output
(bias included) with dt_softplus=True; serving passes the raw dt_proj output with dt_bias and dt_softplus=True, which
is the one form the decode step takes (its step is always softplus(dt + dt_bias)).
"""

from typing import NamedTuple

import torch

from ..triton_utils import cdiv, check_flags, check_index, check_tokens, launch_power_of_2, next_power_of_2
from .backward import launch_selective_scan_bwd
from .decode import _selective_state_update_kernel, pick_state_update_block_e, state_update_args
from .forward import SEGMENT_STEPS, launch_selective_scan_fwd


class ScanBlocks(NamedTuple):
    """Launch shape, exposed so benchmarks can sweep it. block_e: channels per program; chunk: steps per time chunk
    (a power of two; chunk >= the longest sequence runs one chunk per sequence: forward stage 1 alone, no combine);
    seg: steps per backward recompute segment (divides chunk); unroll: unroll factor of the per-step loops (on top
    of the one-step load prefetch); num_warps / bwd_num_warps: warps per forward / backward program; bwd_block_e:
    channels per backward program; save_seg_states: the training forward saves the state entering every seg-th
    step (fp32 [B, cdiv(T, seg), E, N]: N / seg fp32 values per token and channel kept for the backward), which
    spares the backward a recompute pass."""

    block_e: int
    chunk: int
    seg: int
    unroll: int
    num_warps: int
    bwd_num_warps: int
    bwd_block_e: int
    save_seg_states: bool


def pick_scan_blocks(num_seqs: int, max_seq_len: int, num_channels: int, state_size: int, **overrides) -> ScanBlocks:
    """Defaults from the shapes, any keyword given (not None) taking precedence.

    From the H200 sweeps (`bench_kernels.py --only scan_sweep`, BENCHMARKS.md): 32 channels per program and ONE warp,
    forward and backward (a [32, 16] fp32 state block, 16 values per thread). With one warp the block's reductions
    are shuffles, not shared-memory round trips, and many small programs per SM hide each other's load latency.
    Larger N keeps 16 values per thread with more warps. Chunks only as short as needed for ~4096 programs (~30 per
    H200 SM): every chunk boundary costs a stage-0 rerun (one more exp per element). Segments of 64 steps: the
    training forward keeps N / 64 fp32 checkpoint values per token and channel (a quarter of what 16 kept), which took
    the issue-36 training step's peak from 18.49 to 17.94 GiB (1.24x to 1.20x the SSM-off model's) with the step time
    within the run-to-run spread (bench_results/2026-12-03-h200-train-step-*); the backward's per-program scratch grows
    to 64 states (~512 MiB across a launch of ~4096 programs, freed after each layer)."""
    block_n = next_power_of_2(state_size)
    block_e = overrides.get("block_e") or (32 if block_n <= 16 else 16)
    programs = num_seqs * cdiv(num_channels, block_e)
    chunk = overrides.get("chunk") or launch_power_of_2(cdiv(max_seq_len * programs, 4096), floor=64)
    bwd_block_e = overrides.get("bwd_block_e") or block_e
    blocks = ScanBlocks(
        block_e=block_e,
        chunk=chunk,
        seg=min(overrides.get("seg") or SEGMENT_STEPS, chunk),
        unroll=overrides.get("unroll") or 1,
        num_warps=overrides.get("num_warps") or max(1, min(8, block_e * block_n // 512)),
        bwd_num_warps=overrides.get("bwd_num_warps") or max(1, min(8, bwd_block_e * block_n // 512)),
        bwd_block_e=bwd_block_e,
        save_seg_states=overrides.get("save_seg_states", True),
    )
    if blocks.chunk % blocks.seg or any(next_power_of_2(x) != x for x in (chunk, block_e, bwd_block_e)):
        raise ValueError(f"{blocks}: chunk, block_e and bwd_block_e must be powers of two and seg must divide chunk")
    return blocks


def check_scan_inputs(u, dt, A, B, C, D, z, dt_bias, rows: tuple[int, ...]):
    """The op's own tensors over token rows `rows` ([B, T] or [T]); returns (B, C) sharing their strides, as the
    kernels read them (the halves of x_proj's output already do; otherwise both are made contiguous)."""
    num_channels, state_size = u.shape[-1], A.shape[-1]
    for name, x in (("u", u), ("dt", dt), ("z", z)):
        check_tokens(name, x, (*rows, num_channels))
    for name, x in (("B", B), ("C", C)):
        check_tokens(name, x, (*rows, state_size))
    for name, x, shape in (
        ("A", A, (num_channels, state_size)),
        ("D", D, (num_channels,)),
        ("dt_bias", dt_bias, (num_channels,)),
    ):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    if B.stride() != C.stride():
        B, C = B.contiguous(), C.contiguous()
    return B, C


# ---------------------------------------------------------------------------------------------------------------------
# Training: [B, T, E], autograd
# ---------------------------------------------------------------------------------------------------------------------


class ScanResiduals(NamedTuple):
    """What the training forward leaves for the backward beside the op's inputs: the chunk start states (only when
    the segment checkpoints were not saved: the backward recomputes them from these), the chunks' summed steps and
    the segment checkpoints."""

    chunk_h: torch.Tensor | None
    chunk_dtsum: torch.Tensor | None
    seg_states: torch.Tensor | None


def selective_scan_fwd(
    u, dt, A, B, C, D, z, initial_state, seq_idx, dt_bias, dt_softplus: bool, blocks: ScanBlocks,
    A_is_log: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, ScanResiduals]:  # fmt: skip
    """The training forward on checked inputs (`selective_scan_fn` checks them): y [B, T, E] in u's dtype, the final
    state [B, E, N] fp32 and what `selective_scan_bwd` needs. Autograd-free, for the autograd functions built on it.
    A_is_log: A holds A_log, A = -exp(A_log) taken in the kernels (`decay_rates`' work, without its three ops)."""
    batch_size, seq_len, num_channels = u.shape
    state_size = A.shape[-1]
    y = torch.empty(batch_size, seq_len, num_channels, dtype=u.dtype, device=u.device)
    final_state = u.new_empty(batch_size, num_channels, state_size, dtype=torch.float32)
    seg_states = None
    if blocks.save_seg_states:
        num_segs = cdiv(seq_len, blocks.seg)
        seg_states = u.new_empty(batch_size, num_segs, num_channels, state_size, dtype=torch.float32)
    chunk_h, chunk_dtsum = launch_selective_scan_fwd(
        u,
        dt,
        A,
        B,
        C,
        D,
        z,
        y,
        initial_state,
        final_state,
        blocks=blocks,
        max_seq_len=seq_len,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        seg_states=seg_states,
        seq_idx=seq_idx,
        A_is_log=A_is_log,
    )
    # The backward reads the chunk start states only to recompute checkpoints it is not given: with them saved,
    # keeping chunk_h too would hold fp32 [B, num_chunks, E, N] for nothing.
    chunk_h = chunk_h if seg_states is None else None
    return y, final_state, ScanResiduals(chunk_h, chunk_dtsum, seg_states)


def selective_scan_bwd(
    u, dt, A, B, C, D, z, initial_state, seq_idx, dt_bias, dt_softplus: bool, blocks: ScanBlocks,
    residuals: ScanResiduals, dy: torch.Tensor, d_final_state: torch.Tensor | None, dz: torch.Tensor | None = None,
    dBC: torch.Tensor | None = None, A_is_log: bool = False,
) -> tuple[torch.Tensor | None, ...]:  # fmt: skip
    """The training backward: (du, ddt, dA, dB, dC, dD, dz, d_initial_state, d_dt_bias) in the inputs' dtypes (None
    for an absent initial state or dt_bias), from the forward's inputs and residuals and the outputs' gradients.
    dz, dBC: where to write z's gradient and dB and dC side by side (`launch_selective_scan_bwd`), or None for new
    tensors; A_is_log as the forward got it (dA is then A_log's gradient)."""
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    if dz is not None and (dz.shape != z.shape or dz.dtype != z.dtype or dz.stride(-1) != 1):
        raise ValueError(f"dz must be {tuple(z.shape)} {z.dtype} with contiguous channels, got {tuple(dz.shape)} "
                         f"{dz.dtype} with strides {dz.stride()}")  # fmt: skip
    dBC_shape = (*B.shape[:-1], 2 * B.shape[-1])
    if dBC is not None and (dBC.shape != dBC_shape or dBC.dtype != B.dtype or dBC.device != B.device):
        raise ValueError(f"dBC must be {dBC_shape} {B.dtype} (dB and dC side by side) on {B.device}, got "
                         f"{tuple(dBC.shape)} {dBC.dtype} on {dBC.device}")  # fmt: skip
    if d_final_state is not None:
        d_final_state = d_final_state.float().contiguous()
    return launch_selective_scan_bwd(
        u,
        dt,
        A,
        B,
        C,
        D,
        z,
        dy,
        initial_state,
        d_final_state,
        *residuals,
        blocks=blocks,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        seq_idx=seq_idx,
        dz=dz,
        dBC=dBC,
        A_is_log=A_is_log,
    )


class SelectiveScanFunction(torch.autograd.Function):
    """Training scan; the final state's gradient flows too (it seeds the adjoint at the right edge)."""

    @staticmethod
    def forward(ctx, u, dt, A, B, C, D, z, initial_state, seq_idx, dt_bias, dt_softplus: bool, blocks: ScanBlocks):
        y, final_state, residuals = selective_scan_fwd(
            u, dt, A, B, C, D, z, initial_state, seq_idx, dt_bias, dt_softplus, blocks
        )
        ctx.save_for_backward(u, dt, A, B, C, D, z, initial_state, seq_idx, dt_bias, *residuals)
        ctx.dt_softplus, ctx.blocks = dt_softplus, blocks
        return y, final_state

    @staticmethod
    def backward(ctx, dy, d_final_state):
        *inputs, chunk_h, chunk_dtsum, seg_states = ctx.saved_tensors
        *grads, d_initial, d_dt_bias = selective_scan_bwd(
            *inputs,
            ctx.dt_softplus,
            ctx.blocks,
            ScanResiduals(chunk_h, chunk_dtsum, seg_states),
            dy,
            d_final_state,
        )
        # no gradient for seq_idx, the softplus flag and the launch shape
        return *grads, d_initial, None, d_dt_bias, None, None


def selective_scan_fn(
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
    block_e: int | None = None,
    chunk: int | None = None,
    seg: int | None = None,
    unroll: int | None = None,
    num_warps: int | None = None,
    bwd_num_warps: int | None = None,
    bwd_block_e: int | None = None,
    save_seg_states: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable Triton selective scan with the contract of `selective_scan_ref`.

    Args:
        u, dt, z: [B, T, E], any float dtypes (may differ); strided views with a contiguous last dimension (the
            halves of one [B, T, 2E] tensor) are read in place.
        A: [E, N] (fp32). B, C: [B, T, N] (read in place when they share their strides, as the halves of x_proj's
            output do; else copied). D: [E].
        initial_state: [B, E, N] or None (zeros); with seq_idx, the state before the row's first sequence.
        seq_idx: [B, T] contiguous int32 or int64 index of the sequence of every token, for rows that pack several
            sequences (padding-free training, mamba_ssm's convention): where it changes between two consecutive
            tokens the state restarts from zero, forward and backward; the final state is that of the row's last
            sequence. None: one sequence per row. Not differentiable.
        dt_bias: [E] or None, added to dt; dt_softplus: the step is softplus(dt (+ dt_bias)), else dt (+ dt_bias).
            Both in fp32 in the kernels, forward and backward (dt_bias gets its gradient).
        block_e, chunk, seg, unroll, num_warps, bwd_num_warps, bwd_block_e: launch shape (`ScanBlocks`); None picks
            it from the shapes.
        save_seg_states: keep every seg-th state from the forward for the backward (`ScanBlocks`): faster backward,
            fp32 [B, cdiv(T, seg), E, N] more saved activations; False recomputes them in the backward.

    Returns:
        y [B, T, E] in u's dtype and the final state [B, E, N] fp32. Gradients flow to every input (dA, dD, d_dt_bias
        and d_initial_state in fp32 sums) and from both outputs.
    """
    batch_size, seq_len, num_channels = u.shape
    state_size = A.shape[-1]
    B, C = check_scan_inputs(u, dt, A, B, C, D, z, dt_bias, (batch_size, seq_len))
    if initial_state is not None:
        if tuple(initial_state.shape) != (batch_size, num_channels, state_size):
            raise ValueError(
                f"initial_state: expected {(batch_size, num_channels, state_size)}, got {tuple(initial_state.shape)}"
            )
        initial_state = initial_state.float().contiguous()
    if seq_idx is not None:
        check_index("seq_idx", seq_idx, (batch_size, seq_len), like=u)
    blocks = pick_scan_blocks(
        batch_size,
        seq_len,
        num_channels,
        state_size,
        block_e=block_e,
        chunk=chunk,
        seg=seg,
        unroll=unroll,
        num_warps=num_warps,
        bwd_num_warps=bwd_num_warps,
        bwd_block_e=bwd_block_e,
        # Without a backward to come (inference, no_grad) the checkpoints would be written for nothing.
        save_seg_states=save_seg_states
        and torch.is_grad_enabled()
        and any(x is not None and x.requires_grad for x in (u, dt, A, B, C, D, z, initial_state, dt_bias)),
    )
    if seq_len == 0:  # nothing to scan; keeps the kernels free of empty-grid corner cases
        final_state = (
            initial_state
            if initial_state is not None
            else u.new_zeros(batch_size, num_channels, state_size, dtype=torch.float32)
        )
        return torch.empty_like(u), final_state
    dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    return SelectiveScanFunction.apply(
        u, dt, A.contiguous(), B, C, D.contiguous(), z, initial_state, seq_idx, dt_bias, dt_softplus, blocks
    )


# ---------------------------------------------------------------------------------------------------------------------
# Serving: packed prefills against the ssm-state cache [slots, E, N] (any strides)
# ---------------------------------------------------------------------------------------------------------------------


def selective_scan_varlen_fwd(
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
    block_e: int | None = None,
    chunk: int | None = None,
    unroll: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Serving prefill over packed sequences with a state cache; reference `selective_scan_varlen_ref`, same
    signature plus keyword-only launch arguments. Not differentiable.

    Args:
        u, z: [T, E] (strided views with a contiguous last dimension are read in place).
        dt: [T, E] step sizes as in `selective_scan_fn`; serving passes the raw dt_proj output with its bias as
            dt_bias and dt_softplus=True (vLLM's delta_bias + delta_softplus), fused in the kernel in fp32.
        A: [E, N] (fp32); B, C: [T, N]; D: [E].
        ssm_state: [slots, E, N] cache (fp32, bf16 or fp16; any strides, e.g. a view of a bigger cache), updated in
            place with each sequence's final state in its dtype; other slots are not touched.
        cu_seqlens: [S + 1] int32 or int64 token offsets of the sequences.
        state_indices: [S] int32 or int64 slot per sequence; -1 = padding: its tokens get zeros in `out`, no slot
            touched.
        has_initial_state: [S] bool; False starts from zero whatever the slot holds; None: all False.
            One difference from the reference: an EMPTY sequence leaves its slot as it is (the reference writes
            zeros there when it has no initial state); vLLM never schedules an empty prefill.
        out: [T, E] written with y * silu(z) (contiguous last dimension); None: a new tensor in u's dtype.
        dt_bias: [E] or None; dt_softplus: as in `selective_scan_fn`.
        max_seq_len: the longest sequence; computed from cu_seqlens (a host sync) when None.
        block_e, chunk, unroll, num_warps: launch shape (`ScanBlocks`); None picks it from the shapes.

    Returns:
        `out`.
    """
    total_tokens, num_channels = u.shape
    state_size = A.shape[-1]
    num_seqs = state_indices.shape[0]
    if out is None:
        out = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    B, C = check_scan_inputs(u, dt, A, B, C, D, z, dt_bias, (total_tokens,))
    check_tokens("out", out, (total_tokens, num_channels))
    if ssm_state.dim() != 3 or tuple(ssm_state.shape[1:]) != (num_channels, state_size):
        raise ValueError(f"ssm_state: expected [slots, {num_channels}, {state_size}], got {tuple(ssm_state.shape)}")
    check_index("cu_seqlens", cu_seqlens, (num_seqs + 1,), like=u)
    check_index("state_indices", state_indices, (num_seqs,), like=u)
    if has_initial_state is not None:
        check_flags("has_initial_state", has_initial_state, (num_seqs,))
    if num_seqs == 0 or total_tokens == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    blocks = pick_scan_blocks(
        num_seqs,
        max_seq_len,
        num_channels,
        state_size,
        block_e=block_e,
        chunk=chunk,
        unroll=unroll,
        num_warps=num_warps,
    )
    launch_selective_scan_fwd(
        u,
        dt,
        A.contiguous(),
        B,
        C,
        D.contiguous(),
        z,
        out,
        ssm_state if has_initial_state is not None else None,  # None: no slot is read
        ssm_state,
        blocks=blocks,
        max_seq_len=max(max_seq_len, 1),
        dt_bias=dt_bias.contiguous() if dt_bias is not None else None,
        dt_softplus=dt_softplus,
        cu_seqlens=cu_seqlens,
        state_indices=state_indices,
        has_initial_state=has_initial_state,
    )
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Serving: decode steps, one token per request, against the ssm-state cache [slots, E, N] (any strides)
# ---------------------------------------------------------------------------------------------------------------------


def selective_state_update(
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
    block_e: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """One selective-scan step per decoding request, state updated in its slot; same contract as
    `selective_state_update_ref`: ssm_state [slots, E, N] (fp32/bf16/fp16, any strides); u, dt, z [B, E] and B, C
    [B, N] (row-strided views allowed); A [E, N] fp32; D, dt_bias [E]; state_indices [B] int32/int64 (-1 = padding:
    no state touched, zeros written); out [B, E]; has_initial_state [B] bool or None (False: start from a zero
    state). `dt` is the raw dt_proj output, softplus(dt + dt_bias) is taken here. One launch, no host sync:
    CUDA-graph safe. Under torch.compile it is one opaque op (`torch.ops.hybrid_ssm.selective_state_update`), so a
    compiled decode step keeps it in its graph. Returns `out`."""
    update = torch.ops.hybrid_ssm.selective_state_update if torch.compiler.is_compiling() else _selective_state_update
    update(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, out, has_initial_state, block_e, num_warps)
    return out


def _selective_state_update(
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
    has_initial_state: torch.Tensor | None,
    block_e: int | None,
    num_warps: int,
) -> None:
    ssm = state_update_args(ssm_state, u, dt, A, B, C, D, z, dt_bias, state_indices, out, has_initial_state)
    block_e = block_e or pick_state_update_block_e(ssm.E, ssm.N)
    if u.shape[0] == 0:  # an empty grid is not a valid launch
        return
    _selective_state_update_kernel[(u.shape[0], cdiv(ssm.E, block_e))](
        ssm,
        BLOCK_E=block_e,
        BLOCK_N=next_power_of_2(ssm.N),
        HAS_INITIAL_FLAGS=has_initial_state is not None,
        num_warps=num_warps,
    )


# Eager calls launch directly; a compiled graph calls the op, which dispatches to the same launch (its fake
# writes nothing: the op only mutates its arguments).
torch.library.custom_op(
    "hybrid_ssm::selective_state_update", _selective_state_update, mutates_args=("ssm_state", "out")
).register_fake(lambda *args: None)
