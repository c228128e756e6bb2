"""Images in chat rows: ``{"messages": [...], "images": ["a.png", ...]}`` (a prompt/completion
row takes ``"images"`` too). What ``composer data prepare --format chat`` does with them, and the
block rule the SFT reader (:mod:`composer.data.sft`) cuts by.

- Placing (:func:`place_images`): the k-th ``{"type": "image"}`` part of the messages, in
  order, takes ``images[k]``. A row with images but no image part gets them first in its first
  user message, as image parts before its text. Any other number of parts than of images is a
  bad row.
- Paths: a relative path resolves against the folder of the input file, or ``--image-root``.
- Pixels (:func:`load_images`): each image converted to RGB and resized as the image processor
  does (:func:`composer.vision.preprocess.resize_image`); the uint8 ``(3, h, w)`` is what is
  stored, and its ``t * h * w / merge^2`` (in patches) is its token count.
- Tokens: the chat template renders each image part (Qwen-VL's: ``<|vision_start|>``, one
  ``<|image_pad|>``, ``<|vision_end|>``); after tokenising, the k-th pad becomes image k's count
  of pads, ids and mask together (:func:`expand_placeholders`, which ``composer generate
  --chat --image`` shares). A template that writes another number of pads than images: a bad
  row. The three token ids are the tokenizer's (a row with images and a tokenizer without them
  is a bad row).
- Mask: 0 on every image block (:func:`image_blocks`: the ``<|vision_start|>`` right before a
  run of pads, the pads, the ``<|vision_end|>`` right after), the text rule
  (:mod:`composer.data.chat`) everywhere else. The model never predicts an image.
- Truncation (:func:`truncate_blocks`) never splits a block: a cut that lands inside one moves
  to its edge (fewer tokens are kept), and the images whose blocks fall outside are dropped.

Pillow (:mod:`composer.vision.preprocess`) is imported only for a row with images, so text rows
prepare without it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from composer.data import chat
from composer.data.chat import ChatEncoder, RowError
from composer.data.indexed import DataError
from composer.data.tokenizer import HFTokenizer

if TYPE_CHECKING:
    from composer.vision.preprocess import ImageSettings

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
PREPROCESSOR_CONFIG = "preprocessor_config.json"

Span = tuple[int, int]
Grid = tuple[int, int, int]
Image = tuple[np.ndarray, Grid]
"""An image as stored: uint8 ``(3, h, w)`` resized pixels and its grid ``(t, h/P, w/P)``."""


@dataclass(frozen=True)
class VisionIds:
    """The ids of ``<|vision_start|>``, ``<|image_pad|>`` and ``<|vision_end|>``."""

    start: int
    pad: int
    end: int


def vision_ids(tok: HFTokenizer) -> VisionIds:
    """The tokenizer's vision token ids; a :class:`RowError` naming those it lacks."""
    ids = {t: tok.token_id(t) for t in VISION_TOKENS}
    missing = [t for t, i in ids.items() if i is None]
    if missing:
        raise RowError(f"the tokenizer has no {' and no '.join(missing)} token (a row with "
                       f"images needs {', '.join(VISION_TOKENS)})")
    return VisionIds(*(int(i) for i in ids.values()))  # type: ignore[arg-type]


def row_images(record: Any) -> list[str]:
    """The row's ``"images"`` paths (none when the key is missing or null)."""
    if not isinstance(record, dict) or record.get("images") is None:
        return []
    paths = record["images"]
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise RowError("'images' is not a list of image paths")
    return paths


def _image_parts(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if part["type"] == "image")


def place_images(messages: list[dict[str, Any]], n_images: int) -> list[dict[str, Any]]:
    """``messages`` with one image part per image (module docstring): as they are when their
    image parts match the images, else the images first in the first user message."""
    parts = _image_parts(messages)
    if parts == n_images:
        return messages
    if parts:
        raise RowError(f"{parts} image part(s) in the messages for {n_images} image(s) in "
                       "'images'")
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        raise RowError(f"{n_images} image(s) and no user message to put them in")
    message = messages[first]
    content = message.get("content")
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    images = [{"type": "image"} for _ in range(n_images)]
    return [*messages[:first], {**message, "content": images + text}, *messages[first + 1:]]


