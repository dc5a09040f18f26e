"""The Mamba-2 branch between its projections as one op (mamba_ssm's `mamba_split_conv1d_scan_combined`, with
in_proj and out_proj left to their modules so that adapters and tensor-parallel plans keep them).

reference.py   the plain-PyTorch references: `mamba2_inner_ref` (conv, step, chunked scan and gated norm, each the
               reference of its own op) and its decode step on the caches, `mamba2_inner_step_ref`
interface.py   the same on the kernels: one autograd node (`mamba2_inner_fn`) and one op of three launches
               (`mamba2_inner_step`); import it where it is used
"""

from .reference import mamba2_inner_ref, mamba2_inner_step_ref

__all__ = ["mamba2_inner_ref", "mamba2_inner_step_ref"]
