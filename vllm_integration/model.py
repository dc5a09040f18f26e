"""The hybrid model for vLLM: Llama skeleton, with every attention a `HybridAttentionLayer` (window attention plus
the SSM history branch, sharing one input and one `o_proj`). Loads the checkpoint `scripts/convert_to_vllm.py`
writes (fused qkv and gate_up, `A = -exp(A_log)` precomputed, the conv weight as `[E, K]`), or a Transformers
checkpoint directly."""

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.model_executor.models.utils import extract_layer_index

from configuration import HybridConfig

from .attention import HYBRID_ATTENTION_OP, HybridAttentionLayer
from .layout import FUSED_PROJECTIONS, vllm_tensor
from .ssm import hybrid_state_dtypes, hybrid_state_shapes
from .upstream_fixes import rewind_cpu_generators_of_discarded_samples


class HybridMLP(nn.Module):
    def __init__(self, config: HybridConfig, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=False, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))[0]


class HybridAttention(nn.Module):
    """Projections around a `HybridAttentionLayer`: qkv and the SSM's in_proj read the same input; the attention
    output and the SSM branch (after out_proj) are summed before o_proj."""

    def __init__(self, config: HybridConfig, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = tp_size
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        layer_type = config.layer_types[extract_layer_index(prefix)]

        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias or config.qkv_bias,
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
            prefix=f"{prefix}.o_proj",
        )
        self.in_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.ssm_intermediate_size] * 2, bias=False, prefix=f"{prefix}.in_proj"
        )
        # Full-width output on every rank (all-reduced), of which each rank adds its own heads' columns.
        self.out_proj = RowParallelLinear(
            config.ssm_intermediate_size,
            config.num_attention_heads * self.head_dim,
            bias=False,
            input_is_parallel=True,
            prefix=f"{prefix}.out_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
            is_neox_style=True,
        )
        self.attn = HybridAttentionLayer(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            ssm_state_size=config.ssm_state_size,
            ssm_conv_kernel_size=config.ssm_conv_kernel_size,
            ssm_intermediate_size=config.ssm_intermediate_size,
            ssm_dt_rank=config.ssm_dt_rank,
            ssm_conv_bias=config.ssm_conv_bias,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.attn",
            per_layer_sliding_window=config.sliding_window if layer_type == "sliding_attention" else None,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states)[0].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        xz = self.in_proj(hidden_states)[0]  # [T, 2E/tp]: xs | z
        attn_output, ssm_output = self.attn(q, k, v, xz)
        ssm_output = self.out_proj(ssm_output)[0]  # [T, H*D]
        if self.tp_size > 1:
            ssm_output = ssm_output.view(ssm_output.shape[0], self.tp_size, -1)[:, self.tp_rank]
        return self.o_proj(attn_output + ssm_output)[0]


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: HybridConfig, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.self_attn = HybridAttention(config, vllm_config, prefix=f"{prefix}.self_attn")
        self.mlp = HybridMLP(config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0})
class HybridModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, vllm_config, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class HybridForCausalLM(nn.Module, HasInnerState, IsHybrid):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        # Prefix caching: in Mamba "align" mode vLLM schedules chunks that end on block boundaries, keeps each
        # block-boundary state in its own slot and copies a cached one into the running slot (Mamba-1's copy
        # functions: our state has Mamba-1's layout and meaning), so the branch reads and writes one slot per step as
        # without caching. "all" mode would need the kernels to write a state at every block boundary inside a chunk.
        if vllm_config.cache_config.enable_prefix_caching and vllm_config.cache_config.mamba_cache_mode == "all":
            raise ValueError(
                "HybridForCausalLM supports prefix caching in mamba_cache_mode 'align' (the default), not 'all'"
            )
        if vllm_config.speculative_config is not None:
            raise ValueError("HybridForCausalLM does not support speculative decoding yet")
        rewind_cpu_generators_of_discarded_samples()
        # Piecewise compilation must cut the graph at the hybrid op as at vLLM's own attention ops: it reads
        # per-batch metadata on the host (CUDA graphs cannot capture it).
        splitting_ops = vllm_config.compilation_config.splitting_ops
        if (
            vllm_config.compilation_config.splitting_ops_contain_attention()
            and HYBRID_ATTENTION_OP not in splitting_ops
        ):
            splitting_ops.append(HYBRID_ATTENTION_OP)
        self.config = config
        self.model = HybridModel(vllm_config=vllm_config, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        config = vllm_config.model_config.hf_config
        return hybrid_state_shapes(
            vllm_config.parallel_config.tensor_parallel_size,
            config.ssm_intermediate_size,
            config.ssm_state_size,
            config.ssm_conv_kernel_size,
        )

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        cache_config = vllm_config.cache_config
        return hybrid_state_dtypes(
            vllm_config.model_config.dtype, cache_config.mamba_cache_dtype, cache_config.mamba_ssm_cache_dtype
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.mamba1_state_copy_func()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads the converted checkpoint (names as they are here) or a Transformers one, whose q/k/v and gate/up
        are stacked into the fused projections and whose SSM tensors are renamed and transformed on the way."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            name, tensor = vllm_tensor(name, tensor)
            stacked = [(fused, part, shard) for fused, parts in FUSED_PROJECTIONS.items() for part, shard in parts]
            for fused, part, shard_id in stacked:
                if part not in name:
                    continue
                name = name.replace(part, fused)
                param = _checkpoint_param(params, name)
                param.weight_loader(param, tensor, shard_id)
                break
            else:
                param = _checkpoint_param(params, name)
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
        return loaded


def _checkpoint_param(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
    if name not in params:
        raise ValueError(f"unexpected tensor {name!r} in the checkpoint: not a hybrid model of this config")
    return params[name]
