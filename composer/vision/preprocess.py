"""Image preprocessing of Qwen2-VL, Qwen3-VL and Qwen3.5-VL, without torchvision.

Written from transformers' ``Qwen2VLImageProcessorPil`` (the PIL path of the image processor
that Qwen3-VL's and Qwen3.5's processors name), so that ``pixel_values`` and ``image_grid_thw``
equal it bit for bit. Per image:

1. RGB: an image with transparency (an alpha band, or a palette's transparent index) is
   composited onto white; grey and palette images are expanded.
2. Resize with PIL's bicubic filter to ``smart_resize(H, W)``: each side a multiple of
   ``factor = patch_size * merge_size``, ``min_pixels <= h * w <= max_pixels``, aspect kept.
3. Rescale by 1/255 (in float64, stored as float32) and normalise, ``(x - mean) / std`` in
   float32.
4. Repeat the single frame ``temporal_patch_size`` times and cut it into ``(C, T, P, P)``
   patches in block-major order: the ``merge x merge`` blocks row by row, and the patches of a
   block row by row, so that the four patches the merger concatenates are consecutive rows.

The result: ``pixel_values`` (sum over images of h*w / P^2, C*T*P*P) float32 and
``image_grid_thw`` (n_images, 3) int64, one row ``[1, h / P, w / P]`` per image. An image with
h x w patches takes ``h * w / merge^2`` placeholder tokens in the prompt (:func:`n_placeholders`).
Sizes in messages are PIL's ``WIDTHxHEIGHT``.

The steps split in two public halves: :func:`resize_image` (1-2: uint8 ``(3, h, w)``, what a
chat dataset with images stores) and :func:`image_patches` (3-4: what its reader computes), so
that stored images train on exactly :func:`preprocess_images`'s values.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from composer.settings import ConfigError, DataError

try:
    from PIL import Image, ImageOps, UnidentifiedImageError
except ImportError as exc:  # Pillow is the `vision` extra
    raise ImportError("composer.vision.preprocess needs Pillow: "
                      "pip install 'composer-lm[vision]'") from exc

MAX_ASPECT = 200  # smart_resize refuses a longer side over 200 times the shorter one
ImageInput = Image.Image | str | os.PathLike | torch.Tensor

# transformers' Qwen2VLImageProcessor class defaults, which fill what a config file leaves out
_HF_DEFAULTS: dict[str, Any] = {
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),  # OPENAI_CLIP_MEAN
    "image_std": (0.26862954, 0.26130258, 0.27577711),  # OPENAI_CLIP_STD
    "rescale_factor": 1 / 255, "resample": 3}
_ALWAYS_ON = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")


class ImageError(DataError):
    """An image that cannot be read or preprocessed; the message is one line naming it."""


@dataclass(frozen=True)
class ImageSettings:
    """The image processor's settings. The defaults are Qwen3.5's published
    ``preprocessor_config.json`` (Qwen/Qwen3.5-2B-Base, as Qwen3-VL): patches of 16, 2 x 2
    merged, between 256^2 and 4096^2 pixels, mean = std = 0.5."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65536
    max_pixels: int = 16777216
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL.Image.Resampling.BICUBIC

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"image settings: {name} must be a positive integer, "
                                  f"got {value!r}")
        for name in ("min_pixels", "max_pixels"):
            if not isinstance(getattr(self, name), int):
                raise ConfigError(f"image settings: {name} must be an integer, "
                                  f"got {getattr(self, name)!r}")
        if not 0 <= self.min_pixels <= self.max_pixels:
            raise ConfigError(f"image settings: need 0 <= min_pixels <= max_pixels, got "
                              f"{self.min_pixels} and {self.max_pixels}")
        object.__setattr__(self, "mean", _three("mean", self.mean))
        object.__setattr__(self, "std", _three("std", self.std))
        if 0 in self.std:
            raise ConfigError(f"image settings: std must not hold a zero, got {self.std}")
        if self.resample not in {r.value for r in Image.Resampling}:
            raise ConfigError(f"image settings: resample {self.resample!r} is no PIL filter")

    @property
    def factor(self) -> int:
        """Each resized side is a multiple of this: one merge block of patches."""
        return self.patch_size * self.merge_size

    @property
    def d_patch(self) -> int:
        """The length of one row of ``pixel_values``: C * T * P * P."""
        return 3 * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any]) -> ImageSettings:
        """Read a Hugging Face image processor's settings: a model folder (its
        ``preprocessor_config.json``, else ``processor_config.json``'s ``image_processor``), a
        JSON file, or the dict itself. Keys it leaves out take transformers' class defaults
        (Qwen2-VL's: patch 14, CLIP mean and std), as ``Qwen2VLImageProcessor(**config)`` does;
        top-level ``min_pixels`` / ``max_pixels`` override ``size``, as there."""
        where, config = _read_config(source)
        if isinstance(config.get("image_processor"), Mapping):
            config = config["image_processor"]
        off = [k for k in _ALWAYS_ON if config.get(k, True) is False]
        if off:
            raise ConfigError(f"{where}: {', '.join(off)} false is not supported (composer always "
                              f"converts to RGB, resizes, rescales and normalises)")
        get = {**_HF_DEFAULTS, **config}.get
        size = config.get("size") or {}
        if not isinstance(size, Mapping):
            raise ConfigError(f"{where}: size must be an object with shortest_edge and "
                              f"longest_edge, got {size!r}")
        min_pixels = config["min_pixels"] if config.get("min_pixels") is not None else size.get(
            "shortest_edge", size.get("min_pixels", _HF_DEFAULTS["min_pixels"]))
        max_pixels = config["max_pixels"] if config.get("max_pixels") is not None else size.get(
            "longest_edge", size.get("max_pixels", _HF_DEFAULTS["max_pixels"]))
        try:
            return cls(patch_size=get("patch_size"), temporal_patch_size=get("temporal_patch_size"),
                       merge_size=get("merge_size"), min_pixels=min_pixels,
                       max_pixels=max_pixels, mean=get("image_mean"), std=get("image_std"),
                       rescale_factor=get("rescale_factor"), resample=get("resample"))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {str(exc).removeprefix('image settings: ')}") from None


