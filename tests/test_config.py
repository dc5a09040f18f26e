import pytest
from conftest import tiny_config

from configuration import HybridConfig

INVALID_FIELDS = [
    ("vocab_size", 0),
    ("hidden_size", -8),
    ("hidden_size", 48.0),
    ("intermediate_size", 0),
    ("num_hidden_layers", 0),
    ("num_attention_heads", 0),
    ("num_key_value_heads", 3),  # does not divide 4 heads
    ("num_key_value_heads", 0),
    ("head_dim", 15),  # odd: RoPE rotates pairs
    ("head_dim", 0),
    ("max_position_embeddings", 0),
    ("rms_norm_eps", 0.0),
    ("initializer_range", -0.1),
    ("attention_dropout", 1.5),
    ("hidden_act", "not_an_activation"),
    ("sliding_window", 0),
    ("sliding_window", 1),  # Transformers' sliding cache keeps everything for W = 1
    ("sliding_window", None),  # a sliding layer needs a window
    ("layer_types", ["sliding_attention"]),  # wrong length
    ("layer_types", ["sliding_attention", "linear_attention", "full_attention"]),
    ("ssm_state_size", 0),
    ("ssm_conv_kernel_size", 1),
    ("ssm_intermediate_size", 0),
    ("ssm_dt_rank", 0),
    ("ssm_dt_rank", "big"),
    ("ssm_dt_min", 0.0),
    ("ssm_dt_max", -1.0),
    ("ssm_dt_min", 0.5),  # above ssm_dt_max
    ("ssm_dt_init_floor", 0.0),
    ("ssm_conv_bias", "yes"),
    ("use_ssm_branch", 1),
    ("use_ssm_kernels", "auto"),
    ("tie_word_embeddings", None),
    ("qkv_bias", "true"),
]


@pytest.mark.parametrize("field,value", INVALID_FIELDS, ids=[f"{f}={v!r}" for f, v in INVALID_FIELDS])
def test_invalid_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        tiny_config(**{field: value})


def test_defaults_are_a_1b_model():
    config = HybridConfig()
    assert config.model_type == "hybrid"
    assert config.layer_types == ["sliding_attention"] * config.num_hidden_layers
    assert config.head_dim == config.hidden_size // config.num_attention_heads
    assert config.ssm_intermediate_size == config.hidden_size
    assert config.ssm_dt_rank == -(-config.hidden_size // 16)
    assert config.rope_parameters["rope_type"] == "default"
    h, e, n, r = config.hidden_size, config.ssm_intermediate_size, config.ssm_state_size, config.ssm_dt_rank
    kv = config.num_key_value_heads * config.head_dim
    attn = 2 * h * h + 2 * h * kv
    ssm = 2 * e * h + e * config.ssm_conv_kernel_size + e + (r + 2 * n) * e + e * r + e + e * n + e + h * e
    mlp = 3 * h * config.intermediate_size
    total = config.num_hidden_layers * (attn + ssm + mlp + 2 * h) + 2 * config.vocab_size * h + h
    assert 0.8e9 < total < 1.3e9


def test_full_attention_only_needs_no_window():
    config = tiny_config(sliding_window=None, layer_types=["full_attention"] * 3)
    assert config.sliding_window is None


def test_round_trip(tmp_path):
    config = tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    config.save_pretrained(tmp_path)
    loaded = HybridConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert loaded.rope_parameters["rope_theta"] == 5000.0
