"""Supervised fine-tuning samples: masked conversations packed into rows (best-fit decreasing).

Each conversation of a :class:`composer.data.masked.MaskedDataset` (within a ``--split`` range of
documents) is truncated to ``seq_len`` tokens as ``--truncate`` says (``right`` keeps the first
``seq_len``, ``left`` the last, ``error`` refuses), then the conversations are packed into rows of
exactly ``seq_len`` tokens by best-fit decreasing: by length, longest first (ties by document
index), each goes into the open row with the least room that still fits it, else a new row. A
row's unused tail is padding: one more document of the pad token, mask 0 (so nothing is learnt
from it, and document isolation keeps it from the conversations). The packing depends on the
dataset, ``seq_len`` and ``truncate`` only: the same for every layout and every epoch.

Rows are visited in ``default_rng([seed, e]).permutation(n_rows)`` order in epoch ``e`` (as
:class:`composer.train.data.Rows`); global sample ``k`` is row ``k % n_rows`` of epoch
``k // n_rows``. A sample is ``(tokens, doc_ids, mask)``: int64 ``[seq_len]`` token ids, their
documents within the row (0, 1, ...) and the loss mask (1: a supervised target).

A dataset with images (:mod:`composer.data.chat_images`) gives ``(tokens, doc_ids, mask,
images)``: ``images`` the row's images in the order their blocks appear in it, each
``(pixel_values, (t, h, w))`` with ``pixel_values`` float32 ``[t*h*w, d_patch]`` computed from the
stored pixels as :func:`composer.vision.preprocess.preprocess_images` computes it. Truncation
never splits an image block: a cut inside one moves to its edge (the document keeps fewer than
``seq_len`` tokens, and packs as that many), and the images outside the kept tokens are dropped.
"""

from __future__ import annotations

import bisect
import heapq
from typing import TYPE_CHECKING, Any

import numpy as np

from composer.data import chat
from composer.data.chat import TRUNCATE_SIDES
from composer.data.chat_images import Grid, Image, cut, truncate_blocks
from composer.data.indexed import DataError
from composer.data.masked import MaskedDataset

if TYPE_CHECKING:
    import torch

Sample = tuple[Any, ...]
"""``(tokens, doc_ids, mask)``, and ``images`` for a dataset with images (module docstring)."""


def truncate(ids: np.ndarray, mask: np.ndarray, seq_len: int, side: str,
             name: str = "a document") -> tuple[np.ndarray, np.ndarray]:
    """:func:`composer.data.chat.truncate`, its refusal naming the document ``name``."""
    try:
        return chat.truncate(ids, mask, seq_len, side)
    except chat.RowError as e:
        raise DataError(f"{name}: {e}") from None


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Rows of item indices: items by length descending (stable), each into the open row with
    the least remaining room that fits it (the lowest-numbered such row on a tie), else a new
    row. ``O(n log n + n * distinct rooms)``: the open rows are bucketed by their room."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (int(lengths.max()) > capacity or int(lengths.min()) < 1):
        raise DataError(f"packing: item lengths must be in 1..{capacity}")
    order = np.argsort(-lengths, kind="stable")
    rows: list[list[int]] = []
    rooms: list[int] = []  # the distinct rooms of open rows, ascending
    buckets: dict[int, list[int]] = {}  # room -> heap of row numbers with that room
    for i in order.tolist():
        n = int(lengths[i])
        at = bisect.bisect_left(rooms, n)
        if at < len(rooms):
            room = rooms[at]
            row = heapq.heappop(buckets[room])
            if not buckets[room]:
                del buckets[room]
                rooms.pop(at)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        left = room - n
        if left > 0:  # a full row is closed
            if left not in buckets:
                buckets[left] = []
                bisect.insort(rooms, left)
            heapq.heappush(buckets[left], row)
    return rows


