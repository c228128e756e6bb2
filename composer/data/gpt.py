"""Training samples from an indexed dataset, with GPT-dataset semantics (Megatron-LM).

A sample is ``seq_len + 1`` tokens cut from the concatenation of a range of documents (a split)
in a shuffled order: epoch ``e`` orders the documents by ``default_rng([seed, e, 0])``, cuts
``S = (n_tokens - 1) // seq_len`` samples (sample ``j`` starts at token ``j * seq_len``, so
consecutive samples share one token: the last target of one is the first input of the next),
and visits them in the order ``default_rng([seed, e, 1]).permutation(S)``. Global sample ``k``
is sample ``k % S`` of epoch ``k // S``. Each sample also carries ``doc_ids``: which document
each of its tokens comes from (0, 1, ... within the sample), for document isolation.

The per-epoch indices (document order, token offsets, sample order) are built once and cached
as ``.npy`` files beside the dataset (``PREFIX.cache/``) or, where that is not writable, in
``~/.cache/composer/data/``; they are memory-mapped, as is the dataset, so a rank's memory does
not grow with the corpus.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from composer.data.indexed import DataError, IndexedDataset


def split_documents(n_documents: int, split: str | None) -> list[range]:
    """``"969,30,1"`` -> train/valid/test document ranges (Megatron's rounding of the
    cumulative fractions)."""
    if not split:
        return [range(n_documents), range(0), range(0)]
    try:
        parts = [float(p) for p in split.replace("/", ",").split(",")]
    except ValueError:
        raise DataError(f"--split {split!r}: expected numbers like 969,30,1") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise DataError(f"--split {split!r}: one to three non-negative weights, not all zero")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    bounds = [0]
    for p in parts:
        bounds.append(bounds[-1] + int(round(p / total * n_documents)))
    bounds[-1] = n_documents
    bounds = [min(b, n_documents) for b in bounds]
    return [range(bounds[i], bounds[i + 1]) for i in range(3)]


def _cache_dir(prefix: Path) -> Path:
    """``PREFIX.cache/`` when the dataset's folder is writable, else the user cache."""
    beside = prefix.parent / f"{prefix.name}.cache"
    if os.access(prefix.parent, os.W_OK):
        return beside
    key = hashlib.sha256(str(prefix.resolve()).encode()).hexdigest()[:16]
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "composer" / \
        "data" / f"{prefix.name}-{key}"


def _save(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)  # every rank computes the same array: any writer may win


class GPTSamples:
    """The samples of ``documents`` of ``dataset`` (see the module docstring)."""

    def __init__(self, dataset: IndexedDataset, seq_len: int, seed: int,
                 documents: range | None = None, name: str = "") -> None:
        if seq_len < 1:
            raise DataError(f"--seq-len must be >= 1, got {seq_len}")
        self.dataset, self.seq_len, self.seed = dataset, seq_len, seed
        self.documents = documents if documents is not None else range(dataset.n_documents)
        offsets = np.concatenate([[0], np.cumsum(dataset.sequence_lengths, dtype=np.int64)])
        self.doc_offsets = offsets[dataset.document_indices]  # doc d: [off[d], off[d + 1])
        lengths = np.diff(self.doc_offsets)[self.documents.start:self.documents.stop]
        self.n_tokens = int(lengths.sum())
        self.per_epoch = max(0, (self.n_tokens - 1) // seq_len)
        if self.per_epoch == 0:
            raise DataError(f"{name or dataset.prefix}: {self.n_tokens} tokens in documents "
                            f"{self.documents.start}..{self.documents.stop - 1}, fewer than one "
                            f"sample of --seq-len {seq_len} + 1")
        stat = Path(f"{dataset.prefix}.idx").stat()
        self._key = hashlib.sha256(repr((str(Path(dataset.prefix).resolve()), stat.st_size,
                                         stat.st_mtime_ns, seq_len, seed, self.documents.start,
                                         self.documents.stop)).encode()).hexdigest()[:20]
        self._cache = _cache_dir(Path(dataset.prefix))
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, token offset of each in that order (+ the end), sample order)."""
        if e in self._epochs:
            return self._epochs[e]
        paths = [self._cache / f"{self._key}-e{e}-{part}.npy" for part in ("docs", "ends",
                                                                          "samples")]
        if not all(p.exists() for p in paths):
            docs = self.documents.start + np.random.default_rng([self.seed, e, 0]).permutation(
                len(self.documents))
            lengths = self.doc_offsets[docs + 1] - self.doc_offsets[docs]
            ends = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
            samples = np.random.default_rng([self.seed, e, 1]).permutation(self.per_epoch)
            self._cache.mkdir(parents=True, exist_ok=True)
            for path, array in zip(paths, (docs, ends, samples), strict=True):
                _save(path, array)
        arrays = tuple(np.load(p, mmap_mode="r", allow_pickle=False) for p in paths)
        self._epochs = {e: arrays}  # keep only the epoch in use
        return arrays

    def __getitem__(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens (``seq_len + 1``, int64) and their document ids of global sample ``k``."""
        epoch, j = divmod(int(k), self.per_epoch)
        docs, ends, samples = self._epoch(epoch)
        start = int(samples[j]) * self.seq_len
        stop = start + self.seq_len + 1
        first = int(np.searchsorted(ends, start, side="right")) - 1
        tokens, doc_ids = [], []
        pos, i = start, first
        while pos < stop:
            d = int(docs[i])
            lo = int(self.doc_offsets[d]) + pos - int(ends[i])
            hi = int(self.doc_offsets[d]) + min(stop, int(ends[i + 1])) - int(ends[i])
            tokens.append(self.dataset.tokens(lo, hi))
            doc_ids.append(np.full(hi - lo, i - first, dtype=np.int64))
            pos += hi - lo
            i += 1
        return np.concatenate(tokens).astype(np.int64), np.concatenate(doc_ids)


def sequential_samples(dataset: IndexedDataset, seq_len: int,
                       max_samples: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The dataset's documents in file order, cut into ``seq_len + 1`` windows that share one
    token (what ``composer eval --data`` scores); at most ``max_samples``."""
    n_tokens = int(dataset.n_tokens)
    count = (n_tokens - 1) // seq_len
    if max_samples is not None:
        count = min(count, max_samples)
    if count < 1:
        raise DataError(f"{dataset.prefix}: {n_tokens} tokens, fewer than one sample of "
                        f"--seq-len {seq_len} + 1")
    offsets = np.concatenate([[0], np.cumsum(dataset.sequence_lengths, dtype=np.int64)])
    doc_starts = offsets[dataset.document_indices]
    out = []
    for j in range(count):
        lo, hi = j * seq_len, j * seq_len + seq_len + 1
        docs = np.searchsorted(doc_starts, np.arange(lo, hi), side="right") - 1
        out.append((dataset.tokens(lo, hi).astype(np.int64), docs - docs[0]))
    return out
