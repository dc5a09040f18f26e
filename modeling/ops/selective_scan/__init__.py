"""Mamba-1 selective scan of the SSM branch, one module per part (as fla's `fla/ops/<op>/`):

reference.py   plain-PyTorch references, the ground truth of every kernel (exported here; no Triton needed)
forward.py     the forward kernel (chunk stages) and the chunk combine, with the forward launcher
backward.py    the backward kernel and its launcher
decode.py      the decode step (`ssm_state_update`, one token per request from its state slot), its kernel and the
               launch helpers it shares with vLLM's fused decode (vllm_integration/ops/hybrid_decode)
interface.py   launch policy (`ScanBlocks`), autograd and the public functions: import it where the kernels run,
               `from modeling.ops.selective_scan.interface import selective_scan_fn, selective_state_update`
"""

from .reference import selective_scan_ref, selective_scan_varlen_ref, selective_state_update_ref

__all__ = ["selective_scan_ref", "selective_scan_varlen_ref", "selective_state_update_ref"]
