"""Weighted blends of datasets (Megatron-LM's ``--data-path 0.7 A 0.3 B``).

Sample ``k`` of the blend comes from the dataset whose share so far lags its weight most:
``d_k = argmax_d (w_d * (k + 1) - n_d(k))`` with ``n_d(k)`` the samples taken from ``d`` before
``k`` (ties to the lower index), and it is sample ``n_d(k)`` of that dataset. After any ``K``
samples every dataset has contributed ``w_d * K`` within one sample. The assignment is computed
in blocks on demand, remembering only each block's starting counts, so memory stays constant
however long the run.
"""

from __future__ import annotations

import numpy as np

from composer.data.chatset import resolve_builtin
from composer.data.indexed import DataError

BLOCK = 1 << 16


def parse_blend(values: list[str] | str | None) -> list[tuple[float, str]]:
    """``["PREFIX"]`` or ``["0.7", "A", "0.3", "B"]`` -> ``[(weight, prefix), ...]`` (weights
    normalised to sum to 1); a shipped dataset's name (``builtin:chat``) becomes its PREFIX."""
    if values is None:
        return []
    if isinstance(values, str):
        values = values.split()
    values = [str(v) for v in values]
    if len(values) == 1:
        return [(1.0, resolve_builtin(values[0]))]
    if len(values) % 2:
        raise DataError(f"--data {' '.join(values)}: a blend is WEIGHT PREFIX pairs "
                        "(e.g. --data 0.7 A 0.3 B); one PREFIX alone needs no weight")
    pairs = []
    for w, prefix in zip(values[::2], values[1::2], strict=True):
        try:
            weight = float(w)
        except ValueError:
            raise DataError(f"--data: {w!r} is not a weight (a blend is WEIGHT PREFIX "
                            "pairs)") from None
        if not weight > 0:
            raise DataError(f"--data: the weight of {prefix} must be positive, got {w}")
        pairs.append((weight, resolve_builtin(prefix)))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


class Blend:
    """``sources[d][i]`` blended by ``weights`` (see the module docstring)."""

    def __init__(self, sources: list, weights: list[float]) -> None:
        self.sources = sources
        self.weights = np.asarray(weights, dtype=np.float64)
        self._starts = [np.zeros(len(sources), dtype=np.int64)]  # counts before each block
        self._block: tuple[int, np.ndarray, np.ndarray] | None = None

    def _compute(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        counts = self._starts[b].copy()
        which = np.empty(BLOCK, dtype=np.int64)
        index = np.empty(BLOCK, dtype=np.int64)
        base = b * BLOCK
        for i in range(BLOCK):
            d = int(np.argmax(self.weights * (base + i + 1) - counts))
            which[i], index[i] = d, counts[d]
            counts[d] += 1
        if len(self._starts) == b + 1:
            self._starts.append(counts)
        return which, index

    def locate(self, k: int) -> tuple[int, int]:
        """(dataset, sample index in it) of blend sample ``k``."""
        b, i = divmod(int(k), BLOCK)
        if self._block is None or self._block[0] != b:
            while len(self._starts) <= b:
                self._compute(len(self._starts) - 1)
            self._block = (b, *self._compute(b))
        return int(self._block[1][i]), int(self._block[2][i])

    def counts(self, k: int) -> list[int]:
        """Samples taken from each dataset among the first ``k``."""
        b, i = divmod(max(int(k), 0), BLOCK)
        while len(self._starts) <= b:
            self._compute(len(self._starts) - 1)
        out = self._starts[b].copy()
        if i:
            self.locate(b * BLOCK)  # block b in hand
            out += np.bincount(self._block[1][:i], minlength=len(self.sources))
        return out.tolist()

    def __getitem__(self, k: int):
        d, i = self.locate(k)
        return self.sources[d][i]
