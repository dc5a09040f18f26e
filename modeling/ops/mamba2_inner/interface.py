"""The Mamba-2 branch between its projections on the kernels: without a cache as one autograd node
(`mamba2_inner_fn`, the contract of `mamba2_inner_ref`): the causal conv's kernels, the chunked scan's and the gated
norm's (modeling/ops/ssd), its written-out backward among them; and its decode step on the caches as one op of three
launches (`mamba2_inner_step`, the contract of `mamba2_inner_step_ref`).

Why one node: built from its modules, the branch records about 45 autograd nodes a layer (the split, the conv, the
step's casts and softplus, -exp(A_log), the scan, the norm's dozen elementwise ops and the views between them), and a
training step of the issue-36 probe is host-bound on an H200 and an H100 (BENCHMARKS.md). Here the backward calls the
kernels directly and takes the step's softplus and bias, the conv's padding and the norm's gradients in a few ops.
Why one op for the decode step: a generate() step with the dynamic cache is bound by its host work, and the three
decode kernels called through their public functions each check and reshape their arguments (the norm through its
autograd function), between the split of in_proj's output and the views of heads and groups; here one set of checks,
and the launches read in_proj's output and the conv's through strides (12 % less host work a step, BENCHMARKS.md).
"""

import torch

from ..causal_conv1d.forward import launch_causal_conv1d_update
from ..causal_conv1d.interface import causal_conv1d_bwd, causal_conv1d_fwd
from ..decay import decay_rates
from ..ssd.decode import SSDUpdateArgs, launch_ssd_state_update
from ..ssd.forward import CHUNK, MAX_HEAD_DIM, SSDBlocks, pick_ssd_blocks
from ..ssd.gated_norm import gated_rms_norm_bwd, gated_rms_norm_fwd, launch_gated_rms_norm_fwd
from ..ssd.interface import check_ssd_inputs, sequence_segments, ssd_chunk_scan_bwd, ssd_chunk_scan_fwd
from ..triton_utils import check_index
from .reference import split_heads_and_groups, step_sizes, zero_padding


