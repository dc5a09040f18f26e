"""The SSM branch between its two projections, as one op (mamba_ssm's `mamba_inner_fn` without in_proj / out_proj):
conv, x_proj, dt_proj, scan and gate from `xz = in_proj(h)` to the `[B, T, E]` that `out_proj` reads.

reference.py   the plain-PyTorch compositions of the conv and scan references, over a sequence and for one decode
               step on the caches (exported here; no Triton needed)
interface.py   one autograd node over the conv and scan kernels and the two GEMMs between them (`mamba_inner_fn`),
               and the decode step in two launches (`mamba_inner_step`, kernels in decode.py): import it where the
               kernels run, `from modeling.ops.mamba_inner.interface import mamba_inner_fn, mamba_inner_step`
"""

from .reference import mamba_inner_ref, mamba_inner_step_ref

__all__ = ["mamba_inner_ref", "mamba_inner_step_ref"]
