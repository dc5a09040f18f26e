"""Train a hybrid model from a config, fine-tune a checkpoint, or distil a teacher into it, with Transformers'
`Trainer`.

Data: a text file (with `--tokenizer`), or the built-in synthetic recall task (the default), whose word-level
tokenizer is built locally. Writes a `save_pretrained` checkpoint with its tokenizer to `--output-dir`.

    python scripts/train.py --output-dir outputs/recall                      # tiny model, recall task
    python scripts/train.py --config my_config.json --text-file corpus.txt --tokenizer TOKENIZER_DIR --output-dir out
    python scripts/train.py --model outputs/recall --steps 200 --output-dir outputs/recall-ft   # fine-tune
    python scripts/train.py ... --short-window 32     # half of the steps (until 85 %) with attention window 32

Distillation (`--teacher`): the loss is `T^2 KL(teacher || student)` on the next-token distributions at temperature
`--temperature`, plus `--lm-loss-weight` times the student's own LM loss; the teacher (any causal LM with the
student's vocabulary, e.g. the attention checkpoint the student was upcycled from) runs in the same process, without
gradients, on the same batches. `--train` picks what learns: `ssm` (the SSM branch only), `ssm+lora` (the SSM branch
plus LoRA of rank `--lora-rank` on the attention and MLP projections, merged into the saved checkpoint) or `all`.

    python scripts/train.py --model outputs/upcycled --teacher SOURCE_DIR --text-file corpus.txt --train ssm \
        --bf16 --gradient-checkpointing --output-dir outputs/distilled
"""

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import fields as dataclass_fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import Dataset
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import SchedulerType

from configuration import HybridConfig

from .checkpoint_io import CheckpointError, refuse_existing_output, refuse_output_dir, write_directory_atomically
from .modeling_hybrid import HybridForCausalLM
from .recall_task import RecallTask, collate_left_padded, recall_accuracy, small_recall_config


class InputError(Exception):
    """Bad input to `main`, found before anything is written: one `error:` line on stderr, exit code 2."""


# What `--config` may hold: HybridConfig's fields (its own and those of every Transformers config) and the keys a
# saved config.json adds or an older one names.
CONFIG_KEYS = {field.name for field in dataclass_fields(HybridConfig)} | {
    "model_type", "transformers_version", "_name_or_path", "output_attentions",
    "torch_dtype", "rope_theta", "rope_scaling",
}  # fmt: skip


class ExampleDataset(Dataset):
    def __init__(self, examples: list[dict]):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, index):
        return self.examples[index]


