"""The SSM branch between its projections as one op (mamba_ssm's `mamba_inner_fn`, with in_proj and out_proj left
to their modules so that adapters and tensor-parallel plans keep them), in two forms:

    mamba_inner_fn     training and cache-free forwards: one autograd node over the conv kernel, x_proj and dt_proj
                       as plain GEMMs and the scan kernel, the backward of all four written out (`mamba_inner_ref`)
    mamba_inner_step   a decode step on the caches, in two launches (kernels in decode.py; `mamba_inner_step_ref`);
                       under torch.compile one opaque custom op

Why one node: built from modules, the branch records about a dozen autograd nodes a layer (conv, x_proj, the split,
dt_proj, -exp(A_log), the scan and the views between them), and a training step of the issue-36 probe is host-bound
on an H200 (BENCHMARKS.md). Here the same work is one node whose backward calls the GEMMs and kernels directly and
takes dt_proj's bias inside the scan. It dispatches about as many aten ops as the module path (the GEMMs, the
kernels' allocations and reductions stay); what goes is the autograd bookkeeping between them. Why one decode op: a
generate() step with the dynamic cache is bound by its host work, one with the static cache by its launches, and the
module path's step is two kernels, two GEMMs and about thirteen aten ops more.

The module path stays for what these ops cannot see: adapters or quantised layers in place of x_proj / dt_proj /
conv1d, and hooks on them (Mamba1Branch picks), and for the cached prefills (chunked prefill, the scan from a state).
"""

import torch
import torch.nn.functional as F

from ..causal_conv1d.interface import causal_conv1d_bwd, causal_conv1d_fwd
from ..selective_scan.interface import (
    ScanBlocks,
    ScanResiduals,
    check_scan_inputs,
    pick_scan_blocks,
    selective_scan_bwd,
    selective_scan_fwd,
)
from ..triton_utils import check_index, check_tokens
from .decode import launch_mamba_inner_step


class MambaInnerFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D, padding_mask, seq_idx,
        blocks: ScanBlocks,
    ):  # fmt: skip
        batch_size, seq_len, num_channels = xz.shape[0], xz.shape[1], xz.shape[2] // 2
        dt_rank, state_size = dt_proj_weight.shape[1], A_log.shape[1]
        # Under autocast the modules' GEMMs would run in the autocast dtype: so do these (their weights' gradients
        # come back in it, and autograd casts them to the weights' dtypes).
        if torch.is_autocast_enabled(xz.device.type):
            dtype = torch.get_autocast_dtype(xz.device.type)
            x_proj_weight, dt_proj_weight = x_proj_weight.to(dtype), dt_proj_weight.to(dtype)

        xs, z = _conv_input(xz, padding_mask), xz[..., num_channels:]
        u = causal_conv1d_fwd(xs, conv_weight[:, 0], conv_bias, "silu", seq_idx=seq_idx)
        x_dbl = F.linear(u, x_proj_weight)  # [B, T, R + 2N]
        dt_low, B, C = x_dbl.split([dt_rank, state_size, state_size], dim=-1)
        dt = F.linear(dt_low, dt_proj_weight)  # dt_proj's bias is added inside the scan, in fp32
        if padding_mask is not None:
            # softplus(-inf + bias) = 0: a zero step leaves the state as it was, and its gradient is zero
            dt.masked_fill_(padding_mask[..., None] == 0, float("-inf"))
        # The kernels take A = -exp(A_log) (`decay_rates`) themselves, and give back A_log's gradient
        A_log = A_log.contiguous()
        B, C = check_scan_inputs(u, dt, A_log, B, C, D, z, dt_proj_bias, (batch_size, seq_len))
        y, _, residuals = selective_scan_fwd(
            u, dt, A_log, B, C, D, z, None, seq_idx, dt_proj_bias, True, blocks, A_is_log=True
        )
        ctx.save_for_backward(
            xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D, padding_mask, seq_idx,
            u, x_dbl, dt, *residuals,
        )  # fmt: skip
        ctx.blocks = blocks
        return y

    @staticmethod
    def backward(ctx, dy):
        (
            xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D, padding_mask, seq_idx,
            u, x_dbl, dt, chunk_h, chunk_dtsum, seg_states,
        ) = ctx.saved_tensors  # fmt: skip
        blocks: ScanBlocks = ctx.blocks
        num_channels = xz.shape[-1] // 2
        dt_rank, state_size = dt_proj_weight.shape[1], A_log.shape[1]
        dt_low, B, C = x_dbl.split([dt_rank, state_size, state_size], dim=-1)
        z = xz[..., num_channels:]
        # The gradients of xz and of x_dbl = [dt_low, B, C]: in eager, each part written in place (z's by the scan,
        # xs's by the conv, [dB, dC] by the scan's reduction, dt_low's by its GEMM); under torch.compile each writes a
        # buffer of its own and they are concatenated, since functionalizing a launch that writes into a view clones
        # the view and copies it back (two passes where the concatenation is one).
        in_place = not torch.compiler.is_compiling()
        dxz = torch.empty_like(xz, memory_format=torch.contiguous_format) if in_place else None
        d_x_dbl = torch.empty_like(x_dbl) if in_place else None
        du, ddt, dA_log, dB, dC, dD, dz, _, d_dt_bias = selective_scan_bwd(
            u, dt, A_log, B, C, D, z, None, seq_idx, dt_proj_bias, True, blocks,
            ScanResiduals(chunk_h, chunk_dtsum, seg_states), dy, None,
            dxz[..., num_channels:] if in_place else None, d_x_dbl[..., dt_rank:] if in_place else None, A_is_log=True,
        )  # fmt: skip

        # dt = dt_low @ W_dt^T and x_dbl = u @ W_x^T; du gathers the scan's and x_proj's gradients in place.
        if in_place:
            torch.mm(ddt.view(-1, num_channels), dt_proj_weight, out=d_x_dbl.view(-1, x_dbl.shape[-1])[:, :dt_rank])
        else:
            d_x_dbl = torch.cat([ddt @ dt_proj_weight, dB, dC], dim=-1)
        du.view(-1, num_channels).addmm_(d_x_dbl.view(-1, d_x_dbl.shape[-1]), x_proj_weight)
        d_dt_proj_weight = d_x_proj_weight = None
        if ctx.needs_input_grad[4]:
            d_dt_proj_weight = ddt.reshape(-1, num_channels).t() @ dt_low.reshape(-1, dt_rank)
        if ctx.needs_input_grad[3]:
            d_x_proj_weight = d_x_dbl.view(-1, d_x_dbl.shape[-1]).t() @ u.view(-1, num_channels)

        xs = _conv_input(xz, padding_mask)
        dxs, d_conv_weight, d_conv_bias = causal_conv1d_bwd(
            xs,
            conv_weight[:, 0],
            conv_bias,
            du,
            "silu",
            seq_idx=seq_idx,
            dx=dxz[..., :num_channels] if in_place else None,
        )
        if padding_mask is not None:
            dxs.mul_(padding_mask[..., None].to(dxs.dtype))
        if not in_place:
            dxz = torch.cat([dxs, dz], dim=-1)
        return (
            dxz, d_conv_weight[:, None], d_conv_bias, d_x_proj_weight, d_dt_proj_weight, d_dt_bias, dA_log, dD,
            None, None, None,
        )  # fmt: skip


