"""The standard heads (Transformers' generic ones over `HybridModel`) loaded through their Auto classes from a
causal-LM checkpoint: base weights kept, outputs and losses against a computation by hand from `HybridModel`'s hidden
states, one training step that moves the head, and a save/load round trip."""

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModel,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from modeling import (
    HybridForQuestionAnswering,
    HybridForSequenceClassification,
    HybridForTokenClassification,
    HybridModel,
)

TOL = dict(rtol=1e-5, atol=1e-5)
LENGTHS = [9, 5, 1]  # real tokens per row; the rest is right padding
SEQ_LEN = 9


@pytest.fixture
def causal_checkpoint(make_model, tmp_path):
    model = make_model()
    model.save_pretrained(tmp_path / "causal")
    return model, tmp_path / "causal"


def right_padded_batch(pad_token_id: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(3, vocab_size, (len(LENGTHS), SEQ_LEN), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.zeros(len(LENGTHS), SEQ_LEN, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        attention_mask[row, :length] = 1
    return input_ids.masked_fill(attention_mask == 0, pad_token_id), attention_mask


def load_head(auto_class, checkpoint, head_class, causal_model, **kwargs):
    """The head from the causal-LM checkpoint, in eval mode; its base must be the causal LM's, weight for weight."""
    head = auto_class.from_pretrained(checkpoint, **kwargs).eval()
    assert type(head) is head_class and isinstance(head.model, HybridModel)
    base, expected = head.model.state_dict(), causal_model.model.state_dict()
    assert base.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(base[name], tensor, rtol=0, atol=0, msg=name)
    return head


def base_hidden_states(checkpoint, input_ids, attention_mask) -> torch.Tensor:
    """`HybridModel` loaded on its own from the checkpoint: the hidden states the heads read."""
    base = AutoModel.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        return base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def train_step_moves(head, parameter: torch.nn.Parameter, **inputs) -> None:
    """One AdamW step on the head's loss changes `parameter` (one of the head's own weights)."""
    before = parameter.detach().clone()
    head.train()
    optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
    loss = head(**inputs).loss
    assert torch.isfinite(loss)
    loss.backward()
    assert parameter.grad is not None and parameter.grad.abs().sum() > 0
    optimizer.step()
    assert not torch.equal(parameter.detach(), before)
    head.eval()


def assert_round_trip(head, auto_class, path, output_names, **inputs) -> None:
    head.save_pretrained(path)
    reloaded = auto_class.from_pretrained(path).eval()
    assert type(reloaded) is type(head)
    with torch.no_grad():
        expected, got = head(**inputs), reloaded(**inputs)
    for name in output_names:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)


def test_sequence_classification_scores_the_last_real_token(causal_checkpoint, tmp_path):
    causal_model, checkpoint = causal_checkpoint
    head = load_head(
        AutoModelForSequenceClassification, checkpoint, HybridForSequenceClassification, causal_model, num_labels=3
    )
    input_ids, attention_mask = right_padded_batch(head.config.pad_token_id, head.config.vocab_size)
    labels = torch.tensor([2, 0, 1])

    hidden = base_hidden_states(checkpoint, input_ids, attention_mask)  # [B, T, hidden]
    last_real = hidden[torch.arange(len(LENGTHS)), torch.tensor(LENGTHS) - 1]  # [B, hidden]
    expected_logits = last_real @ head.score.weight.T  # [B, num_labels]; the score has no bias
    with torch.no_grad():
        out = head(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    torch.testing.assert_close(out.logits, expected_logits, **TOL)
    torch.testing.assert_close(out.loss, F.cross_entropy(expected_logits, labels), **TOL)

    train_step_moves(head, head.score.weight, input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert_round_trip(
        head,
        AutoModelForSequenceClassification,
        tmp_path / "seq",
        ["logits"],
        input_ids=input_ids,
        attention_mask=attention_mask,
    )


def test_token_classification_is_a_linear_of_each_hidden_state(causal_checkpoint, tmp_path):
    causal_model, checkpoint = causal_checkpoint
    head = load_head(
        AutoModelForTokenClassification, checkpoint, HybridForTokenClassification, causal_model, num_labels=5
    )
    input_ids, attention_mask = right_padded_batch(head.config.pad_token_id, head.config.vocab_size)
    labels = torch.randint(0, 5, input_ids.shape, generator=torch.Generator().manual_seed(1))
    labels = labels.masked_fill(attention_mask == 0, -100)

    hidden = base_hidden_states(checkpoint, input_ids, attention_mask)
    expected_logits = hidden @ head.score.weight.T + head.score.bias  # [B, T, num_labels]
    with torch.no_grad():
        out = head(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    torch.testing.assert_close(out.logits, expected_logits, **TOL)
    expected_loss = F.cross_entropy(expected_logits[attention_mask == 1], labels[attention_mask == 1])
    torch.testing.assert_close(out.loss, expected_loss, **TOL)

    train_step_moves(head, head.score.weight, input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    assert_round_trip(
        head,
        AutoModelForTokenClassification,
        tmp_path / "token",
        ["logits"],
        input_ids=input_ids,
        attention_mask=attention_mask,
    )


def test_question_answering_gives_start_and_end_logits_per_token(causal_checkpoint, tmp_path):
    causal_model, checkpoint = causal_checkpoint
    head = load_head(AutoModelForQuestionAnswering, checkpoint, HybridForQuestionAnswering, causal_model)
    input_ids, attention_mask = right_padded_batch(head.config.pad_token_id, head.config.vocab_size)
    start_positions, end_positions = torch.tensor([2, 1, 0]), torch.tensor([6, 4, 0])

    hidden = base_hidden_states(checkpoint, input_ids, attention_mask)
    weight, bias = head.qa_outputs.weight, head.qa_outputs.bias  # [2, hidden], [2]: start, end
    expected_start = hidden @ weight[0] + bias[0]  # [B, T]
    expected_end = hidden @ weight[1] + bias[1]
    with torch.no_grad():
        out = head(
            input_ids=input_ids,
            attention_mask=attention_mask,
            start_positions=start_positions,
            end_positions=end_positions,
        )
    torch.testing.assert_close(out.start_logits, expected_start, **TOL)
    torch.testing.assert_close(out.end_logits, expected_end, **TOL)
    expected_loss = (
        F.cross_entropy(expected_start, start_positions) + F.cross_entropy(expected_end, end_positions)
    ) / 2
    torch.testing.assert_close(out.loss, expected_loss, **TOL)

    train_step_moves(
        head,
        head.qa_outputs.weight,
        input_ids=input_ids,
        attention_mask=attention_mask,
        start_positions=start_positions,
        end_positions=end_positions,
    )
    assert_round_trip(
        head,
        AutoModelForQuestionAnswering,
        tmp_path / "qa",
        ["start_logits", "end_logits"],
        input_ids=input_ids,
        attention_mask=attention_mask,
    )