def _three(name: str, value: Any) -> tuple[float, float, float]:
    """A per-channel (R, G, B) triple; a single number stands for all three, as in HF."""
    values = [value] * 3 if isinstance(value, (int, float)) else list(value)
    if len(values) != 3 or not all(isinstance(v, (int, float)) for v in values):
        raise ConfigError(f"image settings: {name} must be 3 numbers (R, G, B), got {value!r}")
    return tuple(float(v) for v in values)  # type: ignore[return-value]


def _read_config(source: str | os.PathLike | Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    if isinstance(source, Mapping):
        return "image processor config", source
    path = Path(source)
    if path.is_dir():
        for name in ("preprocessor_config.json", "processor_config.json"):
            if (path / name).is_file():
                path = path / name
                break
        else:
            raise ConfigError(f"{source}: no preprocessor_config.json or processor_config.json")
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable JSON file ({exc})".replace("\n", " ")) from None
    if not isinstance(config, Mapping):
        raise ConfigError(f"{path}: not a JSON object")
    return str(path), config


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The resized (height, width): transformers' ``smart_resize``, operation for operation
    (Python's round-half-even included), less its aspect check, which the caller makes."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _resized_size(name: str, width: int, height: int, s: ImageSettings) -> tuple[int, int]:
    """The (height, width) to resize to, or a one-line error for sizes that have none."""
    if width < 1 or height < 1:
        raise ImageError(f"{name}: {width}x{height} pixels is too small for one "
                         f"{s.patch_size}x{s.patch_size} patch")
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"{name}: {width}x{height} pixels has an aspect ratio of "
                         f"{max(height, width) / min(height, width):.1f}, over {MAX_ASPECT}")
    h, w = smart_resize(height, width, s.factor, s.min_pixels, s.max_pixels)
    if h < s.factor or w < s.factor:  # only with min_pixels = 0: a side rounds to nothing
        raise ImageError(f"{name}: {width}x{height} pixels is too small for one "
                         f"{s.factor}x{s.factor} block of patches (min_pixels is {s.min_pixels})")
    return h, w


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' ``convert_to_rgb``: transparency composited onto white, else ``RGB``."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _open(path: str | os.PathLike) -> Image.Image:
    """A file as an RGB image, turned upright by its EXIF orientation as transformers'
    ``load_image`` does."""
    try:
        with Image.open(path) as image:
            return to_rgb(ImageOps.exif_transpose(image))
    except FileNotFoundError:
        raise ImageError(f"{path}: no such image file") from None
    except IsADirectoryError:
        raise ImageError(f"{path}: a directory, not an image file") from None
    except PermissionError:
        raise ImageError(f"{path}: cannot read the image file: permission denied") from None
    except UnidentifiedImageError:
        raise ImageError(f"{path}: not an image file (Pillow cannot identify it)") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"{path}: cannot read the image: {exc}".replace("\n", " ")) from None


