"""Language modelling on real text, beyond the window: the hybrid against sliding-window and full attention.

Corpus (nothing fetched): the Python sources that ship on every machine, the interpreter's standard library and the
installed packages' `.py` files. The file list is deterministic (sorted walk, size caps, content-hash dedup) and split
into train and validation by a hash of each file's path, so that no file is in both; the results record the file
counts, bytes and a hash of the list. A byte-level BPE is trained on the training split with `tokenizers` and saved
beside the results: every model uses it.

Models, of the same shapes, trained on the same tokens in the same order with the same schedule (bf16 autocast,
Transformers' `Trainer` through `scripts/train.py`):
  hybrid  HybridForCausalLM: sliding-window attention + the SSM history branch in every layer
  swa     the same with `use_ssm_branch=False`
  full    Transformers' own LlamaForCausalLM of the same shape (full causal attention)

and, starting from a trained `full` (its run saves it to `OUTPUT_DIR/full/checkpoint`; or `--teacher DIR`), what a user
with an attention checkpoint gets (scripts/upcycle.py, then scripts/train.py's distillation):
  upcycled       `full` upcycled with the window W, not trained: the sliding-window model of its weights
  distilled      `upcycled` distilled from `full` (KL on the logits; `--distill-mode`, `--distill-lr`)
  distilled-swa  the control: the same without the SSM branch, fine-tuned the same way on the same tokens

Metrics on the held-out files: the loss by position (each evaluation sequence is EOS and the first T-1 tokens of one
held-out file, as files start in the training stream), in buckets [0,W), [W,4W), [4W,16W); beyond 2W, the same loss
when the model sees at most the last 2W tokens (what the older context is worth to it); a passkey probe (a line
`passkey = "k3x9q"`, held-out code, then `assert passkey == "`: is the value the greedy continuation?) at distances
W/2 .. 16W; training tokens/s (median over timed intervals, the first excluded) and peak memory.

    python scripts/bench_lm.py --models hybrid --train-seconds 330      # steps picked from a time budget
    python scripts/bench_lm.py --models swa,full --steps 1500           # the same steps for the others
    python scripts/bench_lm.py --models upcycled,distilled,distilled-swa --steps 1500   # after `full`
    python scripts/bench_lm.py --report R1.json R2.json R3.json --plot lm.png
    python scripts/bench_lm.py --smoke                                  # the whole pipeline on CPU, tiny

Each model's results go to `OUTPUT_DIR/results-MODEL.json`; the corpus, tokenizer and token arrays are cached in
`OUTPUT_DIR` and reused while the file list (its hash) is the same.
"""

import argparse
import datetime
import functools
import hashlib
import itertools
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    TrainerCallback,
    default_data_collator,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from provenance import head_commit  # noqa: E402
from train import TRAINING_MODES, is_ssm_parameter, prepare_trainable, train  # noqa: E402
from upcycle import upcycle  # noqa: E402

from configuration import HybridConfig  # noqa: E402
from modeling import HybridForCausalLM  # noqa: E402
from modeling.checkpoint_io import load_tensors  # noqa: E402

MODELS = ("hybrid", "swa", "full", "upcycled", "distilled", "distilled-swa")
FROM_TEACHER = ("upcycled", "distilled", "distilled-swa")  # built from a trained `full`
EOS = "<|endoftext|>"  # between files in the training stream
# Padding has a token of its own: `nn.Embedding(padding_idx=...)` keeps the padding token's embedding at zero, which
# would leave EOS, if it padded, untrained.
PAD = "<|pad|>"
PASSKEY_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


@dataclass(frozen=True)
class Shape:
    """The shapes shared by the three models, and the training sequence."""

    vocab_size: int = 16384
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 4
    head_dim: int = 64
    window: int = 256  # W
    context: int = 4096  # T: 16 W, so that [4W, 16W) is inside a training sequence
    batch_size: int = 8


SMOKE_SHAPE = Shape(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    window=16,
    context=128,
    batch_size=4,
)


# ---------------------------------------------------------------------------------------------------------------------
# Corpus


