"""Mamba-2's chunked scan (SSD) on the Triton kernels of forward.py and backward.py for training, and of varlen.py for
serving's packed prefills: argument checks and autograd. The references with the same arguments and results are
`ssd_chunk_scan_ref` and `ssd_varlen_scan_ref` (reference.py; tests/test_ssd.py pairs them, gradients included).

    ssd_chunk_scan_fn   x [b, T, H, P], dt [b, T, H], A [H], B and C [b, T, G, N], D [H], initial_state [b, H, P, N]
                        or None, seq_idx [b, T] or None -> (y [b, T, H, P] in x's dtype, final state fp32 [b, H, P, N]),
                        gradients for every floating-point input and from the final state's gradient too
    ssd_chunk_scan_fwd  its forward and backward over checked inputs, for ops that call the scan inside their own
    ssd_chunk_scan_bwd  autograd (mamba2_inner)
    ssd_varlen_scan_fwd packed prefills x [T, H, P] over a cache of state slots, each sequence continuing from (or
                        starting) its slot and leaving its final state there (no autograd)
"""

import torch
from torch import Tensor

from ..triton_utils import check_flags, check_index, check_tokens
from .backward import launch_ssd_chunk_scan_bwd
from .decode import check_heads_and_state_cache
from .forward import CHUNK, MAX_HEAD_DIM, SSDBlocks, launch_ssd_chunk_walk, launch_ssd_outputs_fwd, pick_ssd_blocks
from .reference import split_heads_and_groups


def sequence_segments(seq_idx: Tensor | None) -> Tensor | None:
    """[b, T] int32: how many sequences have started in the row before each token (0 for the row's first sequence),
    a non-decreasing count whichever ids `seq_idx` uses: the kernels compare segments, and two tokens are in one
    sequence exactly when no start lies between them, as the reference restarts wherever seq_idx changes."""
    if seq_idx is None:
        return None
    starts = torch.zeros(seq_idx.shape, dtype=torch.int32, device=seq_idx.device)
    starts[:, 1:] = (seq_idx[:, 1:] != seq_idx[:, :-1]).to(torch.int32)
    return starts.cumsum(1, dtype=torch.int32)


def check_ssd_inputs(x, dt, A, B, C, D, initial_state, seq_idx, chunk_size: int) -> None:
    if x.dim() != 4:
        raise ValueError(f"x: expected [batch, length, heads, head_dim], got {tuple(x.shape)}")
    batch, length, heads, head_dim = x.shape
    check_tokens("x", x, (batch, length, heads, head_dim))
    if B.dim() != 4 or B.shape[:2] != (batch, length):
        raise ValueError(f"B: expected [{batch}, {length}, groups, state_size], got {tuple(B.shape)}")
    groups, state_size = B.shape[2:]
    if heads % groups:
        raise ValueError(f"the groups of B and C ({groups}) must divide the heads of x ({heads})")
    check_tokens("B", B, (batch, length, groups, state_size))
    check_tokens("C", C, (batch, length, groups, state_size))
    if tuple(dt.shape) != (batch, length, heads) or not dt.is_floating_point():
        raise ValueError(f"dt: expected a floating-point tensor of shape {(batch, length, heads)}, got {dt.dtype} "
                         f"{tuple(dt.shape)}")  # fmt: skip
    for name, tensor in (("A", A), ("D", D)):
        if tuple(tensor.shape) != (heads,):
            raise ValueError(f"{name}: expected shape {(heads,)}, got {tuple(tensor.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (batch, heads, head_dim, state_size):
        raise ValueError(
            f"initial_state: expected shape {(batch, heads, head_dim, state_size)}, got {tuple(initial_state.shape)}"
        )
    if seq_idx is not None:
        check_index("seq_idx", seq_idx, (batch, length), x)
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two >= 16 (the kernels' products), got {chunk_size}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim: the backward holds a head's channels in one block, at most {MAX_HEAD_DIM}, got {head_dim}"
        )
    for name, tensor in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("initial_state", initial_state)):
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name}: expected a tensor on {x.device}, got one on {tensor.device}")


