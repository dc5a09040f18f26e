"""The history branch as vLLM serves it, one kind per `config.ssm_type` (the Transformers side: modeling/history).

A branch kind is a class, owned per layer by `HybridAttentionLayer` (under the prefix `{attention prefix}.ssm`), that
is a vLLM Mamba-style layer (`MambaBase`: its state spec, dtype and metadata backend) and provides:

    Branch(config, cache_config, prefix)        its stateful parameters, loaded under the checkpoint's names
                                                (layout.SSM_RENAMES)
    Branch.in_proj_sizes(config, tp_size)       the parts of `self_attn.in_proj`'s output it reads, in order
    Branch.in_proj_weight_loader(config, tp_size, tp_rank)
                                                in_proj's weight loader where its parts do not split evenly over
                                                the tensor-parallel ranks (Mamba-2's groups), else None
    Branch.state_shapes(config, tp_size)        per-slot state shapes, dtypes and vLLM's copy function, for the
    Branch.state_dtypes(model_dtype, cache_config)  model's classmethods (vLLM asks them before building layers)
    Branch.state_copy_func()
    branch.local_size                           its output width on this rank (out_proj's input)
    branch.forward(in_proj_output, output, metadata, ops, max_prefill_len)
                                                the whole branch over a packed batch (decodes first), from and into
                                                each request's state slots, written into `output`
    Branch.reference_ops / Branch.triton_ops(metadata, with_decode_attention)
                                                its ops on the PyTorch references, or on the CUDA kernels with the
                                                step's metadata, its decode step fused with the decodes' window
                                                attention (`with_decode_attention` binds the attention's arguments
                                                to the branch's fused kernel: `hybrid_decode`, `hybrid_decode_ssd`)

A new kind is an op folder in modeling/ops, one file here and one in modeling/history, and a line in each registry.
"""

from configuration import HybridConfig

from .layer import ServedHistoryBranch
from .mamba1 import Mamba1Branch
from .mamba2 import Mamba2Branch
from .metadata import token_split

HISTORY_BRANCHES = {"mamba1": Mamba1Branch, "mamba2": Mamba2Branch}


def history_branch_class(config: HybridConfig) -> type[ServedHistoryBranch]:
    if config.ssm_type not in HISTORY_BRANCHES:
        served = ", ".join(HISTORY_BRANCHES)
        raise ValueError(
            f"the vLLM plugin serves ssm_type {served}, not {config.ssm_type!r} (Transformers only so far)"
        )
    return HISTORY_BRANCHES[config.ssm_type]


__all__ = [
    "HISTORY_BRANCHES",
    "Mamba1Branch",
    "Mamba2Branch",
    "ServedHistoryBranch",
    "history_branch_class",
    "token_split",
]
