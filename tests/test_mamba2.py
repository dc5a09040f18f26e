"""The Mamba-2 history branch (`ssm_type="mamba2"`) in the Transformers model: the branch against Transformers' own
`Mamba2Mixer` on the same weights, and the model's invariants (docs/DESIGN.md) on its PyTorch references: cached
decoding and chunked prefill equal one pass, a packed row equals its sequences alone, left padding equals each prompt
alone, static equals dynamic caches, saving and loading, and a fresh branch adds nothing (W_out = 0)."""

import math

import pytest
import torch
from conftest import MAMBA2_BRANCH as MAMBA2
from conftest import tiny_config
from transformers import DataCollatorWithFlattening

from modeling import HybridCache, HybridForCausalLM
from modeling.history import Mamba2Branch
from modeling.history.branch import slow_down_decays
from modeling.training import HybridTrainer


@pytest.fixture
def make_mamba2(make_model):
    return lambda **overrides: make_model(**{**MAMBA2, **overrides})


def test_branch_is_transformers_mamba2_mixer_on_the_same_weights(make_mamba2):
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    # One group: Transformers' gated norm spans all E channels, ours each group's (the same for G = 1).
    model = make_mamba2(ssm_n_groups=1)
    config = model.config
    branch = model.model.layers[0].self_attn.ssm
    assert isinstance(branch, Mamba2Branch)
    mixer_config = Mamba2Config(
        hidden_size=config.hidden_size, num_heads=config.ssm_num_heads, head_dim=config.ssm_head_dim,
        expand=config.ssm_intermediate_size // config.hidden_size, state_size=config.ssm_state_size,
        n_groups=1, conv_kernel=config.ssm_conv_kernel_size, chunk_size=config.ssm_chunk_size, use_bias=False,
        use_conv_bias=True, layer_norm_epsilon=config.rms_norm_eps, time_step_limit=(0.0, float("inf")),
        num_hidden_layers=1,
    )  # fmt: skip
    assert config.ssm_intermediate_size % config.hidden_size == 0
    mixer = Mamba2Mixer(mixer_config, layer_idx=0)
    # The mixer projects back to hidden_size, the branch to H*D: compare through a mixer whose out_proj is ours.
    mixer.out_proj = torch.nn.Linear(config.ssm_intermediate_size, branch.out_proj.out_features, bias=False)
    mixer.load_state_dict(branch.state_dict())
    hidden = torch.randn(2, 23, config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(branch(hidden), mixer(hidden), atol=1e-5, rtol=1e-5)


def test_cached_decoding_and_chunked_prefill_equal_one_pass(make_mamba2):
    model = make_mamba2()
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        one_pass = model(ids).logits
        cache = HybridCache(model.config)
        pieces = [model(ids[:, :13], past_key_values=cache, use_cache=True).logits]  # a chunk, then two more
        pieces.append(model(ids[:, 13:22], past_key_values=cache, use_cache=True).logits)
        pieces += [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(22, 30)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), one_pass, atol=2e-5, rtol=1e-4)


def test_a_hooked_branch_decodes_through_its_sequence_path_as_the_step_op_does(make_mamba2, monkeypatch):
    """A cached one-token step runs the branch's decode step as one op (`mamba2_inner_step_ref` here) when its conv
    and norm are plain modules, and its sequence path (conv from the cached history, chunked scan from the cached
    state, the norm module) when one carries a hook, as an adapter would: the same logits and caches over three steps
    of a left-padded batch whose last step is padding in row 1 (its state kept)."""
    from modeling.history import mamba2

    calls = []
    step_ref = mamba2.mamba2_inner_step_ref
    monkeypatch.setattr(mamba2, "mamba2_inner_step_ref", lambda *a, **k: calls.append("step") or step_ref(*a, **k))
    model = make_mamba2()
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 97, (2, 9), generator=generator)
    steps = torch.randint(3, 97, (2, 3), generator=generator)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    mask[1, -1] = 0
    results = {}
    for hooked in (False, True):
        branches = [layer.self_attn.ssm for layer in model.model.layers]
        hooks = [branch.norm.register_forward_hook(lambda *args: None) for branch in branches] if hooked else []
        with torch.no_grad():
            cache = model(ids, attention_mask=mask[:, :9], use_cache=True).past_key_values
            calls.clear()
            logits = [
                model(steps[:, t : t + 1], attention_mask=mask[:, : 10 + t], past_key_values=cache, use_cache=True)
                .logits for t in range(3)
            ]  # fmt: skip
        assert calls == ([] if hooked else ["step"] * 3 * len(branches)), calls
        results[hooked] = (
            torch.cat(logits, dim=1),
            [(layer.conv_states[0], layer.recurrent_states[0]) for layer in cache.layers],
        )
        for hook in hooks:
            hook.remove()
    (fused, fused_caches), (sequence, sequence_caches) = results[False], results[True]
    torch.testing.assert_close(fused, sequence, atol=2e-5, rtol=1e-4)
    for (conv, state), (ref_conv, ref_state) in zip(fused_caches, sequence_caches):
        torch.testing.assert_close(conv, ref_conv, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(state, ref_state, atol=2e-5, rtol=1e-4)


def test_packed_row_gives_each_sequence_what_it_gets_alone(make_mamba2):
    model = make_mamba2().train()
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(3, 97, (n,), generator=generator).tolist() for n in (7, 1, 11, 3, 9)]
    batch = DataCollatorWithFlattening()([{"input_ids": ids} for ids in sequences])
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    start = 0
    for ids in sequences:
        alone = model(input_ids=torch.tensor([ids])).logits
        torch.testing.assert_close(logits[:, start : start + len(ids)], alone, atol=2e-5, rtol=1e-5)
        start += len(ids)


