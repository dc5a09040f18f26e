"""Sequence-mixing ops of the hybrid model. Each op has a plain-PyTorch reference (`*_ref`) that runs anywhere and is
the ground truth for its fast kernels."""

from .selective_scan import selective_scan_ref

__all__ = ["selective_scan_ref"]
