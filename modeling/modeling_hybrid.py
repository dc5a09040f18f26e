"""PyTorch hybrid model: every decoder layer runs sliding-window (or full) attention in parallel with a selective-SSM
"history branch" that carries what has left the window. docs/DESIGN.md fixes the math and the names.

Read top to bottom: cache, small modules, attention (which owns the history branch of `config.ssm_type`, built from
modeling/history), decoder layer, `PreTrainedModel`, model, LM head.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionAndStaticFullAttentionLayer,
    LinearAttentionAndStaticSlidingWindowAttentionLayer,
    StaticCache,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.generation import GenerationMixin
from transformers.masking_utils import (
    create_causal_mask,
    create_sliding_window_causal_mask,
    find_packed_sequence_indices,
    sliding_window_overlay,
)
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from configuration import HybridConfig

from .history import HistoryBranch, build_history_branch
from .ops import rms_normalize_heads


logger = logging.get_logger(__name__)


class HybridCache(DynamicCache):
    """Per layer, Transformers' hybrid cache layer: the attention KV (only the last W-1 tokens for a sliding layer)
    plus the SSM conv state `[B, E, K-1]` and ssm state `[B, E, N]` (fp32).

    `DynamicCache(config=...)` would build plain attention layers from `layer_types`, which have no room for the SSM
    states, so the model builds this one (`generate()` included).
    """

    def __init__(self, config: HybridConfig):
        layers = [
            LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=config.sliding_window)
            if layer_type == "sliding_attention"
            else LinearAttentionAndFullAttentionLayer()
            for layer_type in config.layer_types
        ]
        Cache.__init__(self, layers=layers)


class HybridStaticFullAttentionLayer(LinearAttentionAndStaticFullAttentionLayer):
    # The SSM mixin comes first in the MRO and reports no maximum (-1) for the whole layer: give the buffer's length.
    get_max_length = StaticLayer.get_max_length


class HybridStaticSlidingWindowAttentionLayer(LinearAttentionAndStaticSlidingWindowAttentionLayer):
    get_max_length = StaticSlidingWindowLayer.get_max_length


class HybridStaticCache(StaticCache):
    """`HybridCache` with buffers of fixed shapes, for `torch.compile` and CUDA graphs
    (`generate(cache_implementation="static")`): per layer, Transformers' static hybrid layer, the attention KV in a
    `[B, KVH, L, D]` buffer (L = `max_cache_len`, or min(window, `max_cache_len`) for a sliding layer) and the same
    SSM states. Each buffer is allocated at the first forward and then updated in place, at its address.

    It holds at most `max_cache_len` tokens (prompt and new tokens): beyond that a full-attention layer fails to
    index its buffer, and a sliding layer narrower than its window forgets tokens the window still covers.
    `StaticCache(config=...)` would build attention-only layers from `layer_types`, so the model builds this one.
    """

    def __init__(self, config: HybridConfig, max_cache_len: int):
        layers = [
            HybridStaticSlidingWindowAttentionLayer(max_cache_len, config.sliding_window)
            if layer_type == "sliding_attention"
            else HybridStaticFullAttentionLayer(max_cache_len)
            for layer_type in config.layer_types
        ]
        Cache.__init__(self, layers=layers)

    @property
    def is_linear(self) -> list[bool]:
        # Every layer holds attention KV beside its SSM states: none is SSM-only. Transformers 5.23's masks size the
        # full-attention mask from the first layer that is neither sliding nor linear, and its `Cache.is_linear`
        # exempts the dynamic full-and-linear layer but not the static one, so it would take a sliding layer's sizes.
        return [False] * len(self.layers)


HYBRID_CACHES = (HybridCache, HybridStaticCache)


class HybridRMSNorm(LlamaRMSNorm):
    pass


class HybridRotaryEmbedding(LlamaRotaryEmbedding):
    pass


class HybridMLP(nn.Module):
    """SwiGLU: down(act(gate(h)) * up(h))."""

    def __init__(self, config: HybridConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class HybridAttention(nn.Module):
    """GQA attention with RoPE over a sliding window (or the full prefix), plus the SSM history branch that reads the
    same input; `o_proj` projects their sum."""

    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        qkv_bias = config.attention_bias or config.qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.ssm = build_history_branch(config, layer_idx) if config.use_ssm_branch else None
        if config.ssm_branch_norm:  # one learnable scale per branch ([1], not 0-d: FSDP shards no scalars)
            self.attn_branch_scale = nn.Parameter(torch.ones(1))
            if self.ssm is not None:
                self.ssm_branch_scale = nn.Parameter(torch.ones(1))
        # Scales, like a norm's weight: trained without weight decay (`modeling.training.HybridTrainer`).
        self.no_weight_decay = tuple(name for name in ("attn_branch_scale", "ssm_branch_scale") if hasattr(self, name))

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        padding_mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        attention_window: int | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """attention_window: a sliding layer's window for this forward when narrower than the config's (the masks
        carry it too; the flash kernels read it here), as `HybridModel.attention_window` sets it."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        # 1. Window attention.
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, H, T, D]
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, KVH, T, D]
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=attention_window if self.sliding_window and attention_window else self.sliding_window,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1)  # [B, T, H*D]

        # 2. History branch on the same input, summed before the output projection (by the branch's own output
        #    projection: `add_to`). With config.ssm_branch_norm the attention's output and the branch's (where there
        #    is one) are each normalised per head and scaled first.
        if self.config.ssm_branch_norm:
            eps = self.config.rms_norm_eps
            attn_output = self.attn_branch_scale * rms_normalize_heads(attn_output, self.head_dim, eps)
            if self.ssm is not None:
                ssm_output = self.ssm(hidden_states, past_key_values, padding_mask, seq_idx)
                attn_output = attn_output + self.ssm_branch_scale * rms_normalize_heads(ssm_output, self.head_dim, eps)
        elif self.ssm is not None:
            attn_output = self.ssm(hidden_states, past_key_values, padding_mask, seq_idx, add_to=attn_output)
        return self.o_proj(attn_output), attn_weights


class HybridDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: HybridConfig, layer_idx: int):
        super().__init__()
        self.self_attn = HybridAttention(config, layer_idx)
        self.mlp = HybridMLP(config)
        self.input_layernorm = HybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = HybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        padding_mask: torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            padding_mask=padding_mask,
            seq_idx=seq_idx,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


class HybridPreTrainedModel(PreTrainedModel):
    config: HybridConfig
    config_class = HybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["HybridDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # The SSM state cannot be rolled back: no assisted generation, no cache cropping.
    _is_stateful = True
    # What generate() compiles, a decode step on the HybridStaticCache, traces as one graph: on the kernels (their
    # custom ops, torch.ops.hybrid_ssm.*) and on the references (tensor code, no branch on the slots' values). Prefill
    # runs eagerly in generate(); it is not claimed here.
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": HybridDecoderLayer,
        "attentions": HybridAttention,
    }

    def set_attention_window(self, window: int | None) -> None:
        """Narrows the sliding layers' attention window to `window` tokens (at most `config.sliding_window`) for the
        forwards that follow, or restores the config's with None. Full-attention layers are unchanged. A training
        recipe (`modeling.training.StochasticWindowCallback`): with attention seeing less, the SSM branch has to
        carry more; the saved model keeps the config's window."""
        if window is not None:
            if "sliding_attention" not in self.config.layer_types:
                raise ValueError("set_attention_window: the model has no sliding-window layer to narrow")
            if isinstance(window, bool) or not isinstance(window, int) or not 0 < window <= self.config.sliding_window:
                raise ValueError(
                    f"set_attention_window takes a window in [1, sliding_window = {self.config.sliding_window}] or "
                    f"None, got {window!r}"
                )
        self.base_model.attention_window = window

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, HybridAttention) and module.config.ssm_branch_norm:
            init.ones_(module.attn_branch_scale)
            if module.ssm is not None:
                init.ones_(module.ssm_branch_scale)
        if isinstance(module, HistoryBranch):
            module.init_weights()