def test_left_padded_batch_equals_each_prompt_alone(make_mamba2):
    model = make_mamba2()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=generator) for n in (19, 6, 2)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        batched_logits = model(ids, attention_mask=mask).logits
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        for row, prompt in enumerate(prompts):
            alone_logits = model(prompt[None]).logits[0]
            torch.testing.assert_close(batched_logits[row, -len(prompt) :], alone_logits, atol=2e-5, rtol=1e-4)
            alone = model.generate(prompt[None], max_new_tokens=8, do_sample=False, pad_token_id=0)
            assert torch.equal(batched[row, -8:], alone[0, -8:])


def test_static_cache_generates_what_the_dynamic_one_does(make_mamba2):
    model = make_mamba2()
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=9, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dynamic = model.generate(ids, **kwargs)
        static = model.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(static, dynamic)


def test_save_and_load_round_trip(make_mamba2, tmp_path):
    model = make_mamba2()
    model.save_pretrained(tmp_path)
    loaded = HybridForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.ssm_type == "mamba2" and loaded.config.ssm_num_heads == 4
    ids = torch.randint(3, 97, (1, 15), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


def test_a_fresh_branch_adds_nothing_and_trains():
    torch.manual_seed(0)
    with_branch = HybridForCausalLM(tiny_config(**MAMBA2))
    without = HybridForCausalLM(tiny_config(use_ssm_branch=False))
    without.load_state_dict(with_branch.state_dict(), strict=False)
    ids = torch.randint(3, 97, (2, 17), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(with_branch(ids).logits, without(ids).logits)
    branch = with_branch.model.layers[0].self_attn.ssm
    # a in A = -a: uniform in [1, 16] per head (Mamba's initialisation: no slow heads by default for Mamba-2)
    decay_rates = branch.A_log.exp()
    assert torch.all((decay_rates >= 1 * 0.999) & (decay_rates <= 16 * 1.001))
    dt = torch.nn.functional.softplus(branch.dt_bias)
    assert torch.all((dt >= with_branch.config.ssm_dt_min * 0.999) & (dt <= with_branch.config.ssm_dt_max * 1.001))
    # The zero out_proj still receives a gradient: the branch learns from the first step.
    with_branch(ids, labels=ids).loss.backward()
    assert branch.out_proj.weight.grad.abs().sum() > 0


def test_trainer_spares_the_mamba2_dynamics_from_weight_decay(make_mamba2, tmp_path):
    from transformers import TrainingArguments

    model = make_mamba2()
    args = TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1, use_cpu=True, report_to=[])
    decayed = set(HybridTrainer(model=model, args=args).get_decay_parameter_names(model))
    prefix = "model.layers.0.self_attn.ssm."
    assert not {prefix + name for name in ("A_log", "D", "dt_bias")} & decayed
    assert {prefix + "in_proj.weight", prefix + "out_proj.weight"} <= decayed


@pytest.mark.parametrize("ssm_type", ["mamba1", "mamba2"])
def test_memory_timescales_use_the_steps_the_forward_takes(make_model, ssm_type):
    """The diagnostic recomputes each decay's step from the branch's input; here the step is taken from the forward
    itself (Mamba-1: dt_proj's output; Mamba-2: in_proj's last Hs columns), then softplus and 1 / (dt |A|)."""
    model = make_model(**(MAMBA2 if ssm_type == "mamba2" else {}))
    branch = model.model.layers[1].self_attn.ssm
    seen = {}
    branch.register_forward_pre_hook(lambda _m, args: seen.__setitem__("input", args[0]))
    if ssm_type == "mamba1":
        branch.dt_proj.register_forward_hook(lambda _m, _i, out: seen.__setitem__("dt", out))
    else:
        branch.in_proj.register_forward_hook(lambda _m, _i, out: seen.__setitem__("dt", out[..., -branch.num_heads :]))
    with torch.no_grad():
        model(torch.randint(3, 97, (2, 21), generator=torch.Generator().manual_seed(7)))
    A = -branch.A_log.double().exp()
    if ssm_type == "mamba1":
        want = 1 / (torch.nn.functional.softplus(seen["dt"].double()) * A.abs().min(-1).values)
    else:
        want = 1 / (torch.nn.functional.softplus(seen["dt"].double() + branch.dt_bias.double()) * A.abs())
    got = branch.memory_timescales(seen["input"])
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("ssm_type", ["mamba1", "mamba2"])
def test_slow_channels_start_near_no_decay(ssm_type):
    """`ssm_slow_channel_fraction`: the last quarter of the channels (Mamba-1) or heads (Mamba-2) start with decay
    rates 1e-4 times the default initialisation's, every other weight as without it (same seed); through the steps
    the forward takes, those channels remember 1e4 times longer and the others as long as before."""
    fields = MAMBA2 if ssm_type == "mamba2" else {}
    branches = []
    for fraction in (0.0, 0.25):
        torch.manual_seed(0)
        model = HybridForCausalLM(tiny_config(**fields, ssm_slow_channel_fraction=fraction))
        branches.append(model.model.layers[0].self_attn.ssm)
    plain, slow = branches
    if ssm_type == "mamba1":  # Mamba's S4D-real rates 1..N per channel, whatever the fraction
        torch.testing.assert_close(
            plain.A_log, torch.log(torch.arange(1.0, plain.state_size + 1)).expand_as(plain.A_log)
        )
    rows = plain.A_log.shape[0]
    fast = rows - math.floor(0.25 * rows + 0.5)
    assert 0 < fast < rows
    torch.testing.assert_close(slow.A_log[:fast], plain.A_log[:fast], rtol=0, atol=0)
    torch.testing.assert_close(slow.A_log[fast:].exp(), plain.A_log[fast:].exp() * 1e-4)
    for name, weight in plain.state_dict().items():
        if name != "A_log":
            torch.testing.assert_close(slow.state_dict()[name], weight, rtol=0, atol=0, msg=name)
    hidden = torch.randn(2, 9, plain.in_proj.in_features, generator=torch.Generator().manual_seed(3))
    ratio = slow.memory_timescales(hidden).double() / plain.memory_timescales(hidden).double()
    torch.testing.assert_close(ratio[..., :fast], torch.ones_like(ratio[..., :fast]))
    torch.testing.assert_close(ratio[..., fast:], torch.full_like(ratio[..., fast:], 1e4), rtol=1e-4, atol=0)


@pytest.mark.parametrize(
    "rows, fraction, slow_rows",
    # a quarter of 2 Mamba-2 heads is one slow head (Python's round() gives 0), of 10 rows 3 (it gives 2)
    [(2, 0.25, 1), (10, 0.25, 3), (6, 0.25, 2), (1, 0.25, 0), (1, 0.5, 1), (4, 0.25, 1), (64, 0.25, 16), (5, 0.0, 0)],
)
def test_the_share_of_slow_rows_rounds_half_up(rows, fraction, slow_rows):
    A_log = torch.rand(rows, 3, generator=torch.Generator().manual_seed(rows))
    slowed = slow_down_decays(A_log, fraction)
    changed = (slowed != A_log).any(-1)
    assert changed.tolist() == [False] * (rows - slow_rows) + [True] * slow_rows
    torch.testing.assert_close(slowed[changed].exp(), A_log[changed].exp() * 1e-4)


@pytest.mark.parametrize("ssm_type", ["mamba1", "mamba2"])
def test_state_numel_is_what_the_cache_holds(make_model, ssm_type):
    model = make_model(**(MAMBA2 if ssm_type == "mamba2" else {}))
    cache = HybridCache(model.config)
    with torch.no_grad():
        model(torch.randint(3, 97, (1, 9)), past_key_values=cache, use_cache=True)
    for layer, branch in zip(cache.layers, (layer.self_attn.ssm for layer in model.model.layers)):
        assert branch.state_numel() == (layer.conv_states[0].numel(), layer.recurrent_states[0].numel())
