"""The main job: show that the SSM history branch recalls beyond the attention window.

Trains, on the synthetic recall task, the small hybrid model and its attention-only control (the same model with the
SSM branch switched off), prints their recall accuracies side by side and saves the trained hybrid with its
tokenizer to `outputs/demo/hybrid`.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling import HybridForCausalLM  # noqa: E402
from recall_task import RecallTask, recall_accuracy  # noqa: E402
from train import small_recall_config, train  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-dir", default="outputs/demo")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    task = RecallTask()
    tokenizer = task.build_tokenizer()
    train_examples = task.sample_examples(tokenizer, args.steps * 32, seed=args.seed)
    held_out = task.sample_examples(tokenizer, 1000, seed=args.seed + 1)
    window = small_recall_config(tokenizer).sliding_window
    print(
        f"Recall task: {task.num_pairs} key/value pairs, then {task.min_filler}-{task.max_filler} filler tokens, then the "
        f"query. Attention window {window} in 2 layers: it reaches {2 * (window - 1)} tokens back, the pairs lie "
        f"{task.min_filler + 2}+ back. Chance: {1 / task.num_values:.3f}."
    )

    results = {}
    for name, use_ssm in (("hybrid (SWA + SSM)", True), ("control (SWA only)", False)):
        torch.manual_seed(args.seed)
        model = HybridForCausalLM(small_recall_config(tokenizer, use_ssm_branch=use_ssm))
        print(f"\nTraining {name}: {model.num_parameters():,} parameters, {args.steps} steps")
        start = time.perf_counter()
        train(
            model, tokenizer, train_examples, f"{args.output_dir}/trainer", args.steps,
            # Clipping slows the SSM's selectivity from emerging on this task (1.0 vs 0.5 accuracy at 1000 steps).
            lr_scheduler_type="constant_with_warmup", max_grad_norm=0.0, description=name,
        )
        results[name] = (recall_accuracy(model, held_out, tokenizer.pad_token_id), time.perf_counter() - start)
        if use_ssm:
            hybrid_dir = Path(args.output_dir) / "hybrid"
            model.save_pretrained(hybrid_dir)
            tokenizer.save_pretrained(hybrid_dir)

    print(f"\n{'model':<22}{'recall accuracy':>16}{'train time':>12}")
    for name, (accuracy, seconds) in results.items():
        print(f"{name:<22}{accuracy:>16.3f}{seconds:>11.0f}s")
    print(f"\nSaved the trained hybrid and its tokenizer to {Path(args.output_dir) / 'hybrid'}")


if __name__ == "__main__":
    main()