def text_file_examples(path: str, tokenizer, block_size: int) -> list[dict]:
    """Tokenises the whole file and cuts it into blocks of `block_size` tokens (language-model labels)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--text-file {path}: {error}") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < block_size + 1:
        raise InputError(f"--text-file {path} holds {len(ids)} tokens, fewer than one block of {block_size + 1}")
    return [
        {"input_ids": ids[i : i + block_size], "labels": ids[i : i + block_size]}
        for i in range(0, len(ids) - block_size + 1, block_size)
    ]


TRAINING_MODES = ("all", "ssm", "ssm+lora")
# Every linear layer of the attention and the MLP; the SSM branch's own projections (in_proj, x_proj, dt_proj,
# out_proj) are trained in full instead. PEFT matches whole name components, so "o_proj" does not catch "out_proj".
LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# What the teacher is given of a batch: never the labels.
TEACHER_INPUTS = ("input_ids", "attention_mask", "position_ids")


def is_ssm_parameter(name: str) -> bool:
    """Whether a parameter belongs to the SSM history branch (with or without PEFT's `base_model.model.` prefix)."""
    return ".self_attn.ssm." in name


def no_weight_decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """The parameters that train without weight decay beside Trainer's own exclusions (biases, norm weights), as each
    module declares them in `no_weight_decay`: a history branch's own (Mamba-1's A_log and D, as Mamba trains them)
    and the branch scales of `config.ssm_branch_norm`, which are scales like a norm's weight. Names as
    `named_parameters` gives them (a PEFT wrapper's prefix included)."""
    modules = model.named_modules()
    return {f"{prefix}.{name}" for prefix, module in modules for name in getattr(module, "no_weight_decay", ())}


def prepare_trainable(
    model: HybridForCausalLM, mode: str = "all", lora_rank: int = 16, lora_alpha: int | None = None
) -> torch.nn.Module:
    """Sets what trains and returns the model to train (a PEFT wrapper in mode "ssm+lora"; `merge_lora` undoes it).

    "ssm": the SSM branch only, everything else frozen. "ssm+lora": the SSM branch in full plus LoRA adapters (rank
    `lora_rank`, alpha `lora_alpha`, default twice the rank) on `LORA_TARGET_MODULES`, the rest frozen. "all": every
    parameter.
    """
    if mode not in TRAINING_MODES:
        raise ValueError(f"training mode {mode!r} is not one of {TRAINING_MODES}")
    if mode == "all":
        return model.requires_grad_(True)
    if not model.config.use_ssm_branch:
        raise ValueError(
            f"training mode {mode!r} trains the SSM branch, and this model has none (use_ssm_branch=False)"
        )
    if mode == "ssm+lora":
        from peft import LoraConfig, get_peft_model  # only here: the GPU machine has no peft

        lora = LoraConfig(
            r=lora_rank, lora_alpha=lora_alpha or 2 * lora_rank, lora_dropout=0.0, target_modules=LORA_TARGET_MODULES
        )
        model = get_peft_model(model, lora)  # freezes every base parameter
    else:
        model.requires_grad_(False)
    for name, param in model.named_parameters():
        if is_ssm_parameter(name):
            param.requires_grad_(True)
    return model


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model of a `prepare_trainable` result: LoRA merged into the base weights, so that `save_pretrained`
    writes the tensor names of a normal checkpoint. Anything else is returned as is."""
    return model.merge_and_unload() if hasattr(model, "merge_and_unload") else model


def check_same_vocabulary(student: torch.nn.Module, teacher: torch.nn.Module) -> None:
    student_vocab, teacher_vocab = student.config.vocab_size, teacher.config.vocab_size
    if student_vocab != teacher_vocab:
        raise ValueError(
            f"the teacher's vocabulary ({type(teacher).__name__}, vocab_size={teacher_vocab}) differs from the "
            f"student's ({type(student).__name__}, vocab_size={student_vocab}): the KL compares the same tokens"
        )


def distillation_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_rows: int = 1024,
) -> torch.Tensor:
    """`T^2 KL(softmax(teacher / T) || softmax(student / T))`, summed over the vocabulary, in fp32, averaged over the
    positions the LM loss scores: position t counts where `labels[:, t + 1] != -100`.

    logits: [B, T, V]; labels: [B, T]. `num_items_in_batch` (what Trainer counts over the whole gradient-accumulation
    step) replaces this batch's count of positions as the divisor, as in Transformers' LM loss; `T^2` keeps the
    gradients' scale independent of the temperature (Hinton et al. 2015). The fp32 log-probabilities exist for
    `chunk_rows` positions at a time and are recomputed in the backward pass: at once, for 32k positions of a 150k
    vocabulary, they would take ~80 GB.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"the student's logits {tuple(student_logits.shape)} and the teacher's {tuple(teacher_logits.shape)} "
            "differ in shape: the KL needs the same vocabulary on both sides"
        )
    scored = labels[:, 1:] != -100  # [B, T-1]
    student_rows, teacher_rows = student_logits[:, :-1][scored], teacher_logits[:, :-1][scored]  # [M, V] each
    kl = student_logits.new_zeros((), dtype=torch.float32)
    for start in range(0, student_rows.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        kl = kl + checkpoint(_kl_sum, student_rows[rows], teacher_rows[rows], temperature, use_reentrant=False)
    count = scored.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, device=kl.device)
    return temperature**2 * kl / count.clamp(min=1)


