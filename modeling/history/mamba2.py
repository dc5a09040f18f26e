"""The Mamba-2 history branch (`ssm_type="mamba2"`, docs/DESIGN.md): SSD, as Transformers' `Mamba2Mixer` and vLLM's
`MambaMixer2` compute it, with the gated norm grouped as mamba_ssm groups it. Heads of P channels share one decay
each, B and C are shared within groups of heads; the scan's state is [Hs, P, N] per sequence. Its ops: the causal
conv of modeling/ops/causal_conv1d (over the E + 2GN channels of x, B and C) and modeling/ops/ssd (the references,
and on CUDA the chunked scan's, the gated norm's and the decode update's Triton kernels)."""

import importlib.util
import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.utils import logging

from configuration import HybridConfig

from ..ops import (
    causal_conv1d_ref,
    decay_rates,
    gated_rms_norm_ref,
    mamba2_inner_ref,
    mamba2_inner_step_ref,
    ssd_chunk_scan_ref,
)
from ..ops.mamba2_inner.reference import split_heads_and_groups, step_sizes, zero_padding
from .branch import HistoryBranch, slow_down_decays

logger = logging.get_logger(__name__)

# On CUDA tensors: the conv's Triton kernels (the Mamba-1 branch's, any channel count), the chunked scan's Triton
# kernels, the gated norm's Triton kernels, and the branch between its projections as one op over these (training and
# cache-free forwards), and its decode step as one op (the conv's and the norm's kernels and the state update's).
causal_conv1d_fn = ssd_chunk_scan_fn = gated_rms_norm = mamba2_inner_fn = mamba2_inner_step = None
if importlib.util.find_spec("triton") is not None:
    from ..ops.causal_conv1d.interface import causal_conv1d_fn
    from ..ops.mamba2_inner.interface import mamba2_inner_fn, mamba2_inner_step
    from ..ops.ssd.forward import MAX_HEAD_DIM
    from ..ops.ssd.gated_norm import gated_rms_norm
    from ..ops.ssd.interface import ssd_chunk_scan_fn


