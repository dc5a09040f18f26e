import copy
import json
import math
import pickle

import pytest
import torch
from conftest import tiny_config
from transformers import AutoConfig

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
    ("ssm_type", "mamba3"),
    ("ssm_type", None),
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
    ("ssm_slow_channel_fraction", -0.1),
    ("ssm_slow_channel_fraction", 1.5),
    ("ssm_slow_channel_fraction", math.nan),
    ("ssm_slow_channel_fraction", True),
    ("ssm_slow_channel_fraction", "0.1"),
    ("ssm_conv_bias", "yes"),
    ("use_ssm_branch", 1),
    ("ssm_branch_norm", "yes"),
    ("use_ssm_kernels", "auto"),
    ("tie_word_embeddings", None),
    ("qkv_bias", "true"),
    ("rms_norm_eps", math.inf),
    ("initializer_range", math.inf),
    ("initializer_range", math.nan),
    ("ssm_dt_max", math.inf),  # NaN logits
    ("ssm_dt_init_floor", math.inf),
    ("pad_token_id", 97),  # == vocab_size: nn.Embedding asserts at build time
    ("pad_token_id", -1),
    ("bos_token_id", 1.0),
    ("eos_token_id", [2, 97]),
    ("eos_token_id", []),
    ("rope_theta", -5),  # the legacy top-level kwarg; NaN logits
    ("rope_theta", 0.0),
    ("rope_theta", math.inf),
    ("rope_type", "default"),  # not a field: would be ignored silently
    ("rope_parameters", "bogus"),
    ("rope_parameters", {"rope_type": "bogus", "rope_theta": 10000.0}),  # KeyError at build time
    ("rope_parameters", {"rope_type": "default", "rope_theta": math.nan}),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "10000"}),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0}),  # linear needs a factor
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0, "factor": math.inf}),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 0.0}),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    ("rope_parameters", {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "default"}}),
]

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 50000.0,
}


@pytest.mark.parametrize("field,value", INVALID_FIELDS, ids=[f"{f}={v!r}" for f, v in INVALID_FIELDS])
def test_invalid_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        tiny_config(**{field: value})


@pytest.mark.parametrize(
    "rope_parameters,match",
    [
        ({"rope_type": "bogus", "rope_theta": 10000.0}, "rope_type"),
        ({"rope_type": "default", "rope_theta": -5.0}, "rope_theta"),
        ({"rope_type": "default", "rope_theta": math.inf}, "rope_theta"),
    ],
    ids=["rope_type", "rope_theta=-5", "rope_theta=inf"],
)
def test_invalid_rope_parameter_error_names_the_key(rope_parameters, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(rope_parameters=rope_parameters)


@pytest.mark.parametrize(
    "rope_parameters",
    [None, {"rope_type": "default", "rope_theta": 10000.0}, {"rope_theta": 5000.0}, LLAMA3_ROPE],
    ids=["none", "default", "theta-only", "llama3"],
)
def test_rope_parameters_this_project_writes_load(tmp_path, rope_parameters):
    """The forms in our checkpoints' config.json (`scripts/upcycle.py` carries Llama-3 RoPE over) keep loading."""
    config = tiny_config(rope_parameters=None if rope_parameters is None else dict(rope_parameters))
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    loaded = HybridConfig.from_pretrained(tmp_path)
    assert loaded.rope_parameters == config.rope_parameters
    assert loaded.rope_parameters["rope_type"] == (rope_parameters or {}).get("rope_type", "default")


def test_legacy_top_level_rope_theta_is_carried_into_rope_parameters():
    assert tiny_config(rope_theta=5000.0).rope_parameters == {"rope_type": "default", "rope_theta": 5000.0}


def test_eos_token_id_may_be_a_list():
    assert tiny_config(eos_token_id=[2, 96], pad_token_id=None).eos_token_id == [2, 96]


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("num_key_value_heads", 3, "num_key_value_heads"),  # does not divide 4 heads
        ("pad_token_id", 97, "pad_token_id"),
        ("ssm_dt_max", math.inf, "ssm_dt_max"),
        ("rope_parameters", {"rope_type": "bogus", "rope_theta": 10000.0}, "rope_type"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, str) else v,
)
def test_save_pretrained_refuses_an_invalid_config_and_writes_nothing(tmp_path, field, value, match):
    """A field set after construction is checked when saving, as Transformers' `@strict` configs are."""
    config = tiny_config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_save_pretrained_refuses_rope_parameters_edited_in_place(tmp_path):
    config = tiny_config()
    config.rope_parameters["rope_theta"] = -1.0
    with pytest.raises(ValueError, match="rope_theta"):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


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
    assert type(AutoConfig.from_pretrained(tmp_path)) is HybridConfig