class SFTSamples:
    """Packed rows of ``documents`` of ``dataset`` (module docstring)."""

    def __init__(self, dataset: MaskedDataset, seq_len: int, seed: int,
                 documents: range | None = None, truncate_side: str = "right",
                 pad_id: int = 0, name: str = "") -> None:
        if seq_len < 2:
            raise DataError(f"--seq-len must be >= 2 for fine-tuning, got {seq_len}")
        if truncate_side not in TRUNCATE_SIDES:
            raise DataError(f"--truncate {truncate_side!r}: expected one of "
                            f"{', '.join(TRUNCATE_SIDES)}")
        self.dataset, self.seq_len, self.seed = dataset, seq_len, seed
        self.side, self.pad_id = truncate_side, pad_id
        self.name = name or dataset.prefix
        self.documents = documents if documents is not None else range(dataset.n_documents)
        raw = dataset.lengths[self.documents.start:self.documents.stop]
        long = np.flatnonzero(raw > seq_len)
        if long.size and truncate_side == "error":
            d = self.documents.start + int(long[0])
            raise DataError(f"{self.name}: document {d} has {int(raw[long[0]])} tokens, longer "
                            f"than --seq-len {seq_len} ({long.size} such; --truncate "
                            "right|left cuts them)")
        self.truncated = int(long.size)
        lengths = np.minimum(raw, seq_len)
        self.has_images = dataset.has_images
        for i in long.tolist() if self.has_images else []:  # a cut may move to a block's edge
            d = self.documents.start + i
            lo, hi = cut(int(raw[i]), seq_len, truncate_side, dataset.image_blocks(d))
            lengths[i] = hi - lo
        keep = np.flatnonzero(lengths > 0)  # an empty document has nothing to pack
        rows = best_fit_decreasing(lengths[keep], seq_len)
        if not rows:
            raise DataError(f"{self.name}: no tokens in documents {self.documents.start}.."
                            f"{self.documents.stop - 1}")
        # flat: row r holds documents row_docs[row_start[r]:row_start[r + 1]], in packing order
        self.row_docs = np.array([self.documents.start + int(keep[i]) for r in rows for i in r],
                                 dtype=np.int64)
        self.row_start = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(
            np.int64)
        self.n_rows = len(rows)
        self.n_tokens = int(lengths.sum())
        self._epochs: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.n_rows

    def document(self, d: int) -> tuple[np.ndarray, np.ndarray, list[Image]]:
        """Document ``d`` as it is packed: ids, mask and stored images, truncated."""
        ids, mask = self.dataset.document(d)
        name = f"{self.name}: document {d}"
        blocks = self.dataset.image_blocks(d, ids)
        if not blocks:
            return *truncate(ids, mask, self.seq_len, self.side, name), []
        try:
            ids, mask, kept = truncate_blocks(ids, mask, self.seq_len, self.side, blocks)
        except chat.RowError as e:
            raise DataError(f"{name}: {e}") from None
        images = self.dataset.images(d)
        return ids, mask, [images[k] for k in kept]

    def _patches(self, image: Image) -> tuple[torch.Tensor, Grid]:
        import torch

        from composer.vision.preprocess import image_patches

        rows, grid = image_patches(np.asarray(image[0]), self.dataset.image_settings)
        return torch.from_numpy(np.ascontiguousarray(rows)), grid

    def row(self, r: int) -> Sample:
        """Packed row ``r`` (packing order): tokens, doc ids, mask (and images)."""
        tokens = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        docs = np.empty(self.seq_len, dtype=np.int64)
        mask = np.zeros(self.seq_len, dtype=np.int64)
        images: list[tuple[torch.Tensor, Grid]] = []
        pos = 0
        for j, d in enumerate(self.row_docs[self.row_start[r]:self.row_start[r + 1]].tolist()):
            ids, m, stored = self.document(d)
            n = len(ids)
            tokens[pos:pos + n], mask[pos:pos + n], docs[pos:pos + n] = ids, m, j
            images += [self._patches(image) for image in stored]
            pos += n
        if pos < self.seq_len:  # the padding is a document of its own
            docs[pos:] = self.row_start[r + 1] - self.row_start[r]
        return (tokens, docs, mask, images) if self.has_images else (tokens, docs, mask)

    def __getitem__(self, k: int) -> Sample:
        e, i = divmod(int(k), self.n_rows)
        if e not in self._epochs:
            self._epochs = {e: np.random.default_rng([self.seed, e]).permutation(self.n_rows)}
        return self.row(int(self._epochs[e][i]))