def packed_sequence_index(
    batch_size: int,
    seq_len: int,
    position_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    reads_cache: bool,
    seq_idx: torch.Tensor | None,
    flash_kwargs: dict,
) -> torch.Tensor | None:
    """[B, T] index of the sequence each token belongs to when rows pack several sequences (padding-free training,
    `DataCollatorWithFlattening`), else None. The SSM branch restarts its state and conv history where it changes,
    as the attention does at the same boundaries. Taken from, in order: the collator's `seq_idx`; flash-attention's
    `cu_seq_lens_q` (offsets into the flattened batch); `position_ids` that restart (Transformers' rule for its
    masks: a new sequence wherever a position is not its predecessor's plus one), on a forward that reads no cache and
    has no padding mask."""
    if seq_idx is not None:
        if tuple(seq_idx.shape) != (batch_size, seq_len) or seq_idx.is_floating_point():
            raise ValueError(
                f"seq_idx must be an integer tensor of shape [batch, seq_len] = {(batch_size, seq_len)}, got "
                f"{seq_idx.dtype} {tuple(seq_idx.shape)}"
            )
        return seq_idx
    cu_seq_lens = flash_kwargs.get("cu_seq_lens_q")
    if cu_seq_lens is not None:
        if cu_seq_lens.dim() != 1 or cu_seq_lens.shape[0] < 2:
            raise ValueError(f"cu_seq_lens_q must be [num_sequences + 1] offsets, got {tuple(cu_seq_lens.shape)}")
        tokens = torch.arange(batch_size * seq_len, device=cu_seq_lens.device, dtype=cu_seq_lens.dtype)
        return torch.searchsorted(cu_seq_lens[1:].contiguous(), tokens, right=True).view(batch_size, seq_len)
    if position_ids is None or attention_mask is not None or reads_cache:
        return None
    return find_packed_sequence_indices(position_ids.expand(batch_size, -1))


def reads_cache(past_key_values: Cache | None) -> bool:
    """Whether this forward's attention reads keys from the cache. A static cache always does, as buffers of its own
    size, so it sizes the masks even while empty (and is tested first, so that its length, a tensor, is never read
    on the host); a dynamic one once it holds tokens."""
    return past_key_values is not None and (past_key_values.is_compileable or past_key_values.get_seq_length() > 0)


def hybrid_masks(
    config: HybridConfig,
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    past_key_values: Cache | None,
    position_ids: torch.Tensor | None = None,
    attention_window: int | None = None,
    **kwargs,
) -> dict:
    """The masks of one forward: the attention's, by layer type, and under "ssm" the padding of its tokens [B, T] (1
    for real tokens) that the SSM branch zeroes, or None without a 2D mask (a 4D one carries no padding it can use).
    The padding is taken whatever the mask holds (multiplying by an all-ones mask is exact): no branch on its values,
    so the model exports with a mask. generate() builds these once per step outside a compiled forward
    (`create_masks_for_generate`), so that the growing 2D mask never enters the graph. `attention_window` narrows the
    sliding layers' window (`HybridModel.attention_window`)."""
    mask_kwargs = {
        "config": config,
        "inputs_embeds": inputs_embeds,
        "attention_mask": attention_mask,
        # An empty dynamic cache sizes the masks as no cache does; passing none lets the masks find packed sequences
        # in `position_ids` (which they skip whenever a cache is given) on a first forward.
        "past_key_values": past_key_values if reads_cache(past_key_values) else None,
        "position_ids": position_ids,
    }
    masks = {}
    if "full_attention" in config.layer_types:
        masks["full_attention"] = create_causal_mask(**mask_kwargs)
    if "sliding_attention" in config.layer_types:
        narrower = sliding_window_overlay(attention_window) if attention_window else None
        masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs, and_mask_function=narrower)
    has_padding = attention_mask is not None and attention_mask.ndim == 2
    masks["ssm"] = attention_mask[:, -inputs_embeds.shape[1] :].contiguous() if has_padding else None
    return masks