def test_pickle_round_trip_names_the_public_module():
    """Pickles name `modeling.HybridConfig` (configuration/__init__.py), the same class, so that unpickling imports
    `modeling`, which registers the model classes (tests/test_distributed.py runs it in fresh processes)."""
    import modeling

    config = tiny_config(ssm_branch_norm=True)
    assert modeling.HybridConfig is HybridConfig and HybridConfig.__module__ == "modeling"
    loaded = pickle.loads(pickle.dumps(config))
    assert type(loaded) is HybridConfig and loaded.to_dict() == config.to_dict()
    assert copy.deepcopy(config).to_dict() == config.to_dict()


MAMBA2 = {"ssm_type": "mamba2", "ssm_intermediate_size": 48}
INVALID_BRANCH_FIELDS = [
    ({"ssm_num_heads": 4}, "ssm_num_heads does not apply to ssm_type 'mamba1'"),
    ({"ssm_chunk_size": 64}, "ssm_chunk_size does not apply"),
    ({**MAMBA2, "ssm_dt_rank": 4}, "ssm_dt_rank does not apply to ssm_type 'mamba2'"),
    ({**MAMBA2, "ssm_head_dim": 0}, "ssm_head_dim must be a positive integer, got 0"),
    ({**MAMBA2, "ssm_head_dim": -12}, "ssm_head_dim must be a positive integer"),
    ({**MAMBA2, "ssm_num_heads": 0}, "ssm_num_heads must be a positive integer, got 0"),
    ({**MAMBA2, "ssm_head_dim": 16.0}, "ssm_head_dim must be of type"),
    # the default head_dim, 64, is wider than E = 48: the message names it, not the heads derived from it
    (MAMBA2, r"ssm_head_dim \(64\) must divide ssm_intermediate_size \(48\): ssm_num_heads is derived"),
    ({**MAMBA2, "ssm_head_dim": 20}, r"ssm_head_dim \(20\) must divide"),
    ({**MAMBA2, "ssm_num_heads": 5}, r"ssm_num_heads \(5\) must divide ssm_intermediate_size \(48\)"),
    ({**MAMBA2, "ssm_num_heads": 4, "ssm_head_dim": 8}, r"ssm_num_heads \(4\) x ssm_head_dim \(8\) must equal"),
    ({**MAMBA2, "ssm_num_heads": 4, "ssm_n_groups": 3}, r"ssm_n_groups \(3\) must divide ssm_num_heads \(4\)"),
    ({**MAMBA2, "ssm_num_heads": 4, "ssm_chunk_size": 0}, "ssm_chunk_size must be a positive integer"),
]


@pytest.mark.parametrize("fields,match", INVALID_BRANCH_FIELDS, ids=[m[:40] for _, m in INVALID_BRANCH_FIELDS])
def test_invalid_branch_field_raises_value_error_naming_it(fields, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**fields)


def test_slow_share_defaults_to_what_each_branch_was_measured_best_with(tmp_path):
    """A quarter of Mamba-1's channels, none of Mamba-2's heads (BENCHMARKS.md, real text); a value given, or saved
    with a checkpoint, is kept whichever the branch."""
    assert tiny_config().ssm_slow_channel_fraction == 0.25
    assert tiny_config(**MAMBA2, ssm_head_dim=12).ssm_slow_channel_fraction == 0.0
    given = tiny_config(**MAMBA2, ssm_head_dim=12, ssm_slow_channel_fraction=0.25)
    given.save_pretrained(tmp_path)
    assert HybridConfig.from_pretrained(tmp_path).ssm_slow_channel_fraction == 0.25
    assert tiny_config(ssm_slow_channel_fraction=0).ssm_slow_channel_fraction == 0


def test_mamba2_heads_derive_from_either_field():
    assert tiny_config(**MAMBA2, ssm_head_dim=12).ssm_num_heads == 4
    assert tiny_config(**MAMBA2, ssm_num_heads=6).ssm_head_dim == 8


