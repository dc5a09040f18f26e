"""Distillation (scripts/train.py --teacher): the KL term, the training modes, bf16 with gradient checkpointing, and
the command line. The student is upcycled here from a tiny random Mistral (its tensors copied, a fresh SSM branch
whose zero `out_proj` leaves the teacher's function), independently of scripts/upcycle.py."""

import math
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Trainer, TrainerCallback

from configuration import HybridConfig
from modeling import HybridForCausalLM, training
from modeling.recall_task import RecallTask

WINDOW = 8
VOCAB = 101


def teacher_fields(vocab_size: int = VOCAB) -> dict:
    """Random weights of std 0.1 (not 0.02), so that the logits are far from uniform and the KL terms are not tiny."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def mistral_teacher(seed: int = 0, vocab_size: int = VOCAB) -> MistralForCausalLM:
    torch.manual_seed(seed)
    config = MistralConfig(**teacher_fields(vocab_size), sliding_window=WINDOW)
    config._attn_implementation = "eager"
    return MistralForCausalLM(config).eval()


def full_attention_teacher(mistral: MistralForCausalLM) -> LlamaForCausalLM:
    """The Llama of the same weights: no window, so it sees what the student's attention cannot."""
    config = LlamaConfig(**teacher_fields(mistral.config.vocab_size))
    config._attn_implementation = "eager"
    llama = LlamaForCausalLM(config).eval()
    llama.load_state_dict(mistral.state_dict())
    return llama


def upcycled_student(teacher, **overrides) -> HybridForCausalLM:
    source = teacher.config
    fields = {
        "vocab_size": source.vocab_size,
        "hidden_size": source.hidden_size,
        "intermediate_size": source.intermediate_size,
        "num_hidden_layers": source.num_hidden_layers,
        "num_attention_heads": source.num_attention_heads,
        "num_key_value_heads": source.num_key_value_heads,
        "head_dim": source.head_dim,
        "sliding_window": WINDOW,
        "max_position_embeddings": source.max_position_embeddings,
        "rms_norm_eps": source.rms_norm_eps,
        "tie_word_embeddings": False,
        "ssm_state_size": 8,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    student = HybridForCausalLM(HybridConfig(**(fields | overrides)))
    student.set_attn_implementation("eager")
    loaded = student.load_state_dict(teacher.state_dict(), strict=False)
    assert not loaded.unexpected_keys
    assert all(".ssm." in name for name in loaded.missing_keys), loaded.missing_keys
    assert bool(loaded.missing_keys) == student.config.use_ssm_branch
    return student.eval()


def random_tokens(seed: int = 0, batch_size: int = 4, length: int = 32) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch_size, length), generator=torch.Generator().manual_seed(seed))


def examples_of(ids: torch.Tensor) -> list[dict]:
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


def stack(batch: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.tensor([example[key] for example in batch]) for key in batch[0]}


@torch.no_grad()
def kl_on(student, teacher, ids: torch.Tensor) -> float:
    return training.distillation_kl(student(ids).logits, teacher(ids).logits, ids).item()


def distil(model, teacher, ids, output_dir, steps: int, **training_arguments) -> Trainer:
    defaults = {"batch_size": 4, "learning_rate": 1e-2, "disable_tqdm": True, "logging_steps": 1, "use_cpu": True}
    return training.train(
        model,
        None,
        examples_of(ids),
        str(output_dir),
        steps,
        data_collator=stack,
        teacher=teacher,
        **(defaults | training_arguments),
    )


def test_the_kl_is_zero_for_the_upcycled_student_and_not_for_a_perturbed_one():
    teacher = mistral_teacher()
    student = upcycled_student(teacher)
    ids = random_tokens(length=3 * WINDOW)  # longer than the window: the teacher has the same one
    assert kl_on(student, teacher, ids) < 1e-6
    with torch.no_grad():
        student.model.layers[1].self_attn.ssm.out_proj.weight.normal_(0, 0.2)
    assert kl_on(student, teacher, ids) > 1e-3


