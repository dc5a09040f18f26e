"""The main job: show that the SSM history branch recalls beyond the attention window, in training and in serving.

1. Trains, on the synthetic recall task, the small hybrid model and its attention-only control (the same model
   with the SSM branch switched off) with `Trainer`, and prints their recall accuracies side by side.
2. Saves the trained hybrid with its tokenizer to `outputs/demo/hybrid`, converts it for vLLM
   (`outputs/demo/hybrid-vllm`), serves it with vLLM's OpenAI-compatible server, asks it recall questions through
   the completions API and prints what it answers.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modeling.recall_task import QUERY, RecallTask, small_recall_config  # noqa: E402
from modeling.training import train_hybrid_and_control  # noqa: E402
from vllm_integration.convert import convert_checkpoint  # noqa: E402
from tools.vllm_server import post_json, running_server  # noqa: E402


def serve_and_ask(task, tokenizer, vllm_dir: Path, log_path: Path, seed: int, num_samples: int = 200):
    """Asks the served model every question of `num_samples` held-out samples through the OpenAI completions API:
    each prompt is a sample up to a question's key, so the answers count exactly what `recall_accuracy` measured."""
    generator = torch.Generator().manual_seed(seed + 2)
    questions = [question for _ in range(num_samples) for question in task.sample_questions(generator)]
    prompts = [f"{tokenizer.bos_token} {prompt}" for prompt, _ in questions]
    print(f"\nServing {vllm_dir} with vLLM (the server log goes to {log_path}) ...")
    server_args = ["--max-model-len", "512", "--gpu-memory-utilization", "0.2", "--served-model-name", "hybrid"]
    with running_server(vllm_dir, log_path, *server_args) as base_url:
        status, body = post_json(
            base_url + "/v1/completions",
            {"model": "hybrid", "prompt": prompts, "max_tokens": 1, "temperature": 0},
        )
    if status != 200:
        raise RuntimeError(f"the server answered {status}: {body}")
    answers = [choice["text"].strip() for choice in sorted(body["choices"], key=lambda c: c["index"])]
    shown = []
    for prompt, _ in questions[:6]:
        words = prompt.split()
        pairs, asked = 2 * task.num_pairs, words.index(QUERY)
        shown.append(" ".join(words[:pairs]) + f" ... ({asked - pairs} filler) ... " + " ".join(words[asked:]))
    header = "prompt (pairs, filler, questions)"
    width = max(map(len, [header, *shown])) + 2
    print(f"\n{header:<{width}}{'expected':>9}{'served':>8}")
    for text, (_, expected), answer in zip(shown, questions, answers):
        print(f"{text:<{width}}{expected:>9}{answer:>8}")
    correct = sum(answer == expected for (_, expected), answer in zip(questions, answers))
    print(f"\nvLLM answered {correct}/{len(questions)} recall questions correctly through the OpenAI API.")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/demo"))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-serving", action="store_true", help="stop after training")
    args = parser.parse_args()

    # One thread: the same floating-point sums, hence the same training run, whatever the number of cores.
    torch.set_num_threads(1)
    task = RecallTask()
    tokenizer = task.build_tokenizer()
    config = small_recall_config(tokenizer)
    reach = config.num_hidden_layers * (config.sliding_window - 1)
    words, _ = task.sample_words(torch.Generator().manual_seed(args.seed))
    print(
        f"Recall task, a sample: {' '.join(words)}\n{task.min_filler}-{task.max_filler} filler tokens: the attention "
        f"({config.num_hidden_layers} layers, window {config.sliding_window}) reaches {reach} tokens back, every "
        f"value lies {task.min_distance}+ back from its question. Chance: 1/{task.num_values} = "
        f"{1 / task.num_values:.3f}."
    )
    hybrid, _ = train_hybrid_and_control(task, tokenizer, args.steps, args.seed, args.output_dir)

    hf_dir, vllm_dir = args.output_dir / "hybrid", args.output_dir / "hybrid-vllm"
    hybrid.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    print(f"\nSaved the trained hybrid and its tokenizer to {hf_dir}")
    if args.skip_serving:
        return
    convert_checkpoint(hf_dir, vllm_dir, force=True)
    serve_and_ask(task, tokenizer, vllm_dir, args.output_dir / "vllm-server.log", args.seed)
    print(
        "\nThis task is synthetic. Language modelling on real text (the hybrid against sliding-window attention and "
        "full attention, scripts/bench_lm.py) is in BENCHMARKS.md, 'Language modelling on real text'."
    )


if __name__ == "__main__":
    main()
