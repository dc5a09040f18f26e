"""Mamba-2's chunked scan (state-space duality) and gated RMSNorm.

reference.py   the plain-PyTorch references: the recurrence token by token (`ssd_scan_ref`), the same in SSD's chunked
               form (`ssd_chunk_scan_ref`, the algorithm chunked kernels follow), the one-token decode update
               (`ssd_state_update_ref`, over a cache of state slots), the packed prefills over the same slots
               (`ssd_varlen_scan_ref`) and the grouped gated RMSNorm (`gated_rms_norm_ref`) with its gradients
               written out (`gated_rms_norm_bwd_ref`)

forward.py     the chunked scan's forward kernels: the walk over the chunks (the states entering each chunk; reversed,
               their gradients), then the outputs; the launch shapes (`SSDBlocks`)
backward.py    its backward: the states recomputed and their gradients walked back, then every input's gradient per
               chunk
varlen.py      serving's packed prefills over a cache of state slots: the same walk and outputs, each sequence in
               chunks of its own, its state read from and written back to its slot
interface.py   the scan on the kernels with its autograd (`ssd_chunk_scan_fn`, the reference's contract) and the
               packed prefills (`ssd_varlen_scan_fwd`, `ssd_varlen_scan_ref`'s); import it where it is used, as the
               other ops' kernel modules

gated_norm.py  the gated norm's forward and backward kernels (`gated_rms_norm` with its autograd, and
               `gated_rms_norm_fwd` / `gated_rms_norm_bwd` for ops that run it inside their own)

decode.py      the decode update's Triton kernel (`ssd_state_update`, the reference's contract; a custom op under
               torch.compile)
"""

from .reference import (
    gated_rms_norm_bwd_ref,
    gated_rms_norm_ref,
    ssd_chunk_scan_ref,
    ssd_scan_ref,
    ssd_state_update_ref,
    ssd_varlen_scan_ref,
)

__all__ = [
    "gated_rms_norm_bwd_ref",
    "gated_rms_norm_ref",
    "ssd_chunk_scan_ref",
    "ssd_scan_ref",
    "ssd_state_update_ref",
    "ssd_varlen_scan_ref",
]
