"""Where each Transformers tensor goes in the vLLM model: the names as data, which vLLM's `WeightsMapper` applies
when loading (model.py) and the converter reads to fuse projections (convert.py), so the two paths cannot disagree.

Values change in one place only, the receiving parameter's weight loader (history/mamba1.py): `A = -exp(A_log)` (fp32), the
conv weight `[E, 1, K]` viewed as `[E, K]`. A converted checkpoint keeps the Transformers names and values of the SSM
tensors; it differs from a Transformers one by its fused projections and its dtype."""

import math

import torch

from modeling.ops import decay_rates

# Transformers projection -> (fused vLLM projection, shard id of vLLM's fused-layer loader), in concatenation order.
STACKED_PROJECTIONS = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", "q"),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", "k"),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v"),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}

# Transformers SSM tensor -> vLLM parameter, substring renames applied in this order (each at most once). in_proj and
# out_proj project the layer input and output beside q/k/v and o_proj; the stateful rest belongs to the attention
# layer's history branch (`self_attn.attn.ssm`).
SSM_RENAMES = {
    ".self_attn.ssm.in_proj.": ".self_attn.in_proj.",
    ".self_attn.ssm.out_proj.": ".self_attn.out_proj.",
    ".self_attn.ssm.conv1d.": ".self_attn.attn.ssm.conv1d_",
    ".self_attn.ssm.A_log": ".self_attn.attn.ssm.A",
    ".self_attn.ssm.norm.": ".self_attn.attn.ssm.norm_",
    ".self_attn.ssm.": ".self_attn.attn.ssm.",
}

# The history branch kinds (`config.ssm_type`) the plugin serves: vllm_integration/history's registry holds their
# layers; the converter, which imports no vLLM, refuses the others by this list (a test keeps the two in step).
SERVED_SSM_TYPES = ("mamba1", "mamba2")

# The SSM tensors that stay fp32 whatever the checkpoint's dtype (the converter writes them so; the kernels read them
# in fp32): the decay rates' log, the skip and Mamba-2's step bias.
FP32_TENSORS = (".A_log", ".D", ".dt_bias")


def a_from_a_log(a_log: torch.Tensor) -> torch.Tensor:
    """The state decay rates A = -exp(A_log), in fp32 (`decay_rates`): what the kernels read. Raises ValueError where
    it overflows float32 (A_log above ~88.7), which no kernel could use."""
    a = decay_rates(a_log)
    if not torch.isfinite(a).all():
        limit = math.log(torch.finfo(torch.float32).max)
        raise ValueError(
            f"A = -exp(A_log) overflows float32 (values above {limit:.1f}; the largest is {a_log.max().item():.4g})"
        )
    return a
