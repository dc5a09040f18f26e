"""Padding-free packed training (`DataCollatorWithFlattening`): several sequences in one row, `position_ids`
restarting at each, and every sequence gets exactly the logits, loss and gradients it gets alone: the attention
through Transformers' masks, the SSM branch by restarting its state and conv history (`seq_idx`). These run the
PyTorch references; test_modeling_kernels.py runs the same check on the Triton kernels."""

import pytest
import torch
from transformers import DataCollatorWithFlattening

from modeling.modeling_hybrid import packed_sequence_index

# Lengths around the conv width (K = 4: shorter than its K-1 history) and the window (6): a length-1 sequence, one
# shorter than the history, several longer than the window.
LENGTHS = [7, 2, 1, 11, 3, 9]


def random_sequences(lengths=LENGTHS, seed=0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 97, (n,), generator=generator).tolist() for n in lengths]


def packed(sequences, **collator_kwargs) -> dict:
    return DataCollatorWithFlattening(**collator_kwargs)([{"input_ids": ids} for ids in sequences])


def summed_loss(model, **batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss summed over the predicted tokens): the mean times the count, so that losses of different
    batches add up."""
    out = model(**batch)
    return out.logits, out.loss * (batch["labels"][:, 1:] != -100).sum()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("use_cache", [False, True], ids=["no-cache", "use_cache"])
def test_packed_row_gives_each_sequence_what_it_gets_alone(make_model, attn_implementation, use_cache):
    sequences = random_sequences()
    model = make_model(attn_implementation=attn_implementation).train()

    batch = packed(sequences)
    assert batch["input_ids"].shape == (1, sum(LENGTHS))
    logits, loss = summed_loss(model, **batch, use_cache=use_cache)
    loss.backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    alone_loss = 0.0
    start = 0
    for ids in sequences:
        ids = torch.tensor([ids])
        alone_logits, loss_alone = summed_loss(model, input_ids=ids, labels=ids, use_cache=use_cache)
        torch.testing.assert_close(logits[:, start : start + ids.shape[1]], alone_logits, atol=2e-5, rtol=1e-5)
        if ids.shape[1] > 1:  # a single token predicts nothing
            loss_alone.backward()
            alone_loss += loss_alone.item()
        start += ids.shape[1]
    assert loss.item() == pytest.approx(alone_loss, rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_without_the_resets_the_ssm_branch_leaks_across_sequences(make_model):
    """The check above can fail: the same packed row read as one sequence (seq_idx all zeros) changes the logits of
    every sequence after the first, beyond the attention (the model without the branch is unchanged by it)."""
    sequences = random_sequences()
    batch = packed(sequences)
    del batch["labels"]
    with torch.no_grad():
        for use_ssm_branch, differs in ((True, True), (False, False)):
            model = make_model(use_ssm_branch=use_ssm_branch)
            reset = model(**batch).logits
            leaked = model(**batch, seq_idx=torch.zeros_like(batch["input_ids"])).logits
            first = len(sequences[0])
            torch.testing.assert_close(reset[:, :first], leaked[:, :first])
            assert (not torch.allclose(reset[:, first:], leaked[:, first:], atol=1e-4)) == differs


def test_sequence_index_from_the_collators_outputs():
    """position_ids, flash-attention's cu_seq_lens and the collator's own seq_idx name the same sequences."""
    sequences = random_sequences()
    batch = packed(sequences, return_flash_attn_kwargs=True, return_seq_idx=True)
    expected = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None]
    total = sum(LENGTHS)
    from_positions = packed_sequence_index(1, total, batch["position_ids"], None, 0, None, {})
    from_cu_seq_lens = packed_sequence_index(1, total, None, None, 0, None, batch)
    from_collator = packed_sequence_index(1, total, None, None, 0, batch["seq_idx"], {})
    for seq_idx in (from_positions, from_cu_seq_lens, from_collator):
        assert torch.equal(seq_idx.long(), expected)
    # Not packed: no padding mask given but positions that only count up, a padding mask, or a cache to continue.
    positions = torch.arange(total)[None]
    assert packed_sequence_index(1, total, positions, None, 0, None, {}) is None
    assert packed_sequence_index(1, total, batch["position_ids"], torch.ones(1, total), 0, None, {}) is None
    assert packed_sequence_index(1, total, batch["position_ids"], None, 5, None, {}) is None
    with pytest.raises(ValueError, match="seq_idx"):
        packed_sequence_index(1, total, None, None, 0, batch["seq_idx"][:, 1:], {})


def test_collator_seq_idx_and_flash_kwargs_reach_the_ssm_branch(make_model):
    """The collator's seq_idx (and cu_seq_lens, with positions that do not restart) reset the branch as the
    restarting position_ids do."""
    sequences = random_sequences()
    model = make_model()
    batch = packed(sequences, return_flash_attn_kwargs=True, return_seq_idx=True)
    with torch.no_grad():
        reference = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        with_seq_idx = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], seq_idx=batch["seq_idx"]
        )
        torch.testing.assert_close(with_seq_idx.logits, reference)
        flash_kwargs = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
        with_cu = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], **flash_kwargs)
        torch.testing.assert_close(with_cu.logits, reference)


@pytest.mark.parametrize("use_ssm_branch", [True, False], ids=["hybrid", "ssm-off"])
def test_a_training_step_without_position_ids_never_waits_for_the_device(make_model, use_ssm_branch):
    """Rows of one sequence each, no position_ids (a plain training batch): nothing in the forward or backward reads a
    tensor's value on the host. The masks looked for packed sequences in the positions the model makes up itself and
    read the answer (`.all()`: a host sync on a GPU every step) where Transformers' Mistral does not; packed rows
    still come from the caller's position_ids (the tests above)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        reads = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                self.reads.append(func)
            return func(*args, **(kwargs or {}))

    model = make_model(sliding_window=8, attn_implementation="sdpa", use_ssm_branch=use_ssm_branch).train()
    ids = torch.randint(3, 97, (2, 30))
    with HostReads() as mode:
        model(input_ids=ids, labels=ids).loss.backward()
    assert mode.reads == []
