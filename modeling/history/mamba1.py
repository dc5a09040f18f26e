"""The Mamba-1 history branch (`ssm_type="mamba1"`, docs/DESIGN.md): causal depthwise conv, input-dependent step and
state projections, selective scan with a diagonal state per channel, gated by silu(z). Its ops are in modeling/ops
(causal_conv1d, selective_scan, mamba_inner), each with its PyTorch reference beside its Triton kernels."""

import importlib.util
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.utils import logging

from configuration import HybridConfig

from ..ops import (
    causal_conv1d_ref,
    causal_conv1d_update_ref,
    decay_rates,
    mamba_inner_ref,
    mamba_inner_step_ref,
    selective_scan_ref,
    selective_state_update_ref,
)
from .branch import HistoryBranch, slow_down_decays

logger = logging.get_logger(__name__)

# The SSM branch's Triton kernels (causal conv1d and selective scan, forward and backward) run on CUDA tensors; Triton
# ships with PyTorch's CUDA builds. Elsewhere, or with `config.use_ssm_kernels=False`, the PyTorch references run.
is_fast_path_available = importlib.util.find_spec("triton") is not None


class Mamba1Ops(NamedTuple):
    """The SSM branch's ops, all Triton kernels or all PyTorch references (same signatures): the whole branch between
    its projections with no cache (one autograd node on the kernels) and its one-token decode step on the caches
    (two launches), the conv and the scan over sequences, and the one-token decode step of each, in place on the
    cached history and state."""

    mamba_inner: Callable
    mamba_inner_step: Callable
    causal_conv1d: Callable
    selective_scan: Callable
    conv_update: Callable
    state_update: Callable


REFERENCE_OPS = Mamba1Ops(
    mamba_inner_ref, mamba_inner_step_ref, causal_conv1d_ref, selective_scan_ref, causal_conv1d_update_ref,
    selective_state_update_ref,
)  # fmt: skip
KERNEL_OPS = None
if is_fast_path_available:
    from ..ops.causal_conv1d.interface import causal_conv1d_fn, causal_conv1d_update
    from ..ops.mamba_inner.interface import mamba_inner_fn, mamba_inner_step
    from ..ops.selective_scan.interface import selective_scan_fn, selective_state_update

    KERNEL_OPS = Mamba1Ops(
        mamba_inner_fn, mamba_inner_step, causal_conv1d_fn, selective_scan_fn, causal_conv1d_update,
        selective_state_update,
    )  # fmt: skip


