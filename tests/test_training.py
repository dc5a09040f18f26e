"""Training: gradients, checkpointing, autocast, Trainer and PEFT LoRA."""

import pytest
import torch
from conftest import MAMBA2_BRANCH
from torch.utils.data import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from modeling.recall_task import RecallTask, collate_left_padded
from modeling.training import StochasticWindowCallback, train


def batch_of_random_tokens(seed: int = 0, batch_size: int = 4, length: int = 21):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (batch_size, length), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def losses_while_training(model, batch, steps: int, lr: float) -> list[float]:
    """AdamW on the trainable parameters for `steps` steps on one batch; the loss before each step."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_gradients_reach_every_parameter(make_model):
    model = make_model().train()
    model(**batch_of_random_tokens()).loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_a_training_forward_builds_no_cache_unless_given_one(make_model):
    """In training mode the model fills no cache of its own (each sliding layer's first update waits for the GPU, and
    every layer's states would be copied for nothing); its loss is the eval forward's, and a cache passed in is
    still filled."""
    from modeling import HybridCache

    model, batch = make_model(), batch_of_random_tokens()
    expected = model.eval()(**batch).loss
    out = model.train()(**batch)
    assert out.past_key_values is None
    torch.testing.assert_close(out.loss, expected, rtol=0, atol=0)
    cache = HybridCache(model.config)
    assert model(**batch, past_key_values=cache).past_key_values is cache
    assert cache.get_seq_length() == batch["input_ids"].shape[1]


def test_a_few_steps_lower_the_loss(make_model):
    losses = losses_while_training(make_model().train(), batch_of_random_tokens(), steps=8, lr=3e-3)
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("ssm_type", ["mamba1", "mamba2"])
def test_gradient_checkpointing_gives_the_same_gradients(make_model, ssm_type):
    batch = batch_of_random_tokens()
    grads = []
    for checkpointing in (False, True):
        model = make_model(**(MAMBA2_BRANCH if ssm_type == "mamba2" else {})).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
        model(**batch).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_trains_close_to_fp32(make_model, dtype):
    model = make_model().train()
    batch = batch_of_random_tokens()
    reference = model(**batch).loss
    with torch.autocast("cpu", dtype=dtype):
        out = model(**batch)
    assert out.logits.dtype in (dtype, torch.float32)
    torch.testing.assert_close(out.loss.float(), reference, atol=0.05, rtol=0.02)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_bf16_weights_keep_an_fp32_state(make_model):
    model = make_model().to(torch.bfloat16)
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        logits = model(ids).logits
        reference = make_model()(ids).logits
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), reference, atol=0.15, rtol=0.05)
    cache = model(ids, use_cache=True).past_key_values
    assert cache.layers[0].recurrent_states[0].dtype == torch.float32


class ListDataset(Dataset):
    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def test_trainer_out_of_the_box(make_model, tmp_path):
    task = RecallTask(num_pairs=1, min_filler=4, max_filler=8)
    tokenizer = task.build_tokenizer()
    model = make_model(vocab_size=len(tokenizer)).train()
    examples = task.sample_examples(tokenizer, 64, seed=0)
    collate = lambda batch: collate_left_padded(batch, tokenizer.pad_token_id)
    before = sum(model(**collate(examples[i : i + 16])).loss.item() for i in range(0, 64, 16))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        num_train_epochs=6,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=ListDataset(examples), data_collator=collate)
    trainer.train()
    model.eval()
    with torch.no_grad():
        after = sum(model(**collate(examples[i : i + 16])).loss.item() for i in range(0, 64, 16))
    assert after < 0.7 * before


def test_peft_lora_on_the_projection_names(make_model):
    peft = pytest.importorskip("peft")
    model = make_model()
    targets = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "in_proj",
        "x_proj",
        "out_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    )
    wrapped = {
        name.split(".")[-1] for name, module in lora.named_modules() if isinstance(module, peft.tuners.lora.Linear)
    }
    assert wrapped == set(targets)
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen_before = {n: p.clone() for n, p in lora.named_parameters() if not p.requires_grad}
    losses = losses_while_training(lora.train(), batch_of_random_tokens(), steps=6, lr=3e-3)
    assert losses[-1] < 0.98 * losses[0]
    for name, param in lora.named_parameters():
        if name in frozen_before:
            assert torch.equal(param, frozen_before[name]), name


@pytest.mark.parametrize("target", ["dt_proj", "x_proj"])
def test_an_adapter_on_the_branch_projections_takes_part_in_the_decode_step(make_model, target):
    """With a LoRA adapter on x_proj or dt_proj the branch runs its modules one by one, and a cached decode step gives
    the logits of the same position in a cache-free forward of the whole sequence: the adapter acts in the decode step
    as in the prefill (the decode step once applied dt_proj's base weight alone)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = make_model().eval()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=[target],
                                                      init_lora_weights=False))  # fmt: skip
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # an adapter that moves the step
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        want = lora(ids).logits[:, -2:]
        cache = lora(ids[:, :-2], use_cache=True).past_key_values
        steps = [lora(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in (10, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), want, atol=1e-5, rtol=1e-4)


class WindowRecorder(TrainerCallback):
    """The attention window each optimizer step's forwards ran with (after the callbacks before it set it)."""

    def __init__(self):
        self.windows = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.windows.append(model.model.attention_window)


def test_stochastic_window_schedule_in_a_trainer_run(make_model, tmp_path):
    """p = 1 until half of the steps: the first half with the short window, the rest with the config's; p = 0.5:
    about half of the early steps, seeded (the same schedule again), none after `until`; the window is the config's
    once training ends."""
    task = RecallTask(num_pairs=1, min_filler=4, max_filler=8)
    tokenizer = task.build_tokenizer()
    examples = task.sample_examples(tokenizer, 8 * 20, seed=0)
    schedules = []
    for probability, until, seed in ((1.0, 0.5, 0), (0.5, 0.8, 3), (0.5, 0.8, 3)):
        model = make_model(vocab_size=len(tokenizer), sliding_window=6).train()
        recorder = WindowRecorder()
        train(
            model, tokenizer, examples, str(tmp_path), 20, batch_size=8, disable_tqdm=True,
            callbacks=[StochasticWindowCallback(2, probability, until, seed), recorder],
        )  # fmt: skip
        assert model.model.attention_window is None
        schedules.append(recorder.windows)
    assert schedules[0] == [2] * 10 + [None] * 10
    assert schedules[1] == schedules[2] and set(schedules[1][16:]) == {None}
    assert 4 <= schedules[1][:16].count(2) <= 12


def test_stochastic_window_is_checked_before_training(make_model, tmp_path):
    with pytest.raises(ValueError, match="probability and until"):
        StochasticWindowCallback(2, probability=1.5)
    task = RecallTask(num_pairs=1, min_filler=4, max_filler=8)
    tokenizer = task.build_tokenizer()
    model = make_model(vocab_size=len(tokenizer), sliding_window=6)
    with pytest.raises(ValueError, match="set_attention_window takes a window"):
        train(
            model, tokenizer, task.sample_examples(tokenizer, 8, seed=0), str(tmp_path), 2, batch_size=8,
            disable_tqdm=True, callbacks=[StochasticWindowCallback(7)],
        )  # fmt: skip


def test_weight_decay_spares_the_ssm_dynamics_as_mamba_does(make_model, tmp_path):
    """A_log, D and the branch scales of ssm_branch_norm (and the biases and norms, as Trainer spares them) train
    without weight decay; the projections decay. Also through PEFT's wrapper, whose names carry a prefix."""
    from modeling.training import HybridTrainer, prepare_trainable

    args = TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1, use_cpu=True, report_to=[])
    models = (make_model(ssm_branch_norm=True), prepare_trainable(make_model(), "ssm+lora", lora_rank=2))
    for model in models:
        trainer = HybridTrainer(model=model, args=args)
        decayed = set(trainer.get_decay_parameter_names(model))
        names = {name for name, _ in model.named_parameters()}
        ssm = {name for name in names if ".self_attn.ssm." in name}
        dynamics = {n for n in ssm if n.endswith((".A_log", ".D"))}
        dynamics |= {n for n in names if n.endswith("_branch_scale")}
        assert dynamics and not dynamics & decayed
        assert {n for n in ssm if n.endswith(("in_proj.weight", "x_proj.weight", "out_proj.weight"))} <= decayed
        assert not {n for n in decayed if n.endswith("bias") or "norm" in n}
        optimizer = trainer.create_optimizer()
        no_decay = {id(p) for group in optimizer.param_groups if group["weight_decay"] == 0 for p in group["params"]}
        by_name = dict(model.named_parameters())
        assert all(id(by_name[n]) in no_decay for n in dynamics if by_name[n].requires_grad)