def _conv_input(xz: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """xs, the first half of xz, with padding zeroed (a view of xz when there is none)."""
    xs = xz[..., : xz.shape[-1] // 2]
    return xs if padding_mask is None else xs * padding_mask[..., None].to(xs.dtype)


def mamba_inner_fn(
    xz: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    dt_proj_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The branch from `xz = in_proj(h)` to what `out_proj` reads, on the kernels, as one autograd node: the contract
    of `mamba_inner_ref` (same arguments, same result; gradients for every tensor but the mask and seq_idx).

    xz: [B, T, 2E] (in_proj's output, read in place); conv_weight [E, 1, K]; conv_bias [E] or None; x_proj_weight
    [R + 2N, E]; dt_proj_weight [E, R]; dt_proj_bias [E]; A_log [E, N]; D [E]; padding_mask [B, T] (1 real, 0
    padding) or None; seq_idx [B, T] int32/int64 or None. No cache: the conv starts from a zero history and the scan
    from a zero state, per row or per packed sequence."""
    if xz.dim() != 3 or xz.shape[-1] % 2:
        raise ValueError(f"xz must be [B, T, 2E] (in_proj's output), got {tuple(xz.shape)}")
    batch_size, seq_len, num_channels = xz.shape[0], xz.shape[1], xz.shape[2] // 2
    _check_weights(num_channels, conv_weight, x_proj_weight, dt_proj_weight, A_log)
    if padding_mask is not None and tuple(padding_mask.shape) != (batch_size, seq_len):
        raise ValueError(f"padding_mask must be [B, T] = {(batch_size, seq_len)}, got {tuple(padding_mask.shape)}")
    if seq_idx is not None:
        check_index("seq_idx", seq_idx, (batch_size, seq_len), like=xz)
    if seq_len == 0:
        return xz.new_empty(batch_size, 0, num_channels)
    tensors = (xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D)
    # Without a backward to come (evaluation, no_grad) the scan's checkpoints would be written for nothing.
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    blocks = pick_scan_blocks(batch_size, seq_len, num_channels, A_log.shape[1], save_seg_states=needs_grad)
    return MambaInnerFunction.apply(*tensors, padding_mask, seq_idx, blocks)


def _check_weights(num_channels: int, conv_weight, x_proj_weight, dt_proj_weight, A_log) -> None:
    """The shapes that tie the branch's weights to E channels (the ops check the rest: biases, D, dtypes)."""
    if A_log.dim() != 2 or A_log.shape[0] != num_channels:
        raise ValueError(f"A_log must be [E={num_channels}, N], got {tuple(A_log.shape)}")
    if conv_weight.dim() != 3 or conv_weight.shape[:2] != (num_channels, 1):
        raise ValueError(f"conv_weight must be [E={num_channels}, 1, K] (nn.Conv1d's), got {tuple(conv_weight.shape)}")
    dt_rank, state_size = dt_proj_weight.shape[-1], A_log.shape[1]
    if tuple(dt_proj_weight.shape) != (num_channels, dt_rank):
        raise ValueError(f"dt_proj_weight must be [E={num_channels}, R], got {tuple(dt_proj_weight.shape)}")
    if tuple(x_proj_weight.shape) != (dt_rank + 2 * state_size, num_channels):
        raise ValueError(
            f"x_proj_weight must be [R + 2N, E] = {(dt_rank + 2 * state_size, num_channels)}, "
            f"got {tuple(x_proj_weight.shape)}"
        )


# ---------------------------------------------------------------------------------------------------------------------
# Decode: one token per cache row, the conv and state caches updated in place (kernels in decode.py)
# ---------------------------------------------------------------------------------------------------------------------


def mamba_inner_step(
    xz: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    dt_proj_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of the branch between its projections in two launches: the contract of
    `mamba_inner_step_ref` (same arguments, same result up to fp32 summation order). xz [B, 1, 2E] (in_proj's
    output, read in place: its last dimension contiguous); conv_state [>= B, E, K-1] and ssm_state [>= B, E, N] any
    strides (row i is row i's, updated in place); padding_mask [B, 1] (1 real, 0 padding; any dtype and stride) or
    None. No host sync, the grids from shapes: CUDA-graph safe. Under torch.compile it is one opaque op
    (`torch.ops.hybrid_ssm.mamba_inner_step`), so a compiled decode step keeps it in its graph. Inference only (no
    autograd). Returns y [B, 1, E] in xz's dtype."""
    out = xz.new_empty(*xz.shape[:-1], xz.shape[-1] // 2)  # checked with xz in the op
    step = torch.ops.hybrid_ssm.mamba_inner_step if torch.compiler.is_compiling() else _mamba_inner_step
    step(xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D, conv_state, ssm_state,
         padding_mask, out)  # fmt: skip
    return out


def _mamba_inner_step(
    xz: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    x_proj_weight: torch.Tensor,
    dt_proj_weight: torch.Tensor,
    dt_proj_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    padding_mask: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    if xz.dim() != 3 or xz.shape[1] != 1 or xz.shape[2] % 2:
        raise ValueError(f"xz must be [B, 1, 2E] (in_proj's output for one token), got {tuple(xz.shape)}")
    num_rows, num_channels = xz.shape[0], xz.shape[2] // 2
    _check_weights(num_channels, conv_weight, x_proj_weight, dt_proj_weight, A_log)
    check_tokens("xz", xz, tuple(xz.shape))
    for name, x in (("dt_proj_bias", dt_proj_bias), ("D", D), ("conv_bias", conv_bias)):
        if x is not None and (x.shape != (num_channels,) or not x.is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous ({num_channels},), got {tuple(x.shape)}")
    state_size, width = A_log.shape[1], conv_weight.shape[2]
    for name, cache, shape in (
        ("conv_state", conv_state, (num_channels, width - 1)),
        ("ssm_state", ssm_state, (num_channels, state_size)),
    ):
        if cache.dim() != 3 or cache.shape[0] < num_rows or tuple(cache.shape[1:]) != shape:
            raise ValueError(f"{name}: expected [>= {num_rows}, *{shape}] (row i the batch's row i), got "
                             f"{tuple(cache.shape)}")  # fmt: skip
    if padding_mask is not None and tuple(padding_mask.shape) != (num_rows, 1):
        raise ValueError(f"padding_mask: expected ({num_rows}, 1), got {tuple(padding_mask.shape)}")
    if num_rows == 0:  # an empty grid is not a valid launch
        return
    launch_mamba_inner_step(
        xz, conv_weight, conv_bias, x_proj_weight, dt_proj_weight, dt_proj_bias, A_log, D, conv_state, ssm_state,
        padding_mask, out,
    )  # fmt: skip


# Eager calls launch directly; a compiled graph calls the op, which dispatches to the same launch (its fake writes
# nothing: the op only mutates its arguments).
torch.library.custom_op(
    "hybrid_ssm::mamba_inner_step", _mamba_inner_step, mutates_args=("conv_state", "ssm_state", "out")
).register_fake(lambda *args: None)
