"""`torch.export` of the causal LM (CPU reference path, fp32, no cache): the exported program gives eager's logits,
with a left-padded mask (the padding amount is data, not baked into the graph) and without one.

With a cache it does not export: `HybridCache` is no pytree node (Transformers' `register_dynamic_cache_export_support`
covers plain attention layers only), so these export with `use_cache=False`.
"""

import pytest
import torch

TOL = dict(rtol=1e-5, atol=1e-5)


def left_padded_mask(batch: int, seq_len: int, pads: list[int]) -> torch.Tensor:
    mask = torch.ones(batch, seq_len, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return mask


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_exported_program_with_a_padding_mask_equals_eager(make_model, attn_implementation):
    model = make_model(attn_implementation=attn_implementation)
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
