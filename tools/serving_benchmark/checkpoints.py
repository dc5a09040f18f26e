"""The models compared and their checkpoints: random weights, the same shapes, the hybrids converted for vLLM."""

import json
import shutil
from pathlib import Path

import torch

MODELS = ("hybrid", "hybrid-v2", "hybrid-mamba2", "swa", "swa-matched", "llama")
HYBRIDS = ("hybrid", "hybrid-v2", "hybrid-mamba2")
# The checkpoint a model serves where it is not its own: hybrid-v2 serves the hybrid's (on another model runner).
SERVED_CHECKPOINT = {"hybrid-v2": "hybrid"}


def checkpoint_of(model: str) -> str:
    return SERVED_CHECKPOINT.get(model, model)


def hybrid_config(shape: dict, max_len: int, name: str = "hybrid"):
    """The hybrid of `shape`: its Mamba-1 branch (`ssm_state_size`), or for `hybrid-mamba2` the Mamba-2 branch of
    `shape["mamba2"]` (head dim, groups, state size, chunk, conv kernel; the heads derived from E)."""
    from configuration import HybridConfig

    branch = {"ssm_state_size": shape["ssm_state_size"]}
    if name == "hybrid-mamba2":
        branch = {"ssm_type": "mamba2", **shape["mamba2"]}
    return HybridConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        sliding_window=shape["window"],
        layer_types=["sliding_attention"] * shape["num_hidden_layers"],
        ssm_intermediate_size=shape["ssm_intermediate_size"],
        max_position_embeddings=max_len,
        **branch,
    )


def baseline_config(name: str, hybrid):
    """The (Mamba-1) hybrid's shapes without the SSM branch: full attention (Llama), or every layer sliding
    (Mistral-style; vLLM's Llama/Mistral code reads the window per layer from `layer_types`), with the hybrid's MLP or
    one widened to the hybrid's parameter count (`swa-matched`)."""
    if name == "llama":
        return hybrid.attention_only_config(full_attention=True)
    config = hybrid.attention_only_config()
    if name == "swa-matched":
        from tools.lm_benchmark.models import parameter_matched_intermediate_size

        config.intermediate_size = parameter_matched_intermediate_size(hybrid)
    config.layer_types = ["sliding_attention"] * hybrid.num_hidden_layers
    return config


def write_checkpoint(name: str, root: Path, shape: dict, max_len: int) -> Path:
    """The model directory vLLM loads; built once per shape (random weights), reused after."""
    from transformers import LlamaForCausalLM, MistralForCausalLM

    from modeling import HybridForCausalLM
    from vllm_integration.convert import convert_checkpoint

    target = root / name
    if (target / "config.json").exists():
        if json.loads((target / "config.json").read_text())["max_position_embeddings"] >= max_len:
            return target
        shutil.rmtree(target)  # built for shorter sequences
    torch.manual_seed(0)
    dtype = getattr(torch, shape["dtype"])
    if name in HYBRIDS:
        HybridForCausalLM(hybrid_config(shape, max_len, name)).to(dtype).save_pretrained(root / f"{name}-hf")
        convert_checkpoint(root / f"{name}-hf", target, shape["dtype"])
    else:
        model_class = LlamaForCausalLM if name == "llama" else MistralForCausalLM
        model_class(baseline_config(name, hybrid_config(shape, max_len))).to(dtype).save_pretrained(target)
    return target
