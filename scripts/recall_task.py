"""A synthetic long-range recall task and its word-level tokenizer, built locally (nothing is fetched).

A sample is a few key/value pairs, then filler, then a query for one key:

    <bos> k3 v5 k1 v2 f7 f0 f9 ... f4 ? k1 v2

The model must produce the value (`v2`) after `? k1`. The filler is longer than the attention can reach
(`num_layers * (window - 1)` tokens back), so only a model that carries history beyond the window can answer;
an attention-only control is left guessing among the values.
"""

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
QUERY = "?"


@dataclass
class RecallTask:
    num_keys: int = 8
    num_values: int = 8
    num_fillers: int = 4
    num_pairs: int = 1
    min_filler: int = 24
    max_filler: int = 40

    @property
    def words(self) -> list[str]:
        return (
            [f"k{i}" for i in range(self.num_keys)]
            + [f"v{i}" for i in range(self.num_values)]
            + [f"f{i}" for i in range(self.num_fillers)]
            + [QUERY]
        )

    def build_tokenizer(self) -> PreTrainedTokenizerFast:
        vocab = {word: i for i, word in enumerate(SPECIAL_TOKENS + self.words)}
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            pad_token="<pad>",
            bos_token="<bos>",
            eos_token="<eos>",
            unk_token="<unk>",
            padding_side="left",
        )

    def sample_text(self, generator: torch.Generator) -> tuple[str, str]:
        """Returns (prompt, answer): the prompt ends with `? k`, the answer is that key's value."""

        def randint(high: int, size: int = 1) -> list[int]:
            return torch.randint(high, (size,), generator=generator).tolist()

        keys = torch.randperm(self.num_keys, generator=generator)[: self.num_pairs].tolist()
        values = randint(self.num_values, self.num_pairs)
        filler_len = self.min_filler + randint(self.max_filler - self.min_filler + 1)[0]
        pairs = " ".join(f"k{k} v{v}" for k, v in zip(keys, values))
        filler = " ".join(f"f{i}" for i in randint(self.num_fillers, filler_len))
        asked = randint(self.num_pairs)[0]
        return f"{pairs} {filler} {QUERY} k{keys[asked]}", f"v{values[asked]}"

    def sample_examples(self, tokenizer, num_examples: int, seed: int) -> list[dict]:
        """Training examples: `input_ids` = bos + prompt + answer, `labels` = -100 everywhere but the answer."""
        generator = torch.Generator().manual_seed(seed)
        examples = []
        for _ in range(num_examples):
            prompt, answer = self.sample_text(generator)
            prompt_ids = [tokenizer.bos_token_id] + tokenizer.encode(prompt, add_special_tokens=False)
            answer_id = tokenizer.convert_tokens_to_ids(answer)
            examples.append({"input_ids": prompt_ids + [answer_id], "labels": [-100] * len(prompt_ids) + [answer_id]})
        return examples


def collate_left_padded(examples: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Left-pads a list of examples into a batch with `attention_mask` (the answer stays the last token)."""
    length = max(len(e["input_ids"]) for e in examples)
    batch = {"input_ids": [], "attention_mask": [], "labels": []}
    for e in examples:
        pad = length - len(e["input_ids"])
        batch["input_ids"].append([pad_token_id] * pad + e["input_ids"])
        batch["attention_mask"].append([0] * pad + [1] * len(e["input_ids"]))
        batch["labels"].append([-100] * pad + e["labels"])
    return {k: torch.tensor(v) for k, v in batch.items()}


@torch.no_grad()
def recall_accuracy(model, examples: list[dict], pad_token_id: int, batch_size: int = 64) -> float:
    """Fraction of examples whose answer is the argmax of the next-token logits after the prompt."""
    model.eval()
    correct = 0
    for start in range(0, len(examples), batch_size):
        batch = collate_left_padded(examples[start : start + batch_size], pad_token_id)
        logits = model(input_ids=batch["input_ids"][:, :-1], attention_mask=batch["attention_mask"][:, :-1]).logits
        correct += (logits[:, -1].argmax(-1) == batch["input_ids"][:, -1]).sum().item()
    return correct / len(examples)
