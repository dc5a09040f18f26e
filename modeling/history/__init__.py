"""The history branch of every layer, one kind per `config.ssm_type`: a `HistoryBranch` subclass (the module, its
initialisation, its ops' dispatch between Triton kernels and PyTorch references) in one file here, its ops in
modeling/ops, its serving side in vllm_integration/history. A new kind is those files and a line in
`HISTORY_BRANCHES`."""

from configuration import HybridConfig

from .branch import HistoryBranch
from .mamba1 import Mamba1Branch
from .mamba2 import Mamba2Branch

HISTORY_BRANCHES: dict[str, type[HistoryBranch]] = {"mamba1": Mamba1Branch, "mamba2": Mamba2Branch}


def build_history_branch(config: HybridConfig, layer_idx: int) -> HistoryBranch:
    return HISTORY_BRANCHES[config.ssm_type](config, layer_idx)


__all__ = ["HISTORY_BRANCHES", "HistoryBranch", "Mamba1Branch", "Mamba2Branch", "build_history_branch"]
