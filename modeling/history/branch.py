"""What a history branch is to the layer that owns it: `HybridAttention` builds one per layer for `config.ssm_type`
(`modeling.history.HISTORY_BRANCHES`) and talks to it through this class only."""

import math
from abc import ABC, abstractmethod

import torch
from torch import nn
from transformers.cache_utils import Cache

# How much smaller the decay rates of `config.ssm_slow_channel_fraction`'s channels start. At the largest initial step
# (dt_max 0.1) and the largest default rate (16) an e-folding time of 1 / (0.1 * 16 * 1e-4) = 6,250 tokens, beyond
# the language-model benchmark's training context; Adam's steps on A_log (~lr each) keep it slow through training.
SLOW_DECAY_FACTOR = 1e-4


def slow_down_decays(A_log: torch.Tensor, fraction: float) -> torch.Tensor:
    """The initial `A_log` (dim 0: the branch's channels or heads) with the decay rates of its last fraction * rows
    rows, rounded half up, made `SLOW_DECAY_FACTOR` times smaller (`config.ssm_slow_channel_fraction`). Half up, not
    Python's half to even: a quarter of a Mamba-2 branch's 2 heads is one slow head, not none."""
    slow = math.floor(fraction * A_log.shape[0] + 0.5)
    if slow == 0:
        return A_log
    A_log = A_log.clone()
    A_log[A_log.shape[0] - slow :] += math.log(SLOW_DECAY_FACTOR)
    return A_log


class HistoryBranch(nn.Module, ABC):
    """A sequence mixer that reads the layer's normalised input `h` beside the window attention and returns what it
    adds to the attention's output before `o_proj` (docs/DESIGN.md, `s = SSM(h)`).

    Its parameters live under `self_attn.ssm.` (checkpoint names per branch kind in docs/DESIGN.md). Across forward
    calls it carries its state in the model's hybrid cache layers (Transformers' `LinearAttentionAnd*Layer`: a conv
    history `conv_states` and a recurrent state `recurrent_states` per layer, shaped by the branch), so prefill,
    chunked prefill and decoding run the same code.
    """

    # Parameters that train without weight decay (`modeling.training.HybridTrainer` reads this attribute of every
    # module), as the branch's own recipe trains them, e.g. Mamba's A_log and D.
    no_weight_decay: tuple[str, ...] = ()

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def _are_plain(self, *modules: tuple[nn.Module, type]) -> bool:
        """Whether a fused op may read these (module, plain type) pairs' weights directly instead of calling them:
        only when each is exactly its plain type with no hooks, and no global module hook is set. An adapter
        (PEFT), a quantised layer or a hook on any of them needs the module path, which calls each module. The
        same test as `nn.Module.__call__`'s own fast path (run every decode step, a layer: plain reads, no loop over
        names)."""
        if nn.modules.module._has_any_global_hook():
            return False
        for module, plain in modules:
            if type(module) is not plain or (
                module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks
            ):  # fmt: skip
                return False
        return True

    def _project_out(self, y: torch.Tensor, add_to: torch.Tensor | None) -> torch.Tensor:
        """`out_proj(y)`, or `add_to + out_proj(y)`: the sum as the GEMM's own accumulation (addmm) where `out_proj`
        is a plain bias-free `Linear` over a plain weight, so that it takes no kernel of its own (one launch a layer
        fewer, and one graph node of a compiled decode step). An adapter or a hook on `out_proj`, or a weight that is
        a tensor subclass (a tensor-parallel shard: a DTensor), gets the module called and the sum after it."""
        if add_to is None:
            return self.out_proj(y)
        weight = self.out_proj.weight
        if self.out_proj.bias is None and type(weight) is nn.Parameter and self._are_plain((self.out_proj, nn.Linear)):
            return torch.addmm(add_to.flatten(0, -2), y.flatten(0, -2), weight.t()).view(add_to.shape)
        return add_to + self.out_proj(y)

    @abstractmethod
    def forward(
        self,
        hidden_states: torch.Tensor,
        past_key_values: Cache | None = None,
        padding_mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        add_to: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states: [B, T, hidden]; padding_mask: [B, T], 1 for real tokens, 0 for padding (or `None`; padding
        never enters the state); seq_idx: [B, T] index of the packed sequence each token belongs to (or `None`: one
        sequence per row; each packed sequence starts from a zero state). With `past_key_values` the branch continues
        from this layer's cached state and leaves its new state there. Returns s [B, T, num_heads * head_dim], or
        `add_to + s` when given `add_to` of that shape (`_project_out`)."""

    @abstractmethod
    def state_numel(self) -> tuple[int, int]:
        """(conv history, recurrent state) elements the branch keeps per sequence, whatever the context length."""

    @abstractmethod
    def memory_timescales(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """How long the state remembers at each token of a sequence read from its start (no cache), in tokens: per
        token and per decay the branch has (a channel's slowest state, a head's), the e-folding time 1 / (dt |A|) of
        the step it takes there. [B, T, decays]. A diagnostic (tools/lm_benchmark), no part of the forward."""

    @abstractmethod
    def init_weights(self) -> None:
        """The branch's own initialisation (docs/DESIGN.md), run by `HybridPreTrainedModel._init_weights` after the
        generic init of its submodules. `out_proj` starts at zero: a fresh or upcycled model is its attention
        model."""
