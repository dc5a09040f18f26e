"""The data lever of the memory program: a share of the training sequences carry a synthetic retrieval in code, an
identifier assigned a value and, 2W to 8W tokens later, a line that repeats the value after the identifier. Copying
from far back is then worth loss in training, which is how long-context ability is usually taught.

The keys, values and line formats differ from the evaluation's probes (`evaluation.RETRIEVAL_FORMATS`: snake_case
keys, `word42` values, double quotes), so that the probes measure a skill, not a memorised template."""

import functools

import numpy as np
import torch
from torch.utils.data import Dataset

from .evaluation import (
    PROBE_SEED,
    RETRIEVAL_DISTANCES,
    RetrievalProbe,
    random_word,
    retrieval_by_distance,
    retrieval_probes,
)
from .tokens import PackedSequences

# (assignment, use): the use line ends with the value, which the model must fetch from the assignment.
TRAINING_FORMATS = (
    ("{key}: str = '{value}'\n", "\nself.assertEqual({key}, '{value}')\n"),
    ("options['{key}'] = '{value}'\n", "\nlogger.debug('%s', options['{key}'])  # '{value}'\n"),
    ("{key} = Setting('{value}')\n", "\nif {key}.name != '{value}':\n"),
)


class WithSyntheticRetrievals(Dataset):
    """`PackedSequences` in which a share `share` of the sequences (chosen by index, seeded) carry one synthetic
    retrieval: the assignment line written over the stream at a line start, and the use line `min_gap`..`max_gap`
    tokens after the assignment's end (less where the sequence is too short for the drawn gap). Every sequence keeps
    its length; the labels are its tokens, as elsewhere."""

    def __init__(
        self, packed: PackedSequences, tokenizer, share: float, min_gap: int, max_gap: int, seed: int = 0
    ):
        if not 0 <= share <= 1 or not 0 < min_gap <= max_gap:
            raise ValueError(f"share must lie in [0, 1] and 0 < min_gap <= max_gap, got {share}, {min_gap}, {max_gap}")
        self.packed, self.tokenizer, self.share = packed, tokenizer, share
        self.min_gap, self.max_gap, self.seed = min_gap, max_gap, seed
        # Tokens after which a line's code starts: a newline and nothing but the next line's indentation after it
        # (byte-level BPE merges a newline with the spaces that follow it).
        texts = [tokenizer.decode([token]) for token in range(len(tokenizer))]
        self.opens_line = torch.tensor(["\n" in t and not t.rsplit("\n", 1)[1].strip() for t in texts])

    def __len__(self):
        return len(self.packed)

    def carries_retrieval(self, index: int) -> bool:
        return np.random.default_rng((self.seed, index, 0)).random() < self.share

    def __getitem__(self, index):
        item = self.packed[index]
        if not self.carries_retrieval(index):
            return item
        ids = item["input_ids"].clone()
        for start, tokens in self.placement(index, ids):
            ids[start : start + len(tokens)] = torch.tensor(tokens)
        return {"input_ids": ids, "labels": ids}

    def placement(self, index: int, ids: torch.Tensor) -> list[tuple[int, list[int]]]:
        """Where sequence `index` (its stream tokens `ids`) gets its assignment and its use line: [(start, tokens)]
        for the two. The assignment starts a line's code (after a newline and its indentation) early enough for the
        whole span to fit (at 0 if no line starts there)."""
        assignment, use = self.retrieval(np.random.default_rng((self.seed, index, 1)))
        gap = int(np.random.default_rng((self.seed, index, 2)).integers(self.min_gap, self.max_gap + 1))
        gap = min(gap, ids.numel() - len(assignment) - len(use))  # a short sequence takes a shorter gap
        if gap < self.min_gap:
            raise ValueError(
                f"a retrieval's two lines ({len(assignment) + len(use)} tokens) and min_gap {self.min_gap} do not fit "
                f"in a training sequence of {ids.numel()} tokens"
            )
        span = len(assignment) + gap + len(use)
        starts = (torch.nonzero(self.opens_line[ids[: ids.numel() - span]]).flatten() + 1).tolist() or [0]
        start = starts[int(np.random.default_rng((self.seed, index, 3)).integers(len(starts)))]
        return [(start, assignment), (start + len(assignment) + gap, use)]

    def retrieval(self, generator) -> tuple[list[int], list[int]]:
        """The tokens of one (assignment, use) pair drawn by `draw_retrieval`."""
        (assignment, use), key, value = draw_retrieval(generator)
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        return encode(assignment.format(key=key, value=value)), encode(use.format(key=key, value=value))


def draw_retrieval(generator) -> tuple[tuple[str, str], str, str]:
    """One of `TRAINING_FORMATS`, a camelCase key with a digit (`kodaSemir3`) and a value of a word, a dash and three
    digits (`tavemo-417`)."""
    formats = TRAINING_FORMATS[int(generator.integers(len(TRAINING_FORMATS)))]
    key = random_word(generator, 2) + random_word(generator, 2).capitalize() + str(generator.integers(10))
    value = f"{random_word(generator, 3)}-{generator.integers(100, 1000)}"
    return formats, key, value


def training_pair_probe(generator, index: int) -> tuple[str, str, str]:
    """(assignment, question, value) drawn as the data lever draws its training pairs (`draw_retrieval`); the
    question is the use line up to its value."""
    (assignment, use), key, value = draw_retrieval(generator)
    return assignment.format(key=key, value=value), use.split("{value}")[0].format(key=key), value


def training_format_probes(
    tokenizer, validation: list[np.ndarray], distance: int, count: int, seed: int
) -> list[RetrievalProbe]:
    """Graded retrieval probes drawn as the data lever draws its training pairs (formats, keys and values: none of them
    seen in training, only their kind): whether a run learned what it was taught, beside the evaluation's own probes,
    which ask whether that transfers."""
    return retrieval_probes(tokenizer, validation, distance, count, seed, draw=training_pair_probe, seed_offset=20_000)


def training_format_retrieval(model, data, shape, args, max_gap: int) -> dict:
    """`retrieval_score` of `training_format_probes` at the evaluation's distances from 2W to `max_gap` (the gaps the
    data lever trains), keyed as the evaluation's retrieval."""
    multiples = [m for m in RETRIEVAL_DISTANCES if 2 * shape.window <= int(m * shape.window) <= max_gap]
    return retrieval_by_distance(
        model, shape, args, multiples,
        lambda distance: training_format_probes(
            data.tokenizer, data.validation, distance, args.retrieval_probes, PROBE_SEED
        ),
    )  # fmt: skip