def python_source_roots() -> list[tuple[str, Path]]:
    """(label, directory) of the standard library and of the installed packages, each directory once."""
    paths = sysconfig.get_paths()
    roots, seen = [], set()
    for label, key in (("stdlib", "stdlib"), ("site", "purelib"), ("site", "platlib")):
        path = Path(paths[key]).resolve()
        if path not in seen and path.is_dir():
            roots.append((label, path))
            seen.add(path)
    return roots


def _hash_fraction(text: str, salt: str) -> float:
    """A deterministic number in [0, 1) drawn from `text`."""
    return int.from_bytes(hashlib.sha1(f"{salt}:{text}".encode()).digest()[:8], "big") / 2**64


@dataclass
class Corpus:
    train: list[str]
    validation: list[str]
    stats: dict


def collect_corpus(
    roots: list[tuple[str, Path]],
    min_file_bytes: int = 256,
    max_file_bytes: int = 1 << 20,
    max_total_bytes: int | None = None,
    validation_fraction: float = 0.02,
) -> Corpus:
    """Every `.py` file under `roots` (sorted walk; symlinks, `__pycache__` and another root's subtree skipped) of
    `min_file_bytes..max_file_bytes`, readable as UTF-8, whose content was not seen before. With `max_total_bytes`,
    files are taken in the order of a hash of their path until the budget is spent (a spread, deterministic sample).
    The split is by a second hash of the path: the same file always lands on the same side."""
    root_dirs = {path for _, path in roots}
    candidates = []  # (name, path, size)
    for label, root in roots:
        for directory, subdirs, files in os.walk(root):
            current = Path(directory)
            # The standard library's folder holds the base interpreter's site-packages: walked as its own root, or not.
            subdirs[:] = sorted(
                d
                for d in subdirs
                if d != "__pycache__"
                and not (current / d).is_symlink()
                and (current / d) not in root_dirs
                and not (label == "stdlib" and d in ("site-packages", "dist-packages"))
            )
            for name in sorted(files):
                path = current / name
                if name.endswith(".py") and not path.is_symlink():
                    size = path.stat().st_size
                    if min_file_bytes <= size <= max_file_bytes:
                        candidates.append((f"{label}/{path.relative_to(root)}", path, size))
    if max_total_bytes is not None:
        candidates.sort(key=lambda c: _hash_fraction(c[0], "sample"))

    seen_contents, listing = set(), []
    corpus = Corpus(train=[], validation=[], stats={})
    skipped = {"duplicate": 0, "not_utf8": 0}
    total = 0
    for name, path, size in candidates:
        if max_total_bytes is not None and total + size > max_total_bytes:
            continue
        raw = path.read_bytes()
        digest = hashlib.sha1(raw).hexdigest()
        if digest in seen_contents:
            skipped["duplicate"] += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        seen_contents.add(digest)
        total += size
        split = "validation" if _hash_fraction(name, "split") < validation_fraction else "train"
        getattr(corpus, split).append(text)
        listing.append(f"{split}\t{name}\t{digest}")
    listing.sort()
    corpus.stats = {
        "roots": [f"{label}: {path}" for label, path in roots],
        "train_files": len(corpus.train),
        "validation_files": len(corpus.validation),
        "train_bytes": sum(len(t.encode()) for t in corpus.train),
        "validation_bytes": sum(len(t.encode()) for t in corpus.validation),
        "skipped": skipped,
        "file_caps_bytes": [min_file_bytes, max_file_bytes],
        "max_total_bytes": max_total_bytes,
        "list_sha256": hashlib.sha256("\n".join(listing).encode()).hexdigest(),
    }
    return corpus


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer and token arrays


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's pre-tokenizer, every byte in the base alphabet) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=EOS, eos_token=EOS, pad_token=PAD)


def encode_files(tokenizer, texts: list[str]) -> list[np.ndarray]:
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.uint16) for e in encodings]


@dataclass
class TokenizedCorpus:
    tokenizer: PreTrainedTokenizerFast
    train: np.ndarray  # the training files' tokens, each file followed by EOS
    validation: list[np.ndarray]  # one array per held-out file
    stats: dict


