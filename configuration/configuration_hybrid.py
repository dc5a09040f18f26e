# Copyright 2026 The hybrid-swa-ssm authors.
"""Configuration of the hybrid model: sliding-window attention with a Mamba-1 selective-SSM history branch.

`docs/DESIGN.md` (shared with the kernels and the vLLM model) fixes the math these fields parameterise.
"""

import math
from dataclasses import fields as dataclass_fields

from huggingface_hub.dataclasses import type_validator
from transformers import LlamaConfig, MistralConfig
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

HYBRID_LAYER_TYPES = ("sliding_attention", "full_attention")
# The history branches `modeling.history.HISTORY_BRANCHES` builds (docs/DESIGN.md); a test keeps the two in step.
SSM_TYPES = ("mamba1", "mamba2")
# Fields of one branch kind only, with their defaults: set to anything else under the other kind, they are refused.
MAMBA1_ONLY_FIELDS = {"ssm_dt_rank": "auto"}
MAMBA2_ONLY_FIELDS = {"ssm_num_heads": None, "ssm_head_dim": None, "ssm_n_groups": 1, "ssm_chunk_size": 256}
# Fields that mean the same in HybridConfig and in Transformers' Llama, Mistral and Qwen2 configs (upcycling reads
# them from a source, `attention_only_config` writes them into a twin).
ATTENTION_MODEL_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_dropout",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)
# "default" is computed by the rotary embedding itself; the others by Transformers' `ROPE_INIT_FUNCTIONS`.
HYBRID_ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)