def expand_placeholders(ids: Sequence[int] | np.ndarray, pad_id: int, counts: Sequence[int],
                        mask: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """``ids`` (int64) with the k-th ``pad_id`` repeated ``counts[k]`` times, and ``mask``
    repeated alike; a :class:`RowError` when the pads are not one per count."""
    ids = np.asarray(ids, dtype=np.int64)
    at = np.flatnonzero(ids == pad_id)
    if len(at) != len(counts):
        raise RowError(f"the chat template wrote {len(at)} image placeholder(s) for "
                       f"{len(counts)} image(s)")
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[at] = counts
    return np.repeat(ids, repeats), None if mask is None else np.repeat(mask, repeats)


def image_blocks(ids: np.ndarray, vision: VisionIds, counts: Sequence[int]) -> list[Span]:
    """Each image's block ``[lo, hi)`` in expanded ``ids``: its run of ``counts[k]`` pads (the
    pads in order, image by image), with the ``<|vision_start|>`` right before it and the
    ``<|vision_end|>`` right after it when they are there."""
    at = np.flatnonzero(np.asarray(ids) == vision.pad)
    if len(at) != sum(counts):
        raise DataError(f"{len(at)} image placeholder tokens for {len(counts)} image(s) of "
                        f"{sum(counts)} tokens")
    blocks, k = [], 0
    for n in counts:
        lo, hi = int(at[k]), int(at[k]) + n
        if int(at[k + n - 1]) != hi - 1:
            raise DataError(f"image {len(blocks)}'s {n} placeholder tokens are not contiguous")
        lo -= 1 if lo > 0 and ids[lo - 1] == vision.start else 0
        hi += 1 if hi < len(ids) and ids[hi] == vision.end else 0
        blocks.append((lo, hi))
        k += n
    return blocks


def cut(n: int, seq_len: int, side: str, blocks: Sequence[Span]) -> Span:
    """The tokens ``[lo, hi)`` kept of ``n`` cut to at most ``seq_len`` (``right``: the first,
    ``left``: the last), the cut moved to the edge of a block it would split."""
    if n <= seq_len:
        return 0, n
    if side == "right":
        hi = next((lo for lo, hi in blocks if lo < seq_len < hi), seq_len)
        return 0, hi
    lo = next((hi for lo, hi in blocks if lo < n - seq_len < hi), n - seq_len)
    return lo, n


def truncate_blocks(ids: np.ndarray, mask: np.ndarray, seq_len: int, side: str,
                    blocks: Sequence[Span]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """:func:`composer.data.chat.truncate` that never splits a block of ``blocks``: the kept
    ids, mask and the indices of the images whose blocks are kept."""
    if len(ids) <= seq_len or side not in ("right", "left"):
        ids, mask = chat.truncate(ids, mask, seq_len, side)  # unchanged, or the refusal
        return ids, mask, list(range(len(blocks)))
    lo, hi = cut(len(ids), seq_len, side, blocks)
    kept = [k for k, (a, b) in enumerate(blocks) if lo <= a and b <= hi]
    return ids[lo:hi], mask[lo:hi], kept


def _preprocess() -> Any:
    """:mod:`composer.vision.preprocess`, or a one-line :class:`DataError` without Pillow (fatal,
    not a bad row: every row with images would fail the same way)."""
    try:
        from composer.vision import preprocess
    except ImportError as e:
        raise DataError(f"a row with images: {e}") from None
    return preprocess


def image_settings(folder: str | os.PathLike[str] | None, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> ImageSettings:
    """The settings images are resized with: the tokenizer folder's ``preprocessor_config.json``
    when it has one (:meth:`ImageSettings.from_hf`), else Qwen3.5's; then the flags."""
    image_settings_class = _preprocess().ImageSettings
    has_config = folder is not None and Path(folder, PREPROCESSOR_CONFIG).is_file()
    settings = image_settings_class.from_hf(folder) if has_config else image_settings_class()
    flags = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    return dataclasses.replace(settings, **{k: v for k, v in flags.items() if v is not None})


def n_tokens(grid: Grid, merge_size: int) -> int:
    """An image's placeholder tokens: ``t * h * w / merge^2``."""
    t, h, w = grid
    return t * h * w // merge_size ** 2


def load_images(paths: Sequence[str], root: str, settings: ImageSettings) -> list[Image]:
    """Each path (relative ones under ``root``) read and resized; a bad image is a
    :class:`RowError` naming it."""
    resize_image = _preprocess().resize_image
    images = []
    for path in paths:
        try:
            pixels = resize_image(path if os.path.isabs(path) else os.path.join(root, path),
                                  settings)
        except DataError as e:  # ImageError: one line naming the file
            raise RowError(str(e)) from None
        _, h, w = pixels.shape
        grid = (1, h // settings.patch_size, w // settings.patch_size)
        images.append((np.ascontiguousarray(pixels), grid))
    return images


class ImageRows:
    """The image half of encoding chat rows with ``tok``: the vision ids and image settings are
    found once per process, at the first row with images."""

    def __init__(self, tok: HFTokenizer, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> None:
        self.tok, self.min_pixels, self.max_pixels = tok, min_pixels, max_pixels
        self._vision: VisionIds | None = None
        self._settings: ImageSettings | None = None

    @property
    def vision(self) -> VisionIds:
        if self._vision is None:
            self._vision = vision_ids(self.tok)
        return self._vision

    @property
    def settings(self) -> ImageSettings:
        if self._settings is None:
            self._settings = image_settings(self.tok.folder, self.min_pixels, self.max_pixels)
        return self._settings

    def encode(self, encoder: ChatEncoder, messages: list[dict[str, Any]], start: int | None,
               paths: Sequence[str], root: str
               ) -> tuple[np.ndarray, np.ndarray, list[Image], list[Span]]:
        """A row's expanded ids, mask (0 on the image blocks), images and blocks."""
        vision = self.vision  # a tokenizer without the tokens fails before any image is read
        images = load_images(paths, root, self.settings)
        counts = [n_tokens(grid, self.settings.merge_size) for _, grid in images]
        ids, mask = encoder.encode(messages, start)
        ids, expanded = expand_placeholders(ids, vision.pad, counts, mask)
        assert expanded is not None
        blocks = image_blocks(ids, vision, counts)
        for lo, hi in blocks:
            expanded[lo:hi] = 0
        if not expanded.any():
            raise RowError("no supervised token outside the image blocks")
        return ids, expanded, images, blocks