def _from_tensor(name: str, image: torch.Tensor, s: ImageSettings) -> Image.Image:
    """A (C, H, W) tensor as a PIL image with the same pixels (C = 1 grey, 3 RGB, 4 RGBA)."""
    if image.ndim != 3 or image.shape[0] not in (1, 3, 4):
        raise ImageError(f"{name}: a tensor image is (C, H, W) with C = 1, 3 or 4, "
                         f"got shape {tuple(image.shape)}")
    _resized_size(name, image.shape[2], image.shape[1], s)  # refuse before converting
    pixels = image.detach().cpu()
    if pixels.dtype == torch.uint8:
        array = pixels.numpy()
    elif pixels.is_floating_point():
        x = pixels.double().numpy()
        lo, hi = float(x.min()), float(x.max())
        if not (0.0 <= lo and hi <= 1.0):  # also refuses NaN
            raise ImageError(f"{name}: a float tensor image holds values in [0, 1], "
                             f"got [{lo:g}, {hi:g}]")
        array = np.rint(x * 255).astype(np.uint8)
    else:
        raise ImageError(f"{name}: a tensor image is uint8 (0-255) or floating (0-1), "
                         f"got {pixels.dtype}")
    hwc = np.ascontiguousarray(array.transpose(1, 2, 0))
    return Image.fromarray(hwc[..., 0] if hwc.shape[2] == 1 else hwc)


def _rgb(index: int, image: ImageInput, s: ImageSettings) -> tuple[str, Image.Image]:
    if isinstance(image, (str, os.PathLike)):
        return str(image), _open(image)
    name = f"image {index}"
    if isinstance(image, torch.Tensor):
        return name, to_rgb(_from_tensor(name, image, s))
    if isinstance(image, Image.Image):
        if getattr(image, "filename", ""):
            name = f"{name} ({image.filename})"
        return name, to_rgb(image)
    raise ImageError(f"{name}: expected a PIL image, a path or a (C, H, W) tensor, "
                     f"got {type(image).__name__}")


def patchify(pixels: np.ndarray, s: ImageSettings) -> np.ndarray:
    """(C, h, w) float32 -> (h/P * w/P, C*T*P*P), merge blocks first (the processor's order)."""
    c, height, width = pixels.shape
    p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
    gh, gw = height // p, width // p
    blocks = pixels.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return frames.reshape(gh * gw, c * t * p * p)


def resize_image(image: ImageInput, settings: ImageSettings | None = None,
                 index: int = 0) -> np.ndarray:
    """Steps 1 and 2 (module docstring) of one image: uint8 ``(3, h, w)``, each side a multiple
    of ``settings.factor``. What a dataset stores (3 bytes a pixel): :func:`image_patches` of
    it is the image's part of :func:`preprocess_images`, bit for bit. ``index`` names an image
    that is not a path in errors."""
    s = settings or ImageSettings()
    name, rgb = _rgb(index, image, s)
    height, width = _resized_size(name, rgb.width, rgb.height, s)
    return np.asarray(rgb.resize((width, height), resample=s.resample)).transpose(2, 0, 1)


