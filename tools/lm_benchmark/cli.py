"""Language modelling on real text, beyond the window: the hybrid against sliding-window and full attention.

Corpus (nothing fetched): the Python sources that ship on every machine, the interpreter's standard library and the
installed packages' `.py` files. The file list is deterministic (sorted walk, size caps, content-hash dedup) and split
into train and validation by a hash of each file's path, so that no file is in both; the results record the file
counts, bytes and a hash of the list. A byte-level BPE is trained on the training split with `tokenizers` and saved
beside the results: every model uses it.

Models, of the same shapes, trained on the same tokens in the same order with the same schedule (bf16 autocast,
Transformers' `Trainer` through `modeling/training.py`):
  hybrid  HybridForCausalLM: sliding-window attention + the SSM history branch in every layer
  swa     the same with `use_ssm_branch=False`
  swa-matched  `swa` with its MLP widened to the hybrid's parameter count (the branch's parameters as plain width)
  full    Transformers' own LlamaForCausalLM of the same shape (full causal attention)

and, starting from a trained `full` (its run saves it to `OUTPUT_DIR/full/checkpoint`; or `--teacher DIR`), what a user
with an attention checkpoint gets (scripts/upcycle.py, then scripts/train.py's distillation):
  upcycled       `full` upcycled with the window W, not trained: the sliding-window model of its weights
  distilled      `upcycled` distilled from `full` (KL on the logits; `--distill-mode`, `--distill-lr`)
  distilled-swa  the control: the same without the SSM branch, fine-tuned the same way on the same tokens

Metrics on the held-out files: the loss by position (each evaluation sequence is EOS and the first T-1 tokens of one
held-out file, as files start in the training stream), in buckets [0,W), [W,4W), [4W,16W); beyond 2W, the same loss
when the model sees at most the last 2W tokens (what the older context is worth to it); for a hybrid, the same loss
with its SSM branch alone restarted D..2D tokens back (D = W, 2W, 4W: what the branch carries); the loss on tokens
whose bigram last occurred within W, W..4W or beyond 4W back; graded retrieval (an identifier-like key assigned a
value in held-out code, the question `distance` tokens later: the value's log-probability with and without the
assignment) and a passkey probe (a line `passkey = "k3x9q"`, held-out code, then `assert passkey == "`: is the value
the greedy continuation?) at distances W/2 .. 16W; training tokens/s (median over timed intervals, the first excluded)
and peak memory.

    python scripts/bench_lm.py --models hybrid --train-seconds 330      # steps picked from a time budget
    python scripts/bench_lm.py --models swa,full --steps 1500           # the same steps for the others
    python scripts/bench_lm.py --models upcycled,distilled,distilled-swa --steps 1500   # after `full`
    python scripts/bench_lm.py --models hybrid --steps 1500 --seed 1 --tag seed1   # the noise floor
    python scripts/bench_lm.py --models hybrid --steps 1500 --set ssm_dt_min=1e-4 --tag dt-min-1e-4   # a lever
    python scripts/bench_lm.py --models hybrid --steps 1500 --short-window 32 --tag short-window   # another
    python scripts/bench_lm.py --models hybrid --steps 1500 --retrieval-data-share 0.02 --tag data   # the data lever
    python scripts/bench_lm.py --models hybrid --shape small --steps 6000    # a smaller model for more tokens
    python scripts/bench_lm.py --report R1.json R2.json R3.json --plot lm.png
    python scripts/bench_lm.py --smoke                                  # the whole pipeline on CPU, tiny

`--stage train` then `--stage evaluate` split one run in two processes (two device calls, each inside its time
limit): the first trains and saves the model and its training record to `OUTPUT_DIR/MODEL[-TAG]/trained`, the second
loads them, evaluates and writes the results as one run would.

Each model's results go to `OUTPUT_DIR/results-MODEL.json` (`results-MODEL-TAG.json` with `--tag`); the corpus,
tokenizer and token arrays are cached in `OUTPUT_DIR` and reused while the file list (its hash) is the same.
"""

