"""Training batches: a layout-independent order over fixed-length token rows.

The rows come from a ``.npy`` array (:func:`composer.run.load_tokens`) or from ``synthetic``, a
built-in corpus that needs no file: row ``i`` is the arithmetic progression
``(a_i + b_i * t) mod V`` with ``a_i``, ``b_i`` drawn from ``seed``, so a model can learn it (the
stride is readable from the context) and its loss falls within a few dozen steps.

Order: epoch ``e`` visits the rows in ``default_rng([seed, e]).permutation(n)``; global batch
``k`` is samples ``k*G .. (k+1)*G - 1`` of the concatenated epochs. The data position is one
number, the consumed samples, so resuming needs nothing else. Data-parallel rank ``r`` takes the
contiguous ``r``-th share of each global batch and cuts it into micro-batches.
"""

from __future__ import annotations

import numpy as np

SYNTHETIC = "synthetic"
SYNTHETIC_ROWS = 4096


def synthetic_rows(vocab: int, seq_len: int, seed: int = 0,
                   n_rows: int = SYNTHETIC_ROWS) -> np.ndarray:
    """``n_rows x seq_len`` progressions ``(a + b t) mod vocab`` (strides 1..min(vocab-1, 8))."""
    rng = np.random.default_rng([seed, 0x5EED])
    a = rng.integers(0, vocab, (n_rows, 1))
    b = rng.integers(1, max(2, min(vocab - 1, 8) + 1), (n_rows, 1))
    return (a + b * np.arange(seq_len)[None, :]) % vocab


class Batches:
    """Global batches of ``global_batch`` rows of ``data`` in a seeded, resumable order."""

    def __init__(self, data: np.ndarray, global_batch: int, seed: int) -> None:
        self.data, self.global_batch, self.seed = data, global_batch, seed
        self._epochs: dict[int, np.ndarray] = {}

    def _epoch(self, e: int) -> np.ndarray:
        if e not in self._epochs:
            self._epochs = {e: np.random.default_rng([self.seed, e]).permutation(len(self.data))}
        return self._epochs[e]

    def indices(self, consumed: int) -> np.ndarray:
        """Row indices of the global batch that starts after ``consumed`` samples."""
        n = len(self.data)
        pos = np.arange(consumed, consumed + self.global_batch)
        return np.array([self._epoch(int(p // n))[p % n] for p in pos])

    def local(self, consumed: int, dp: int, dp_rank: int, micro: int) -> list[np.ndarray]:
        """This data-parallel rank's micro-batches (arrays of rows) of that global batch."""
        share = self.global_batch // dp
        mine = self.indices(consumed)[dp_rank * share:(dp_rank + 1) * share]
        return [self.data[mine[i:i + micro]] for i in range(0, share, micro)]
