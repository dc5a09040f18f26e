"""Elementwise math shared by the Triton kernels, where `triton.language` lacks a function or its accuracy."""

import triton
import triton.language as tl


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
