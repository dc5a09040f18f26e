"""Helpers shared by the Triton kernels: math that `triton.language` lacks (or lacks the accuracy of), and the
device facts the launchers size their grids from."""

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device; 1 on CPU (Triton's interpreter runs programs one at a time)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def softplus(x):
    """softplus as torch computes it (linear above 20) with log1p's accuracy for small exp(x), which tl lacks:
    log(w) * e / (w - 1) with w = 1 + e cancels the rounding of w (Goldberg's log1p)."""
    b_e = tl.exp(tl.minimum(x, 20.0))
    b_w = 1.0 + b_e
    b_e_rounded = b_w - 1.0
    m_tiny = b_e_rounded == 0.0  # 1 + e == 1: log1p(e) == e to fp32 precision
    b_log1p = tl.where(m_tiny, b_e, tl.log(b_w) * (b_e / tl.where(m_tiny, 1.0, b_e_rounded)))
    return tl.where(x > 20.0, x, b_log1p)