def test_the_kl_matches_a_naive_reference():
    generator = torch.Generator().manual_seed(0)
    batch_size, length, vocab, temperature = 3, 7, 11, 2.5
    student_logits = 3 * torch.randn(batch_size, length, vocab, generator=generator)
    teacher_logits = 3 * torch.randn(batch_size, length, vocab, generator=generator)
    labels = torch.randint(vocab, (batch_size, length), generator=generator)
    labels[0, :3] = -100
    labels[1, 4] = -100
    labels[2, -1] = -100

    terms = []
    for b in range(batch_size):
        for t in range(length - 1):
            if labels[b, t + 1] != -100:
                student_log_probs = F.log_softmax(student_logits[b, t].double() / temperature, dim=-1)
                teacher_probs = F.softmax(teacher_logits[b, t].double() / temperature, dim=-1)
                terms.append(F.kl_div(student_log_probs, teacher_probs, reduction="sum"))
    assert len(terms) == batch_size * (length - 1) - 4
    reference = temperature**2 * torch.stack(terms)

    kl = training.distillation_kl(student_logits, teacher_logits, labels, temperature)
    assert kl.dtype == torch.float32
    torch.testing.assert_close(kl.double(), reference.mean(), rtol=1e-5, atol=1e-7)
    # In chunks of rows (the last one short), recomputed in backward: the same value and the same gradient.
    student = student_logits.clone().requires_grad_(True)
    reference_student = student_logits.double().requires_grad_(True)
    training.distillation_kl(student, teacher_logits, labels, temperature, chunk_rows=4).backward()
    reference_terms = [
        F.kl_div(
            F.log_softmax(reference_student[b, t] / temperature, dim=-1),
            F.softmax(teacher_logits[b, t].double() / temperature, dim=-1),
            reduction="sum",
        )
        for b in range(batch_size)
        for t in range(length - 1)
        if labels[b, t + 1] != -100
    ]
    (temperature**2 * torch.stack(reference_terms).mean()).backward()
    torch.testing.assert_close(student.grad.double(), reference_student.grad, rtol=1e-5, atol=1e-7)
    # Under gradient accumulation Trainer passes the whole step's count: the sum is divided by it instead.
    kl = training.distillation_kl(student_logits.bfloat16(), teacher_logits.bfloat16(), labels, temperature, 40)
    assert kl.dtype == torch.float32
    torch.testing.assert_close(kl.double(), reference.sum() / 40, rtol=2e-2, atol=1e-3)


def test_distilling_a_full_attention_teacher_lowers_the_kl_beyond_the_window(tmp_path):
    mistral = mistral_teacher()
    teacher = full_attention_teacher(mistral)
    student = upcycled_student(mistral)
    ids = random_tokens(batch_size=8, length=4 * WINDOW)
    before = kl_on(student, teacher, ids)
    assert before > 0.05  # the teacher sees beyond the window, the student's attention does not
    trainer = distil(training.prepare_trainable(student, "ssm"), teacher, ids, tmp_path, steps=10)
    logged = [entry["distill_kl"] for entry in trainer.state.log_history if "distill_kl" in entry]
    assert len(logged) == 10 and logged[0] == pytest.approx(before, rel=0.1)
    after = kl_on(student.eval(), teacher, ids)
    assert after < 0.8 * before, (before, after)


def test_the_lm_loss_is_added_with_its_weight(tmp_path):
    teacher = mistral_teacher()
    student = upcycled_student(teacher)
    ids = random_tokens()
    trainer = distil(training.prepare_trainable(student, "ssm"), teacher, ids, tmp_path, steps=1, lm_loss_weight=0.5)
    (entry,) = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert entry["distill_kl"] < 1e-6  # step 0: the student is its teacher
    assert entry["lm_loss"] == pytest.approx(math.log(VOCAB), rel=0.5)
    assert entry["loss"] == pytest.approx(entry["distill_kl"] + 0.5 * entry["lm_loss"], rel=1e-3)