class Mamba2GatedRMSNorm(nn.Module):
    """rmsnorm(y * silu(z)) over each of G groups of E/G channels, times a learned weight [E] (mamba_ssm's
    `RMSNormGated` with `group_size`; Transformers' `MambaRMSNormGated` is the case G = 1)."""

    def __init__(self, hidden_size: int, group_size: int, eps: float, use_kernels: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.group_size, self.eps, self.use_kernels = group_size, eps, use_kernels

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        on_kernels = y.is_cuda and self.use_kernels and gated_rms_norm is not None
        norm = gated_rms_norm if on_kernels else gated_rms_norm_ref
        return norm(y, z, self.weight, self.group_size, self.eps)


class Mamba2Branch(HistoryBranch):
    """Mamba-2 history branch. Reads the layer's normalised input `h` and returns `[B, T, H*D]`, which the attention
    adds to its own output before `o_proj`. The conv history `[B, E + 2GN, K-1]` and the state `[B, Hs, P, N]` (fp32)
    are carried in the hybrid cache across forward calls."""

    no_weight_decay = ("A_log", "D", "dt_bias")

    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__(layer_idx)
        self.intermediate_size = config.ssm_intermediate_size
        self.num_heads, self.head_dim = config.ssm_num_heads, config.ssm_head_dim
        self.n_groups, self.state_size = config.ssm_n_groups, config.ssm_state_size
        self.conv_kernel_size = config.ssm_conv_kernel_size
        self.chunk_size = config.ssm_chunk_size
        self.dt_min, self.dt_max, self.dt_init_floor = config.ssm_dt_min, config.ssm_dt_max, config.ssm_dt_init_floor
        self.slow_channel_fraction = config.ssm_slow_channel_fraction
        self.use_kernels = config.use_ssm_kernels
        self.conv_channels = self.intermediate_size + 2 * self.n_groups * self.state_size

        self.in_proj = nn.Linear(
            config.hidden_size, self.intermediate_size + self.conv_channels + self.num_heads, bias=False
        )
        self.conv1d = nn.Conv1d(
            self.conv_channels,
            self.conv_channels,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_channels,
            bias=config.ssm_conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = Mamba2GatedRMSNorm(
            self.intermediate_size, self.intermediate_size // self.n_groups, config.rms_norm_eps, self.use_kernels
        )
        self.out_proj = nn.Linear(self.intermediate_size, config.num_attention_heads * config.head_dim, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        past_key_values: Cache | None = None,
        padding_mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        add_to: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        has_history = past_key_values is not None and past_key_values.has_previous_state(self.layer_idx)
        layer_cache = past_key_values.layers[self.layer_idx] if has_history else None

        # 1. Input projection: z gates the output, xBC feeds the conv, dt the step.
        zxbcdt = self.in_proj(hidden_states)
        on_kernels = self._on_kernels(hidden_states)
        plain = self._inner_modules_are_plain()
        if past_key_values is None and plain and not (on_kernels and self.head_dim > MAX_HEAD_DIM):
            # Steps 2-5 below as one op: on the kernels one autograd node instead of about 45 (heads wider than the
            # scan's kernels take run the steps below, the scan on its reference)
            weights = (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight)
            if on_kernels:
                y = mamba2_inner_fn(zxbcdt, *weights, self.n_groups, self.norm.eps, padding_mask, seq_idx)
            else:
                y = mamba2_inner_ref(
                    zxbcdt, *weights, self.n_groups, self.norm.eps, padding_mask, seq_idx, self.chunk_size
                )
            return self._project_out(y, add_to)
        if layer_cache is not None and length == 1 and seq_idx is None and not layer_cache.record_past and plain:
            # Steps 2-5 for one new token per row as one op, the cached conv history and state updated in place
            # (no chunk machinery, no host sync): on the kernels three launches under one set of checks, where a
            # generate() step with the dynamic cache is bound by host work. With a hook on the conv or the norm (an
            # adapter) a decode step takes the steps below, as any forward does.
            step = mamba2_inner_step if on_kernels else mamba2_inner_step_ref
            y = step(
                zxbcdt, self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight,
                self.n_groups, self.norm.eps, layer_cache.conv_states[0], layer_cache.recurrent_states[0],
                padding_mask,
            )  # fmt: skip
            return self._project_out(y, add_to)
        z, xBC, dt = zxbcdt.split([self.intermediate_size, self.conv_channels, self.num_heads], dim=-1)
        xBC = zero_padding(xBC, padding_mask)

        # 2. Causal depthwise conv (silu fused) over x, B and C, continuing from the cached last K-1 inputs.
        conv_history = layer_cache.conv_states[0] if has_history else None  # [B, E + 2GN, K-1]
        conv = causal_conv1d_fn if on_kernels else causal_conv1d_ref
        xBC_conv = conv(xBC, self.conv1d.weight[:, 0], self.conv1d.bias, "silu", conv_history, seq_idx)
        if past_key_values is not None:
            # Updates the cached history in place: only after the conv has read it.
            past_key_values.update_conv_state(
                xBC.transpose(1, 2), self.layer_idx, conv_kernel_size=self.conv_kernel_size - 1
            )
        x, B, C = split_heads_and_groups(xBC_conv, self.intermediate_size, self.num_heads, self.n_groups)

        # 3. The step per head, in fp32; a padding token steps by zero and leaves the state as it was.
        dt = step_sizes(dt, self.dt_bias, padding_mask)  # [B, T, Hs]

        # 4. The chunked scan from the cached state; packed sequences each start from zero. The result does not
        #    depend on the chunk, the work does: the kernels take their tile (64), the reference the config's chunk,
        #    no longer than the input.
        initial_state = layer_cache.recurrent_states[0] if has_history else None
        A = decay_rates(self.A_log)
        if on_kernels and self.head_dim <= MAX_HEAD_DIM:
            y, final_state = ssd_chunk_scan_fn(x, dt, A, B, C, self.D, initial_state, seq_idx)
        else:
            if on_kernels:
                logger.warning_once(
                    f"The Mamba-2 branch's scan runs its PyTorch reference: its kernels take heads of up to "
                    f"{MAX_HEAD_DIM} channels, this model's have ssm_head_dim={self.head_dim}."
                )
            chunk = min(self.chunk_size, length)
            y, final_state = ssd_chunk_scan_ref(x, dt, A, B, C, self.D, chunk, initial_state, seq_idx)
        if past_key_values is not None:
            past_key_values.update_recurrent_state(final_state.detach(), self.layer_idx)

        # 5. Gated RMSNorm per group of E/G channels, then the output projection.
        return self._project_out(self.norm(y.reshape(batch, length, -1), z), add_to)

    def _on_kernels(self, hidden_states: torch.Tensor) -> bool:
        """The Triton kernels for CUDA tensors (Triton installed), unless the config says `use_ssm_kernels=False`."""
        return hidden_states.is_cuda and self.use_kernels and causal_conv1d_fn is not None

    def _inner_modules_are_plain(self) -> bool:
        """Whether the inner ops may read conv1d's and the norm's weights directly (`_are_plain`)."""
        return self._are_plain((self.conv1d, nn.Conv1d), (self.norm, Mamba2GatedRMSNorm))

    def state_numel(self) -> tuple[int, int]:
        return self.conv_channels * (self.conv_kernel_size - 1), self.num_heads * self.head_dim * self.state_size

    @torch.no_grad()
    def memory_timescales(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dt = self.in_proj(hidden_states)[..., -self.num_heads :]
        dt = step_sizes(dt, self.dt_bias)  # [B, T, Hs]
        return 1.0 / (dt * -decay_rates(self.A_log))

    @torch.no_grad()
    def init_weights(self) -> None:
        # docs/DESIGN.md: A = -a with a uniform in [1, 16] per head (a share of the heads near no decay, if asked);
        # D = 1; softplus(dt_bias) log-uniform in [dt_min, dt_max] (the inverse softplus gives the bias); W_out = 0.
        A_log = torch.log(torch.empty(self.num_heads, device=self.A_log.device).uniform_(1, 16))
        init.copy_(self.A_log, slow_down_decays(A_log, self.slow_channel_fraction))
        init.ones_(self.D)
        log_dt = torch.rand(self.num_heads, device=self.dt_bias.device)
        log_dt = log_dt * (math.log(self.dt_max) - math.log(self.dt_min)) + math.log(self.dt_min)
        dt = torch.exp(log_dt).clamp(min=self.dt_init_floor)
        init.copy_(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        # The input side as the Mamba-1 branch initialises it (PyTorch's default, as mamba_ssm).
        init.kaiming_uniform_(self.in_proj.weight, a=math.sqrt(5))
        init.kaiming_uniform_(self.conv1d.weight, a=math.sqrt(5))
        if self.conv1d.bias is not None:
            init.zeros_(self.conv1d.bias)
        init.ones_(self.norm.weight)
        init.zeros_(self.out_proj.weight)