class HybridConfig(PreTrainedConfig):
    r"""
    Configuration of a [`HybridModel`]. Every decoder layer runs causal attention (sliding-window or full, per
    `layer_types`) in parallel with a Mamba-1 selective-SSM "history branch" that reads the same normalised input and
    carries what has left the window; the two outputs are summed before `o_proj`. The defaults give a ~1B model.

    Args:
        vocab_size (`int`, *optional*, defaults to 32000):
            Vocabulary size.
        hidden_size (`int`, *optional*, defaults to 2048):
            Dimension of the residual stream.
        intermediate_size (`int`, *optional*, defaults to 5632):
            Dimension of the SwiGLU MLP.
        num_hidden_layers (`int`, *optional*, defaults to 16):
            Number of decoder layers.
        num_attention_heads (`int`, *optional*, defaults to 16):
            Number of query heads H.
        num_key_value_heads (`int`, *optional*, defaults to 4):
            Number of key/value heads (GQA); must divide `num_attention_heads`. `None` means `num_attention_heads`.
        head_dim (`int`, *optional*):
            Dimension D of each attention head; even (RoPE). `None` means `hidden_size // num_attention_heads`.
        hidden_act (`str`, *optional*, defaults to `"silu"`):
            Activation of the MLP gate.
        max_position_embeddings (`int`, *optional*, defaults to 32768):
            Longest position the RoPE parameters were chosen for.
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the normal initialiser of the linear and embedding weights.
        rms_norm_eps (`float`, *optional*, defaults to 1e-06):
            Epsilon of the RMSNorms.
        use_cache (`bool`, *optional*, defaults to `True`):
            Whether the model returns its cache (`HybridCache`) for generation.
        tie_word_embeddings (`bool`, *optional*, defaults to `False`):
            Whether `lm_head` shares the input embedding matrix.
        rope_parameters (`RopeParameters` or `dict`, *optional*):
            RoPE parameters in Transformers' format (`rope_theta`, `rope_type`, ...), one dict for every layer;
            defaults to theta 10000. The attention rotates the whole head (no `partial_rotary_factor` below 1).
        attention_bias (`bool`, *optional*, defaults to `False`):
            Whether the q/k/v and o projections have a bias (Llama's convention).
        qkv_bias (`bool`, *optional*, defaults to `False`):
            Whether the q/k/v projections have a bias while `o_proj` has none (Qwen2's convention); implied by
            `attention_bias`.
        attention_dropout (`float`, *optional*, defaults to 0.0):
            Dropout on the attention probabilities during training.
        sliding_window (`int`, *optional*, defaults to 4096):
            Window W (at least 2) of `"sliding_attention"` layers: query `t` sees keys `t-W < s <= t` (W keys, itself
            included).
        layer_types (`list[str]`, *optional*):
            Attention kind per layer, `"sliding_attention"` or `"full_attention"`; defaults to all sliding. Every layer
            has the SSM branch whatever its attention kind.
        ssm_type (`str`, *optional*, defaults to `"mamba1"`):
            The kind of history branch in every layer (docs/DESIGN.md): `"mamba1"`, Mamba-1's selective scan with a
            diagonal state per channel, or `"mamba2"`, Mamba-2 (SSD): heads of `ssm_head_dim` channels sharing one
            decay each, a `[head_dim, N]` state per head, B and C shared within each of `ssm_n_groups` groups, and a
            gated RMSNorm before `out_proj`. The `ssm_*` fields below size it; those of the other kind must stay at
            their defaults.
        ssm_state_size (`int`, *optional*, defaults to 16):
            State size N per SSM channel.
        ssm_conv_kernel_size (`int`, *optional*, defaults to 4):
            Kernel size K of the causal depthwise conv1d (at least 2).
        ssm_intermediate_size (`int`, *optional*):
            Number of SSM channels E. `None` means `hidden_size`.
        ssm_dt_rank (`int` or `"auto"`, *optional*, defaults to `"auto"`):
            Mamba-1: rank R of the dt projection; `"auto"` means `ceil(hidden_size / 16)`.
        ssm_num_heads (`int`, *optional*):
            Mamba-2: number of heads Hs, with `ssm_num_heads * ssm_head_dim == ssm_intermediate_size`; give one of the
            two (or neither: head dim 64).
        ssm_head_dim (`int`, *optional*):
            Mamba-2: channels P per head.
        ssm_n_groups (`int`, *optional*, defaults to 1):
            Mamba-2: groups G of heads sharing B and C (and one RMSNorm group each); must divide `ssm_num_heads`.
        ssm_chunk_size (`int`, *optional*, defaults to 256):
            Mamba-2: chunk length of the chunked (SSD) scan, a speed setting that does not change the function.
        ssm_dt_min (`float`, *optional*, defaults to 0.001):
            Lower end of the log-uniform range `softplus(dt_proj.bias)` is initialised in.
        ssm_dt_max (`float`, *optional*, defaults to 0.1):
            Upper end of that range.
        ssm_dt_init_floor (`float`, *optional*, defaults to 0.0001):
            Smallest initial dt.
        ssm_slow_channel_fraction (`float`, *optional*):
            Share (0 to 1) of the branch's channels (Mamba-1) or heads (Mamba-2), the last ones, whose decay rates
            `A` start 10^4 times smaller than Mamba's initialisation's (fraction * rows rounded half up): near no
            decay (an e-folding time of 6,250 tokens for a rate of 16 at the default largest initial step, 0.1), so
            that part of the state keeps what left the window from the start; Adam's steps on `A_log`, about the
            learning rate each, keep them slow through training. Defaults to 0.25 for Mamba-1 and 0 for Mamba-2, as
            measured on real text (123M, 26M tokens): a quarter of Mamba-1's channels makes the branch alone carry
            49-57 % of what full attention gains from context older than 2W, against 4-5 % with none; a quarter of
            Mamba-2's heads carries 13 % and costs 0.06 nats of loss inside the window. An initialisation only:
            the function of given weights does not depend on it. 0 gives Mamba's initialisation. `A_log` trains
            without weight decay, which would undo it.
        ssm_conv_bias (`bool`, *optional*, defaults to `True`):
            Whether the conv1d has a bias.
        use_ssm_branch (`bool`, *optional*, defaults to `True`):
            Switches the SSM history branch off (it is then not built): the model is plain sliding-window
            attention, the control the architecture is measured against.
        ssm_branch_norm (`bool`, *optional*, defaults to `False`):
            Normalises each branch per head before the sum, with a learnable scale per branch and layer (as Hymba
            does): `o_proj(attn_branch_scale * rms(a) + ssm_branch_scale * rms(s))`, where `rms` divides each head's
            D values by their root mean square. Off, the plain sum `o_proj(a + s)`. A training lever of the memory
            program (the branch is not drowned by the attention's scale); the scales start at 1. With
            `use_ssm_branch=False` the attention's output alone is normalised and scaled: the sliding-window control
            of this option. Upcycling does not offer it (the normalised attention would not be the checkpoint's).
        use_ssm_kernels (`bool`, *optional*, defaults to `True`):
            Whether the SSM branch runs its Triton kernels (causal conv1d and selective scan) when the model is on a
            CUDA device. `False` forces the plain PyTorch reference path everywhere; CPU tensors always take it.

    ```python
    >>> from configuration import HybridConfig
    >>> from modeling import HybridForCausalLM
    >>> config = HybridConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    ...                       intermediate_size=512, sliding_window=128)
    >>> model = HybridForCausalLM(config)
    ```"""

    model_type = "hybrid"
    keys_to_ignore_at_inference = ["past_key_values"]
    default_theta = 10000.0
    # Tensor parallelism (`from_pretrained(..., tp_plan="auto")`): attention and MLP as Llama's. `o_proj` is rowwise
    # over H*D, so what it reads, a + s, must be this rank's head columns of both: q/k/v are colwise over heads, and
    # the SSM's `out_proj` colwise over its H*D outputs (from the full E channels). The SSM channels E are not split:
    # `in_proj` is sharded but gathers its output (xs|z in full, as Qwen3-Next's linear attention), and the conv, the
    # scan, `x_proj`, `dt_proj`, `A_log` and `D` run replicated on every rank. Splitting E would need `out_proj`
    # rowwise over E with a reduce-scatter onto the head columns (none of Transformers 5.17's styles; "rowwise"
    # all-reduces to the full H*D), and the conv weight, `A_log` and `D`, which the branch reads directly, as local
    # shards (the styles make them DTensors).
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.ssm.in_proj": "colwise_gather_output",
        "layers.*.self_attn.ssm.out_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float | int = 0.02
    rms_norm_eps: float | int = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    qkv_bias: bool = False
    attention_dropout: float | int = 0.0
    sliding_window: int | None = 4096
    layer_types: list[str] | None = None
    ssm_type: str = "mamba1"
    ssm_state_size: int = 16
    ssm_conv_kernel_size: int = 4
    ssm_intermediate_size: int | None = None
    ssm_dt_rank: int | str = "auto"
    ssm_num_heads: int | None = None
    ssm_head_dim: int | None = None
    ssm_n_groups: int = 1
    ssm_chunk_size: int = 256
    ssm_dt_min: float | int = 0.001
    ssm_dt_max: float | int = 0.1
    ssm_dt_init_floor: float | int = 1e-4
    ssm_slow_channel_fraction: float | int | None = None
    ssm_conv_bias: bool = True
    use_ssm_branch: bool = True
    ssm_branch_norm: bool = False
    use_ssm_kernels: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and _is_positive_int(self.hidden_size) and _is_positive_int(self.num_attention_heads):
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.ssm_intermediate_size is None:
            self.ssm_intermediate_size = self.hidden_size
        if self.ssm_type == "mamba1" and self.ssm_dt_rank == "auto" and _is_positive_int(self.hidden_size):
            self.ssm_dt_rank = math.ceil(self.hidden_size / 16)
        if self.ssm_type == "mamba2" and _is_positive_int(self.ssm_intermediate_size):
            if self.ssm_num_heads is None and self.ssm_head_dim is None:
                self.ssm_head_dim = 64
            # The other of the two where the given one divides E (`validate_ssm_type_fields` says which does not).
            if self.ssm_num_heads is None and _divides(self.ssm_head_dim, self.ssm_intermediate_size):
                self.ssm_num_heads = self.ssm_intermediate_size // self.ssm_head_dim
            elif self.ssm_head_dim is None and _divides(self.ssm_num_heads, self.ssm_intermediate_size):
                self.ssm_head_dim = self.ssm_intermediate_size // self.ssm_num_heads
        if self.ssm_slow_channel_fraction is None:  # the share each branch was measured best with (docstring)
            self.ssm_slow_channel_fraction = 0.0 if self.ssm_type == "mamba2" else 0.25
        if self.layer_types is None and _is_positive_int(self.num_hidden_layers):
            self.layer_types = ["sliding_attention"] * self.num_hidden_layers
        # `rope_scaling` is the legacy name of `rope_parameters` (and wins, as in Transformers' standardisation).
        self.rope_parameters = kwargs.pop("rope_scaling", None) or self.rope_parameters
        # Checked before Transformers' RoPE standardisation reads `rope_parameters` and `layer_types`, and again
        # after it (by `validate`), when a legacy top-level `rope_theta` has been moved in.
        self.validate_hybrid_fields()
        super().__post_init__(**kwargs)
        self.validate()

    def __setattr__(self, name, value):
        # Transformers' configs are `@strict` dataclasses, whose fields check their type on every assignment, at
        # construction and after it; so do this config's own fields, raising the ValueError naming the field that
        # its other checks raise. Values (ranges, fields that must agree) are checked by `validate`: at
        # construction, before `save_pretrained` writes, and when a model is built from the config.
        expected = _FIELD_TYPES.get(name)
        if isinstance(value, tuple) and name in ("layer_types", "eos_token_id"):
            value = list(value)  # as JSON gives them back: a saved and loaded config equals the one built
        if expected is not None:
            try:
                type_validator(name, value, expected)
            except TypeError:
                expected = getattr(expected, "__name__", expected)
                raise ValueError(f"HybridConfig.{name} must be of type {expected}, got {value!r}") from None
        super().__setattr__(name, value)

    def validate(self):
        """The check Transformers runs before `save_pretrained` writes anything (and, for `@strict` configs, after
        construction, as here), and the model runs when built from the config: ours, then Transformers' own class
        validators (`validate_rope`, ...)."""
        self.validate_hybrid_fields()
        try:
            super().validate()
        except KeyError as error:  # `validate_rope`: a key the RoPE type needs is missing
            raise ValueError(f"HybridConfig.rope_parameters: {error.args[0]}") from None

    def validate_hybrid_fields(self):
        """Raises a `ValueError` naming the first invalid field."""
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "ssm_state_size",
            "ssm_intermediate_size",
            "ssm_n_groups",
            "ssm_chunk_size",
        ):
            value = getattr(self, name)
            if not _is_positive_int(value):
                raise ValueError(f"HybridConfig.{name} must be a positive integer, got {value!r}")
        for name in (
            "use_cache",
            "tie_word_embeddings",
            "attention_bias",
            "qkv_bias",
            "ssm_conv_bias",
            "use_ssm_branch",
            "ssm_branch_norm",
            "use_ssm_kernels",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HybridConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("rms_norm_eps", "ssm_dt_min", "ssm_dt_max", "ssm_dt_init_floor"):
            value = getattr(self, name)
            if not _is_finite(value) or not value > 0:
                raise ValueError(f"HybridConfig.{name} must be a positive finite number, got {value!r}")
        self.validate_ssm_type_fields()
        if not _is_finite(self.initializer_range) or self.initializer_range < 0:
            raise ValueError(
                f"HybridConfig.initializer_range must be a finite number >= 0, got {self.initializer_range!r}"
            )
        if not _is_real(self.attention_dropout) or not 0 <= self.attention_dropout < 1:
            raise ValueError(f"HybridConfig.attention_dropout must be in [0, 1), got {self.attention_dropout!r}")
        if self.hidden_act not in ACT2FN:
            raise ValueError(
                f"HybridConfig.hidden_act must be one of Transformers' activations, got {self.hidden_act!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"HybridConfig.num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"HybridConfig.head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not _is_int(self.ssm_conv_kernel_size) or self.ssm_conv_kernel_size < 2:
            raise ValueError(
                f"HybridConfig.ssm_conv_kernel_size must be an integer >= 2, got {self.ssm_conv_kernel_size!r}"
            )
        if not _is_real(self.ssm_slow_channel_fraction) or not 0 <= self.ssm_slow_channel_fraction <= 1:
            raise ValueError(
                "HybridConfig.ssm_slow_channel_fraction must be a number in [0, 1], "
                f"got {self.ssm_slow_channel_fraction!r}"
            )
        if self.ssm_dt_min > self.ssm_dt_max:
            raise ValueError(
                f"HybridConfig.ssm_dt_min ({self.ssm_dt_min}) must not exceed ssm_dt_max ({self.ssm_dt_max})"
            )
        if not isinstance(self.layer_types, list) or len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"HybridConfig.layer_types must be a list of num_hidden_layers={self.num_hidden_layers} entries, "
                f"got {self.layer_types!r}"
            )
        for i, layer_type in enumerate(self.layer_types):
            if layer_type not in HYBRID_LAYER_TYPES:
                raise ValueError(
                    f"HybridConfig.layer_types[{i}] must be one of {HYBRID_LAYER_TYPES}, got {layer_type!r}"
                )
        # W = 1 (a token attends to itself only) is refused: Transformers' sliding-window cache keeps the last W-1
        # keys through a `-W+1:` slice, which for W = 1 keeps them all.
        if "sliding_attention" in self.layer_types and not (_is_int(self.sliding_window) and self.sliding_window >= 2):
            raise ValueError(
                "HybridConfig.sliding_window must be an integer >= 2 when a layer is sliding, "
                f"got {self.sliding_window!r}"
            )
        if self.sliding_window is not None and not _is_positive_int(self.sliding_window):
            raise ValueError(
                f"HybridConfig.sliding_window must be a positive integer or None, got {self.sliding_window!r}"
            )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is None:
                continue
            ids = value if name == "eos_token_id" and isinstance(value, list) else [value]
            if not ids or not all(_is_int(i) and 0 <= i < self.vocab_size for i in ids):
                allowed = "None, an id or a non-empty list of ids" if name == "eos_token_id" else "None or an id"
                raise ValueError(
                    f"HybridConfig.{name} must be {allowed} in [0, vocab_size={self.vocab_size}), got {value!r}"
                )
        # RoPE, read as Transformers' standardisation reads it (`None` and a missing key mean the defaults). Its
        # `validate_rope` (run by `validate`) checks the keys each type needs but only warns about the values.
        for name in ("rope_type", "rope_theta"):  # a legacy top-level `rope_theta` is moved in by `__post_init__`
            if name in vars(self):
                raise ValueError(f"HybridConfig.{name} is not a field: the model reads rope_parameters['{name}']")
        rope = self.rope_parameters if self.rope_parameters is not None else {}
        if not isinstance(rope, dict):
            raise ValueError(f"HybridConfig.rope_parameters must be a dict or None, got {rope!r}")
        if set(rope) & set(HYBRID_LAYER_TYPES):
            raise ValueError(
                f"HybridConfig.rope_parameters must be one dict for every layer, not one per layer type, got {rope!r}"
            )
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in HYBRID_ROPE_TYPES:
            raise ValueError(
                f"HybridConfig.rope_parameters['rope_type'] must be one of {HYBRID_ROPE_TYPES}, got {rope_type!r}"
            )
        theta = rope.get("rope_theta", self.default_theta)
        if not _is_finite(theta) or not theta > 0:
            raise ValueError(
                f"HybridConfig.rope_parameters['rope_theta'] must be a positive finite number, got {theta!r}"
            )
        for key, value in rope.items():
            numbers = value if isinstance(value, (list, tuple)) else [value]
            if any(_is_real(x) and not _is_finite(x) for x in numbers):
                raise ValueError(f"HybridConfig.rope_parameters['{key}'] must be finite numbers, got {value!r}")
        if "factor" in rope and not (_is_finite(rope["factor"]) and rope["factor"] >= 1):
            raise ValueError(f"HybridConfig.rope_parameters['factor'] must be a number >= 1, got {rope['factor']!r}")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                "HybridConfig.rope_parameters['partial_rotary_factor'] must be 1 (the attention rotates the whole "
                f"head), got {rope['partial_rotary_factor']!r}"
            )
        original = rope.get("original_max_position_embeddings")
        if original is not None and not _is_positive_int(original):
            raise ValueError(
                "HybridConfig.rope_parameters['original_max_position_embeddings'] must be a positive integer, "
                f"got {original!r}"
            )

    def validate_ssm_type_fields(self):
        """The fields of the chosen history branch kind, and none of the other's."""
        if self.ssm_type not in SSM_TYPES:
            raise ValueError(f"HybridConfig.ssm_type must be one of {', '.join(SSM_TYPES)}, got {self.ssm_type!r}")
        other_kind_fields = MAMBA2_ONLY_FIELDS if self.ssm_type == "mamba1" else MAMBA1_ONLY_FIELDS
        for name, default in other_kind_fields.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"HybridConfig.{name} does not apply to ssm_type {self.ssm_type!r}: leave it at {default!r}, "
                    f"got {getattr(self, name)!r}"
                )
        if self.ssm_type == "mamba1":
            if not _is_positive_int(self.ssm_dt_rank):
                raise ValueError(
                    f"HybridConfig.ssm_dt_rank must be a positive integer or 'auto', got {self.ssm_dt_rank!r}"
                )
            return
        for name in ("ssm_head_dim", "ssm_num_heads"):
            value = getattr(self, name)
            if value is not None and not _is_positive_int(value):
                raise ValueError(f"HybridConfig.{name} must be a positive integer, got {value!r}")
        if self.ssm_num_heads is None and self.ssm_head_dim is None:
            raise ValueError(
                "HybridConfig.ssm_num_heads or ssm_head_dim must be given for ssm_type 'mamba2' (the other, or with "
                "neither a head_dim of 64, is derived when the config is built: set ssm_type at construction)"
            )
        for given, derived in (("ssm_head_dim", "ssm_num_heads"), ("ssm_num_heads", "ssm_head_dim")):
            if getattr(self, derived) is None:
                raise ValueError(
                    f"HybridConfig.{given} ({getattr(self, given)}) must divide ssm_intermediate_size "
                    f"({self.ssm_intermediate_size}): {derived} is derived from them"
                )
        if self.ssm_num_heads * self.ssm_head_dim != self.ssm_intermediate_size:
            raise ValueError(
                f"HybridConfig.ssm_num_heads ({self.ssm_num_heads}) x ssm_head_dim ({self.ssm_head_dim}) must equal "
                f"ssm_intermediate_size ({self.ssm_intermediate_size})"
            )
        if self.ssm_num_heads % self.ssm_n_groups:
            raise ValueError(
                f"HybridConfig.ssm_n_groups ({self.ssm_n_groups}) must divide ssm_num_heads ({self.ssm_num_heads})"
            )

    def attention_only_config(self, full_attention: bool = False) -> PreTrainedConfig:
        """Transformers' own attention model of this config's shapes, without the SSM branch: the anchor or control
        a hybrid is compared with. `MistralConfig` (every layer sliding with this window; no `layer_types`, which
        Mistral's forward does not need) or, with `full_attention`, `LlamaConfig`. Biases on q/k/v alone (Qwen2's
        convention) have no Llama or Mistral twin, nor `attention_bias` a Mistral one: refused."""
        if self.qkv_bias and not self.attention_bias:
            raise ValueError("HybridConfig.attention_only_config: q/k/v biases without an o bias have no Llama twin")
        if self.attention_bias and not full_attention:
            raise ValueError("HybridConfig.attention_only_config: Mistral has no attention biases")
        fields = {name: getattr(self, name) for name in (*ATTENTION_MODEL_FIELDS, "head_dim")}
        fields["rope_parameters"] = dict(self.rope_parameters)
        if full_attention:
            return LlamaConfig(**fields, attention_bias=self.attention_bias)
        return MistralConfig(**fields, sliding_window=self.sliding_window)


# The declared type of each of HybridConfig's own fields (not those it inherits), checked on assignment.
_FIELD_TYPES = {
    field.name: field.type for field in dataclass_fields(HybridConfig) if field.name in HybridConfig.__annotations__
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value) -> bool:
    return _is_int(value) and value > 0


def _divides(divisor, value) -> bool:
    return _is_positive_int(divisor) and _is_positive_int(value) and value % divisor == 0


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value) -> bool:
    return _is_int(value) or (_is_real(value) and math.isfinite(value))


__all__ = ["HybridConfig"]