def _kl_sum(student_rows: torch.Tensor, teacher_rows: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(softmax(teacher / T) || softmax(student / T)) of [M, V] rows, summed, in fp32."""
    student_log_probs = F.log_softmax(student_rows.float() / temperature, dim=-1)
    teacher_log_probs = F.log_softmax(teacher_rows.float() / temperature, dim=-1)
    return F.kl_div(student_log_probs, teacher_log_probs, reduction="sum", log_target=True)


class HybridTrainer(Trainer):
    """`Trainer` that applies no weight decay to the SSM branch's A_log and D, as Mamba trains them (decay would pull
    every state's rate -exp(A_log) towards -1 and the skip D towards 0), nor to the branch scales of
    `config.ssm_branch_norm`; biases and norms are spared as `Trainer` spares them."""

    def get_decay_parameter_names(self, model) -> list[str]:
        spared = no_weight_decay_parameter_names(model)
        return [name for name in super().get_decay_parameter_names(model) if name not in spared]


class DistillationTrainer(HybridTrainer):
    """`HybridTrainer` whose loss is `distillation_kl(student, teacher)` plus `lm_loss_weight` times the student's LM
    loss.

    The teacher runs on each training batch under `no_grad` (in the autocast of `--bf16`, as the student does) and is
    given `TEACHER_INPUTS` of it; it is not part of the trained model, so neither the optimizer nor the checkpoints
    see it. The two parts are logged as `distill_kl` and `lm_loss` beside `loss`.
    """

    def __init__(self, *args, teacher: PreTrainedModel, temperature: float = 1.0, lm_loss_weight: float = 0.0, **kw):
        super().__init__(*args, **kw)
        check_same_vocabulary(self.model, teacher)
        if temperature <= 0:
            raise ValueError(f"the distillation temperature must be positive, not {temperature}")
        self.teacher = teacher.to(self.args.device).eval().requires_grad_(False)
        self.temperature = temperature
        self.lm_loss_weight = lm_loss_weight
        self._loss_parts: dict[str, torch.Tensor] = {}
        self._loss_parts_logged_step = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        student_inputs = dict(inputs)
        if self.lm_loss_weight > 0:
            if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
                student_inputs["num_items_in_batch"] = num_items_in_batch
        else:
            del student_inputs["labels"]
        outputs = model(**student_inputs)
        with torch.no_grad(), self.accelerator.autocast():
            teacher_inputs = {k: inputs[k] for k in TEACHER_INPUTS if k in inputs}
            teacher_logits = self.teacher(**teacher_inputs, use_cache=False).logits
        parts = {
            "distill_kl": distillation_kl(outputs.logits, teacher_logits, labels, self.temperature, num_items_in_batch)
        }
        loss = parts["distill_kl"]
        if self.lm_loss_weight > 0:
            parts["lm_loss"] = outputs.loss
            loss = loss + self.lm_loss_weight * outputs.loss
        if (
            self.args.average_tokens_across_devices
            and self.model_accepts_loss_kwargs
            and num_items_in_batch is not None
        ):
            # As Trainer.compute_loss: num_items_in_batch counts every process's tokens, and DDP averages gradients.
            loss = loss * self.accelerator.num_processes
        if model.training:
            for name, value in parts.items():
                self._loss_parts[name] = self._loss_parts.get(name, 0) + value.detach()
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        steps = self.state.global_step - self._loss_parts_logged_step
        if "loss" in logs and self._loss_parts and steps > 0:
            # Per optimizer step, as `loss` (each micro-batch's part is already divided by the step's token count).
            logs.update({name: total.item() / steps for name, total in self._loss_parts.items()})
            self._loss_parts, self._loss_parts_logged_step = {}, self.state.global_step
        super().log(logs, *args, **kwargs)


class StochasticWindowCallback(TrainerCallback):
    """Pressure on the SSM branch (SWAX, arXiv 2509.24552): before each optimizer step, the sliding layers' attention
    window is `short_window` with probability `probability`, else the config's; from `until` (a fraction of the
    steps) on, always the config's, so that the model ends trained on the window it is served with. Seeded: the same
    schedule for every run with the same arguments."""

    def __init__(self, short_window: int, probability: float = 0.5, until: float = 0.85, seed: int = 0):
        if not 0 <= probability <= 1 or not 0 <= until <= 1:
            raise ValueError(f"probability and until must lie in [0, 1], got {probability} and {until}")
        self.short_window, self.probability, self.until = short_window, probability, until
        self.generator = random.Random(seed)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.set_attention_window(self.short_window)  # checks the window against the model's before any step
        model.set_attention_window(None)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        short = state.global_step < self.until * state.max_steps and self.generator.random() < self.probability
        model.set_attention_window(self.short_window if short else None)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        model.set_attention_window(None)


def train(
    model: HybridForCausalLM,
    tokenizer,
    examples: list[dict] | Dataset,
    output_dir: str,
    steps: int,
    batch_size: int = 32,
    learning_rate: float = 3e-3,
    lr_scheduler_type: str = "cosine",
    max_grad_norm: float = 1.0,
    weight_decay: float = 0.1,
    bf16: bool = False,
    gradient_checkpointing: bool = False,
    description: str = "",
    data_collator=None,
    callbacks=None,
    *,
    teacher: PreTrainedModel | None = None,
    temperature: float = 1.0,
    lm_loss_weight: float = 0.0,
    **training_arguments,
) -> Trainer:
    """Trains `model` in place with `HybridTrainer` (AdamW, no weight decay on the SSM's A_log and D, 10 % warmup,
    then `lr_scheduler_type`; progress bar), or with a `DistillationTrainer` when a `teacher` is given
    (`temperature`, `lm_loss_weight`: its loss). Only the parameters that require grad train (`prepare_trainable`).

    The defaults learn the recall task on every seed. Measured there: at lr 1e-2 with neither weight decay nor
    clipping, the SSM branch's chain of products (in_proj, conv, x_proj, dt_proj) grew until dt at filler tokens
    reached 10-90 (init <= 0.1) and the branch put out 1e2-1e7 times what the attention does, within the first 200
    steps; on some seeds that came before the recall was learned, and training stalled.

    `examples`: a list of examples or a `Dataset`; `data_collator` batches them (default: left padding with
    `attention_mask`). `training_arguments` override the `TrainingArguments` set here (e.g. `weight_decay`, `optim`).
    """
    defaults = dict(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        lr_scheduler_type=lr_scheduler_type,
        warmup_steps=max(1, steps // 10),
        max_grad_norm=max_grad_norm,
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        report_to=[],
        bf16=bf16,
        gradient_checkpointing=gradient_checkpointing,
        use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True,
        run_name=description or None,
    )
    trainer_class, distillation = HybridTrainer, {}
    if teacher is not None:
        trainer_class = DistillationTrainer
        distillation = {"teacher": teacher, "temperature": temperature, "lm_loss_weight": lm_loss_weight}
    trainer = trainer_class(
        model=model,
        args=TrainingArguments(**(defaults | training_arguments)),
        train_dataset=ExampleDataset(examples) if isinstance(examples, list) else examples,
        data_collator=data_collator or (lambda batch: collate_left_padded(batch, tokenizer.pad_token_id)),
        callbacks=callbacks,
        **distillation,
    )
    trainer.train()
    return trainer


# The demo's comparison on the recall task: key -> (name, use_ssm_branch).
HYBRID_AND_CONTROL = {"hybrid": ("hybrid (SWA + SSM)", True), "control": ("control (SWA only)", False)}


def train_hybrid_and_control(task: RecallTask, tokenizer, steps: int, seed: int, output_dir: Path):
    """Trains the recall task's hybrid (`small_recall_config`) and its attention-only control on the same examples
    and prints their recall accuracies on 1000 held-out samples; returns the trained hybrid and the accuracies (keys
    of `HYBRID_AND_CONTROL`)."""
    train_examples = task.sample_examples(tokenizer, steps * 32, seed=seed)
    held_out = task.sample_examples(tokenizer, 1000, seed=seed + 1)
    accuracies, seconds, hybrid = {}, {}, None
    for key, (name, use_ssm) in HYBRID_AND_CONTROL.items():
        torch.manual_seed(seed)
        model = HybridForCausalLM(small_recall_config(tokenizer, use_ssm_branch=use_ssm))
        print(f"\nTraining {name}: {model.num_parameters():,} parameters, {steps} steps")
        start = time.perf_counter()
        train(
            model,
            tokenizer,
            train_examples,
            str(output_dir / "trainer"),
            steps,  # train()'s defaults are the recipe that learns this task on every seed (its docstring says why)
            description=name,
        )
        accuracies[key] = recall_accuracy(model, held_out, tokenizer.pad_token_id)
        seconds[key] = time.perf_counter() - start
        hybrid = model if use_ssm else hybrid
    print(f"\n{'model':<22}{'recall accuracy':>16}{'train time':>12}")
    for key, (name, _) in HYBRID_AND_CONTROL.items():
        print(f"{name:<22}{accuracies[key]:>16.3f}{seconds[key]:>11.0f}s")
    return hybrid, accuracies


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--config", help="HybridConfig JSON to train from scratch (default: the small recall model)")
    start.add_argument("--model", help="save_pretrained checkpoint to fine-tune")
    parser.add_argument("--text-file", help="train on this text file instead of the recall task")
    parser.add_argument(
        "--recall-pairs", type=int, default=1,
        help="key/value pairs per recall sample, every one asked (> 1: multi-query associative recall)",
    )  # fmt: skip
    parser.add_argument("--tokenizer", help="tokenizer directory for --text-file (default: the --model's)")
    parser.add_argument("--block-size", type=int, default=256, help="tokens per text-file example")
    parser.add_argument("--output-dir", required=True, help="written whole at the end, or not at all")
    parser.add_argument("--force", action="store_true", help="replace --output-dir if it exists")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--lr-scheduler",
        default="cosine",
        choices=[kind.value for kind in SchedulerType],
        help="Trainer's lr_scheduler_type",
    )
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: none)")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--no-ssm", action="store_true", help="switch the SSM branch off (attention-only control)")
    parser.add_argument("--train", choices=TRAINING_MODES, default="all", help="what trains (default: everything)")
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank of --train ssm+lora")
    parser.add_argument("--lora-alpha", type=int, help="LoRA alpha of --train ssm+lora (default: twice the rank)")
    parser.add_argument("--teacher", help="causal LM checkpoint to distil into the --model (same vocabulary)")
    parser.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    parser.add_argument("--lm-loss-weight", type=float, default=0.0, help="weight of the LM loss beside the KL")
    parser.add_argument("--seed", type=int, default=0)
    add_stochastic_window_arguments(parser)
    return parser.parse_args(argv)


def add_stochastic_window_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `StochasticWindowCallback` (scripts/train.py and scripts/bench_lm.py)."""
    parser.add_argument(
        "--short-window",
        type=int,
        help="train part of the steps with this narrower attention window (e.g. W/8), to leave more to the SSM branch",
    )
    parser.add_argument("--short-window-prob", type=float, default=0.5, help="share of steps with the short window")
    parser.add_argument(
        "--short-window-until", type=float, default=0.85, help="fraction of the steps after which the window is W"
    )