def prepare_data(corpus: Corpus, vocab_size: int, tokenizer_bytes: int, cache_dir: Path) -> TokenizedCorpus:
    """Trains the tokenizer on the first `tokenizer_bytes` of the training split and tokenizes both splits, or loads
    them from `cache_dir` when they were made from the same file list and settings."""
    key = {"list_sha256": corpus.stats["list_sha256"], "vocab_size": vocab_size, "tokenizer_bytes": tokenizer_bytes}
    meta_path = cache_dir / "corpus.json"
    cached = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if cached.get("key") == key:
        stats = cached["stats"]
        tokenizer = PreTrainedTokenizerFast.from_pretrained(cache_dir / "tokenizer")
        validation = np.load(cache_dir / "validation.npz")
        lengths = validation["lengths"].tolist()
        validation = np.split(validation["tokens"], np.cumsum(lengths)[:-1])
        return TokenizedCorpus(tokenizer, np.load(cache_dir / "train.npy", mmap_mode="r"), validation, stats)

    start = time.perf_counter()
    sample, sample_bytes = [], 0
    for text in corpus.train:
        if sample_bytes >= tokenizer_bytes:
            break
        sample.append(text)
        sample_bytes += len(text.encode())
    tokenizer = train_tokenizer(sample, vocab_size)
    train_files = encode_files(tokenizer, corpus.train)
    eos = np.asarray([tokenizer.eos_token_id], dtype=np.uint16)
    train_tokens = np.concatenate([part for ids in train_files for part in (ids, eos)])
    validation = encode_files(tokenizer, corpus.validation)
    stats = dict(corpus.stats)
    stats.update(
        train_tokens=int(train_tokens.size),
        validation_tokens=int(sum(v.size for v in validation)),
        bytes_per_token=round(stats["train_bytes"] / train_tokens.size, 3),
        tokenizer_vocab_size=len(tokenizer),
        tokenizer_trained_on_bytes=sample_bytes,
        prepare_seconds=round(time.perf_counter() - start, 1),
    )
    cache_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(cache_dir / "tokenizer")
    np.save(cache_dir / "train.npy", train_tokens)
    np.savez(cache_dir / "validation.npz", tokens=np.concatenate(validation), lengths=[v.size for v in validation])
    meta_path.write_text(json.dumps({"key": key, "stats": stats}, indent=1))
    return TokenizedCorpus(tokenizer, train_tokens, validation, stats)


class PackedSequences(Dataset):
    """The training stream cut into consecutive sequences of `context` tokens (files packed, EOS between them)."""

    def __init__(self, tokens: np.ndarray, context: int):
        self.tokens, self.context = tokens, context

    def __len__(self):
        return self.tokens.size // self.context

    def __getitem__(self, index):
        ids = torch.from_numpy(self.tokens[index * self.context : (index + 1) * self.context].astype(np.int64))
        return {"input_ids": ids, "labels": ids}


# ---------------------------------------------------------------------------------------------------------------------
# Models


