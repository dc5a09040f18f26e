"""`torch.export` of the causal LM (CPU reference path, fp32): the exported program gives eager's logits, with a
left-padded mask (the padding amount is data, not baked into the graph) and without one.

A bare `torch.export.export(model, ...)` with a cache does not export (`HybridCache` is no pytree node of its own), so
those export with `use_cache=False`; generation exports through Transformers' exporter, which registers the caches'
layers as pytrees and splits `generate()` into its prefill and decode steps, as ExecuTorch users do.
"""

import copy

import pytest
import torch
import transformers
from conftest import MAMBA2_BRANCH
from packaging.version import Version
from transformers import GenerationConfig
from transformers.exporters.exporter_dynamo import DynamoConfig, DynamoExporter
from transformers.exporters.utils import decompose_for_generation, get_leaf_tensors

TOL = dict(rtol=1e-5, atol=1e-5)


def left_padded_mask(batch: int, seq_len: int, pads: list[int]) -> torch.Tensor:
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return mask


@pytest.mark.parametrize("ssm_type", ["mamba1", "mamba2"])
@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_exported_program_with_a_padding_mask_equals_eager(make_model, attn_implementation, ssm_type):
    model = make_model(attn_implementation=attn_implementation, **(MAMBA2_BRANCH if ssm_type == "mamba2" else {}))
    input_ids = torch.randint(3, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    attention_mask = left_padded_mask(3, 11, pads=[4, 0, 1])
    with torch.no_grad():
        exported = torch.export.export(
            model, args=(), kwargs={"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
        ).module()

        # The input it was exported with, then one of the same shape with other tokens and other padding (none in one
        # row, more than the sliding window in another).
        other_ids = torch.randint(3, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
        for ids, mask in [(input_ids, attention_mask), (other_ids, left_padded_mask(3, 11, pads=[0, 7, 2]))]:
            expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            got = exported(input_ids=ids, attention_mask=mask, use_cache=False).logits
            torch.testing.assert_close(got, expected, **TOL)


def test_exported_program_without_a_mask_equals_eager(make_model):
    model = make_model()
    input_ids = torch.randint(3, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exported = torch.export.export(model, args=(), kwargs={"input_ids": input_ids, "use_cache": False}).module()
        other_ids = torch.randint(3, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
        for ids in (input_ids, other_ids):
            expected = model(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(exported(input_ids=ids, use_cache=False).logits, expected, **TOL)


# Transformers 5.23's exporter traces a dynamic sliding-window cache layer as a full one on purpose
# (`exporter_dynamo._patch_sliding_window_layer`: the mask still applies the window, and a trace would otherwise bake
# in the layer's token counter): its exported steps keep every key where eager keeps the last W-1. Its exported decode
# step then misplaces the padding of a left-padded row whose prompt outgrew the window: Transformers' own
# MistralForCausalLM (W 6, a 9-token prompt, 3 pads) gives logits 0.09 off eager's in that row, exact in the others.
# There the dynamic cache is exported from unpadded prompts; the static cache (a static layer is not patched) keeps
# the padded ones.
TRACES_SLIDING_LAYERS_AS_FULL = Version(transformers.__version__) >= Version("5.23")


def assert_step_outputs_match(got: dict, expected: dict, step: str) -> None:
    """The exported step's outputs are eager's: logits and SSM states exactly; a sliding layer's keys and values too,
    or, where the exporter keeps them all, ending with eager's window."""
    assert got.keys() == expected.keys(), step
    for name, want in expected.items():
        have = got[name]
        if TRACES_SLIDING_LAYERS_AS_FULL and name.endswith((".keys", ".values")) and have.shape != want.shape:
            assert have.shape[-2] > want.shape[-2] and have.shape[:-2] == want.shape[:-2], f"{step}: {name}"
            have = have[..., -want.shape[-2] :, :]
        torch.testing.assert_close(have, want, **TOL, msg=lambda m, name=name: f"{step}, {name}: {m}")


@pytest.mark.parametrize("ssm_type", ["mamba1", "mamba2"])
@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["hybrid-cache", "static-cache"])
def test_exported_generation_steps_equal_eager(make_model, cache_implementation, ssm_type):
    """Transformers' exporter on generate(): the prefill and the one-token decode step (the SSM's decode ops, in place
    on the cache) each export with torch.export and give eager's logits and caches. The decode step once failed here
    on a Python branch over the slots' values in the conv update reference (`GuardOnDataDependentSymNode`)."""
    model = make_model(**(MAMBA2_BRANCH if ssm_type == "mamba2" else {}))
    input_ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    pads = [0, 0] if TRACES_SLIDING_LAYERS_AS_FULL and cache_implementation is None else [3, 0]
    inputs = {"input_ids": input_ids, "attention_mask": left_padded_mask(2, 9, pads=pads)}
    generation_config = GenerationConfig(cache_implementation=cache_implementation) if cache_implementation else None
    with torch.no_grad():
        steps = decompose_for_generation(model, inputs, generation_config=generation_config)
    assert set(steps) == {"prefill", "decode"}
    for name, (module, step_inputs) in steps.items():
        with torch.no_grad():
            expected = get_leaf_tensors(module(**copy.deepcopy(step_inputs)))
            exported = DynamoExporter().export(module, step_inputs, config=DynamoConfig(dynamic=False))
            program = getattr(exported, "program", exported)  # Transformers 5.23 wraps the ExportedProgram
            got = get_leaf_tensors(program.module()(**copy.deepcopy(step_inputs)))
        assert any("conv_states" in key for key in got), f"{name}: the SSM states are among the outputs"
        assert_step_outputs_match(got, expected, name)