def ssd_chunk_scan_fwd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, initial: Tensor | None,
    segments: Tensor | None, chunk_size: int, blocks: SSDBlocks, with_final_state: bool = True,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """y and the final state (None without `with_final_state`) over checked inputs: A and D contiguous, `initial`
    fp32 contiguous or None, `segments` from `sequence_segments`. Keeps nothing: the backward recomputes the states
    (in fp32: it multiplies states and their gradients in fp32). Here they feed only the outputs' products, which
    take them in x's dtype: stored in it, the same y from half the bytes for bf16 inputs."""
    states, final_state = launch_ssd_chunk_walk(
        x, dt, A, B, segments, initial, chunk_size, blocks, reverse=False, with_end=with_final_state,
        walk_dtype=x.dtype,
    )  # fmt: skip
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch_ssd_outputs_fwd(x, dt, A, B, C, D, segments, states, y, chunk_size, blocks)
    return y, final_state


def ssd_chunk_scan_bwd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, initial: Tensor | None,
    segments: Tensor | None, dy: Tensor, dfinal: Tensor | None, chunk_size: int, blocks: SSDBlocks,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """Gradients (dxBC, ddt, dA, dD, d initial) from dy and the final state's gradient (fp32 contiguous or None),
    the forward's arguments given again: dxBC those of x, B and C side by side, [b, T, H P + 2 G N] in their promoted
    dtype (the layout of Mamba-2's conv output; `split_heads_and_groups` gives the three), the others in fp32. The
    states entering the chunks are recomputed first."""
    states, _ = launch_ssd_chunk_walk(
        x, dt, A, B, segments, initial, chunk_size, blocks, reverse=False, with_end=False
    )
    return launch_ssd_chunk_scan_bwd(
        x, dt, A, B, C, D, segments, states, dy, dfinal, initial is not None, chunk_size, blocks
    )


class SSDChunkScanFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, initial_state, seq_idx, chunk_size: int, blocks: SSDBlocks):
        segments = sequence_segments(seq_idx)
        A, D = A.contiguous(), D.contiguous()  # read as A[h], D[h]
        initial = initial_state.float().contiguous() if initial_state is not None else None
        y, final_state = ssd_chunk_scan_fwd(x, dt, A, B, C, D, initial, segments, chunk_size, blocks)
        # The states are recomputed in the backward: P*N/L fp32 values per token and head, 8x the input's bytes.
        ctx.save_for_backward(x, dt, A, B, C, D, initial, segments)
        ctx.initial_dtype = initial_state.dtype if initial_state is not None else None
        ctx.chunk_size, ctx.blocks = chunk_size, blocks
        ctx.set_materialize_grads(False)
        return y, final_state

    @staticmethod
    def backward(ctx, dy, d_final_state):
        x, dt, A, B, C, D, initial, segments = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        dfinal = d_final_state.float().contiguous() if d_final_state is not None else None
        dxBC, ddt, dA, dD, dh0 = ssd_chunk_scan_bwd(
            x, dt, A, B, C, D, initial, segments, dy, dfinal, ctx.chunk_size, ctx.blocks
        )
        dx, dB, dC = split_heads_and_groups(dxBC, x.shape[2] * x.shape[3], x.shape[2], B.shape[2])
        d_initial = dh0.to(ctx.initial_dtype) if dh0 is not None else None
        return (
            dx.to(x.dtype), ddt.to(dt.dtype), dA.to(A.dtype), dB.to(B.dtype), dC.to(C.dtype), dD.to(D.dtype),
            d_initial,
            None, None, None,
        )  # fmt: skip