def build_model(kind: str, shape: Shape, tokenizer, attn_implementation: str, seed: int) -> torch.nn.Module:
    """A freshly initialised `kind` model (seeded: the same initial weights for the same shapes), on the GPU if any."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=4 * shape.context,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if kind == "full":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = HybridForCausalLM(HybridConfig(**common, sliding_window=shape.window, use_ssm_branch=kind == "hybrid"))
    model.set_attn_implementation(attn_implementation)
    return model.cuda() if torch.cuda.is_available() else model


def teacher_dir(args) -> Path:
    return args.teacher or args.output_dir / "full" / "checkpoint"


@functools.cache
def upcycled_checkpoint(teacher: Path, output_dir: Path, window: int) -> Path:
    """The teacher upcycled with the window (scripts/upcycle.py, fp32), once per run: `full`, which writes the teacher,
    runs before every model made from it (`parse_args` sees to that)."""
    upcycled_dir = output_dir / "upcycled" / "checkpoint"
    upcycle(teacher, upcycled_dir, sliding_window=window, dtype_name="float32", force=True)
    return upcycled_dir


def build_from_teacher(kind: str, shape: Shape, args) -> torch.nn.Module:
    """The upcycled `full` checkpoint with its SSM branch (`upcycled`, `distilled`) or without (`distilled-swa`), on
    the GPU if any."""
    upcycled_dir = upcycled_checkpoint(teacher_dir(args), args.output_dir, shape.window)
    if kind == "distilled-swa":  # the same tensors less the branch, strictly
        model = HybridForCausalLM(HybridConfig.from_pretrained(upcycled_dir, use_ssm_branch=False))
        tensors = load_tensors(upcycled_dir)
        model.load_state_dict({name: t for name, t in tensors.items() if not is_ssm_parameter(name)})
    else:
        model = HybridForCausalLM.from_pretrained(upcycled_dir)
    model.set_attn_implementation(args.attn)
    return model.cuda() if torch.cuda.is_available() else model


def load_teacher(args) -> torch.nn.Module:
    """The distillation teacher in bf16 on the GPU (fp32 on CPU), with SDPA: it only runs forward."""
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir(args), dtype=dtype, attn_implementation="sdpa")
    return teacher.cuda() if torch.cuda.is_available() else teacher


# ---------------------------------------------------------------------------------------------------------------------
# Training


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
        callbacks=[timer],
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


def model_to_train(kind: str, data: TokenizedCorpus, shape: Shape, args) -> tuple[torch.nn.Module, dict]:
    """The model of `kind` before training, and what `train_model` needs beside it (the teacher, for distillation)."""
    if kind not in FROM_TEACHER:
        return build_model(kind, shape, data.tokenizer, args.attn, args.seed), {}
    model = build_from_teacher(kind, shape, args)
    if kind == "upcycled":
        return model, {}
    return prepare_trainable(model, args.distill_mode), {"teacher": load_teacher(args)}


def probe_seconds_per_step(kind: str, data: TokenizedCorpus, shape: Shape, args) -> float:
    """Trains a throwaway copy of the model for a few steps, which compiles what its training needs (the real run then
    starts warm), and returns the median seconds per step."""
    model, extra = model_to_train(kind, data, shape, args)
    dataset = PackedSequences(data.train, shape.context)
    training = train_model(model, data.tokenizer, dataset, shape, 12, args, args.output_dir / kind / "probe", **extra)
    return shape.batch_size * shape.context / training["tokens_per_second"]


# ---------------------------------------------------------------------------------------------------------------------
# Evaluation


def autocast():
    return (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if torch.cuda.is_available()
        else torch.autocast("cpu", enabled=False)
    )


@torch.no_grad()
def loss_by_position(model, sequences: torch.Tensor, batch_size: int) -> np.ndarray:
    """Mean next-token loss at each position of `sequences` [S, T]: entry t is the loss of predicting token t+1 from
    tokens 0..t, averaged over the S sequences. Returns [T-1]."""
    device = next(model.parameters()).device
    total = torch.zeros(sequences.shape[1] - 1, dtype=torch.float64)
    for start in range(0, len(sequences), batch_size):
        ids = sequences[start : start + batch_size].to(device)
        with autocast():
            logits = model(input_ids=ids).logits[:, :-1]
        losses = F.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
        total += losses.sum(0).double().cpu()
    return (total / len(sequences)).numpy()


@torch.no_grad()
def loss_with_short_context(model, sequences: torch.Tensor, window: int, batch_size: int) -> np.ndarray:
    """Like `loss_by_position`, but the prediction from position t (kW <= t < (k+1)W, k >= 2) sees only tokens
    (k-1)W..t: between W and 2W tokens, a whole attention window, and nothing older than 2W. Against the whole-file
    loss this shows how much a model draws from context older than 2W. Entries t < 2W are NaN. Returns [T-1]."""
    length = sequences.shape[1]
    losses = np.full(length - 1, np.nan)
    for first in range(2 * window, length - 1, window):  # first = kW
        chunk = sequences[:, first - window : min(length, first + window + 1)]
        chunk_losses = loss_by_position(model, chunk, batch_size)  # entry j: position first - W + j
        last = min(first + window, length - 1)
        losses[first:last] = chunk_losses[window : window + last - first]
    return losses


def position_buckets(window: int, context: int) -> dict[str, tuple[int, int]]:
    edges = [0, window, 4 * window, 16 * window]
    buckets = {}
    for low, high in itertools.pairwise(edges):
        if low < context - 1:
            name = f"[{_in_windows(low, window)},{_in_windows(high, window)})"
            buckets[name] = (low, min(high, context - 1))
    return buckets


def context_gain(losses: np.ndarray, short_context_losses: np.ndarray, shape: Shape) -> dict:
    """Per bucket beyond 2W: the loss with the whole file before each position, with at most 2W tokens of it, and
    their difference (what the context older than 2W is worth)."""
    gains = {}
    for name, (low, high) in position_buckets(shape.window, shape.context).items():
        low = max(low, 2 * shape.window)
        if low < high:
            whole, short = float(losses[low:high].mean()), float(short_context_losses[low:high].mean())
            gains[f"[{_in_windows(low, shape.window)},{name.split(',')[1]}"] = {
                "whole_file": round(whole, 4),
                "last_2W": round(short, 4),
                "gain": round(short - whole, 4),
            }
    return gains


def _in_windows(position: int, window: int) -> str:
    return "0" if position == 0 else ("W" if position == window else f"{position // window}W")


def binned_curve(losses: np.ndarray, num_bins: int = 40) -> list[tuple[float, float]]:
    """(geometric centre, mean loss) of log-spaced position bins, for the plot."""
    edges = np.unique(np.geomspace(1, losses.size + 1, num_bins).astype(int))
    return [
        (float(math.sqrt(low * high)), float(losses[low - 1 : high - 1].mean()))
        for low, high in itertools.pairwise(edges)
    ]


def evaluation_sequences(validation: list[np.ndarray], context: int, limit: int, eos_token_id: int) -> torch.Tensor:
    """EOS, then the first `context - 1` tokens of each held-out file that has that many (at most `limit` files): a
    file as it starts in the training stream, where every file follows an EOS. [S, context]"""
    long_files = [ids[: context - 1] for ids in validation if ids.size >= context - 1][:limit]
    if not long_files:
        raise SystemExit(f"error: no held-out file has {context - 1} tokens; lower the context or add files")
    files = torch.from_numpy(np.stack(long_files).astype(np.int64))
    return torch.cat([torch.full((len(files), 1), eos_token_id), files], dim=1)


@dataclass
class PasskeyProbe:
    input_ids: list[int]  # assignment line, `distance` tokens of filler, question, the answer but its last token
    answer: list[int]


def passkey_probes(
    tokenizer, validation: list[np.ndarray], distance: int, count: int, seed: int
) -> list[PasskeyProbe]:
    """`count` probes: `passkey = "<5 random characters>"`, then `distance` tokens of held-out code (cut from the
    held-out files joined by blank lines, starting after a newline), then `assert passkey == "`."""
    generator = np.random.default_rng(seed + distance)
    newline = tokenizer.encode("\n\n", add_special_tokens=False)
    stream = np.concatenate([part for ids in validation for part in (ids, np.asarray(newline, dtype=np.uint16))])
    line_starts = np.flatnonzero(np.isin(stream, tokenizer.encode("\n", add_special_tokens=False)))[:-1] + 1
    question = tokenizer.encode('\nassert passkey == "', add_special_tokens=False)
    line_starts = line_starts[line_starts + distance <= stream.size]
    if line_starts.size == 0:
        raise SystemExit(f"error: the held-out files hold too few tokens for a passkey probe at distance {distance}")
    probes = []
    for start in generator.choice(line_starts, size=count):
        value = "".join(generator.choice(list(PASSKEY_ALPHABET), size=5))
        answer = tokenizer.encode(value, add_special_tokens=False)
        assignment = (
            tokenizer.encode('passkey = "', add_special_tokens=False)
            + answer
            + tokenizer.encode('"\n', add_special_tokens=False)
        )
        filler = stream[start : start + distance].tolist()
        probes.append(PasskeyProbe(assignment + filler + question + answer[:-1], answer))
    return probes


@torch.no_grad()
def passkey_accuracy(model, probes: list[PasskeyProbe], batch_size: int) -> float:
    """Fraction of probes whose answer is the greedy continuation of the question (every answer token the argmax)."""
    device = next(model.parameters()).device
    correct = 0
    for start in range(0, len(probes), batch_size):
        batch = probes[start : start + batch_size]
        length = max(len(p.input_ids) for p in batch)
        # Left padding with a mask: the answers line up at the end of every row.
        ids = torch.full((len(batch), length), model.config.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, probe in enumerate(batch):
            ids[row, length - len(probe.input_ids) :] = torch.tensor(probe.input_ids)
            mask[row, length - len(probe.input_ids) :] = 1
        with autocast():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        for row, probe in enumerate(batch):
            predicted = logits[row, length - len(probe.answer) :].argmax(-1).tolist()
            correct += predicted == probe.answer
    return correct / len(probes)


@torch.no_grad()
def ssm_memory_stats(model, sequences: torch.Tensor, window: int) -> list[dict] | None:
    """Per layer, how long the history branch remembers on held-out text: for each channel the median over tokens of
    the e-folding time `1 / (dt * min_n |A_n|)` of its slowest state (in tokens), summarised over the channels."""
    layers = [layer.self_attn.ssm for layer in model.model.layers] if isinstance(model, HybridForCausalLM) else []
    if not layers or layers[0] is None:
        return None
    captured = {}
    hooks = [
        ssm.dt_proj.register_forward_hook(lambda _m, _i, out, i=i: captured.__setitem__(i, F.softplus(out.float())))
        for i, ssm in enumerate(layers)
    ]
    try:
        with autocast():
            model(input_ids=sequences.to(next(model.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
    stats = []
    for i, ssm in enumerate(layers):
        slowest_rate = torch.exp(ssm.A_log.float()).min(-1).values  # [E]: min_n |A_n|
        memory = (1.0 / (captured[i] * slowest_rate)).flatten(0, 1).median(0).values  # [E], tokens
        stats.append(
            {
                "memory_tokens_p10_p50_p90": [
                    round(float(q), 1) for q in memory.quantile(torch.tensor([0.1, 0.5, 0.9], device=memory.device))
                ],
                "channels_beyond_window": round(float((memory > window).float().mean()), 3),
                "out_proj_norm": round(float(ssm.out_proj.weight.float().norm()), 3),
            }
        )
    return stats


def evaluate(model, data: TokenizedCorpus, shape: Shape, args) -> dict:
    model.eval()
    # Evaluation shapes vary (probe lengths): SDPA computes the same attention without a compilation per shape.
    model.set_attn_implementation("sdpa")
    sequences = evaluation_sequences(data.validation, shape.context, args.eval_sequences, data.tokenizer.eos_token_id)
    losses = loss_by_position(model, sequences, args.eval_batch_size)
    result = {
        "evaluation_sequences": len(sequences),
        "mean_loss": round(float(losses.mean()), 4),
        "loss_by_bucket": {
            name: round(float(losses[low:high].mean()), 4)
            for name, (low, high) in position_buckets(shape.window, shape.context).items()
        },
        "loss_curve": binned_curve(losses),
        "context_beyond_2W": context_gain(
            losses, loss_with_short_context(model, sequences, shape.window, args.eval_batch_size), shape
        ),
        "passkey": {},
    }
    for multiple in (0.5, 2, 4, 8, 16):
        distance = int(multiple * shape.window)
        probes = passkey_probes(data.tokenizer, data.validation, distance, args.passkey_probes, args.seed)
        key = f"{multiple:g}W ({distance})" + (" >T" if len(probes[0].input_ids) + 1 > shape.context else "")
        result["passkey"][key] = round(passkey_accuracy(model, probes, args.eval_batch_size), 3)
    result["ssm_memory"] = ssm_memory_stats(model, sequences[: args.eval_batch_size], shape.window)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Report


def label(result: dict) -> str:
    """The model's name in tables and plots; a distillation that does not train everything says what it trained."""
    mode = result.get("distillation", {}).get("mode", "all")
    return result["model"] + (f" ({mode})" if mode != "all" else "")


