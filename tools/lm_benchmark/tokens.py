"""The corpus as tokens: a byte-level BPE trained on its training split, both splits tokenized (and cached), and
the training stream cut into sequences."""

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerFast

from .corpus import Corpus

EOS = "<|endoftext|>"  # between files in the training stream
# Padding has a token of its own: `nn.Embedding(padding_idx=...)` keeps the padding token's embedding at zero, which
# would leave EOS, if it padded, untrained.
PAD = "<|pad|>"


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