def ssd_chunk_scan_fn(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
    initial_state: Tensor | None = None, seq_idx: Tensor | None = None, chunk_size: int = CHUNK, **blocks: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`ssd_chunk_scan_ref` on the kernels (same arguments and results; the chunk is the kernels' tile, 64 unless
    given: the result does not depend on it). `blocks`: launch shapes (`SSDBlocks` fields) for benchmarks to sweep.

    Inside a caller that is itself being compiled (`torch.compile(model)`, `Trainer(torch_compile=True)`) Dynamo traces
    this autograd function and its launches into the caller's graph (CUDA tensors: the interpreter's launches are
    opaque to it); the backward still recomputes the states from the saved inputs."""
    check_ssd_inputs(x, dt, A, B, C, D, initial_state, seq_idx, chunk_size)
    launch = pick_ssd_blocks(x.shape[-1], B.shape[-1], **blocks)
    return SSDChunkScanFunction.apply(x, dt, A, B, C, D, initial_state, seq_idx, chunk_size, launch)


def ssd_varlen_scan_fwd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, state_cache: Tensor, cu_seqlens: Tensor,
    state_indices: Tensor, has_initial_state: Tensor, chunk_size: int, out: Tensor | None = None, *,
    dt_bias: Tensor | None = None, dt_softplus: bool = False, tile: int = CHUNK, split_walk: bool = False,
    **blocks: int,
) -> Tensor:  # fmt: skip
    """`ssd_varlen_scan_ref`'s contract and result on the kernels of varlen.py (serving prefills, no autograd): x
    [T, H, P] and B, C [T, G, N] (tokens and heads/groups strided, the last dimension contiguous: views of the
    conv's output), dt [T, H] raw with dt_bias [H] / dt_softplus, A and D [H] fp32, state_cache [slots, H, P, N]
    (fp32, bf16 or fp16, any strides) read and written in place, cu_seqlens [S+1], state_indices [S] and
    has_initial_state [S] of S sequences. Returns out [T, H, P] in x's dtype; rows past cu_seqlens[-1] are not
    written. `chunk_size` is the reference's; the result does not depend on it. The kernels cut each sequence in
    chunks of `tile` tokens (a power of two from 16 to 128; fewer chunks store fewer states, each costs more work),
    and walk the states down them in one kernel or in two (`split_walk`, varlen.py). No host sync. `blocks`: launch
    shapes (`SSDBlocks` fields: walk_*, out_*) for benchmarks to sweep."""
    from .varlen import launch_ssd_varlen_scan

    if x.dim() != 3 or B.dim() != 3:
        raise ValueError(f"x, B: expected [tokens, heads, head_dim] and [tokens, groups, N], got {tuple(x.shape)} "
                         f"and {tuple(B.shape)}")  # fmt: skip
    num_tokens, heads, head_dim = x.shape
    groups, state_size = B.shape[1:]
    if groups == 0 or heads % groups:
        raise ValueError(f"the groups of B and C ({groups}) must divide the heads of x ({heads})")
    check_tokens("x", x, (num_tokens, heads, head_dim))
    check_tokens("B", B, (num_tokens, groups, state_size))
    check_tokens("C", C, (num_tokens, groups, state_size))
    if tuple(dt.shape) != (num_tokens, heads) or not dt.is_floating_point():
        raise ValueError(f"dt: expected a floating-point tensor of shape {(num_tokens, heads)}, got {tuple(dt.shape)}")
    check_heads_and_state_cache(A, D, dt_bias, state_cache, heads, head_dim, state_size)
    if tile not in (16, 32, 64, 128):
        raise ValueError(f"tile: expected a power of two from 16 to 128 tokens, got {tile}")
    num_seqs = state_indices.shape[0]
    check_index("cu_seqlens", cu_seqlens, (num_seqs + 1,), like=x)
    check_index("state_indices", state_indices, (num_seqs,), like=x)
    check_flags("has_initial_state", has_initial_state, (num_seqs,))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out: expected {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if num_seqs:
        launch_ssd_varlen_scan(
            x, dt, A, B, C, D, state_cache, cu_seqlens, state_indices, has_initial_state, out, dt_bias, dt_softplus,
            pick_ssd_blocks(head_dim, state_size, **blocks), tile, split_walk,
        )  # fmt: skip
    return out
