"""Training batches: a layout-independent order over samples, read rank by rank.

Three sources, one interface (``local``): an indexed dataset or a weighted blend of them
(``--data``: :mod:`composer.data.gpt`, :mod:`composer.data.blend`; samples of ``seq_len + 1``
tokens with their document ids), the built-in corpus when no data is named
(:mod:`composer.data.corpus`), or fixed rows from ``--tokens`` (a ``.npy`` array, or
``synthetic``: row ``i`` is the progression ``(a_i + b_i t) mod V``, learnable and file-free).

Global batch ``k`` is samples ``k*G .. (k+1)*G - 1`` of the source's order; data-parallel rank
``r`` reads only the contiguous ``r``-th share of it, cut into micro-batches. The data position
is one number, the samples consumed, so a resumed run continues with the next unseen sample
whatever its global batch size. Samples of conversations with images carry them; a
micro-batch's images are concatenated in the row-major order of their blocks
(:attr:`Micro.pixel_values`, :attr:`Micro.image_grid_thw`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from composer.config import ConfigError

if TYPE_CHECKING:
    import torch

IGNORE_INDEX = -100  # composer.blocks.loss.IGNORE_INDEX (numpy only here)

SYNTHETIC = "synthetic"
SYNTHETIC_ROWS = 4096


def synthetic_rows(vocab: int, seq_len: int, seed: int = 0,
                   n_rows: int = SYNTHETIC_ROWS) -> np.ndarray:
    """``n_rows x seq_len`` progressions ``(a + b t) mod vocab`` (strides 1..min(vocab-1, 8))."""
    rng = np.random.default_rng([seed, 0x5EED])
    a = rng.integers(0, vocab, (n_rows, 1))
    b = rng.integers(1, max(2, min(vocab - 1, 8) + 1), (n_rows, 1))
    return (a + b * np.arange(seq_len)[None, :]) % vocab


@dataclass
class Micro:
    ids: np.ndarray
    """``(m, T)`` token ids."""
    doc_ids: np.ndarray | None = None
    """``(m, T)`` document of each token within its row (samples of an indexed dataset)."""
    labels: np.ndarray | None = None
    """``(m, T)`` unshifted labels: the ids where the loss mask is 1, ``-100`` elsewhere (masked
    samples, the SFT objective); None: the ids themselves are the labels."""
    pixel_values: torch.Tensor | None = None
    """float32 ``[N, d_patch]``: the images of the rows, concatenated in row-major order of
    their blocks (row 0's in the order they appear in it, then row 1's...); None when the
    micro-batch has no image (:attr:`Batches.has_images` says whether the source can have)."""
    image_grid_thw: torch.Tensor | None = None
    """int64 ``[n, 3]``: each of those images' ``(t, h, w)`` in patches, in the same order."""


class Rows:
    """Fixed rows in ``default_rng([seed, e]).permutation(n)`` order per epoch ``e``."""

    def __init__(self, data: np.ndarray, seed: int) -> None:
        self.data, self.seed = data, seed
        self._epochs: dict[int, np.ndarray] = {}

    def __getitem__(self, k: int) -> tuple[np.ndarray, None]:
        e, i = divmod(int(k), len(self.data))
        if e not in self._epochs:
            self._epochs = {e: np.random.default_rng([self.seed, e]).permutation(len(self.data))}
        return self.data[self._epochs[e][i]], None


class Batches:
    """Global batches of ``global_batch`` samples of ``samples`` (anything indexable by the
    global sample number and returning ``(tokens, doc_ids or None)``, or ``(tokens, doc_ids,
    mask)`` for masked samples, ``(tokens, doc_ids, mask, images)`` with images:
    :class:`composer.data.sft.SFTSamples`). ``has_images``: the source carries images (for a
    blend, any of its datasets), so any micro-batch may have some."""

    def __init__(self, samples, global_batch: int, vocab_size: int | None = None,
                 name: str = "", has_images: bool = False) -> None:
        self.samples, self.global_batch = samples, global_batch
        self.vocab_size, self.name = vocab_size, name
        self.has_images = has_images

    def local(self, consumed: int, dp: int, dp_rank: int, micro: int) -> list[Any]:
        """This data-parallel rank's micro-batches of the global batch after ``consumed``: its
        contiguous share, ``micro`` samples at a time (:meth:`micro_batch`)."""
        share = self.global_batch // dp
        first = consumed + dp_rank * share
        return [self.micro_batch([self.samples[first + lo + i] for i in range(micro)],
                                 first + lo) for lo in range(0, share, micro)]

    def check_vocab(self, ids: np.ndarray, what: str) -> None:
        if self.vocab_size is not None and ids.size and int(ids.max()) >= self.vocab_size:
            raise ConfigError(f"{self.name}: token id {int(ids.max())} ({what}..) is beyond "
                              f"the model's vocabulary ({self.vocab_size})")

    def micro_batch(self, rows: list, start: int) -> Micro:
        """One micro-batch of ``rows`` (the samples from global number ``start`` on)."""
        ids = np.stack([r[0] for r in rows])
        docs = None if rows[0][1] is None else np.stack([r[1] for r in rows])
        labels = None
        if len(rows[0]) > 2:  # a loss mask: labels are the supervised ids, -100 elsewhere
            mask = np.stack([r[2] for r in rows])
            labels = np.where(mask != 0, ids, IGNORE_INDEX)
        self.check_vocab(ids, f"sample {start}")
        # a blend may mix datasets with images (4-tuples) and without (3-tuples)
        images = [image for r in rows if len(r) > 3 for image in r[3]]
        if not images:
            return Micro(ids, docs, labels)
        import torch

        return Micro(ids, docs, labels, torch.cat([p for p, _ in images]),
                     torch.tensor([list(g) for _, g in images], dtype=torch.int64))


def blend_batches(parts: list[list], weights: list[float], name: str, global_batch: int,
                  vocab_size: int, has_images: bool = False) -> tuple[Batches, Batches | None]:
    """Training and validation batches of a blend: ``parts[0]`` holds each dataset's training
    samples, ``parts[1]`` its validation samples (validation only when every dataset has a
    share), mixed by ``weights`` (:class:`composer.data.blend.Blend`); ``has_images``: any
    dataset carries images (:attr:`Batches.has_images`)."""
    from composer.data.blend import Blend

    samples = [s[0] if len(s) == 1 else Blend(s, weights) for s in parts if s]
    train = Batches(samples[0], global_batch, vocab_size, name, has_images)
    valid = None
    if len(parts[1]) == len(weights):
        valid = Batches(samples[1], global_batch, vocab_size, name, has_images)
    return train, valid
