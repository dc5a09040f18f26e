"""The hybrid model for vLLM: Llama skeleton, with every attention a `HybridAttentionLayer` (window attention plus
the SSM history branch, sharing one input and one `o_proj`). Loads a Transformers checkpoint or the one
`scripts/convert_to_vllm.py` writes (projections fused, one dtype), through vLLM's `AutoWeightsLoader` with the
names of layout.py."""

import functools
from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_reduce_scatter,
)
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsLoRA, SupportsPP
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    WeightsMapper,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
)
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from configuration import HybridConfig
from modeling.ops import rms_normalize_heads

from .attention import HYBRID_ATTENTION_OP, HybridAttentionLayer
from .compat import auto_weights_loader
from .layout import SSM_RENAMES, STACKED_PROJECTIONS
from .history import history_branch_class
from .upstream_fixes import rewind_cpu_generators_of_discarded_samples, skip_rows_without_adapter_in_cpu_lora_ops


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
        history_branch = history_branch_class(config)
        self.in_proj = MergedColumnParallelLinear(
            config.hidden_size, history_branch.in_proj_sizes(config, tp_size), bias=False, prefix=f"{prefix}.in_proj"
        )
        in_proj_loader = history_branch.in_proj_weight_loader(config, tp_size, get_tensor_model_parallel_rank())
        if in_proj_loader is not None:
            self.in_proj.weight.weight_loader = in_proj_loader
        # Each rank's partial sums over its channels, reduce-scattered in forward: each rank receives the summed
        # columns of its own heads, which is all its o_proj input needs.
        self.out_proj = RowParallelLinear(
            config.ssm_intermediate_size,
            config.num_attention_heads * self.head_dim,
            bias=False,
            input_is_parallel=True,
            reduce_results=False,
            prefix=f"{prefix}.out_proj",
        )
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
            is_neox_style=True,
        )
        # config.ssm_branch_norm: each branch normalised per head (this rank's heads) and scaled before the sum.
        self.ssm_branch_norm = config.ssm_branch_norm
        self.branch_norm_eps = config.rms_norm_eps
        if self.ssm_branch_norm:
            self.attn_branch_scale = nn.Parameter(torch.ones(1))
            self.ssm_branch_scale = nn.Parameter(torch.ones(1))
        self.attn = HybridAttentionLayer(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            make_history_branch=functools.partial(history_branch, config, vllm_config.cache_config),
            sliding_window=config.sliding_window if layer_type == "sliding_attention" else None,
            max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states)[0].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        in_proj_output = self.in_proj(hidden_states)[0]  # [T, sum(in_proj_sizes) / tp], e.g. xs | z
        attn_output, ssm_output = self.attn(q, k, v, in_proj_output)
        ssm_output = self.out_proj(ssm_output)[0]  # [T, H*D] partial sums over this rank's channels
        if self.tp_size > 1:
            ssm_output = tensor_model_parallel_reduce_scatter(ssm_output, dim=-1)  # [T, H*D/tp]: this rank's heads
        if self.ssm_branch_norm:
            eps = self.branch_norm_eps
            attn_output = self.attn_branch_scale * rms_normalize_heads(attn_output, self.head_dim, eps)
            ssm_output = self.ssm_branch_scale * rms_normalize_heads(ssm_output, self.head_dim, eps)
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


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class HybridModel(nn.Module):
    """The decoder stack; under pipeline parallelism each rank holds its slice of the layers (with their KV and SSM
    states), the first rank the embedding, the last the final norm, and the ranks pass (hidden states, residual)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        pp_group = get_pp_group()
        # The last rank needs the embedding too when the LM head is tied to it.
        if pp_group.is_first_rank or (config.tie_word_embeddings and pp_group.is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: HybridDecoderLayer(config, vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if pp_group.is_last_rank else PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class HybridForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsLoRA, SupportsPP):
    # LoRA adapters name the Transformers projections; vLLM maps them onto the fused ones (and in_proj, one
    # Transformers projection, onto the [xs | z] halves of its merged layer).
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
        "in_proj": ["in_proj"],
    }
    embedding_modules = {"embed_tokens": "input_embeddings", "lm_head": "output_embeddings"}
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_substr=SSM_RENAMES, orig_to_new_stacked=STACKED_PROJECTIONS)

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
        lora_config = vllm_config.lora_config
        if lora_config is not None and current_platform.is_cuda_alike():
            # vLLM's GPU LoRA kernels (punica's Triton ops) take half-precision activations and adapters only: on an
            # fp32 model they fail an assert inside the first batch with an adapter, after the engine started.
            # (LoRAConfig resolves its lora_dtype, "auto" by default, to the model's when the VllmConfig is built.)
            dtypes = {vllm_config.model_config.dtype, lora_config.lora_dtype}
            if not dtypes <= {torch.float16, torch.bfloat16}:
                raise ValueError(
                    f"LoRA on a GPU needs a float16 or bfloat16 model and adapters (vLLM's LoRA kernels take no other "
                    f"dtype): got model dtype {vllm_config.model_config.dtype} and lora_dtype "
                    f"{lora_config.lora_dtype}; serve with --dtype bfloat16"
                )
        rewind_cpu_generators_of_discarded_samples()
        skip_rows_without_adapter_in_cpu_lora_ops()
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
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head")
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(config.vocab_size)
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        config = vllm_config.model_config.hf_config
        return history_branch_class(config).state_shapes(config, vllm_config.parallel_config.tensor_parallel_size)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        history_branch = history_branch_class(vllm_config.model_config.hf_config)
        return history_branch.state_dtypes(vllm_config.model_config.dtype, vllm_config.cache_config)

    def get_mamba_state_copy_func(self):
        # vLLM's model runners call this on the built model, whose config names the branch kind.
        return history_branch_class(self.config).state_copy_func()

    def get_mamba_state_copy_funcs(self, mamba_types) -> dict:
        # vLLM 0.29 and later ask for the copy functions per Mamba backend type, through this class method of
        # `IsHybrid`, which calls `get_mamba_state_copy_func` on the class: here on the model, which knows its branch.
        copy_funcs = self.get_mamba_state_copy_func()
        return {mamba_type: copy_funcs for mamba_type in mamba_types}

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = auto_weights_loader(self, tied_lm_head=self.config.tie_word_embeddings)
        return loader.load_weights(_reject_precomputed_a(weights), mapper=self.hf_to_vllm_mapper)


def _reject_precomputed_a(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """Checkpoints hold A_log; a tensor named A is A = -exp(A_log) already (an older converter's output), which A's
    loader would transform again."""
    for name, tensor in weights:
        if name.endswith(".ssm.A"):
            raise ValueError(
                f"{name}: this checkpoint holds A = -exp(A_log), written by an older scripts/convert_to_vllm.py; "
                "convert the Transformers checkpoint again"
            )
        yield name, tensor
