"""Training a benchmark model with `modeling.training.train` (the same schedule and data order for every model),
timed: tokens/s over intervals after the first, and peak memory."""

import itertools
import statistics
import time
from pathlib import Path

import torch
from transformers import TrainerCallback, default_data_collator

from modeling.modeling_hybrid import HybridForCausalLM
from modeling.training import stochastic_window_callbacks, train
from .models import Shape, model_to_train
from .tokens import PackedSequences, TokenizedCorpus


class StepTimer(TrainerCallback):
    """Wall time of every `every` optimizer steps (device synchronised), for tokens/s without the first interval
    (compilation, allocator warm-up)."""

    def __init__(self, every: int):
        self.every, self.marks = every, []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

    def interval_seconds(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.marks)]


def train_model(model, tokenizer, dataset, shape: Shape, steps: int, args, output_dir: Path, teacher=None) -> dict:
    """Trains `model` in place for `steps` steps (distilled from `teacher` if given, at `--distill-lr`); returns the
    throughput, memory and loss log."""
    timer = StepTimer(every=max(1, min(25, steps // 8)))
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = train(
        model,
        tokenizer,
        dataset,
        str(output_dir / "trainer"),
        steps,
        batch_size=shape.batch_size,
        learning_rate=args.lr if teacher is None else args.distill_lr,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        weight_decay=0.0,
        bf16=torch.cuda.is_available(),
        data_collator=default_data_collator,
        # The attention-window recipe narrows the hybrids' sliding layers; Llama (`full`) has none.
        callbacks=[timer, *(stochastic_window_callbacks(args) if isinstance(model, HybridForCausalLM) else [])],
        warmup_steps=max(1, steps // 20),
        adam_beta2=0.95,
        optim="adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch",
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=max(1, steps // 40),
        disable_tqdm=True,
        teacher=teacher,
    )
    intervals = timer.interval_seconds()
    tokens_per_step = shape.batch_size * shape.context
    return {
        "steps": steps,
        "tokens": steps * tokens_per_step,
        "epochs": round(steps * shape.batch_size / len(dataset), 3),
        "tokens_per_second": round(timer.every * tokens_per_step / statistics.median(intervals))
        if intervals
        else None,
        "timed_intervals": len(intervals),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "loss_log": [(e["step"], round(e["loss"], 4)) for e in trainer.state.log_history if "loss" in e],
    }


def probe_seconds_per_step(kind: str, data: TokenizedCorpus, shape: Shape, args) -> float:
    """Trains a throwaway copy of the model for a few steps, which compiles what its training needs (the real run then
    starts warm), and returns the median seconds per step."""
    model, extra = model_to_train(kind, data, shape, args)
    dataset = PackedSequences(data.train, shape.context)
    training = train_model(model, data.tokenizer, dataset, shape, 12, args, args.output_dir / kind / "probe", **extra)
    return shape.batch_size * shape.context / training["tokens_per_second"]
