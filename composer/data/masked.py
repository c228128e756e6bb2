"""A token dataset with an aligned loss mask: what ``composer data prepare --format chat`` writes,
what the SFT objective reads and what ``composer data inspect`` reports.

On disk, for a dataset ``PREFIX``:

    PREFIX.bin / PREFIX.idx            the tokens: a Megatron indexed dataset (one document per
                                       conversation), readable by Megatron-LM as it is
    PREFIX.mask.bin / PREFIX.mask.idx  the mask: an indexed dataset of uint8 0/1, one document per
                                       conversation, each exactly as long as its tokens
    PREFIX.tokenizer/                  the tokenizer (and chat template) the tokens were made with
    PREFIX.chat.json                   what made it: format, mask mode, counts (``meta``)

A dataset of conversations with images (:mod:`composer.data.chat_images`) has beside them:

    PREFIX.pixels.bin / .idx           an indexed dataset of uint8, one document per image: its
                                       resized RGB pixels, the flat ``(3, h, w)`` (3 bytes a
                                       pixel), everything before rescaling and normalising
    PREFIX.images.npy                  int64 ``[n_images, 4]``: document, t, h, w (t = 1; h and
                                       w in patches), one row per image in document order, each
                                       document's in the order of their blocks in its tokens

and ``meta["images"]``: ``count``, ``settings`` (the :class:`ImageSettings` fields) and the
``image_token_id``, ``vision_start_token_id`` and ``vision_end_token_id`` of its tokens.

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
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from composer.data.chat_images import Grid, Image, Span, VisionIds, image_blocks, n_tokens
from composer.data.indexed import DataError, IndexedDataset, IndexedWriter
from composer.data.tokenizer import describe_tokenizer

if TYPE_CHECKING:
    from composer.vision.preprocess import ImageSettings

MASK_SUFFIX = ".mask"
META_SUFFIX = ".chat.json"
PIXELS_SUFFIX = ".pixels"
IMAGES_SUFFIX = ".images.npy"
IMAGE_FILES = (f"{PIXELS_SUFFIX}.bin", f"{PIXELS_SUFFIX}.idx", IMAGES_SUFFIX)


def is_masked(prefix: str | os.PathLike[str]) -> bool:
    """Whether ``prefix`` has a mask beside its tokens."""
    return Path(f"{prefix}{MASK_SUFFIX}.idx").is_file()


class MaskedDataset:
    """Tokens and mask of ``prefix`` (both memory-mapped), and its images when ``meta`` has
    them (``has_images``; the pixels memory-mapped too); checked aligned at open."""

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
        self.has_images = bool(self.meta.get("images"))
        self.image_settings: ImageSettings | None = None
        self.vision: VisionIds | None = None
        self.n_images = 0
        if self.has_images:
            self._open_images(self.meta["images"])

    def _open_images(self, info: dict[str, Any]) -> None:
        from composer.vision.preprocess import ImageSettings

        self.image_settings = ImageSettings(**info["settings"])
        self.vision = VisionIds(int(info["vision_start_token_id"]), int(info["image_token_id"]),
                                int(info["vision_end_token_id"]))
        self.pixels = IndexedDataset(f"{self.prefix}{PIXELS_SUFFIX}")
        path = f"{self.prefix}{IMAGES_SUFFIX}"
        try:
            grids = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot read ({type(e).__name__}: {e})".replace(
                "\n", " ")) from None
        self.n_images = n = int(info["count"])
        if grids.dtype != np.int64 or grids.shape != (n, 4) or self.pixels.n_sequences != n:
            raise DataError(f"{path}: {grids.dtype} {grids.shape} and {self.pixels.n_sequences} "
                            f"stored images, for the {n} of {self.prefix}{META_SUFFIX}")
        docs, p = grids[:, 0], self.image_settings.patch_size
        if n and (docs[0] < 0 or docs[-1] >= self.n_documents or np.any(np.diff(docs) < 0)
                  or np.any(grids[:, 1] != 1)):
            raise DataError(f"{path}: images out of document order, or t != 1")
        if not np.array_equal(self.pixels.sequence_lengths, 3 * grids[:, 2] * grids[:, 3] * p * p):
            raise DataError(f"{self.prefix}{PIXELS_SUFFIX}: image sizes differ from the grids "
                            f"of {path}")
        self._grids = grids
        self._first = np.searchsorted(docs, np.arange(self.n_documents + 1))

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

    def grids(self, d: int) -> list[Grid]:
        """Document ``d``'s image grids ``(t, h, w)`` (in patches), in the order of their
        blocks; none for a dataset without images."""
        if not self.has_images:
            return []
        rows = self._grids[self._first[d]:self._first[d + 1], 1:]
        return [(int(t), int(h), int(w)) for t, h, w in rows]

    def images(self, d: int) -> list[Image]:
        """Document ``d``'s images: uint8 ``(3, h, w)`` resized pixels (views) and grids."""
        if not self.has_images:
            return []
        assert self.image_settings is not None
        p = self.image_settings.patch_size
        return [(self.pixels.document(i).reshape(3, h * p, w * p), (t, h, w))
                for i, (t, h, w) in enumerate(self.grids(d), int(self._first[d]))]

    def image_blocks(self, d: int, ids: np.ndarray | None = None) -> list[Span]:
        """Where document ``d``'s images are in its tokens (``ids``, read when None): each
        block ``[lo, hi)`` (:func:`composer.data.chat_images.image_blocks`)."""
        grids = self.grids(d)
        if not grids:
            return []
        assert self.image_settings is not None and self.vision is not None
        counts = [n_tokens(g, self.image_settings.merge_size) for g in grids]
        try:
            return image_blocks(self.tokens.document(d) if ids is None else ids, self.vision,
                                counts)
        except DataError as e:
            raise DataError(f"{self.prefix}: document {d}: {e}") from None

    def supervised_tokens(self) -> int:
        return int(self.masks.tokens(0, self.masks.n_tokens).sum(dtype=np.int64))


