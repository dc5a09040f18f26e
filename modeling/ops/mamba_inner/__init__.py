"""The SSM branch between its two projections, as one op (mamba_ssm's `mamba_inner_fn` without in_proj / out_proj):
conv, x_proj, dt_proj, scan and gate from `xz = in_proj(h)` to the `[B, T, E]` that `out_proj` reads.

reference.py   the plain-PyTorch composition of the conv and scan references (exported here; no Triton needed)
interface.py   one autograd node over the conv and scan kernels and the two GEMMs between them: import it where the
               kernels run, `from modeling.ops.mamba_inner.interface import mamba_inner_fn`
"""

from .reference import mamba_inner_ref

__all__ = ["mamba_inner_ref"]