class HybridModel(HybridPreTrainedModel):
    def __init__(self, config: HybridConfig):
        # A config's fields check their types when assigned; what they must be together, and each one's range, is
        # checked here too, for a config changed after it was built. Fewer layers than `layer_types` names (e.g.
        # `from_pretrained(..., num_hidden_layers=1)`, which Transformers' models serve from the first entries) keep
        # the first entries, so that the config stays whole for `save_pretrained`.
        if isinstance(config.layer_types, list) and len(config.layer_types) > config.num_hidden_layers:
            config.layer_types = config.layer_types[: config.num_hidden_layers]
        config.validate()
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [HybridDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = HybridRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = HybridRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        # A window narrower than `config.sliding_window` for the sliding layers, or None: a training recipe that
        # leaves more of the context to the SSM branch (`set_attention_window`; not saved with the model).
        self.attention_window: int | None = None
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        r"""
        attention_mask (`torch.Tensor` of shape `(batch_size, past_length + sequence_length)`, *optional*):
            1 for tokens to attend to, 0 for padding. Padding also never enters the SSM state; with left padding, a row
            gives exactly what the unpadded prompt alone gives.
        past_key_values (`HybridCache`, *optional*):
            Attention KV and SSM states of the tokens seen so far; created when `use_cache` and none is given, except
            in training mode.
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        # A training forward builds no cache unless given one (Mamba's default in Transformers): filling it would copy
        # every layer's states for nothing, and its sliding layers' first update waits for the GPU.
        if use_cache and past_key_values is None and not self.training:
            past_key_values = HybridCache(self.config)
        if (
            past_key_values is not None
            and self.config.use_ssm_branch
            and not isinstance(past_key_values, HYBRID_CACHES)
        ):
            raise ValueError(
                "past_key_values must be a HybridCache or a HybridStaticCache (they hold the SSM states), "
                f"got {type(past_key_values).__name__}"
            )

        batch_size, seq_len = inputs_embeds.shape[:2]
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        seq_idx = packed_sequence_index(
            batch_size,
            seq_len,
            position_ids,
            attention_mask,
            reads_cache(past_key_values),
            kwargs.pop("seq_idx", None),
            kwargs,
        )
        if not isinstance(causal_mask_mapping := attention_mask, dict):
            # The caller's position_ids, not the default below: Transformers' masks look for packed sequences in
            # them, and reading the answer is a host sync, which positions counted from 0 need not pay.
            causal_mask_mapping = hybrid_masks(
                self.config, inputs_embeds, attention_mask, past_key_values, position_ids, self.attention_window
            )
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        padding_mask = causal_mask_mapping.get("ssm")

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer, layer_type in zip(self.layers, self.config.layer_types):
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask_mapping[layer_type],
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                padding_mask=padding_mask,
                seq_idx=seq_idx,
                attention_window=self.attention_window,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
        )


class HybridForCausalLM(HybridPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # As Llama's: the plans for the base model's modules live in the config (`base_model_tp_plan`/`_pp_plan`).
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: HybridConfig):
        super().__init__(config)
        self.model = HybridModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    # generate() builds the masks of a step outside the compiled forward when the cache is static.
    create_masks_for_generate = staticmethod(hybrid_masks)

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ) -> None:
        # generate() would build its caches from `layer_types`, with no room for the SSM states: give it ours.
        if model_kwargs.get("past_key_values") is not None or generation_config.use_cache is False:
            super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
            return
        implementation = generation_config.cache_implementation
        if implementation in (None, "dynamic"):
            model_kwargs["past_key_values"] = HybridCache(self.config)
        elif implementation == "static":
            # As generate() sizes a StaticCache: room for this call, for `max_cache_len` if it asks for more, and never
            # less than an earlier call's, so that the compiled step keeps its shapes from call to call.
            max_cache_len = max(
                max_cache_length,
                generation_config.max_cache_len or 0,
                getattr(self, "_previous_max_cache_length", -1),
            )
            self._previous_max_cache_length = max_cache_len
            model_kwargs["past_key_values"] = HybridStaticCache(self.config, max_cache_len)
        else:
            raise ValueError(
                "HybridForCausalLM generates with its HybridCache (cache_implementation None or 'dynamic') or its "
                f"HybridStaticCache ('static'); cache_implementation={implementation!r} is not supported"
            )

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Next-token targets (shifted inside the loss); -100 is ignored.
        logits_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0):
            Compute logits for the last `logits_to_keep` positions only (0: all), or for the given indices.

        ```python
        >>> model = HybridForCausalLM(HybridConfig(...))
        >>> out = model.generate(input_ids, max_new_tokens=16)
        ```"""
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# The standard heads, Transformers' generic ones over `HybridModel` (built through `AutoModel`, under `model` as in the
# causal LM, so a causal-LM checkpoint loads into them with its base weights).
class HybridForSequenceClassification(GenericForSequenceClassification, HybridPreTrainedModel): ...


class HybridForTokenClassification(GenericForTokenClassification, HybridPreTrainedModel): ...


class HybridForQuestionAnswering(GenericForQuestionAnswering, HybridPreTrainedModel): ...


__all__ = [
    "HybridCache",
    "HybridForCausalLM",
    "HybridForQuestionAnswering",
    "HybridForSequenceClassification",
    "HybridForTokenClassification",
    "HybridModel",
    "HybridPreTrainedModel",
    "HybridStaticCache",
]
