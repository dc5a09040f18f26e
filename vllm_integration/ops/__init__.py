"""The kernels of the vLLM backend (`HybridTritonAttentionImpl`), in vLLM's layouts: the paged KV cache of its Triton
attention backend and the Mamba-style state cache. Each op is a folder with its plain-PyTorch reference (the ground
truth, exported here without importing Triton), its kernels and its interface (launch policy, checks, the public
functions; import it where the kernels run):

    paged_attention   window attention over the paged KV cache for packed prefills and chunked prefills (rows of
                      any query length; what vLLM's prefills run)
    hybrid_decode     the decode step: the window attention and the history branch's state update fused in one
                      launch (`hybrid_decode`, `hybrid_decode_ssd`: what vLLM's decodes run)
    attention_tile.py the window-attention steps both attention kernels are built from: the online-softmax step
                      over a tile of paged keys, and the merge of split-K partials (the fused decode's)

The glossary of dimension letters is in paged_attention/reference.py; tests in tests/vllm_ops/, one file per op. The
SSM branch's other kernels (conv, scan, and the state update alone, whose SSM step `hybrid_decode` runs) are shared
with the Transformers model and live in modeling/ops.
"""

from .hybrid_decode import hybrid_decode_ref, hybrid_decode_ssd_ref, window_attention_decode_ref
from .paged_attention import paged_window_attention_ref

__all__ = [
    "hybrid_decode_ref",
    "hybrid_decode_ssd_ref",
    "paged_window_attention_ref",
    "window_attention_decode_ref",
]
