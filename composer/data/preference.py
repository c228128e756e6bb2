"""Preference pairs: what ``composer data prepare --format preference`` makes of each row, and
what the DPO objective (:mod:`composer.train.dpo`) reads back.

Rows (one JSON object per line, or a parquet row): ``{"prompt": P, "chosen": W, "rejected": L}``.
``P`` is a string (one user message) or a list of messages (the conversation so far); ``W`` and
``L`` are each a string (one assistant message), one message, or a list of messages. Messages are
those of :mod:`composer.data.chat` (roles, content, tool calls, reasoning fields).

Each side is rendered as its own conversation, ``P + W`` and ``P + L``, with the chat template
exactly as ``--format chat --mask completion`` renders a prompt/completion row
(:class:`composer.data.chat.ChatEncoder`): the mask covers the assistant turns of the completion
(their content and end-of-turn token), never the prompt nor the role header. A row is bad (a
one-line error naming ``file:line``, or counted and skipped with ``--skip-bad-rows``) when a field
is missing, a side has no supervised token, or the two sides encode to the same tokens and mask
(a pair that prefers nothing over itself: its DPO gradient is zero, most often a data mistake).
``seq_len`` cuts (``right``: the first tokens, ``left``: the last) or refuses (``error``) each
side longer than it (``truncated`` in the record counts the sides cut); a side left without
supervised token, or two sides left identical, is bad.

Storage: :mod:`composer.data.masked`'s format, documents in pairs (document ``2i`` is pair
``i``'s prompt + chosen, ``2i + 1`` its prompt + rejected), ``PREFIX.chat.json`` recording
``"kind": "preference"`` (and ``"pairs"``); :func:`is_preference` tells such a dataset.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from composer.data import chat
from composer.data.chat import ChatEncoder, RowError
from composer.data.indexed import DataError
from composer.data.masked import META_SUFFIX, MaskedDataset

KIND = "preference"
FIELDS = ("prompt", "chosen", "rejected")
Encoded = tuple[np.ndarray, np.ndarray]


def _field(record: dict[str, Any], field: str) -> list[dict[str, Any]]:
    """A field's messages, checked as :mod:`composer.data.chat` checks a row's (a string is one
    user message for the prompt, one assistant message for a side; one message object is a
    list of one); errors name the field and the message's number within it."""
    value = record[field]
    if isinstance(value, dict):
        value = [value]
    try:
        raw = chat._messages(value, field, "user" if field == "prompt" else "assistant")
        messages = [chat._message(m, n) for n, m in enumerate(raw, 1)]
    except RowError as e:
        raise RowError(str(e) if str(e).startswith(repr(field)) else f"{field}: {e}") from None
    if not messages and field != "prompt":
        raise RowError(f"{field!r} has no messages")
    if any(isinstance(m.get("content"), list) and any(part["type"] == "image"
                                                      for part in m["content"])
           for m in messages):
        raise RowError(f"{field}: image parts in preference pairs are not built yet (--format "
                       "chat takes rows with images)")
    return messages


def parse_pair(record: Any) -> tuple[tuple[list[dict[str, Any]], int],
                                     tuple[list[dict[str, Any]], int]]:
    """The two conversations of a row, each as (messages, index of the completion's first
    message)."""
    if not isinstance(record, dict):
        raise RowError(f"a row is a JSON object, not {type(record).__name__}")
    missing = [f for f in FIELDS if f not in record]
    if missing:
        raise RowError(f"no {' and no '.join(repr(f) for f in missing)} key (a preference row "
                       "has 'prompt', 'chosen' and 'rejected')")
    if record.get("images"):
        raise RowError("'images' in preference pairs are not built yet (--format chat takes "
                       "rows with images)")
    prompt = _field(record, "prompt")
    return ((prompt + _field(record, "chosen"), len(prompt)),
            (prompt + _field(record, "rejected"), len(prompt)))