import argparse
import datetime
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ..provenance import head_commit
from modeling.history import HistoryBranch
from modeling.training import TRAINING_MODES, add_stochastic_window_arguments
from .corpus import collect_corpus, python_source_roots
from .evaluation import PartTimer, evaluate
from .models import (
    FROM_TEACHER,
    MODELS,
    SHAPES,
    SMOKE_SHAPE,
    Shape,
    load_trained,
    model_to_train,
    shape_fields,
    teacher_dir,
)
from .report import plot, plot_decision, print_table
from .retrieval_data import WithSyntheticRetrievals, training_format_retrieval
from .timed_training import probe_seconds_per_step, train_model
from .tokens import PackedSequences, TokenizedCorpus, prepare_data


def ssm_state_bytes(model) -> int | None:
    """Bytes of history-branch state a sequence holds across all layers (conv history in bf16, the recurrent state in
    fp32, as bf16 serving keeps them), or None for a model without the branch."""
    branches = [module for module in model.modules() if isinstance(module, HistoryBranch)]
    if not branches:
        return None
    return sum(2 * conv + 4 * recurrent for conv, recurrent in (branch.state_numel() for branch in branches))


def longest_retrieval_gap(shape: Shape) -> int:
    """The data lever's gaps run from 2W to this: 8W, at most half a training sequence."""
    return min(8 * shape.window, shape.context // 2)


def run_settings(kind: str, shape: Shape, args) -> dict:
    """What makes a run's model what it is (its data included), recorded by `--stage train` and checked by
    `--stage evaluate`, as JSON reads it back."""
    settings = {
        "model": kind, "shape": asdict(shape), "seed": args.seed, "config_overrides": args.config_overrides,
        "lr": args.lr, "retrieval_data_share": args.retrieval_data_share, "short_window": args.short_window,
        "short_window_prob": args.short_window_prob, "short_window_until": args.short_window_until,
        "corpus_bytes": args.corpus_bytes, "validation_fraction": args.validation_fraction,
        "tokenizer_bytes": args.tokenizer_bytes,
    }  # fmt: skip
    return json.loads(json.dumps(settings))


def run_name(kind: str, args) -> str:
    return kind + (f"-{args.tag}" if args.tag else "")


def trained_dir(kind: str, args) -> Path:
    """Where `--stage train` leaves the trained model and `training.json` for `--stage evaluate`."""
    return args.output_dir / run_name(kind, args) / "trained"


def run_model(kind: str, data: TokenizedCorpus, shape: Shape, steps: int, args) -> dict | None:
    """Builds, trains (`upcycled`: not) and evaluates one model; returns its results, as `results-KIND.json` holds them
    (`--stage train`: saves the trained model and returns None; `--stage evaluate`: loads it and evaluates)."""
    if args.stage == "evaluate":
        saved = trained_dir(kind, args)
        training = json.loads((saved / "training.json").read_text())
        if training["corpus_list_sha256"] != data.stats["list_sha256"]:
            raise SystemExit(f"--stage evaluate: {saved} was trained on another corpus than this machine's")
        args.attn = training["attn"]  # what it trained with (after any fallback), for its record
        model = load_trained(kind, saved, args.attn)
        print(f"\n== {kind}: {model.num_parameters():,} parameters, trained by `{training['command']}`; evaluating")
        return evaluate_model(kind, model, data, shape, training, args)
    dataset = PackedSequences(data.train, shape.context)
    max_gap = longest_retrieval_gap(shape)
    if args.retrieval_data_share:
        dataset = WithSyntheticRetrievals(
            dataset, data.tokenizer, args.retrieval_data_share, min(2 * shape.window, max_gap), max_gap, args.seed
        )
    model, extra = model_to_train(kind, data, shape, args)
    if kind == "upcycled":
        steps = 0
    state = ssm_state_bytes(model)
    print(
        f"\n== {kind}: {model.num_parameters():,} parameters"
        + (f", {state:,} bytes of branch state per sequence" if state else "")
        + f", {steps} steps of {shape.batch_size} x {shape.context}"
    )
    if steps:
        training = train_model(model, data.tokenizer, dataset, shape, steps, args, args.output_dir / kind, **extra)
        print(f"== {kind}: trained, {training['tokens_per_second']} tokens/s")
    else:
        training = {"steps": 0, "tokens": 0, "tokens_per_second": None, "peak_memory_gib": None, "loss_log": []}
    if kind == "full":  # the teacher of the upcycled models
        model.save_pretrained(teacher_dir(args))
        data.tokenizer.save_pretrained(teacher_dir(args))
    if args.stage == "train":
        saved = trained_dir(kind, args)
        model.save_pretrained(saved)
        record = {
            **training, "command": " ".join(sys.argv), "settings": run_settings(kind, shape, args),
            "attn": args.attn, "corpus_list_sha256": data.stats["list_sha256"],
        }  # fmt: skip
        (saved / "training.json").write_text(json.dumps(record, indent=1))
        print(f"== {kind}: saved to {saved} for --stage evaluate")
        return None
    return evaluate_model(kind, model, data, shape, training, args)


def evaluate_model(kind: str, model, data: TokenizedCorpus, shape: Shape, training: dict, args) -> dict:
    """Evaluates a trained model; returns its results record."""
    evaluation = evaluate(model, data, shape, args)
    if args.retrieval_data_share and args.retrieval_probes:
        timer = PartTimer()
        with timer.part("retrieval, training formats"):
            gap = longest_retrieval_gap(shape)
            evaluation["retrieval_training_formats"] = training_format_retrieval(model, data, shape, args, gap)
        evaluation["seconds"].update(timer.seconds)
    distillation = {}
    if kind in FROM_TEACHER and kind != "upcycled":
        distillation = {"teacher": str(teacher_dir(args)), "mode": args.distill_mode, "learning_rate": args.distill_lr}
    return {
        "model": kind,
        "parameters": model.num_parameters(),
        "ssm_state_bytes_per_sequence": ssm_state_bytes(model),
        "shape": asdict(shape),
        "attn_implementation": args.attn,
        "learning_rate": args.lr,
        "seed": args.seed,
        "tag": args.tag,
        "config_overrides": args.config_overrides,
        "retrieval_data_share": args.retrieval_data_share,
        "short_window": None
        if args.short_window is None
        else {"window": args.short_window, "probability": args.short_window_prob, "until": args.short_window_until},
        "distillation": distillation,
        "train": training,
        "eval": evaluation,
        "corpus": data.stats,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "commit": args.commit or head_commit(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench_lm.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="hybrid,swa,full", help=f"comma-separated, of {', '.join(MODELS)}")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimizer steps per model")
    budget.add_argument("--train-seconds", type=float, help="pick the steps that fit this budget for the first model")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/bench_lm"))
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="base", help="the models' shape (models.SHAPES; default base)"
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--teacher", type=Path, help="the trained `full` checkpoint (default: OUTPUT_DIR/full/checkpoint)"
    )
    parser.add_argument("--distill-lr", type=float, default=3e-4, help="peak learning rate of the distillations")
    parser.add_argument(
        "--distill-mode", default="all", help=f"what the distillations train: {', '.join(TRAINING_MODES)}"
    )
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order (the probes stay fixed)")
    parser.add_argument(
        "--set",
        dest="config_overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a HybridConfig field for the hybrid and swa models (repeatable; VALUE read as JSON, else a string)",
    )
    parser.add_argument("--tag", help="names this run's results (results-MODEL-TAG.json) and its rows in reports")
    add_stochastic_window_arguments(parser)
    parser.add_argument(
        "--retrieval-data-share",
        type=float,
        default=0.0,
        help="share of training sequences that carry a synthetic retrieval (a key assigned, used 2W-8W tokens later)",
    )
    parser.add_argument(
        "--attn",
        help="attention implementation for training (default: flex_attention on CUDA, "
        "sdpa on CPU); evaluation always runs SDPA",
    )
    parser.add_argument("--corpus-bytes", type=int, help="cap on the corpus size (a hash-spread sample of the files)")
    parser.add_argument("--validation-fraction", type=float, default=0.02, help="share of the files held out")
    parser.add_argument("--tokenizer-bytes", type=int, default=64 << 20, help="training text for the tokenizer")
    parser.add_argument("--eval-sequences", type=int, default=256)
    parser.add_argument("--eval-batch-size", type=int, default=8)
    parser.add_argument("--passkey-probes", type=int, default=200, help="probes per distance (0: no passkey probe)")
    parser.add_argument(
        "--retrieval-probes", type=int, default=120, help="graded retrieval probes per distance (0: none)"
    )
    parser.add_argument("--report", nargs="+", type=Path, metavar="JSON", help="print the table of these results")
    parser.add_argument("--plot", type=Path, help="with --report (or after a run): the loss-by-position PNG")
    parser.add_argument(
        "--decision-plot",
        type=Path,
        help="with --report (or after a run): the memory program's PNG (retrieval by distance, the SSM's gain)",
    )
    parser.add_argument("--commit", help="the commit to record (default: git's HEAD, where there is a .git)")
    parser.add_argument("--smoke", action="store_true", help="tiny corpus slice, tiny models, a few steps, CPU")
    parser.add_argument(
        "--stage",
        choices=("all", "train", "evaluate"),
        default="all",
        help="train and evaluate (all), or only train and save, or only evaluate what --stage train saved",
    )
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="build the corpus, tokenizer and token arrays in OUTPUT_DIR, then stop",
    )
    args = parser.parse_args(argv)
    if args.report:
        missing = [str(path) for path in args.report if not path.is_file()]
        if missing:
            parser.error(f"--report: no such file: {', '.join(missing)}")
        return args
    args.config_overrides = config_overrides(
        parser, args.config_overrides, SMOKE_SHAPE if args.smoke else SHAPES[args.shape]
    )
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown or not args.models:
        parser.error(f"--models takes {', '.join(MODELS)}; got {', '.join(unknown) or 'none'}")
    if args.steps is not None and args.steps < 1 or args.train_seconds is not None and args.train_seconds <= 0:
        parser.error("--steps and --train-seconds must be positive")
    if args.smoke:
        args.steps = args.steps or 20
        args.corpus_bytes = args.corpus_bytes or 2 << 20
        args.validation_fraction = 0.2
        args.tokenizer_bytes = 1 << 20
        args.eval_sequences, args.passkey_probes, args.retrieval_probes = 16, 16, 6
    elif args.steps is None and args.train_seconds is None and not args.prepare_only and args.stage != "evaluate":
        parser.error("give --steps or --train-seconds (or --smoke, or --report)")
    not_from_scratch = [kind for kind in args.models if kind in FROM_TEACHER]
    if args.stage != "all" and not_from_scratch:
        parser.error(f"--stage {args.stage} runs models trained from scratch; not {', '.join(not_from_scratch)}")
    if not 0 <= args.retrieval_data_share <= 1:
        parser.error(f"--retrieval-data-share must lie in [0, 1], got {args.retrieval_data_share}")
    if args.distill_mode not in TRAINING_MODES:
        parser.error(f"--distill-mode takes {', '.join(TRAINING_MODES)}; got {args.distill_mode}")
    if "distilled-swa" in args.models and args.distill_mode != "all":
        parser.error("distilled-swa (no SSM branch) trains with --distill-mode all only")
    from_teacher = [i for i, kind in enumerate(args.models) if kind in FROM_TEACHER]
    full_first = "full" in args.models and args.models.index("full") < min(from_teacher, default=0)
    if from_teacher and not full_first and not (teacher_dir(args) / "config.json").exists():
        parser.error(
            f"{args.models[from_teacher[0]]} starts from a trained full: put full before it in --models, or run it "
            f"first, or give --teacher (no checkpoint at {teacher_dir(args)})"
        )
    args.attn = args.attn or ("flex_attention" if torch.cuda.is_available() else "sdpa")
    if args.stage == "evaluate":
        check_trained_models(parser, args)
    return args


