"""Mamba-2's gated RMSNorm on CUDA: its references compiled by TorchInductor, the forward into one fused kernel
(elementwise work and a reduction per group) and the written-out backward into a few (the gradients of y and z per
group, the weight's as a sum over the tokens), which Inductor generates for the installed torch and Triton.

Calls without grad (evaluation, generate(), and every call of the backward) take the batch and time dimensions
symbolic from their first call, so a new batch size or length does not compile again: left to Dynamo's own rule (a
dimension turns dynamic only after it changed, per cached variant), an evaluation after training compiled a variant
per batch size and hit the recompile limit, an error under fullgraph (H200). Training calls keep Dynamo's rule: a
training batch keeps its shape.

Inside a caller that is itself being compiled (generate()'s compiled decode step with a static cache, a user's
`torch.compile` of the model) each hands the caller's graph its reference to trace: Dynamo refuses the shape marks and
config patches there, and the caller's compile covers it anyway.
"""

import torch

from .reference import gated_rms_norm_bwd_ref, gated_rms_norm_ref

# Variants that may exist at once: one per kind of call (grad mode, dtype) and per training shape; more than Dynamo's
# default of 8.
RECOMPILE_LIMIT = 32

_compiled_norm = torch.compile(gated_rms_norm_ref, fullgraph=True)
_compiled_norm_bwd = torch.compile(gated_rms_norm_bwd_ref, fullgraph=True)


def _mark_tokens_dynamic(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(tensor, 1)


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float
) -> torch.Tensor:
    """`gated_rms_norm_ref` compiled; same arguments and result."""
    if torch.compiler.is_compiling():
        return gated_rms_norm_ref(y, z, weight, group_size, eps)
    if not torch.is_grad_enabled():
        _mark_tokens_dynamic(y, z)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return _compiled_norm(y, z, weight, group_size, eps)


def gated_rms_norm_bwd(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float, dout: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gated_rms_norm_bwd_ref` compiled; same arguments and results. y, z and dout [B, T, E]."""
    if torch.compiler.is_compiling():
        return gated_rms_norm_bwd_ref(y, z, weight, group_size, eps, dout)
    _mark_tokens_dynamic(y, z, dout)
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return _compiled_norm_bwd(y, z, weight, group_size, eps, dout)