def ssm_names(model) -> set[str]:
    return {name for name, _ in model.named_parameters() if ".self_attn.ssm." in name}


@pytest.mark.parametrize("mode", ["ssm", "ssm+lora", "all"])
def test_training_modes_train_what_they_name_and_nothing_else(tmp_path, mode):
    if mode == "ssm+lora":
        peft = pytest.importorskip("peft")
    teacher = mistral_teacher()
    student = upcycled_student(teacher)
    model = training.prepare_trainable(student, mode, lora_rank=4)
    names = {name for name, _ in model.named_parameters()}
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    ssm = ssm_names(model)
    assert (
        len(ssm) == 2 * 9
    )  # two layers of in_proj, conv1d (weight, bias), x_proj, dt_proj (weight, bias), A_log, D, out_proj
    if mode == "ssm":
        assert trainable == ssm
    elif mode == "ssm+lora":
        lora = {name for name in names if "lora_" in name}
        assert trainable == ssm | lora
        wrapped = {name for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)}
        assert {name.rsplit(".", 1)[-1] for name in wrapped} == set(training.LORA_TARGET_MODULES)
        assert len(wrapped) == 2 * len(training.LORA_TARGET_MODULES)
        assert not any(".ssm." in name for name in wrapped | lora)  # in_proj, out_proj, ... are trained in full
    else:
        assert trainable == names

    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    distil(model, teacher, random_tokens(), tmp_path, steps=1, warmup_steps=0)
    changed = {name for name, param in model.named_parameters() if not torch.equal(param, before[name])}
    assert changed <= trainable
    assert any(name.endswith("ssm.out_proj.weight") for name in changed)
    if mode == "ssm+lora":
        assert any("lora_B" in name for name in changed)
    if mode == "all":
        assert any(name.endswith("self_attn.q_proj.weight") for name in changed)


def test_lora_mode_saves_a_plain_checkpoint_after_the_merge(tmp_path):
    pytest.importorskip("peft")
    teacher = mistral_teacher()
    upcycled_student(teacher).save_pretrained(tmp_path / "plain")
    model = training.prepare_trainable(upcycled_student(teacher), "ssm+lora", lora_rank=4)
    ids = random_tokens()
    distil(model, teacher, ids, tmp_path / "run", steps=2, warmup_steps=0)
    model.eval()
    with torch.no_grad():
        trained_logits = model(ids).logits
    merged = training.merge_lora(model)
    assert type(merged) is HybridForCausalLM
    merged.save_pretrained(tmp_path / "merged")

    def tensor_names(directory) -> set[str]:
        with safe_open(directory / "model.safetensors", "pt") as checkpoint:
            return set(checkpoint.keys())

    assert tensor_names(tmp_path / "merged") == tensor_names(tmp_path / "plain")
    reloaded = HybridForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reloaded.set_attn_implementation("eager")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained_logits, atol=1e-5, rtol=1e-5)
        assert kl_on(reloaded, teacher, ids) > 0  # it trained: the merged LoRA and the SSM moved it


def test_ssm_modes_refuse_a_model_without_an_ssm_branch():
    student = upcycled_student(mistral_teacher(), use_ssm_branch=False)
    for mode in ("ssm", "ssm+lora"):
        with pytest.raises(ValueError, match="use_ssm_branch=False"):
            training.prepare_trainable(student, mode)
    with pytest.raises(ValueError, match="not one of"):
        training.prepare_trainable(student, "lora")