def encode_pair(encoder: ChatEncoder, record: Any, seq_len: int | None = None,
                side: str = "right") -> tuple[Encoded, Encoded, int]:
    """A row's chosen and rejected (token ids, mask), and how many of them ``seq_len`` cut.
    ``encoder`` masks completions (``mode="completion"``)."""
    if encoder.mode != "completion":
        raise DataError(f"preference pairs mask the completion, not {encoder.mode!r}")
    chosen, rejected = parse_pair(record)
    out, cut = [], 0
    for name, (messages, start) in zip(FIELDS[1:], (chosen, rejected), strict=True):
        try:
            ids, mask = encoder.encode(messages, start)
        except RowError as e:
            raise RowError(f"{name}: {e}") from None
        if seq_len is not None and len(ids) > seq_len:
            try:
                ids, mask = chat.truncate(ids, mask, seq_len, side)
            except RowError as e:
                raise RowError(f"{name}: {e}") from None
            cut += 1
            if not mask.any():
                raise RowError(f"{name}: no supervised token in the {seq_len} tokens "
                               f"--truncate {side} keeps")
        out.append((ids, mask))
    (ids_w, mask_w), (ids_l, mask_l) = out
    if np.array_equal(ids_w, ids_l) and np.array_equal(mask_w, mask_l):
        raise RowError("'chosen' and 'rejected' are identical" +
                       (f" (in the {seq_len} tokens --truncate {side} keeps)" if cut else ""))
    return out[0], out[1], cut


def is_preference(prefix: str | Path) -> bool:
    """Whether ``prefix`` is a dataset of preference pairs (``"kind": "preference"``)."""
    path = Path(f"{prefix}{META_SUFFIX}")
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("kind") == KIND
    except ValueError:
        return False


class PreferencePairs:
    """Pairs ``pairs`` (a range of pair indices) of a preference dataset, visited in
    ``default_rng([seed, e]).permutation(len(pairs))`` order in epoch ``e``: global sample
    ``k`` is pair ``k % n`` of epoch ``k // n``. A sample is ``(ids_w, mask_w, ids_l, mask_l)``
    (int64 arrays, each side cut to ``seq_len`` as ``truncate`` says:
    :func:`composer.data.sft.truncate`)."""

    def __init__(self, dataset: MaskedDataset, seed: int, pairs: range | None = None,
                 seq_len: int | None = None, truncate_side: str = "right",
                 name: str = "") -> None:
        self.dataset, self.seed, self.seq_len, self.side = dataset, seed, seq_len, truncate_side
        self.name = name or dataset.prefix
        if dataset.meta.get("kind") != KIND or dataset.n_documents % 2:
            raise DataError(f"{self.name}: not a dataset of preference pairs (prepare it with "
                            "`composer data prepare --format preference`)")
        self.pairs = pairs if pairs is not None else range(dataset.n_documents // 2)
        if not len(self.pairs):
            raise DataError(f"{self.name}: no pairs in this split")
        lengths = dataset.lengths.reshape(-1, 2)[self.pairs.start:self.pairs.stop]
        self.longest = int(lengths.max())
        """The longest side of these pairs, before ``seq_len``."""
        self.truncated = 0 if seq_len is None else int((lengths > seq_len).any(1).sum())
        """Pairs with a side longer than ``seq_len``."""
        if self.truncated and truncate_side == "error":
            i = self.pairs.start + int(np.flatnonzero((lengths > seq_len).any(1))[0])
            raise DataError(f"{self.name}: pair {i} has {int(lengths[i - self.pairs.start].max())} "
                            f"tokens, longer than --seq-len {seq_len} ({self.truncated} such; "
                            "--truncate right|left cuts them)")
        self._epochs: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.pairs)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Pair ``i`` of the dataset (not of the split): chosen ids, mask, rejected ids, mask."""
        from composer.data.sft import truncate

        out = []
        for d in (2 * i, 2 * i + 1):
            ids, mask = self.dataset.document(d)
            if self.seq_len is not None:
                ids, mask = truncate(ids, mask, self.seq_len, self.side,
                                     f"{self.name}: document {d}")
            out += [ids.astype(np.int64), mask.astype(np.int64)]
        return out[0], out[1], out[2], out[3]

    def __getitem__(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        e, i = divmod(int(k), len(self.pairs))
        if e not in self._epochs:
            self._epochs = {e: np.random.default_rng([self.seed, e]).permutation(len(self.pairs))}
        return self.pair(self.pairs.start + int(self._epochs[e][i]))