class MaskedWriter:
    """Writes tokens, mask and images together; nothing is published until all are complete
    (as a context manager: finalized on a clean exit, removed on an error)."""

    def __init__(self, prefix: str | os.PathLike[str], dtype: type[np.number] | np.dtype) -> None:
        self.prefix = str(prefix)
        self._tokens = IndexedWriter(self.prefix, dtype)
        try:
            self._masks = IndexedWriter(f"{self.prefix}{MASK_SUFFIX}", np.uint8)
        except BaseException:
            self._tokens.abort()
            raise
        self._pixels: IndexedWriter | None = None  # opened at the first image
        self._grids: list[tuple[int, int, int, int]] = []

    @property
    def n_documents(self) -> int:
        return self._tokens.n_documents

    @property
    def n_images(self) -> int:
        return len(self._grids)

    def add_document(self, tokens: np.ndarray, mask: np.ndarray,
                     images: Sequence[Image] = ()) -> None:
        """One document, with its images (uint8 ``(3, h, w)`` pixels and ``(t, h, w)`` grid, in
        the order of their blocks in ``tokens``)."""
        tokens, mask = np.asarray(tokens), np.asarray(mask)
        if tokens.shape != mask.shape:
            raise DataError(f"a mask of shape {mask.shape} for tokens of shape {tokens.shape}")
        self._tokens.add_document(tokens)
        self._masks.add_document(mask.astype(np.uint8))
        for pixels, (t, h, w) in images:
            if self._pixels is None:
                self._pixels = IndexedWriter(f"{self.prefix}{PIXELS_SUFFIX}", np.uint8)
            self._pixels.add_document(np.asarray(pixels).reshape(-1))
            self._grids.append((self.n_documents - 1, t, h, w))

    def _publish_images(self) -> None:
        """The pixels, then their table; a dataset without images removes those an earlier one
        (``--force``) left."""
        if self._pixels is None:
            for suffix in IMAGE_FILES:
                Path(f"{self.prefix}{suffix}").unlink(missing_ok=True)
            return
        self._pixels.finalize()
        path = Path(f"{self.prefix}{IMAGES_SUFFIX}")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.save(f, np.array(self._grids, dtype=np.int64).reshape(-1, 4))
        os.replace(tmp, path)

    def finalize(self, meta: dict[str, Any] | None = None) -> None:
        """Publish the images, the mask, then the tokens, then ``PREFIX.chat.json``: a reader
        that finds the tokens finds their mask and images."""
        try:
            self._publish_images()
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
        for writer in (self._tokens, self._masks, self._pixels):
            if writer is not None and writer._open:
                writer.abort()
        if Path(f"{self.prefix}.idx").exists():
            return
        for suffix in (MASK_SUFFIX + ".bin", MASK_SUFFIX + ".idx", *IMAGE_FILES):
            Path(f"{self.prefix}{suffix}").unlink(missing_ok=True)

    def __enter__(self) -> MaskedWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
        elif self._tokens._open:
            self.finalize()


def inspect_chat(prefix: str) -> dict[str, Any]:
    """A chat dataset's counts (``documents``, ``tokens``, ``supervised_tokens``; a dataset of
    preference pairs also ``pairs``) and what made it (``PREFIX.chat.json``)."""
    ds = MaskedDataset(prefix)
    tokens = ds.tokens
    preference = ds.meta.get("kind") == "preference"  # composer.data.preference.KIND
    pairs = {"kind": "preference", "pairs": ds.n_documents // 2} if preference else {}
    return {"format": ds.meta.get("format", "chat"), **pairs, "documents": ds.n_documents,
            "tokens": tokens.n_tokens,
            "supervised_tokens": ds.supervised_tokens(), "n_documents": ds.n_documents,
            "n_sequences": tokens.n_sequences, "n_tokens": tokens.n_tokens,
            "dtype": tokens.dtype.name, "tokenizer": describe_tokenizer(f"{prefix}.tokenizer"),
            "bin_bytes": os.path.getsize(f"{prefix}.bin"), "images": ds.n_images,
            **({"pixels_bytes": os.path.getsize(f"{prefix}{PIXELS_SUFFIX}.bin")}
               if ds.has_images else {}),
            **{k: ds.meta[k] for k in ("mask", "skipped_rows", "truncated", "seq_len",
                                       "truncate", "chat_template") if k in ds.meta}}


def row(prefix: str, i: int) -> dict[str, list[Any]]:
    """Conversation ``i`` (input order, bad rows left out) as token ids and loss mask (and,
    with images, their ``image_grid_thw``); for a dataset without a mask (text), every token
    is a target: an all-ones mask."""
    ds: MaskedDataset | IndexedDataset = (MaskedDataset if is_masked(prefix)
                                          else IndexedDataset)(prefix)
    n = ds.n_documents
    if not 0 <= i < n:
        raise DataError(f"--row {i}: the dataset has {n:,} documents (0 to {n - 1:,})")
    images = {}
    if isinstance(ds, MaskedDataset):
        ids, mask = ds.document(i)
        if ds.has_images:
            images = {"image_grid_thw": [list(g) for g in ds.grids(i)]}
    else:
        ids = ds.document(i)
        mask = np.ones(len(ids), dtype=np.uint8)
    return {"token_ids": [int(x) for x in ids], "loss_mask": [int(x) for x in mask], **images}
