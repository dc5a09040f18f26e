"""Where each Transformers tensor goes in the vLLM model, and how it changes on the way. Pure PyTorch: the converter
(scripts/convert_to_vllm.py) and the vLLM loader (`HybridForCausalLM.load_weights`) share it, so the two loading
paths cannot disagree. q/k/v and gate/up are fused: the converter concatenates them in `FUSED_PROJECTIONS` order,
the loader stacks them through the fused layers' shard loaders."""

import torch

# fused vLLM projection -> (Transformers projection, shard id of vLLM's fused-layer loader), in concatenation order
FUSED_PROJECTIONS = {
    ".self_attn.qkv_proj.": ((".self_attn.q_proj.", "q"), (".self_attn.k_proj.", "k"), (".self_attn.v_proj.", "v")),
    ".mlp.gate_up_proj.": ((".mlp.gate_proj.", 0), (".mlp.up_proj.", 1)),
}


def vllm_tensor(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Maps a Transformers tensor to its vLLM name and value; names already in vLLM's layout pass through."""
    if ".self_attn.ssm." not in name:
        return name, tensor
    prefix, leaf = name.split(".self_attn.ssm.")
    if leaf in ("in_proj.weight", "out_proj.weight"):  # projections of the layer input, beside q/k/v and o_proj
        return f"{prefix}.self_attn.{leaf}", tensor
    state = f"{prefix}.self_attn.attn.ssm."  # the stateful part, owned by the attention layer's SSM adapter
    if leaf == "conv1d.weight":
        return state + "conv1d_weight", tensor[:, 0, :]  # [E, 1, K] -> [E, K]
    if leaf == "conv1d.bias":
        return state + "conv1d_bias", tensor
    if leaf == "A_log":
        return state + "A", -torch.exp(tensor.float())  # the one place A = -exp(A_log) is applied
    if leaf == "D":
        return state + "D", tensor.float()
    return state + leaf, tensor
