"""The per-head branch normalisation of `config.ssm_branch_norm`, one definition for the Transformers and vLLM models
(plain PyTorch: the two branches' outputs are normalised where they are summed, no kernel of its own)."""

import torch


def rms_normalize_heads(x: torch.Tensor, head_dim: int, eps: float) -> torch.Tensor:
    """x [..., H*D] with each head's D values divided by their root mean square, in fp32 (no weight: the model scales
    each branch with one learnable scalar). Per head, so that a tensor-parallel rank normalises the heads it holds."""
    heads = x.unflatten(-1, (-1, head_dim)).float()
    heads = heads * torch.rsqrt(heads.square().mean(-1, keepdim=True) + eps)
    return heads.flatten(-2).to(x.dtype)