def _normalized(pixels: np.ndarray, s: ImageSettings) -> np.ndarray:
    """uint8 (3, h, w) rescaled and normalised: float32, in transformers' dtypes."""
    x = (pixels.astype(np.float64) * s.rescale_factor).astype(np.float32)
    mean = np.array(s.mean, dtype=np.float32)[:, None, None]
    std = np.array(s.std, dtype=np.float32)[:, None, None]
    return (x - mean) / std


def image_patches(pixels: np.ndarray,
                  settings: ImageSettings | None = None) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Steps 3 and 4 on :func:`resize_image`'s uint8 ``(3, h, w)``: the image's rows of
    ``pixel_values`` (``h/P * w/P``, C*T*P*P) float32 and its grid ``(1, h/P, w/P)``."""
    s = settings or ImageSettings()
    if pixels.ndim != 3 or pixels.shape[0] != 3 or pixels.dtype != np.uint8 or \
            pixels.shape[1] % s.factor or pixels.shape[2] % s.factor:
        raise ImageError(f"resized pixels are uint8 (3, h, w) with h and w multiples of "
                         f"{s.factor}, got {pixels.dtype} {tuple(pixels.shape)}")
    grid = (1, pixels.shape[1] // s.patch_size, pixels.shape[2] // s.patch_size)
    return patchify(_normalized(pixels, s), s), grid


def preprocess_images(images: ImageInput | Sequence[ImageInput],
                      settings: ImageSettings | None = None,
                      **overrides: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Images -> (``pixel_values`` (N, C*T*P*P) float32, ``image_grid_thw`` (n_images, 3) int64).

    ``settings`` defaults to Qwen3.5's (:class:`ImageSettings`); keywords override its fields
    (``patch_size=14, max_pixels=...``). Each image is one of:

    - a path: read with Pillow and turned upright by its EXIF orientation, as transformers'
      ``load_image``; unlike ``load_image`` (a bare ``convert("RGB")``), transparency is
      composited onto white here, as transformers does for an image passed in memory;
    - a PIL image, in any mode (RGB, RGBA, L, LA, P, ...): converted to RGB as above;
    - a channels-first ``(C, H, W)`` tensor, C = 1 (grey), 3 (RGB) or 4 (RGBA): uint8 holds
      pixels 0-255; a floating tensor holds 0-1 and is read as the pixels ``round(255 x)``
      (so ``k / 255`` is pixel k). The pixels become a PIL image and take the PIL path: PIL's
      bicubic is the reference and converting is the plain way to equal it, so a tensor equals
      the PIL image of its pixels, and transformers given the same uint8 tensor.

    Bad images raise :class:`ImageError` (a ``ValueError``), one line naming the file or index.
    """
    known = [f.name for f in dataclasses.fields(ImageSettings)]
    if unknown := sorted(set(overrides) - set(known)):
        raise ConfigError(f"image settings: no setting {', '.join(unknown)} (there are "
                          f"{', '.join(known)})")
    s = dataclasses.replace(settings or ImageSettings(), **overrides)
    if isinstance(images, (str, os.PathLike, Image.Image, torch.Tensor)):
        images = [images]
    rows, grids = [], []
    for index, image in enumerate(images):
        patches, grid = image_patches(resize_image(image, s, index), s)
        rows.append(patches)
        grids.append(list(grid))
    pixel_values = np.concatenate(rows) if rows else np.zeros((0, s.d_patch), np.float32)
    return (torch.from_numpy(np.ascontiguousarray(pixel_values)),
            torch.tensor(grids, dtype=torch.int64).reshape(-1, 3))


def n_placeholders(grid_thw: torch.Tensor | Sequence[Sequence[int]],
                   merge_size: int = 2) -> list[int]:
    """The ``<|image_pad|>`` tokens each image takes: t * h * w / merge^2, per row of
    ``image_grid_thw`` (a single (t, h, w) row counts as one image)."""
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
    if rows and not isinstance(rows[0], (list, tuple)):
        rows = [rows]
    counts = []
    for t, h, w in rows:
        if h % merge_size or w % merge_size:
            raise ValueError(f"image grid {t}x{h}x{w} does not split into {merge_size}x"
                             f"{merge_size} merge blocks")
        counts.append(t * h * w // merge_size ** 2)
    return counts