class Gradients(TrainerCallback):
    """Keeps the gradients of every parameter at each optimizer step (Trainer zeroes them after)."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({name: param.grad for name, param in model.named_parameters()})


def test_bf16_with_gradient_checkpointing_gives_ssm_gradients(tmp_path):
    mistral = mistral_teacher()
    teacher = full_attention_teacher(mistral)
    model = training.prepare_trainable(upcycled_student(mistral), "ssm")
    ssm_calls = []
    model.model.layers[0].self_attn.ssm.register_forward_hook(lambda *_: ssm_calls.append(1))
    gradients = Gradients()
    trainer = distil(
        model,
        teacher,
        random_tokens(),
        tmp_path,
        steps=2,
        bf16=True,
        gradient_checkpointing=True,
        callbacks=[gradients],
    )
    assert trainer.accelerator.mixed_precision == "bf16"
    assert model.is_gradient_checkpointing and len(ssm_calls) == 2 * 2  # each step's forward runs again in backward
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in losses)
    for step in gradients.steps:
        for name, grad in step.items():
            if ".self_attn.ssm." in name:
                assert grad is not None and torch.isfinite(grad).all(), name
            else:
                assert grad is None, name
        # Through the frozen embeddings and the checkpointed layers, the SSM output projections get a gradient.
        assert all(step[f"model.layers.{i}.self_attn.ssm.out_proj.weight"].abs().sum() > 0 for i in range(2))


@pytest.fixture
def saved_models(tmp_path):
    """A teacher and its upcycled student on disk, with the recall task's word-level tokenizer, and a text file."""
    task = RecallTask()
    tokenizer = task.build_tokenizer()
    teacher = mistral_teacher(vocab_size=len(tokenizer))
    teacher.save_pretrained(tmp_path / "teacher")
    upcycled_student(teacher).save_pretrained(tmp_path / "student")
    tokenizer.save_pretrained(tmp_path / "student")
    words = torch.randint(len(task.words), (400,), generator=torch.Generator().manual_seed(0)).tolist()
    (tmp_path / "corpus.txt").write_text(" ".join(task.words[i] for i in words))
    return tmp_path


def test_cli_distils_a_saved_student_into_a_plain_checkpoint(saved_models):
    pytest.importorskip("peft")
    root = saved_models
    training.main(
        [
            "--model",
            str(root / "student"),
            "--teacher",
            str(root / "teacher"),
            "--text-file",
            str(root / "corpus.txt"),
            "--block-size",
            "16",
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--train",
            "ssm+lora",
            "--lora-rank",
            "4",
            "--temperature",
            "2",
            "--output-dir",
            str(root / "out"),
        ]
    )
    assert (root / "out" / "tokenizer.json").exists()
    before = HybridForCausalLM.from_pretrained(root / "student").state_dict()
    after = HybridForCausalLM.from_pretrained(root / "out").state_dict()
    assert after.keys() == before.keys()
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    lora_targets = {name for name in after if name.rsplit(".", 2)[-2] in training.LORA_TARGET_MODULES}
    assert changed <= {name for name in after if ".ssm." in name} | lora_targets
    assert any(".ssm." in name for name in changed) and changed & lora_targets


def test_cli_teacher_needs_a_student(saved_models, capsys):
    assert training.main(["--teacher", str(saved_models / "teacher"), "--output-dir", str(saved_models / "out")]) == 2
    assert capsys.readouterr().err.startswith("error: --teacher needs --model")


def test_cli_refuses_a_teacher_of_another_vocabulary(saved_models, capsys):
    student_vocab = HybridConfig.from_pretrained(saved_models / "student").vocab_size
    mistral_teacher(vocab_size=student_vocab + 3).save_pretrained(saved_models / "other")
    arguments = ["--model", str(saved_models / "student"), "--teacher", str(saved_models / "other")]
    out = saved_models / "out"
    assert training.main([*arguments, "--steps", "1", "--batch-size", "2", "--output-dir", str(out)]) == 2
    assert re.search(
        f"^error: .*vocab_size={student_vocab + 3}.*vocab_size={student_vocab}", capsys.readouterr().err, re.M
    )
    assert not out.exists()