def stochastic_window_callbacks(args) -> list[TrainerCallback]:
    """`[StochasticWindowCallback]` when `--short-window` is given, else none."""
    if args.short_window is None:
        return []
    return [StochasticWindowCallback(args.short_window, args.short_window_prob, args.short_window_until, args.seed)]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (InputError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def check_arguments(args) -> None:
    """What the flags must be by themselves, and the output directory, before any work."""
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--block-size", args.block_size)):
        if value < 1:
            raise InputError(f"{flag} must be at least 1, got {value}")
    if args.teacher and not args.model:
        raise InputError("--teacher needs --model, the student to distil into (e.g. from scripts/upcycle.py)")
    if args.no_ssm and args.model:
        raise InputError(
            "--no-ssm builds a model without the branch: it takes --config or the recall model, not --model"
        )
    if args.text_file and not (args.tokenizer or args.model):
        raise InputError("--text-file needs --tokenizer (or a --model that has one)")
    if not args.text_file and not 1 <= args.recall_pairs <= RecallTask.num_keys:
        raise InputError(f"--recall-pairs takes 1 to {RecallTask.num_keys} (the task's keys)")
    if args.model:  # a local checkpoint or one on the Hub
        config = loaded("config", AutoConfig.from_pretrained, args.model)
        if config.model_type != HybridConfig.model_type:
            raise InputError(
                f"--model {args.model} is a {config.model_type!r} checkpoint, not a hybrid: make one of it with "
                "scripts/upcycle.py"
            )
    for path in (args.model, args.config, args.text_file, args.tokenizer, args.teacher):
        if path is not None and Path(path).exists():  # --force would delete an input inside the output
            refuse_output_dir(Path(path), Path(args.output_dir), args.force)
    refuse_existing_output(Path(args.output_dir), args.force)


def read_config(path: str) -> HybridConfig:
    """`--config`: a JSON object of HybridConfig fields (a saved config.json too), every key one the config knows."""
    try:
        fields = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"--config {path}: {error}") from None
    if not isinstance(fields, dict):
        raise InputError(
            f"--config {path}: expected a JSON object of HybridConfig fields, got {type(fields).__name__}"
        )
    unknown = sorted(set(fields) - CONFIG_KEYS)
    if unknown:
        raise InputError(f"--config {path}: not HybridConfig fields: {', '.join(unknown)}")
    try:
        return HybridConfig.from_dict(fields)
    except (ValueError, StrictDataclassError) as error:  # the latter: a field every Transformers config has
        raise InputError(f"--config {path}: {error}") from None