class Mamba2InnerFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, zxbcdt, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, padding_mask, seq_idx, n_groups: int,
        eps: float, blocks: SSDBlocks,
    ):  # fmt: skip
        intermediate_size, num_heads = norm_weight.shape[0], A_log.shape[0]
        z, xBC, dt_in = zxbcdt.split([intermediate_size, conv_weight.shape[0], num_heads], dim=-1)
        xBC_conv = causal_conv1d_fwd(
            zero_padding(xBC, padding_mask), conv_weight[:, 0], conv_bias, "silu", seq_idx=seq_idx
        )
        x, B, C = split_heads_and_groups(xBC_conv, intermediate_size, num_heads, n_groups)
        dt = step_sizes(dt_in, dt_bias, padding_mask)
        A, D = decay_rates(A_log), D.contiguous()
        check_ssd_inputs(x, dt, A, B, C, D, None, seq_idx, CHUNK)
        segments = sequence_segments(seq_idx)
        y, _ = ssd_chunk_scan_fwd(x, dt, A, B, C, D, None, segments, CHUNK, blocks, with_final_state=False)
        y = y.flatten(-2)  # [B, T, E]
        out = gated_rms_norm_fwd(y, z, norm_weight, intermediate_size // n_groups, eps)
        # Kept for the backward: the conv's output (the scan's x, B and C), the step and the scan's output (the
        # norm's input), together fewer bytes than the fp32 copies the module path's autograd keeps for the norm.
        ctx.save_for_backward(
            zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, padding_mask, seq_idx, segments, xBC_conv,
            dt, y,
        )  # fmt: skip
        ctx.n_groups, ctx.eps, ctx.blocks, ctx.A_log_dtype = n_groups, eps, blocks, A_log.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        (
            zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, padding_mask, seq_idx, segments, xBC_conv, dt,
            y,
        ) = ctx.saved_tensors  # fmt: skip
        intermediate_size, num_heads = norm_weight.shape[0], A.shape[0]
        widths = [intermediate_size, conv_weight.shape[0], num_heads]
        z, xBC, dt_in = zxbcdt.split(widths, dim=-1)
        # zxbcdt's gradient: in eager, z's and xBC's parts written in place by the norm's and the conv's kernels;
        # under torch.compile each a buffer of its own, concatenated (functionalizing a launch that writes into a view
        # clones the view and copies it back: two passes where the concatenation is one)
        in_place = not torch.compiler.is_compiling()
        d_zxbcdt = torch.empty_like(zxbcdt, memory_format=torch.contiguous_format) if in_place else None
        dz_out, d_xBC_out, ddt_out = d_zxbcdt.split(widths, dim=-1) if in_place else (None, None, None)
        dy, dz, d_norm_weight = gated_rms_norm_bwd(
            y, z, norm_weight, intermediate_size // ctx.n_groups, ctx.eps, dout, dz_out
        )

        x, B, C = split_heads_and_groups(xBC_conv, intermediate_size, num_heads, ctx.n_groups)
        # the gradient of the conv's output [x, B, C], laid out as that output
        d_xBC_conv, ddt, dA, dD, _ = ssd_chunk_scan_bwd(
            x, dt, A, B, C, D, None, segments, dy.unflatten(-1, (num_heads, -1)), None, CHUNK, ctx.blocks
        )
        # dt = softplus(dt_in + dt_bias), times the mask (`step_sizes`): softplus' derivative is the sigmoid.
        ddt = ddt * torch.sigmoid(dt_in.float() + dt_bias.float())
        if padding_mask is not None:
            ddt = ddt * padding_mask[..., None].to(ddt.dtype)
        d_xBC, d_conv_weight, d_conv_bias = causal_conv1d_bwd(
            zero_padding(xBC, padding_mask), conv_weight[:, 0], conv_bias, d_xBC_conv, "silu", seq_idx=seq_idx,
            dx=d_xBC_out,
        )  # fmt: skip
        if padding_mask is not None:
            d_xBC.mul_(padding_mask[..., None].to(d_xBC.dtype))
        if in_place:
            ddt_out.copy_(ddt)
        else:
            d_zxbcdt = torch.cat([dz, d_xBC, ddt.to(zxbcdt.dtype)], dim=-1)
        dA_log = (dA * A).to(ctx.A_log_dtype)  # A = -exp(A_log)
        return (
            d_zxbcdt, d_conv_weight[:, None], d_conv_bias, ddt.sum((0, 1)).to(dt_bias.dtype), dA_log,
            dD.to(D.dtype), d_norm_weight, None, None, None, None, None,
        )  # fmt: skip


def mamba2_inner_fn(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    n_groups: int,
    eps: float,
    padding_mask: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """`mamba2_inner_ref` on the kernels as one autograd node: same arguments (the chunk is the kernels' tile, 64:
    the result does not depend on it) and result, gradients for every tensor but the mask and seq_idx. Heads of up
    to `MAX_HEAD_DIM` channels. No cache: the conv starts from a zero history and the scan from a zero state, per row
    or per packed sequence."""
    intermediate_size, num_heads, state_size = _check_branch(
        zxbcdt, conv_weight, dt_bias, A_log, D, norm_weight, n_groups
    )
    if intermediate_size // num_heads > MAX_HEAD_DIM:
        raise ValueError(
            f"E={intermediate_size} (norm_weight) must be Hs={num_heads} heads of at most {MAX_HEAD_DIM} channels"
        )
    batch_size, seq_len = zxbcdt.shape[:2]
    if padding_mask is not None and tuple(padding_mask.shape) != (batch_size, seq_len):
        raise ValueError(f"padding_mask must be [B, T] = {(batch_size, seq_len)}, got {tuple(padding_mask.shape)}")
    if seq_idx is not None:
        check_index("seq_idx", seq_idx, (batch_size, seq_len), like=zxbcdt)
    if seq_len == 0:
        return zxbcdt.new_empty(batch_size, 0, intermediate_size)
    blocks = pick_ssd_blocks(intermediate_size // num_heads, state_size)
    return Mamba2InnerFunction.apply(
        zxbcdt, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, padding_mask, seq_idx, n_groups, eps, blocks
    )


def _check_branch(zxbcdt, conv_weight, dt_bias, A_log, D, norm_weight, n_groups: int) -> tuple[int, int, int]:
    """The shapes that tie in_proj's output and the branch's weights together; returns (E, Hs, N)."""
    if norm_weight.dim() != 1 or A_log.dim() != 1:
        raise ValueError(
            f"norm_weight must be [E] and A_log [Hs], got {tuple(norm_weight.shape)}, {tuple(A_log.shape)}"
        )
    intermediate_size, num_heads = norm_weight.shape[0], A_log.shape[0]
    conv_channels = conv_weight.shape[0]
    for name, tensor in (("dt_bias", dt_bias), ("D", D)):
        if tuple(tensor.shape) != (num_heads,):
            raise ValueError(f"{name} must be [Hs={num_heads}] (A_log's heads), got {tuple(tensor.shape)}")
    if intermediate_size % num_heads:
        raise ValueError(f"E={intermediate_size} (norm_weight) must be a whole number of Hs={num_heads} heads")
    if (
        num_heads % n_groups
        or conv_channels <= intermediate_size
        or (conv_channels - intermediate_size) % (2 * n_groups)
    ):
        raise ValueError(
            f"conv_weight's {conv_channels} channels must be E + 2GN with E={intermediate_size} and G={n_groups} "
            f"groups dividing the Hs={num_heads} heads"
        )
    if conv_weight.dim() != 3 or conv_weight.shape[1] != 1:
        raise ValueError(f"conv_weight must be [E + 2GN, 1, K] (nn.Conv1d's), got {tuple(conv_weight.shape)}")
    width = intermediate_size + conv_channels + num_heads
    if zxbcdt.dim() != 3 or zxbcdt.shape[-1] != width:
        raise ValueError(
            f"zxbcdt must be [B, T, E + (E + 2GN) + Hs = {width}] (in_proj's output), got {tuple(zxbcdt.shape)}"
        )
    return intermediate_size, num_heads, (conv_channels - intermediate_size) // (2 * n_groups)


# ---------------------------------------------------------------------------------------------------------------------
# Decode: one token per cache row, the conv history and the state updated in place
# ---------------------------------------------------------------------------------------------------------------------


def mamba2_inner_step(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    n_groups: int,
    eps: float,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of the branch between its projections in three launches (the conv update, the state update,
    the gated norm): the contract of `mamba2_inner_step_ref` (same arguments, same result up to fp32 summation
    order). zxbcdt [B, 1, E + (E + 2GN) + Hs] (in_proj's output, read in place: its last dimension contiguous);
    conv_state [>= B, E + 2GN, K-1] and ssm_state [>= B, Hs, P, N] any strides (row i is row i's, updated in place);
    padding_mask [B, 1] or None. No host sync, the grids from shapes: CUDA-graph safe. Under torch.compile it is one
    opaque op (`torch.ops.hybrid_ssm.mamba2_inner_step`), so a compiled decode step keeps it in its graph. Inference
    only (no autograd). Returns [B, 1, E] in zxbcdt's dtype."""
    out = zxbcdt.new_empty(zxbcdt.shape[0], 1, norm_weight.shape[0])  # checked with zxbcdt in the op
    step = torch.ops.hybrid_ssm.mamba2_inner_step if torch.compiler.is_compiling() else _mamba2_inner_step
    step(zxbcdt, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, n_groups, eps, conv_state, ssm_state,
         padding_mask, out)  # fmt: skip
    return out


def _mamba2_inner_step(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    n_groups: int,
    eps: float,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    padding_mask: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    intermediate_size, num_heads, state_size = _check_branch(
        zxbcdt, conv_weight, dt_bias, A_log, D, norm_weight, n_groups
    )
    num_rows, conv_channels, width = zxbcdt.shape[0], conv_weight.shape[0], conv_weight.shape[2]
    head_dim = intermediate_size // num_heads
    if zxbcdt.shape[1] != 1 or zxbcdt.stride(-1) != 1:
        raise ValueError(f"zxbcdt must be [B, 1, ...] with its last dimension contiguous, got {tuple(zxbcdt.shape)} "
                         f"with strides {zxbcdt.stride()}")  # fmt: skip
    for name, tensor in (("conv_bias", conv_bias), ("dt_bias", dt_bias), ("D", D), ("norm_weight", norm_weight)):
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if conv_bias is not None and tuple(conv_bias.shape) != (conv_channels,):
        raise ValueError(f"conv_bias must be [E + 2GN = {conv_channels}], got {tuple(conv_bias.shape)}")
    for name, cache, shape in (
        ("conv_state", conv_state, (conv_channels, width - 1)),
        ("ssm_state", ssm_state, (num_heads, head_dim, state_size)),
    ):
        if cache.dim() != len(shape) + 1 or cache.shape[0] < num_rows or tuple(cache.shape[1:]) != shape:
            raise ValueError(f"{name}: expected [>= {num_rows}, *{shape}] (row i the batch's row i), got "
                             f"{tuple(cache.shape)}")  # fmt: skip
    if ssm_state.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"ssm_state: expected fp32, bf16 or fp16, got {ssm_state.dtype}")
    if padding_mask is not None and tuple(padding_mask.shape) != (num_rows, 1):
        raise ValueError(f"padding_mask: expected ({num_rows}, 1), got {tuple(padding_mask.shape)}")
    if num_rows == 0:  # an empty grid is not a valid launch
        return

    # in_proj's output read through its row stride: z, the conv's input and the step before its bias are column
    # ranges of one [B, width] view. The kernels mask the padding rows (a zero conv input, a zero step), row i owns
    # cache row i, and A = -exp(A_log) is taken in the state update: no aten op runs between the launches (a
    # compiled step would capture each as a graph node of its own).
    row_in = zxbcdt.view(num_rows, -1)
    z, xBC, dt = row_in[:, :intermediate_size], row_in[:, intermediate_size:-num_heads], row_in[:, -num_heads:]
    xBC_conv = torch.empty(num_rows, conv_channels, dtype=zxbcdt.dtype, device=zxbcdt.device)
    launch_causal_conv1d_update(
        xBC, conv_weight[:, 0], conv_bias, conv_state, None, None, xBC_conv, activation="silu",
        padding_mask=padding_mask,
    )  # fmt: skip

    # x [B, Hs, P], B and C [B, G, N] are read in place in the conv's output, at columns 0, E and E + GN.
    y = torch.empty(num_rows, intermediate_size, dtype=zxbcdt.dtype, device=zxbcdt.device)
    row_stride, group_channels = xBC_conv.stride(0), n_groups * state_size
    ssd = SSDUpdateArgs(
        ssm_state, *ssm_state.stride(), xBC_conv, row_stride, head_dim, dt, dt.stride(0), dt_bias,
        A_log, D, xBC_conv[:, intermediate_size:], row_stride, state_size,
        xBC_conv[:, intermediate_size + group_channels :], row_stride, state_size, y, intermediate_size, head_dim,
        dt, dt, num_heads, head_dim, state_size, num_heads // n_groups,
        padding_mask if padding_mask is not None else dt, padding_mask.stride(0) if padding_mask is not None else 0,
    )  # fmt: skip
    launch_ssd_state_update(
        ssd, num_rows, has_indices=False, has_initial_flags=False, has_dt_bias=True, dt_softplus=True,
        has_mask=padding_mask is not None, a_is_log=True,
    )  # fmt: skip
    launch_gated_rms_norm_fwd(y, z, norm_weight, out, intermediate_size // n_groups, eps)


# Eager calls launch directly; a compiled graph calls the op, which dispatches to the same launches (its fake writes
# nothing: the op only mutates its arguments).
torch.library.custom_op(
    "hybrid_ssm::mamba2_inner_step", _mamba2_inner_step, mutates_args=("conv_state", "ssm_state", "out")
).register_fake(lambda *args: None)