def check_trained_models(parser, args) -> None:
    """`--stage evaluate`: every model was trained by `--stage train` with these arguments' settings."""
    shape = SMOKE_SHAPE if args.smoke else SHAPES[args.shape]
    for kind in args.models:
        record = trained_dir(kind, args) / "training.json"
        if not record.exists():
            parser.error(f"--stage evaluate: no trained model at {record.parent} (--stage train first)")
        trained, given = json.loads(record.read_text())["settings"], run_settings(kind, shape, args)
        if trained != given:
            parser.error(
                f"--stage evaluate: {record.parent} was trained with {trained}, and these arguments say {given}: give "
                "--stage evaluate the arguments of --stage train"
            )


def config_overrides(parser, assignments: list[str], shape: Shape) -> dict:
    """`--set FIELD=VALUE` pairs as HybridConfig keyword arguments, checked as the run's hybrid of `shape` takes them
    (before the corpus is built). `use_ssm_branch` is the model kind's (`--models`), not a lever."""
    from configuration import HybridConfig

    fields = HybridConfig().to_dict()
    overrides = {}
    for assignment in assignments:
        field, equals, text = assignment.partition("=")
        if not equals or field not in fields:
            parser.error(f"--set takes FIELD=VALUE with a HybridConfig field; got {assignment!r}")
        if field == "use_ssm_branch":
            parser.error("--set use_ssm_branch: the model kind sets it (--models hybrid, swa, swa-matched)")
        try:
            overrides[field] = json.loads(text)
        except json.JSONDecodeError:
            overrides[field] = text
    try:
        HybridConfig(**{**shape_fields(shape), "sliding_window": shape.window, **overrides})
    except (TypeError, ValueError) as error:
        parser.error(f"--set: {error}")
    return overrides


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        results = [json.loads(path.read_text()) for path in args.report]
        print_table(results)
        if args.plot:
            plot(results, args.plot)
            print(f"plot: {args.plot}")
        if args.decision_plot:
            plot_decision(results, args.decision_plot)
            print(f"plot: {args.decision_plot}")
        return 0

    shape = SMOKE_SHAPE if args.smoke else SHAPES[args.shape]
    roots = python_source_roots()
    if args.smoke:
        roots = [root for root in roots if root[0] == "stdlib"]
    start = time.perf_counter()
    corpus = collect_corpus(roots, max_total_bytes=args.corpus_bytes, validation_fraction=args.validation_fraction)
    data = prepare_data(corpus, shape.vocab_size, args.tokenizer_bytes, args.output_dir / "data")
    print(
        f"corpus: {data.stats['train_files']:,} train / {data.stats['validation_files']:,} held-out files, "
        f"{data.stats['train_tokens']:,} / {data.stats['validation_tokens']:,} tokens, list sha256 "
        f"{data.stats['list_sha256'][:16]} ({time.perf_counter() - start:.0f} s)"
    )

    if args.prepare_only:
        return 0
    # The first trained model's probe compiles and times its training, and checks that the attention implementation
    # trains.
    trained = [] if args.stage == "evaluate" else [kind for kind in args.models if kind != "upcycled"]
    steps = args.steps
    if trained:
        try:
            seconds_per_step = probe_seconds_per_step(trained[0], data, shape, args)
        except Exception as error:  # any failure of the compiled attention: fall back to the one that always trains
            if args.attn == "sdpa":
                raise
            print(f"warning: training with {args.attn} failed ({type(error).__name__}: {error}); using sdpa")
            args.attn = "sdpa"
            seconds_per_step = probe_seconds_per_step(trained[0], data, shape, args)
        steps = args.steps or max(1, int(args.train_seconds / seconds_per_step))
        print(f"{trained[0]}: {seconds_per_step * 1e3:.0f} ms per step ({args.attn}): {steps} steps")

    results = []
    for kind in args.models:
        result = run_model(kind, data, shape, steps, args)
        if result is None:
            continue
        path = args.output_dir / f"results-{run_name(kind, args)}.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"results: {path}")
        results.append(result)
    if not results:
        return 0
    print()
    print_table(results)
    if args.plot:
        plot(results, args.plot)
    if args.decision_plot:
        plot_decision(results, args.decision_plot)
    return 0
