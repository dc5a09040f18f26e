"""scripts/train.py end to end on tiny runs: from scratch on the recall task, then fine-tuning on a text file."""

import json

import torch
import train
from recall_task import RecallTask
from transformers import AutoModelForCausalLM, AutoTokenizer

from modeling import HybridForCausalLM


def test_recall_task_puts_the_answer_beyond_the_attention_reach():
    task = RecallTask()
    tokenizer = task.build_tokenizer()
    config = train.small_recall_config(tokenizer)
    reach = config.num_hidden_layers * (config.sliding_window - 1)
    for example in task.sample_examples(tokenizer, 50, seed=3):
        ids = example["input_ids"]
        answer = ids[-1]
        value_position = ids.index(answer)  # the pair's value: the only earlier occurrence of a value token
        query_position = len(ids) - 2  # the logits at the key after "?" predict the answer
        assert query_position - value_position > reach
        assert example["labels"][:-1] == [-100] * (len(ids) - 1) and example["labels"][-1] == answer


def test_train_from_scratch_then_fine_tune_on_text(tmp_path, capsys):
    out = tmp_path / "scratch"
    train.main(["--output-dir", str(out), "--steps", "3", "--batch-size", "4"])
    assert "recall accuracy" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, HybridForCausalLM)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token == "<pad>"
    assert json.loads((out / "config.json").read_text())["model_type"] == "hybrid"

    text = tmp_path / "corpus.txt"
    generator = torch.Generator().manual_seed(0)
    words = RecallTask().words
    text.write_text(" ".join(words[i] for i in torch.randint(len(words), (400,), generator=generator).tolist()))
    tuned = tmp_path / "tuned"
    train.main(
        [
            "--model",
            str(out),
            "--text-file",
            str(text),
            "--block-size",
            "16",
            "--steps",
            "4",
            "--batch-size",
            "4",
            "--output-dir",
            str(tuned),
        ]
    )
    before, after = HybridForCausalLM.from_pretrained(out), HybridForCausalLM.from_pretrained(tuned)
    changed = [n for n, p in after.named_parameters() if not torch.equal(p, before.state_dict()[n])]
    assert changed, "fine-tuning changed no parameter"
    assert (tuned / "tokenizer.json").exists()
