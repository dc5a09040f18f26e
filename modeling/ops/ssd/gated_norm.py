"""Mamba-2's gated RMSNorm on CUDA: Triton kernels for `gated_rms_norm_ref` and its written-out backward
`gated_rms_norm_bwd_ref` (reference.py: the contract, the math), as mamba_ssm's and vLLM's `layernorm_gated` do it.

forward   one program per (token, group): y and z of the group's channels in registers, g = y silu(z), its root mean
          square, and g / rms(g) * weight stored in y's dtype. fp32 inside.
backward  one program per (block of tokens, group): the group's statistics recomputed from y and z (nothing saved but
          the inputs), dy and dz stored per token, the weight's gradient summed over the block's tokens in registers
          and written once per block; the blocks' partial sums are added after the launch.

Inside a caller that Dynamo is compiling (generate()'s compiled decode step with a static cache, `torch.compile` of
the model) the references are traced instead: Inductor fuses them into the caller's graph.
"""

import torch
import triton
import triton.language as tl

from ..triton_utils import cdiv, next_power_of_2, num_sms
from .reference import gated_rms_norm_bwd_ref, gated_rms_norm_ref


@triton.jit
def _gated_rms_norm_fwd_kernel(
    p_y, p_z, p_weight, p_out, s_y_row, s_z_row, s_out_row, group_size, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    o_col = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    m_col = tl.arange(0, BLOCK) < group_size
    b_y = tl.load(p_y + row * s_y_row + o_col, mask=m_col, other=0.0).to(tl.float32)
    b_z = tl.load(p_z + row * s_z_row + o_col, mask=m_col, other=0.0).to(tl.float32)
    b_g = b_y * b_z * tl.sigmoid(b_z)
    b_inv_rms = tl.rsqrt(tl.sum(b_g * b_g, 0) / group_size + eps)
    b_w = tl.load(p_weight + o_col, mask=m_col, other=0.0).to(tl.float32)
    tl.store(p_out + row * s_out_row + o_col, (b_g * b_inv_rms * b_w).to(p_out.dtype.element_ty), mask=m_col)


@triton.jit
def _gated_rms_norm_bwd_kernel(
    p_y, p_z, p_weight, p_dout, p_dy, p_dz, p_dweight_part, s_y_row, s_z_row, s_dout_row, s_dy_row, s_dz_row,
    num_rows, rows_per_program, channels, group_size, eps, BLOCK: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    o_col = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    m_col = tl.arange(0, BLOCK) < group_size
    b_w = tl.load(p_weight + o_col, mask=m_col, other=0.0).to(tl.float32)
    b_dweight = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = block * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, num_rows)
    first = row_start.to(tl.int64)  # offsets in int64: rows x row stride passes 2^31
    p_y_row, p_z_row = p_y + first * s_y_row + o_col, p_z + first * s_z_row + o_col
    p_dout_row = p_dout + first * s_dout_row + o_col
    p_dy_row, p_dz_row = p_dy + first * s_dy_row + o_col, p_dz + first * s_dz_row + o_col
    for _ in range(row_start, row_end):
        b_y = tl.load(p_y_row, mask=m_col, other=0.0).to(tl.float32)
        b_z = tl.load(p_z_row, mask=m_col, other=0.0).to(tl.float32)
        b_dout = tl.load(p_dout_row, mask=m_col, other=0.0).to(tl.float32)
        b_gate = tl.sigmoid(b_z)
        b_silu = b_z * b_gate
        b_g = b_y * b_silu
        b_inv_rms = tl.rsqrt(tl.sum(b_g * b_g, 0) / group_size + eps)
        b_n = b_g * b_inv_rms
        b_dweight += b_dout * b_n
        b_dn = b_dout * b_w
        b_dg = b_inv_rms * (b_dn - b_n * (tl.sum(b_dn * b_n, 0) / group_size))
        b_dy = b_dg * b_silu
        b_dz = b_dg * b_y * b_gate * (1.0 + b_z * (1.0 - b_gate))  # silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))
        tl.store(p_dy_row, b_dy.to(p_dy.dtype.element_ty), mask=m_col)
        tl.store(p_dz_row, b_dz.to(p_dz.dtype.element_ty), mask=m_col)
        p_y_row += s_y_row
        p_z_row += s_z_row
        p_dout_row += s_dout_row
        p_dy_row += s_dy_row
        p_dz_row += s_dz_row
    tl.store(p_dweight_part + block.to(tl.int64) * channels + o_col, b_dweight, mask=m_col)


def _num_warps(block: int) -> int:
    """A warp per 256 channels of the group, 1 to 8 (as mamba_ssm's gated norm): each thread holds 8 of a row's."""
    return min(max(block // 256, 1), 8)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """[..., E] as [rows, E] with a row stride and contiguous channels (a view where it can be: z is a column slice
    of in_proj's output)."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int) -> None:
    channels = weight.shape[0]
    if y.shape != z.shape or y.shape[-1] != channels or weight.dim() != 1:
        raise ValueError(
            f"gated_rms_norm: expected y and z [..., E] and weight [E], got {tuple(y.shape)}, {tuple(z.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if group_size < 1 or channels % group_size:
        raise ValueError(f"gated_rms_norm: group_size {group_size} must divide the {channels} channels")


def gated_rms_norm_fwd(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float):
    """`gated_rms_norm_ref` on the forward kernel, no autograd (the reference inside a caller Dynamo compiles)."""
    if torch.compiler.is_compiling():
        # A new tensor, not the reference's fp32 `.to()` of itself: Dynamo (torch 2.11) gives an autograd function
        # whose output an op returned as its own input (`.to` to its dtype, `.contiguous()`) a zero output gradient,
        # and the autograd functions here return this one's result. Inductor fuses the clone into the norm's kernel.
        return gated_rms_norm_ref(y, z, weight, group_size, eps).clone()
    _check(y, z, weight, group_size)
    y_rows, z_rows, weight = _rows(y), _rows(z), weight.contiguous()  # the kernels read weight[c] at c
    out = torch.empty(y_rows.shape, dtype=y.dtype, device=y.device)
    if out.numel():
        launch_gated_rms_norm_fwd(y_rows, z_rows, weight, out, group_size, eps)
    return out.view(y.shape)


def launch_gated_rms_norm_fwd(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, group_size: int, eps: float
) -> None:
    """The forward kernel over checked arguments: y, z and out hold one row per index of their first dimension (row
    strides, the row's E channels contiguous), weight [E] contiguous; at least one row."""
    block = next_power_of_2(group_size)
    _gated_rms_norm_fwd_kernel[(y.shape[0], weight.shape[0] // group_size)](
        y, z, weight, out, y.stride(0), z.stride(0), out.stride(0), group_size, eps,
        BLOCK=block, num_warps=_num_warps(block),
    )  # fmt: skip


def gated_rms_norm_bwd(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    dout: torch.Tensor,
    dz: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gated_rms_norm_bwd_ref` on the backward kernel (the reference inside a caller Dynamo compiles): (dy in y's
    dtype, dz in z's, dweight [E] in weight's). dz: where to write z's gradient (z's shape and dtype, its tokens
    viewable as rows of contiguous channels: e.g. a column range of the gradient of in_proj's output), or None for a
    new tensor; not under torch.compile, where the reference computes a new one."""
    if torch.compiler.is_compiling():
        return gated_rms_norm_bwd_ref(y, z, weight, group_size, eps, dout)
    _check(y, z, weight, group_size)
    if dout.shape != y.shape:
        raise ValueError(f"gated_rms_norm_bwd: expected dout {tuple(y.shape)}, got {tuple(dout.shape)}")
    y_rows, z_rows, dout_rows, weight = _rows(y), _rows(z), _rows(dout), weight.contiguous()
    num_rows, channels = y_rows.shape
    dy = torch.empty(y_rows.shape, dtype=y.dtype, device=y.device)
    if dz is None:
        dz = torch.empty(z_rows.shape, dtype=z.dtype, device=z.device)
    elif dz.shape != z.shape or dz.dtype != z.dtype or dz.stride(-1) != 1:
        raise ValueError(f"gated_rms_norm_bwd: dz must be {tuple(z.shape)} {z.dtype} with contiguous channels, got "
                         f"{tuple(dz.shape)} {dz.dtype} with strides {dz.stride()}")  # fmt: skip
    dz_rows = dz.view(num_rows, channels)  # a view, so that the kernel writes into dz itself
    # Enough blocks of tokens to fill the GPU with the groups' programs, each summing its tokens' weight gradients.
    blocks = max(1, min(num_rows, 4 * num_sms(y.device)))
    rows_per_program = cdiv(num_rows, blocks)
    blocks = cdiv(num_rows, rows_per_program) if num_rows else 1
    block = next_power_of_2(group_size)
    dweight_parts = torch.empty(blocks, channels, dtype=torch.float32, device=y.device)  # every (block, group) writes
    if not num_rows:
        dweight_parts.zero_()
    else:
        _gated_rms_norm_bwd_kernel[(blocks, channels // group_size)](
            y_rows, z_rows, weight, dout_rows, dy, dz_rows, dweight_parts, y_rows.stride(0), z_rows.stride(0),
            dout_rows.stride(0), dy.stride(0), dz_rows.stride(0), num_rows, rows_per_program, channels, group_size,
            eps, BLOCK=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return dy.view(y.shape), dz_rows.view(z.shape), dweight_parts.sum(0).to(weight.dtype)


class GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, z, weight, group_size: int, eps: float):
        ctx.save_for_backward(y, z, weight)
        ctx.group_size, ctx.eps = group_size, eps
        return gated_rms_norm_fwd(y, z, weight, group_size, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable  # the written-out backward has no graph: refuse a double backward
    def backward(ctx, dout):
        y, z, weight = ctx.saved_tensors
        dy, dz, dweight = gated_rms_norm_bwd(y, z, weight, ctx.group_size, ctx.eps, dout)
        return dy, dz, dweight, None, None


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """`gated_rms_norm_ref` on the kernels, with its gradients (the reference inside a caller Dynamo compiles)."""
    if torch.compiler.is_compiling():
        return gated_rms_norm_ref(y, z, weight, group_size, eps)
    return GatedRMSNormFunction.apply(y, z, weight, group_size, eps)
