"""The SSM's state decay rates from their log parameter, one definition for every path that reads them: the
Transformers model's branch, the references of `mamba_inner`, and vLLM's weight loader and converter
(vllm_integration/layout.py, which adds the finiteness check a loaded checkpoint needs). The Triton kernels that read
A_log directly (the fused training op's scan, `A_is_log`; the decode steps) compute the same -exp(A_log) in fp32
themselves (Triton's exp: within an ulp or so of torch's)."""

import torch


def decay_rates(A_log: torch.Tensor) -> torch.Tensor:
    """A [E, N] = -exp(A_log), in fp32 whatever A_log's dtype: what the scans read. Differentiable in A_log
    (dA_log = dA * A)."""
    return -torch.exp(A_log.float())
