"""The corpus: every Python source that ships on this machine (standard library, installed packages), nothing
fetched, deduplicated by content and split into train and validation by file."""

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path


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