def loaded(what: str, from_pretrained, path: str, **kwargs):
    """`from_pretrained(path)` (a local directory or a Hub name), what it cannot load an `InputError` naming it (the
    first line of Transformers' message)."""
    try:
        return from_pretrained(path, **kwargs)
    except (OSError, ValueError) as error:
        raise InputError(f"no {what} could be loaded from {path}: {str(error).splitlines()[0]}") from None


def run(args) -> None:
    check_arguments(args)
    torch.manual_seed(args.seed)
    task = None
    if args.text_file:
        tokenizer = loaded("tokenizer", AutoTokenizer.from_pretrained, args.tokenizer or args.model)
        examples = text_file_examples(args.text_file, tokenizer, args.block_size)
    else:
        task = RecallTask(num_pairs=args.recall_pairs)
        if args.model:
            tokenizer = loaded("tokenizer", AutoTokenizer.from_pretrained, args.model)
        else:
            tokenizer = task.build_tokenizer()
        examples = task.sample_examples(tokenizer, args.steps * args.batch_size, seed=args.seed)
    if len(examples) < args.batch_size:  # the Trainer drops the last partial batch: it would train no step
        raise InputError(f"{len(examples)} examples make no batch of --batch-size {args.batch_size}")

    if args.model:
        # fp32 weights whatever the checkpoint's dtype: --bf16 is mixed precision over them.
        model = HybridForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    elif args.config:
        config = read_config(args.config)
        if args.no_ssm:  # the attention-only control: the same config without the branch (ssm_branch_norm, if
            config.use_ssm_branch = False  # set, then normalises the attention alone, as bench_lm's controls do)
        model = HybridForCausalLM(config)
    else:
        model = HybridForCausalLM(small_recall_config(tokenizer, use_ssm_branch=not args.no_ssm))
    if len(tokenizer) > model.config.vocab_size:
        raise InputError(
            f"the tokenizer's {len(tokenizer)} tokens do not fit the model's vocab_size {model.config.vocab_size}"
        )
    window = model.config.sliding_window if "sliding_attention" in model.config.layer_types else None
    if args.short_window is not None and not (window and 1 <= args.short_window <= window):
        raise InputError(f"--short-window takes 1 to the model's sliding_window {window}, got {args.short_window}")
    try:
        callbacks = stochastic_window_callbacks(args)
    except ValueError as error:
        raise InputError(f"--short-window-prob, --short-window-until: {error}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    teacher = None
    if args.teacher:
        dtype = torch.bfloat16 if args.bf16 else "auto"
        teacher = loaded("teacher", AutoModelForCausalLM.from_pretrained, args.teacher, dtype=dtype)
        try:
            check_same_vocabulary(model, teacher)
        except ValueError as error:
            raise InputError(str(error)) from None
    trained = prepare_trainable(model, args.train, args.lora_rank, args.lora_alpha)

    # The Trainer's own files (logs) go to a directory of its own; the checkpoint is written whole or not at all.
    with tempfile.TemporaryDirectory(prefix="train-") as trainer_dir:
        trainer = train(
            trained,
            tokenizer,
            examples,
            trainer_dir,
            args.steps,
            args.batch_size,
            args.lr,
            args.lr_scheduler,
            args.max_grad_norm,
            args.weight_decay,
            args.bf16,
            args.gradient_checkpointing,
            callbacks=callbacks,
            teacher=teacher,
            temperature=args.temperature,
            lm_loss_weight=args.lm_loss_weight,
        )
    model = merge_lora(trained)

    def write(staging: Path) -> None:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    if not trainer.is_world_process_zero():  # under torchrun one process writes the checkpoint
        return
    write_directory_atomically(Path(args.output_dir), write, args.force)
    if task is not None:
        held_out = task.sample_examples(tokenizer, 1000, seed=args.seed + 1)
        print(
            f"recall accuracy on 1000 held-out prompts: {recall_accuracy(model, held_out, tokenizer.pad_token_id):.3f}"
        )
    print(f"saved model and tokenizer to {args.output_dir}")


if __name__ == "__main__":
    sys.exit(main())
