import os
import shutil
import sys
from pathlib import Path

# Triton kernels run in Triton's interpreter on machines without a GPU. Set before anything imports triton: its
# standard library is jit-compiled at import time. Engines and servers started by tests drop it again.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from configuration import HybridConfig  # noqa: E402
from modeling import HybridForCausalLM  # noqa: E402


def tiny_config(**overrides) -> HybridConfig:
    """A model small enough for CPU tests, with both layer kinds, GQA and a short window."""
    fields = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ssm_state_size=8,
        ssm_conv_kernel_size=4,
        ssm_intermediate_size=40,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    fields.update(overrides)
    return HybridConfig(**fields)


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Gives the zero-initialised SSM output projection (and the norms) random values, so every path matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("out_proj.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
            elif "norm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture
def make_model():
    def make(seed: int = 0, attn_implementation: str = "eager", **overrides) -> HybridForCausalLM:
        torch.manual_seed(seed)
        model = HybridForCausalLM(tiny_config(**overrides))
        model.set_attn_implementation(attn_implementation)
        return randomize_(model, seed).eval()

    return make