class Mamba1Branch(HistoryBranch):
    """Mamba-1 selective-SSM history branch. Reads the layer's normalised input `h` and returns `[B, T, H*D]`, which
    the attention adds to its own output before `o_proj`.

    The state is carried in `HybridCache` across forward calls, so prefill, chunked prefill and decoding all run the
    same code: the conv continues from the cached last K-1 inputs and the scan from the cached state.
    """

    no_weight_decay = ("A_log", "D")

    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__(layer_idx)
        self.intermediate_size = config.ssm_intermediate_size
        self.state_size = config.ssm_state_size
        self.conv_kernel_size = config.ssm_conv_kernel_size
        self.dt_rank = config.ssm_dt_rank
        self.dt_min, self.dt_max, self.dt_init_floor = config.ssm_dt_min, config.ssm_dt_max, config.ssm_dt_init_floor
        self.slow_channel_fraction = config.ssm_slow_channel_fraction
        self.use_kernels = config.use_ssm_kernels

        self.in_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.conv1d = nn.Conv1d(
            self.intermediate_size,
            self.intermediate_size,
            kernel_size=self.conv_kernel_size,
            groups=self.intermediate_size,
            bias=config.ssm_conv_bias,
        )
        self.x_proj = nn.Linear(self.intermediate_size, self.dt_rank + 2 * self.state_size, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.intermediate_size, bias=True)
        self.A_log = nn.Parameter(torch.empty(self.intermediate_size, self.state_size))
        self.D = nn.Parameter(torch.empty(self.intermediate_size))
        self.out_proj = nn.Linear(self.intermediate_size, config.num_attention_heads * config.head_dim, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        past_key_values: Cache | None = None,
        padding_mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        add_to: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states: [B, T, hidden]; padding_mask: [B, T], 1 for real tokens, 0 for padding (or `None`);
        seq_idx: [B, T] index of the packed sequence each token belongs to (or `None`: one sequence per row);
        add_to: what the output is added to (`HistoryBranch.forward`)."""
        ops = self._ops_for(hidden_states)
        has_history = past_key_values is not None and past_key_values.has_previous_state(self.layer_idx)

        # 1. Input projection: xs feeds the conv and the scan, z gates the output. Padding is zeroed so that the conv
        #    of the first real token sees the same zero history as at the start of a sequence.
        xz = self.in_proj(hidden_states)  # [B, T, 2E]
        if past_key_values is None and self._inner_modules_are_plain():
            # Steps 2-4 below as one op: on the kernels one autograd node instead of about a dozen
            y = ops.mamba_inner(
                xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight, self.dt_proj.bias,
                self.A_log, self.D, padding_mask, seq_idx,
            )  # fmt: skip
            return self._project_out(y, add_to)
        layer_cache = past_key_values.layers[self.layer_idx] if has_history else None
        if layer_cache is not None and xz.shape[1] == 1 and seq_idx is None and not layer_cache.record_past:
            return self._project_out(self._decode_step(xz, layer_cache, padding_mask, ops), add_to)

        xs, z = xz.chunk(2, dim=-1)  # [B, T, E] each
        if padding_mask is not None:
            xs = xs * padding_mask[..., None].to(xs.dtype)

        # 2. Causal depthwise conv (silu fused), continuing from the cached last K-1 inputs.
        conv_history = layer_cache.conv_states[0] if has_history else None  # [B, E, K-1]
        u = ops.causal_conv1d(xs, self.conv1d.weight[:, 0], self.conv1d.bias, "silu", conv_history, seq_idx)
        if past_key_values is not None:
            # Updates the cached history in place: only after the conv has read it.
            past_key_values.update_conv_state(
                xs.transpose(1, 2), self.layer_idx, conv_kernel_size=self.conv_kernel_size - 1
            )

        # 3. Input-dependent step size and state projections. The step is softplus(dt_proj(...)), the softplus taken
        #    inside the scan in fp32: the backward keeps dt_proj's [B, T, E] output alone, not fp32 copies before and
        #    after an elementwise softplus.
        dt_low, B, C = self.x_proj(u).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        dt = self.dt_proj(dt_low)  # [B, T, E]
        if padding_mask is not None:
            # softplus(-inf) = 0, and a zero step leaves the state exactly as it was: padding never enters the state.
            dt = dt.masked_fill(padding_mask[..., None] == 0, float("-inf"))

        # 4. Selective scan in fp32 from the cached state; packed sequences each start from zero.
        A = decay_rates(self.A_log)  # [E, N]
        initial_state = layer_cache.recurrent_states[0] if has_history else None
        y, final_state = ops.selective_scan(u, dt, A, B, C, self.D, z, initial_state, seq_idx, dt_softplus=True)
        if past_key_values is not None:
            past_key_values.update_recurrent_state(final_state.detach(), self.layer_idx)

        return self._project_out(y, add_to)

    def _decode_step(self, xz, layer_cache, padding_mask, ops: Mamba1Ops) -> torch.Tensor:
        """Steps 2-4 for one new token per row, xz [B, 1, 2E]: the decode ops update the cached conv history and
        state in place (the scan's recurrence at T = 1 without its chunk machinery; no host sync). A padding token
        (padding_mask [B, 1] 0) does what it does in the scan: its zeroed xs enters the history, the state stays as
        it was (the update's padding slot, -1; its output, zeros, is nobody's). Returns y [B, 1, E].

        With plain modules the whole step is one op (`mamba_inner_step`: two launches on the kernels, where the
        modules take two kernels, two GEMMs and about thirteen aten ops more: a generate() step with the dynamic cache
        is bound by that host work, one with the static cache by its launches)."""
        conv_state, ssm_state = layer_cache.conv_states[0], layer_cache.recurrent_states[0]
        if self._inner_modules_are_plain():
            # Steps 2-4 as one op, as `mamba_inner` does them without a cache
            return ops.mamba_inner_step(
                xz, self.conv1d.weight, self.conv1d.bias, self.x_proj.weight, self.dt_proj.weight, self.dt_proj.bias,
                self.A_log, self.D, conv_state, ssm_state, padding_mask,
            )  # fmt: skip
        # 1b. xs and z of the token, padding zeroed, as in `forward`; 2. the conv update; 3. x_proj and dt_proj,
        #     called (an adapter on either takes part, as in the prefill); 4. the state update, softplus in fp32
        xs, z = xz[:, 0].chunk(2, dim=-1)  # [B, E] each
        rows = stepped = torch.arange(xz.shape[0], device=xz.device, dtype=torch.int32)  # row i owns cache row i
        if padding_mask is not None:
            xs = xs * padding_mask.to(xs.dtype)
            stepped = torch.where(padding_mask[:, 0].bool(), rows, -1)
        u = ops.conv_update(xs, self.conv1d.weight[:, 0], self.conv1d.bias, conv_state, rows, "silu")
        dt_low, B, C = self.x_proj(u).split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        dt = self.dt_proj(dt_low)  # its bias included: the update's own bias is zero
        y = torch.empty_like(u)
        no_bias = torch.zeros_like(self.D)
        ops.state_update(ssm_state, u, dt, decay_rates(self.A_log), B, C, self.D, z, no_bias, stepped, y)
        return y[:, None]

    def _inner_modules_are_plain(self) -> bool:
        """Whether `mamba_inner` may read conv1d's, x_proj's and dt_proj's weights directly (`_are_plain`)."""
        return self._are_plain((self.conv1d, nn.Conv1d), (self.x_proj, nn.Linear), (self.dt_proj, nn.Linear))

    def _ops_for(self, hidden_states: torch.Tensor) -> Mamba1Ops:
        """The Triton kernels for CUDA tensors, else the PyTorch references."""
        if hidden_states.is_cuda and self.use_kernels:
            if is_fast_path_available:
                return KERNEL_OPS
            logger.warning_once(
                "The SSM branch runs its slow PyTorch reference on CUDA because Triton is not installed "
                "(`pip install triton`); set `config.use_ssm_kernels=False` to silence this."
            )
        return REFERENCE_OPS

    def state_numel(self) -> tuple[int, int]:
        return self.intermediate_size * (self.conv_kernel_size - 1), self.intermediate_size * self.state_size

    @torch.no_grad()
    def memory_timescales(self, hidden_states: torch.Tensor) -> torch.Tensor:
        xs, _ = self.in_proj(hidden_states).chunk(2, dim=-1)
        u = causal_conv1d_ref(xs, self.conv1d.weight[:, 0], self.conv1d.bias, "silu")
        dt_low = self.x_proj(u)[..., : self.dt_rank]
        dt = F.softplus(self.dt_proj(dt_low).float())  # [B, T, E]
        slowest_rate = (-decay_rates(self.A_log)).min(dim=-1).values  # [E]: a channel's slowest state
        return 1.0 / (dt * slowest_rate)

    @torch.no_grad()
    def init_weights(self) -> None:
        # Mamba's S4D-real init: A = -(1..N) per channel (a share of the channels near no decay, if asked); D = 1.
        A = torch.arange(1, self.state_size + 1, dtype=torch.float32, device=self.A_log.device)
        A_log = torch.log(A).expand(self.intermediate_size, -1)
        init.copy_(self.A_log, slow_down_decays(A_log, self.slow_channel_fraction))
        init.ones_(self.D)
        # Mamba's init of the input side (PyTorch's default, as in mamba_ssm): uniform within 1/sqrt(fan_in), not
        # the std-0.02 normal of the other projections. What the state gives back at a token is a product of
        # in_proj, conv and x_proj (u, B and C): with any of them at 0.02 it starts near nothing (on the demo's
        # model, 1e-5 of the skip term D * u with in_proj and x_proj at 0.02, 3e-3 with this init), and so does
        # the gradient that teaches the branch to recall.
        init.kaiming_uniform_(self.in_proj.weight, a=math.sqrt(5))
        init.kaiming_uniform_(self.conv1d.weight, a=math.sqrt(5))
        init.kaiming_uniform_(self.x_proj.weight, a=math.sqrt(5))
        if self.conv1d.bias is not None:
            init.zeros_(self.conv1d.bias)
        dt_init_std = self.dt_rank**-0.5
        init.uniform_(self.dt_proj.weight, -dt_init_std, dt_init_std)
        # dt bias such that softplus(bias) is log-uniform in [dt_min, dt_max]; the inverse softplus gives it.
        log_dt = torch.rand(self.intermediate_size, device=self.dt_proj.bias.device)
        log_dt = log_dt * (torch.log(torch.tensor(self.dt_max)) - torch.log(torch.tensor(self.dt_min)))
        dt = torch.exp(log_dt + torch.log(torch.tensor(self.dt_min))).clamp(min=self.dt_init_floor)
        init.copy_(self.dt_proj.bias, dt + torch.log(-torch.expm1(-dt)))
        # A fresh model is the attention model plus a branch that learns to help.
        init.zeros_(self.out_proj.weight)