@pytest.mark.parametrize(
    "field,value", [("sliding_window", "8"), ("ssm_slow_channel_fraction", "0.1"), ("layer_types", "sliding"),
                    ("use_ssm_branch", 1), ("ssm_head_dim", 12.0)],
)  # fmt: skip
def test_assigning_a_field_checks_its_type_as_transformers_strict_configs_do(field, value):
    """Transformers' configs (`@strict` dataclasses) check a field's type when it is assigned, after construction
    too; here a ValueError names the field and the config keeps its value."""
    config = tiny_config()
    before = getattr(config, field)
    with pytest.raises(ValueError, match=f"HybridConfig.{field} must be of type"):
        setattr(config, field, value)
    assert getattr(config, field) == before
    config.ssm_dt_max = 1  # an int where a float is declared, as Transformers' `float | int` fields take
    config.rms_norm_eps = 1e-5


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"ssm_slow_channel_fraction": 2.0}, "ssm_slow_channel_fraction must be a number in"),
        ({"sliding_window": 1}, "sliding_window must be an integer >= 2"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"ssm_type": "mamba2"}, "ssm_dt_rank does not apply to ssm_type 'mamba2'"),  # derived for Mamba-1
        ({"ssm_dt_rank": "auto", "ssm_type": "mamba2"}, "ssm_num_heads or ssm_head_dim must be given"),
    ],
)
def test_a_model_built_from_a_config_changed_after_construction_checks_it(changes, match):
    """Values (ranges, and fields that must agree) are checked again when a model is built, so that a config edited
    after construction fails there, naming the field, rather than deep in a forward or silently (a slow share of 2
    slowed every channel)."""
    from modeling import HybridForCausalLM, HybridForSequenceClassification

    for model_class in (HybridForCausalLM, HybridForSequenceClassification):
        config = tiny_config()
        for field, value in changes.items():
            setattr(config, field, value)
        with pytest.raises(ValueError, match=match):
            model_class(config)


def test_a_model_loaded_with_fewer_layers_keeps_the_first_layer_types(tmp_path):
    """`from_pretrained(..., num_hidden_layers=1)` (a checkpoint trimmed for a quick test, as Transformers' models
    serve it from the first entries of `layer_types`): the model validates the config it is built from, so the
    config keeps the first entries and saves whole; the layer's weights are the checkpoint's."""
    from modeling import HybridForCausalLM

    HybridForCausalLM(tiny_config()).save_pretrained(tmp_path / "three")
    model = HybridForCausalLM.from_pretrained(tmp_path / "three", num_hidden_layers=2)
    assert model.config.layer_types == ["sliding_attention", "full_attention"] and len(model.model.layers) == 2
    full = HybridForCausalLM.from_pretrained(tmp_path / "three")
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, full.state_dict()[name]), name
    model.save_pretrained(tmp_path / "two")
    assert HybridForCausalLM.from_pretrained(tmp_path / "two").config.layer_types == model.config.layer_types


def test_list_fields_take_tuples_as_lists():
    config = tiny_config(layer_types=("sliding_attention",) * 3, eos_token_id=(2, 3))
    assert config.layer_types == ["sliding_attention"] * 3 and config.eos_token_id == [2, 3]


def test_every_ssm_type_the_config_accepts_has_a_branch():
    from configuration.configuration_hybrid import SSM_TYPES
    from modeling.history import HISTORY_BRANCHES

    assert set(SSM_TYPES) == set(HISTORY_BRANCHES)


def test_branch_norm_without_the_ssm_branch_is_the_attentions_alone():
    config = HybridConfig(use_ssm_branch=False, ssm_branch_norm=True)
    assert config.ssm_branch_norm and not config.use_ssm_branch  # the control of the option (docs/DESIGN.md)


def test_attention_only_config_is_the_transformers_twin_of_the_shapes():
    config = tiny_config(rms_norm_eps=1e-5, tie_word_embeddings=True)
    shared = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings")  # fmt: skip
    mistral, llama = config.attention_only_config(), config.attention_only_config(full_attention=True)
    assert (mistral.model_type, llama.model_type) == ("mistral", "llama")
    for twin in (mistral, llama):
        assert {name: getattr(twin, name) for name in shared} == {name: getattr(config, name) for name in shared}
        assert twin.rope_parameters["rope_theta"] == config.rope_parameters["rope_theta"]
    assert mistral.sliding_window == config.sliding_window
    with pytest.raises(ValueError, match="no Llama twin"):
        tiny_config(qkv_bias=True).attention_only_config(full_attention=True)
    with pytest.raises(ValueError, match="Mistral has no attention biases"):
        tiny_config(attention_bias=True).attention_only_config()
    assert tiny_config(attention_bias=True).attention_only_config(full_attention=True).attention_bias