def print_table(results: list[dict]) -> None:
    buckets = list(results[0]["eval"]["loss_by_bucket"])
    passkeys = list(results[0]["eval"]["passkey"])
    header = [
        "model",
        "params",
        "tokens",
        "tok/s",
        "mean loss",
        *(f"loss {b}" for b in buckets),
        *(f"passkey {p}" for p in passkeys),
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in results:
        ev = r["eval"]
        tok_s = r["train"]["tokens_per_second"]
        row = [
            label(r),
            _count(r["parameters"]),
            _count(r["train"]["tokens"]),
            f"{tok_s:,}" if tok_s else "-",
            f"{ev['mean_loss']:.3f}",
            *(f"{ev['loss_by_bucket'][b]:.3f}" for b in buckets),
            *(f"{ev['passkey'][p]:.2f}" for p in passkeys),
        ]
        print("| " + " | ".join(row) + " |")
    with_gain = [r for r in results if "context_beyond_2W" in r["eval"]]
    if with_gain:
        print(
            "\nloss with the whole file before each position / with at most its last 2W tokens (gain: the older part)"
        )
        buckets = list(with_gain[0]["eval"]["context_beyond_2W"])
        print("| model | " + " | ".join(buckets) + " |")
        print("|" + "---|" * (len(buckets) + 1))
        for r in with_gain:
            cells = [
                f"{g['whole_file']:.4f} / {g['last_2W']:.4f} (gain {g['gain']:+.4f})"
                for g in r["eval"]["context_beyond_2W"].values()
            ]
            print(f"| {label(r)} | " + " | ".join(cells) + " |")
    print_gap_recovered(results)


def print_gap_recovered(results: list[dict]) -> None:
    """Per position bucket, the share of the gap between `upcycled` (its teacher's weights with the window) and its
    teacher `full` that each distilled model closes: 0 is the upcycled model's loss, 1 the teacher's."""
    by_model = {label(r): r["eval"]["loss_by_bucket"] for r in results}
    students = [label(r) for r in results if r["model"] in ("distilled", "distilled-swa")]
    if not ({"full", "upcycled"} <= set(by_model) and students):
        return
    teacher, start = by_model["full"], by_model["upcycled"]
    print("\nshare of the gap upcycled -> full (teacher) that distillation closes, by position bucket")
    print("| bucket | full | upcycled | " + " | ".join(students) + " |")
    print("|" + "---|" * (3 + len(students)))
    for bucket in teacher:
        gap = start[bucket] - teacher[bucket]
        cells = [
            f"{by_model[m][bucket]:.3f}" + (f" ({(start[bucket] - by_model[m][bucket]) / gap:.0%})" if gap > 0 else "")
            for m in students
        ]
        print(f"| {bucket} | {teacher[bucket]:.3f} | {start[bucket]:.3f} | " + " | ".join(cells) + " |")


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def plot(results: list[dict], path: Path) -> None:
    """Loss against position (log x, the window marked) and, below, each model's loss minus the first model's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, delta) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[3, 2])
    reference = results[0]
    _, reference_loss = zip(*reference["eval"]["loss_curve"])
    for r in results:
        x, y = zip(*r["eval"]["loss_curve"])
        ax.plot(x, y, label=f"{label(r)} ({_count(r['parameters'])})")
        delta.plot(x, np.subtract(y, reference_loss))
    window = reference["shape"]["window"]
    # The first few positions (hardly any context) lie far above the rest: keep the scale for the rest.
    settled = [
        (x, y, y - y0) for r in results for (x, y), y0 in zip(r["eval"]["loss_curve"], reference_loss) if x >= 16
    ]
    _, losses, differences = zip(*settled)
    ax.set_ylim(min(losses) - 0.1, max(losses) + 0.3)
    delta.set_ylim(min(differences) - 0.05, max(differences) + 0.05)
    for axis in (ax, delta):
        axis.axvline(window, color="grey", linestyle="--", linewidth=1)
        axis.grid(alpha=0.3)
    ax.text(window, ax.get_ylim()[1], " window W", va="top", color="grey")
    ax.set_xscale("log")
    ax.set_ylabel("next-token loss (nats)")
    delta.set_ylabel(f"minus {label(reference)}'s")
    delta.set_xlabel("position in the evaluation sequence (tokens)")
    corpus = reference["corpus"]
    ax.set_title(f"Held-out Python sources ({corpus['validation_files']} files, list {corpus['list_sha256'][:10]})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)


# ---------------------------------------------------------------------------------------------------------------------


def run_model(kind: str, data: TokenizedCorpus, shape: Shape, steps: int, args) -> dict:
    dataset = PackedSequences(data.train, shape.context)
    model, extra = model_to_train(kind, data, shape, args)
    if kind == "upcycled":
        steps = 0
    print(f"\n== {kind}: {model.num_parameters():,} parameters, {steps} steps of {shape.batch_size} x {shape.context}")
    if steps:
        training = train_model(model, data.tokenizer, dataset, shape, steps, args, args.output_dir / kind, **extra)
        print(f"== {kind}: trained, {training['tokens_per_second']} tokens/s; evaluating")
    else:
        training = {"steps": 0, "tokens": 0, "tokens_per_second": None, "peak_memory_gib": None, "loss_log": []}
    if kind == "full":  # the teacher of the upcycled models
        model.save_pretrained(teacher_dir(args))
        data.tokenizer.save_pretrained(teacher_dir(args))
    distillation = {}
    if extra:
        distillation = {"teacher": str(teacher_dir(args)), "mode": args.distill_mode, "learning_rate": args.distill_lr}
    return {
        "model": kind,
        "parameters": model.num_parameters(),
        "shape": asdict(shape),
        "attn_implementation": args.attn,
        "learning_rate": args.lr,
        "seed": args.seed,
        "distillation": distillation,
        "train": training,
        "eval": evaluate(model, data, shape, args),
        "corpus": data.stats,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "commit": args.commit or head_commit(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="hybrid,swa,full", help=f"comma-separated, of {', '.join(MODELS)}")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimizer steps per model")
    budget.add_argument("--train-seconds", type=float, help="pick the steps that fit this budget for the first model")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/bench_lm"))
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--teacher", type=Path, help="the trained `full` checkpoint (default: OUTPUT_DIR/full/checkpoint)"
    )
    parser.add_argument("--distill-lr", type=float, default=3e-4, help="peak learning rate of the distillations")
    parser.add_argument(
        "--distill-mode", default="all", help=f"what the distillations train: {', '.join(TRAINING_MODES)}"
    )
    parser.add_argument("--seed", type=int, default=0)
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
    parser.add_argument("--passkey-probes", type=int, default=200, help="probes per distance")
    parser.add_argument("--report", nargs="+", type=Path, metavar="JSON", help="print the table of these results")
    parser.add_argument("--plot", type=Path, help="with --report (or after a run): the loss-by-position PNG")
    parser.add_argument("--commit", help="the commit to record (default: git's HEAD, where there is a .git)")
    parser.add_argument("--smoke", action="store_true", help="tiny corpus slice, tiny models, a few steps, CPU")
    args = parser.parse_args(argv)
    if args.report:
        return args
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
        args.eval_sequences, args.passkey_probes = 16, 16
    elif args.steps is None and args.train_seconds is None:
        parser.error("give --steps or --train-seconds (or --smoke, or --report)")
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
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        results = [json.loads(path.read_text()) for path in args.report]
        print_table(results)
        if args.plot:
            plot(results, args.plot)
            print(f"plot: {args.plot}")
        return 0

    shape = SMOKE_SHAPE if args.smoke else Shape()
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

    # The first trained model's probe compiles and times its training, and checks that the attention implementation
    # trains.
    trained = [kind for kind in args.models if kind != "upcycled"]
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
        path = args.output_dir / f"results-{kind}.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"results: {path}")
        results.append(result)
    print()
    print_table(results)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
