"""A token dataset with an aligned loss mask: what ``composer data prepare --format chat`` writes
and what the SFT objective reads.

On disk, for a dataset ``PREFIX``:

    PREFIX.bin / PREFIX.idx            the tokens: a Megatron indexed dataset (one document per
                                       conversation), readable by Megatron-LM as it is
    PREFIX.mask.bin / PREFIX.mask.idx  the mask: an indexed dataset of uint8 0/1, one document per
                                       conversation, each exactly as long as its tokens
    PREFIX.tokenizer/                  the tokenizer (and chat template) the tokens were made with
    PREFIX.chat.json                   what made it: format, mask mode, counts (``meta``)

A dataset of preference pairs (``--format preference``, :mod:`composer.data.preference`) is the
same format with its documents in pairs: ``2i`` is pair ``i``'s prompt + chosen, ``2i + 1`` its
prompt + rejected, and ``meta["kind"] == "preference"``.

``mask[t] == 1`` means token ``t`` is a supervised *target*: the loss includes the prediction of
token ``t`` from the tokens before it. So a training label is ``ids[t]`` where the mask is 1 and
ignored (``-100``) where it is 0, before the usual shift
(:func:`composer.blocks.model.shift_labels`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from composer.data.indexed import DataError, IndexedDataset, IndexedWriter

MASK_SUFFIX = ".mask"
META_SUFFIX = ".chat.json"


def is_masked(prefix: str | os.PathLike[str]) -> bool:
    """Whether ``prefix`` has a mask beside its tokens."""
    return Path(f"{prefix}{MASK_SUFFIX}.idx").is_file()


class MaskedDataset:
    """Tokens and mask of ``prefix`` (both memory-mapped); checked aligned at open."""

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = str(prefix)
        self.tokens = IndexedDataset(self.prefix)
        if not is_masked(self.prefix):
            raise DataError(f"{self.prefix}: no loss mask ({self.prefix}{MASK_SUFFIX}.idx); "
                            "prepare chat data with `composer data prepare --format chat`")
        self.masks = IndexedDataset(f"{self.prefix}{MASK_SUFFIX}")
        if self.masks.dtype != np.uint8 or self.masks.n_documents != self.tokens.n_documents or \
                not np.array_equal(self.masks.sequence_lengths, self.tokens.sequence_lengths):
            raise DataError(f"{self.prefix}{MASK_SUFFIX}: the mask is not aligned with the tokens "
                            f"({self.masks.n_documents} masks, {self.tokens.n_documents} "
                            "documents)")
        path = Path(f"{self.prefix}{META_SUFFIX}")
        self.meta: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["prefix"])  # type: ignore[misc]

    @property
    def n_documents(self) -> int:
        return self.tokens.n_documents

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per document (int64)."""
        offsets = np.concatenate([[0], np.cumsum(self.tokens.sequence_lengths, dtype=np.int64)])
        return np.diff(offsets[self.tokens.document_indices])

    def document(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        """Document ``d``'s tokens and its 0/1 mask (views)."""
        return self.tokens.document(d), self.masks.document(d)

    def supervised_tokens(self) -> int:
        return int(self.masks.tokens(0, self.masks.n_tokens).sum(dtype=np.int64))


class MaskedWriter:
    """Writes tokens and mask together; nothing is published until both are complete (as a
    context manager: finalized on a clean exit, removed on an error)."""

    def __init__(self, prefix: str | os.PathLike[str], dtype: type[np.number] | np.dtype) -> None:
        self.prefix = str(prefix)
        self._tokens = IndexedWriter(self.prefix, dtype)
        try:
            self._masks = IndexedWriter(f"{self.prefix}{MASK_SUFFIX}", np.uint8)
        except BaseException:
            self._tokens.abort()
            raise

    @property
    def n_documents(self) -> int:
        return self._tokens.n_documents

    def add_document(self, tokens: np.ndarray, mask: np.ndarray) -> None:
        tokens, mask = np.asarray(tokens), np.asarray(mask)
        if tokens.shape != mask.shape:
            raise DataError(f"a mask of shape {mask.shape} for tokens of shape {tokens.shape}")
        self._tokens.add_document(tokens)
        self._masks.add_document(mask.astype(np.uint8))

    def finalize(self, meta: dict[str, Any] | None = None) -> None:
        """Publish the mask, then the tokens, then ``PREFIX.chat.json``: a reader that finds the
        tokens finds their mask."""
        try:
            self._masks.finalize()
            self._tokens.finalize()
        except BaseException:
            self.abort()
            raise
        if meta is not None:
            path = Path(f"{self.prefix}{META_SUFFIX}")
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(meta, indent=1) + "\n")
            os.replace(tmp, path)

    def abort(self) -> None:
        for writer in (self._tokens, self._masks):
            if writer._open:
                writer.abort()
        for suffix in (MASK_SUFFIX + ".bin", MASK_SUFFIX + ".idx"):
            path = Path(f"{self.prefix}{suffix}")
            if path.exists() and not Path(f"{self.prefix}.idx").exists():
                path.unlink()

    def __enter__(self) -> MaskedWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
        elif self._tokens._open:
            self.finalize()
