"""Causal depthwise conv1d of the SSM branch, one module per part (as fla's `fla/ops/<op>/`):

reference.py   plain-PyTorch references, the ground truth of every kernel (exported here; no Triton needed)
forward.py     forward kernels and launchers: training / prefill conv, prefill conv-state write, decode update
backward.py    the training backward kernel and its launcher
interface.py   the public functions (checks, launch policy, autograd): import it where the kernels run,
               `from modeling.ops.causal_conv1d.interface import causal_conv1d_fn`
"""

from .reference import causal_conv1d_ref, causal_conv1d_update_ref, causal_conv1d_varlen_ref

__all__ = ["causal_conv1d_ref", "causal_conv1d_update_ref", "causal_conv1d_varlen_ref"]
