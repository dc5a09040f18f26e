"""Evaluation on the held-out files: the loss by position and in buckets of the window W, the same loss with the
context cut to the last 2W tokens and with the SSM branch restarted W, 2W or 4W tokens back, the loss on bigrams
repeated from inside and from beyond the window, retrieval of an assigned value scored by its log-probability and
passkey probes (exact greedy copies) at distances W/2 .. 16W, and how long the SSM branch remembers."""

import contextlib
import functools
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from modeling.modeling_hybrid import HybridForCausalLM
from .models import Shape
from .tokens import TokenizedCorpus

PASSKEY_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def autocast():
    return (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if torch.cuda.is_available()
        else torch.autocast("cpu", enabled=False)
    )


@torch.no_grad()
def token_losses(model, sequences: torch.Tensor, batch_size: int, seq_idx: torch.Tensor | None = None) -> np.ndarray:
    """Next-token loss at every position of every sequence of `sequences` [S, T]: entry [s, t] is the loss of
    predicting token t+1 of row s from its tokens 0..t. `seq_idx` [T] (a hybrid's, optional): where the SSM branch
    restarts in every row, the attention unchanged. Returns [S, T-1] (fp32)."""
    device = next(model.parameters()).device
    rows = []
    for start in range(0, len(sequences), batch_size):
        ids = sequences[start : start + batch_size].to(device)
        restarts = {} if seq_idx is None else {"seq_idx": seq_idx.to(device).expand(len(ids), -1).contiguous()}
        with autocast():
            logits = model(input_ids=ids, **restarts).logits[:, :-1]
        rows.append(F.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none").cpu())
    return torch.cat(rows).numpy()


def loss_by_position(
    model, sequences: torch.Tensor, batch_size: int, seq_idx: torch.Tensor | None = None
) -> np.ndarray:
    """`token_losses` averaged over the sequences: entry t is the mean loss of predicting token t+1 from tokens
    0..t. Returns [T-1]."""
    return token_losses(model, sequences, batch_size, seq_idx).mean(0, dtype=np.float64)


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


@torch.no_grad()
def loss_with_ssm_reset(model, sequences: torch.Tensor, history: int, batch_size: int) -> np.ndarray:
    """Like `loss_by_position`, with the attention unchanged (its whole window) but the history branch's state and
    conv history restarted so that the prediction from position t >= `history` carries in the SSM only tokens
    b..t, b = (t // history - 1) * history: between `history` and 2 * `history` tokens. Against the whole-file loss
    this is what the branch alone draws from older context (the short-context measure also cuts the attention's
    relays across layers). Two forwards: restarts at even multiples of `history` serve the positions t with
    t // history odd, restarts at odd multiples the others (through the model's `seq_idx`, as packed training
    restarts the branch). In a model of several layers the attention also reads earlier positions' branches, each
    restarted on the same grid (at most 2 * `history` tokens before its own position). Entries t < `history` are NaN.
    Returns [T-1]."""
    positions = np.arange(sequences.shape[1])
    segment = positions[:-1] // history
    losses = np.full(len(segment), np.nan)
    for parity in (0, 1):
        seq_idx = torch.from_numpy((positions + parity * history) // (2 * history))
        served = (segment % 2 == 1 - parity) & (segment >= 1)  # [T-1]: the positions whose restart is this pass's
        losses[served] = loss_by_position(model, sequences, batch_size, seq_idx)[served]
    return losses


def ssm_reset_gain(model, sequences: torch.Tensor, losses: np.ndarray, shape: Shape, batch_size: int) -> dict:
    """For the history branch restarted D = W, 2W, 4W tokens back (`loss_with_ssm_reset`), over the positions
    >= 2D: the whole-file loss, the loss with the reset, and their difference (what the branch carries from beyond
    D to 2D tokens back). Empty for a model without the branch."""
    if not (isinstance(model, HybridForCausalLM) and model.config.use_ssm_branch):
        return {}
    gains = {}
    for multiple in (1, 2, 4):
        history = multiple * shape.window
        if 2 * history >= shape.context - 1:
            continue
        reset = loss_with_ssm_reset(model, sequences, history, batch_size)
        whole, without = float(losses[2 * history :].mean()), float(reset[2 * history :].mean())
        gains[f"{multiple}W"] = {
            "whole_file": round(whole, 4),
            "ssm_reset": round(without, 4),
            "gain": round(without - whole, 4),
        }
    return gains


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


def previous_bigram_distance(sequences: torch.Tensor) -> np.ndarray:
    """For the prediction from position t of each row (token t+1 after token t): how far back the same bigram
    (token t, token t+1) last occurred, t - j for the latest j < t with the same pair at (j, j+1), or 0 where it has
    not occurred before in the row. [S, T-1]"""
    ids = sequences.numpy().astype(np.int64)
    bigrams = ids[:, :-1] * (int(ids.max()) + 1) + ids[:, 1:]
    distance = np.zeros(bigrams.shape, dtype=np.int64)
    for row, codes in enumerate(bigrams.tolist()):
        last = {}
        for t, code in enumerate(codes):
            if code in last:
                distance[row, t] = t - last[code]
            last[code] = t
    return distance


def repeated_bigram_loss(sequences: torch.Tensor, losses: np.ndarray, window: int) -> dict:
    """Zoology's associative-recall view of real text: at positions >= 2W, the mean loss of tokens whose bigram
    (previous token, token) last occurred inside the attention window (at most W back: the attention sees the earlier
    copy), W..4W back, more than 4W back, or never before in the sequence, with their counts. A model that carries
    what left the window lowers the middle classes towards the first. `losses` [S, T-1] from `token_losses`."""
    distance = previous_bigram_distance(sequences)[:, 2 * window :]
    losses = losses[:, 2 * window :]
    classes = {
        "within W": (distance >= 1) & (distance <= window),
        "W..4W back": (distance > window) & (distance <= 4 * window),
        "beyond 4W": distance > 4 * window,
        "first occurrence": distance == 0,
    }
    return {
        name: {"loss": round(float(losses[chosen].mean()), 4) if chosen.any() else None, "tokens": int(chosen.sum())}
        for name, chosen in classes.items()
    }


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


def code_fillers(tokenizer, validation: list[np.ndarray], distance: int, count: int, generator) -> list[list[int]]:
    """`count` runs of `distance` tokens of held-out code (cut from the held-out files joined by blank lines,
    starting after a newline): what separates a probe's assignment from its question."""
    newline = tokenizer.encode("\n\n", add_special_tokens=False)
    stream = np.concatenate([part for ids in validation for part in (ids, np.asarray(newline, dtype=np.uint16))])
    line_starts = np.flatnonzero(np.isin(stream, tokenizer.encode("\n", add_special_tokens=False)))[:-1] + 1
    line_starts = line_starts[line_starts + distance <= stream.size]
    if line_starts.size == 0:
        raise SystemExit(f"error: the held-out files hold too few tokens for a probe at distance {distance}")
    return [stream[start : start + distance].tolist() for start in generator.choice(line_starts, size=count)]


def passkey_probes(
    tokenizer, validation: list[np.ndarray], distance: int, count: int, seed: int
) -> list[PasskeyProbe]:
    """`count` probes: `passkey = "<5 random characters>"`, then `distance` tokens of held-out code
    (`code_fillers`), then `assert passkey == "`."""
    generator = np.random.default_rng(seed + distance)
    question = tokenizer.encode('\nassert passkey == "', add_special_tokens=False)
    probes = []
    for filler in code_fillers(tokenizer, validation, distance, count, generator):
        value = "".join(generator.choice(list(PASSKEY_ALPHABET), size=5))
        answer = tokenizer.encode(value, add_special_tokens=False)
        assignment = (
            tokenizer.encode('passkey = "', add_special_tokens=False)
            + answer
            + tokenizer.encode('"\n', add_special_tokens=False)
        )
        probes.append(PasskeyProbe(assignment + filler + question + answer[:-1], answer))
    return probes


# Graded retrieval: (assignment, question) in three code formats; the question ends where the value starts. No
# training text holds these keys (random), and the synthetic-retrieval data lever must not use these formats.
RETRIEVAL_FORMATS = (
    ('{key} = "{value}"\n', '\nassert {key} == "'),
    ('registry["{key}"] = "{value}"\n', '\nassert registry["{key}"] == "'),
    ('def {key}():\n    return "{value}"\n', '\nassert {key}() == "'),
)
RETRIEVAL_DISTANCES = (0.5, 1, 2, 4, 8, 16)  # in windows W
PROBE_SEED = 0  # the probes are the instrument: the same for every model and training seed
CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"


def random_word(generator, syllables: int) -> str:
    return "".join(generator.choice(list(CONSONANTS)) + generator.choice(list(VOWELS)) for _ in range(syllables))


@dataclass
class RetrievalProbe:
    assignment: list[int]  # the key's assignment line
    filler: list[int]  # `distance` tokens of held-out code
    question: list[int]  # the key asked for, up to the value
    value: list[int]  # the value's tokens, scored


def evaluation_probe(generator, index: int) -> tuple[str, str, str]:
    """(assignment, question, value) of the evaluation's probe number `index`: the formats in turn, an identifier-like
    key (two pronounceable random words, `kodu_samire`) assigned an identifier-like value (a word and two digits,
    `tavemo42`)."""
    assignment, question = RETRIEVAL_FORMATS[index % len(RETRIEVAL_FORMATS)]
    key = f"{random_word(generator, 2)}_{random_word(generator, 3)}"
    value = random_word(generator, 3) + "".join(generator.choice(list("0123456789"), size=2))
    return assignment.format(key=key, value=value), question.format(key=key), value


def retrieval_probes(
    tokenizer,
    validation: list[np.ndarray],
    distance: int,
    count: int,
    seed: int,
    draw: Callable[[np.random.Generator, int], tuple[str, str, str]] = evaluation_probe,
    seed_offset: int = 10_000,
) -> list[RetrievalProbe]:
    """`count` probes: an assignment, `distance` tokens of held-out code, then the question; `draw(generator, index)`
    writes each probe's (assignment, question, value), by default the evaluation's own (`evaluation_probe`)."""
    generator = np.random.default_rng(seed_offset + seed + distance)
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    probes = []
    for i, filler in enumerate(code_fillers(tokenizer, validation, distance, count, generator)):
        assignment, question, value = draw(generator, i)
        probes.append(RetrievalProbe(encode(assignment), filler, encode(question), encode(value)))
    return probes


def retrieval_by_distance(model, shape, args, multiples, probes_at: Callable[[int], list[RetrievalProbe]]) -> dict:
    """`retrieval_score` of the probes `probes_at(distance)` makes, for each distance `multiple * W`; keyed "2W (512)",
    with " >T" where a probe is longer than the training context."""
    scores = {}
    for multiple in multiples:
        distance = int(multiple * shape.window)
        probes = probes_at(distance)
        longest = max(len(p.assignment + p.filler + p.question + p.value) for p in probes)
        key = f"{multiple:g}W ({distance})" + (" >T" if longest > shape.context else "")
        scores[key] = retrieval_score(model, probes, args.eval_batch_size)
    return scores


@torch.no_grad()
def continuation_logprob(
    model, prefixes: list[list[int]], continuations: list[list[int]], batch_size: int
) -> np.ndarray:
    """Per pair, the mean log-probability per token of `continuation` after `prefix` (teacher forced). Rows are left
    padded with a mask, so that every continuation ends the row. [len(prefixes)]"""
    device = next(model.parameters()).device
    scores = []
    for start in range(0, len(prefixes), batch_size):
        rows = [p + c for p, c in zip(prefixes[start : start + batch_size], continuations[start : start + batch_size])]
        length = max(map(len, rows))
        ids = torch.full((len(rows), length), model.config.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(rows):
            ids[row, length - len(tokens) :] = torch.tensor(tokens)
            mask[row, length - len(tokens) :] = 1
        with autocast():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        means = []
        for row, continuation in enumerate(continuations[start : start + batch_size]):
            n = len(continuation)
            # The positions before each continuation token, normalised there alone (on the device: a row's whole
            # [length, vocab] never leaves it).
            log_probs = logits[row, length - n - 1 : length - 1].float().log_softmax(-1)
            means.append(log_probs.gather(-1, torch.tensor(continuation, device=device)[:, None]).mean())
        scores.extend(torch.stack(means).tolist())
    return np.asarray(scores)


def retrieval_score(model, probes: list[RetrievalProbe], batch_size: int) -> dict:
    """The value's mean log-probability per token with its assignment before the filler, and without it (the same
    filler and question: what the model guesses from the format alone); their difference is what it retrieved."""
    values = [p.value for p in probes]
    with_key = continuation_logprob(model, [p.assignment + p.filler + p.question for p in probes], values, batch_size)
    without = continuation_logprob(model, [p.filler + p.question for p in probes], values, batch_size)
    return {
        "logprob": round(float(with_key.mean()), 4),
        "logprob_without_assignment": round(float(without.mean()), 4),
        "retrieved": round(float((with_key - without).mean()), 4),
    }


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
    """Per layer, how long the history branch remembers on held-out text: for each of its decays (a Mamba-1 channel's
    slowest state, a Mamba-2 head) the median over tokens of the e-folding time `1 / (dt |A|)` (in tokens,
    `HistoryBranch.memory_timescales`), summarised over the decays."""
    layers = [layer.self_attn.ssm for layer in model.model.layers] if isinstance(model, HybridForCausalLM) else []
    if not layers or layers[0] is None:
        return None
    captured = {}
    hooks = [
        ssm.register_forward_pre_hook(lambda _m, args, i=i: captured.__setitem__(i, args[0]))
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
        with autocast():
            timescales = ssm.memory_timescales(captured[i])
        memory = timescales.flatten(0, 1).median(0).values  # [decays], tokens
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


class PartTimer:
    """Wall seconds of each part of the evaluation (device synchronised), for the record and the log."""

    def __init__(self):
        self.seconds = {}

    @contextlib.contextmanager
    def part(self, name: str):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds[name] = round(time.perf_counter() - start, 1)
        print(f"evaluation: {name} in {self.seconds[name]} s", flush=True)


def evaluate(model, data: TokenizedCorpus, shape: Shape, args) -> dict:
    model.eval()
    # Evaluation shapes vary (probe lengths): SDPA computes the same attention without a compilation per shape.
    model.set_attn_implementation("sdpa")
    timer = PartTimer()
    sequences = evaluation_sequences(data.validation, shape.context, args.eval_sequences, data.tokenizer.eos_token_id)
    with timer.part("loss by position"):
        per_token = token_losses(model, sequences, args.eval_batch_size)
    losses = per_token.mean(0, dtype=np.float64)
    with timer.part("short context"):
        short_context_losses = loss_with_short_context(model, sequences, shape.window, args.eval_batch_size)
    with timer.part("SSM reset"):
        reset_gains = ssm_reset_gain(model, sequences, losses, shape, args.eval_batch_size)
    result = {
        "evaluation_sequences": len(sequences),
        "mean_loss": round(float(losses.mean()), 4),
        "loss_by_bucket": {
            name: round(float(losses[low:high].mean()), 4)
            for name, (low, high) in position_buckets(shape.window, shape.context).items()
        },
        "loss_curve": binned_curve(losses),
        "context_beyond_2W": context_gain(losses, short_context_losses, shape),
        "ssm_beyond_reset": reset_gains,
        "repeated_bigrams": repeated_bigram_loss(sequences, per_token, shape.window),
        "passkey": {},
        "retrieval": {},
    }
    with timer.part("passkey"):
        for multiple in (0.5, 2, 4, 8, 16) if args.passkey_probes else ():
            distance = int(multiple * shape.window)
            probes = passkey_probes(data.tokenizer, data.validation, distance, args.passkey_probes, PROBE_SEED)
            key = f"{multiple:g}W ({distance})" + (" >T" if len(probes[0].input_ids) + 1 > shape.context else "")
            result["passkey"][key] = round(passkey_accuracy(model, probes, args.eval_batch_size), 3)
    with timer.part("retrieval"):
        if args.retrieval_probes:
            count = args.retrieval_probes
            result["retrieval"] = retrieval_by_distance(
                model, shape, args, RETRIEVAL_DISTANCES,
                lambda distance: retrieval_probes(data.tokenizer, data.validation, distance, count, PROBE_SEED),
            )  # fmt: skip
    with timer.part("SSM memory"):
        result["ssm_memory"] = ssm_memory_stats(model, sequences[: args.eval_batch_size], shape.window)
    result["seconds"] = timer.seconds
    return result
