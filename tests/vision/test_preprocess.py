"""Image preprocessing equals transformers' Qwen2VLImageProcessorPil bit for bit (random pixels,
every branch of smart_resize, every input kind), and bad images fail with one exact line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from composer.data.indexed import DataError
from composer.settings import ConfigError
from composer.vision.preprocess import (
    ImageError,
    ImageSettings,
    n_placeholders,
    preprocess_images,
    smart_resize,
)

pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    Qwen2VLImageProcessorPil,
)

# Qwen/Qwen3.5-2B-Base's preprocessor_config.json (and Qwen3-VL's)
QWEN35 = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
          "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
          "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
          "image_processor_type": "Qwen2VLImageProcessorFast"}
SMALL = {**QWEN35, "size": {"longest_edge": 200_000, "shortest_edge": 4096}}  # max_pixels bites
QWEN2 = {}  # transformers' class defaults: Qwen2-VL's patch 14, CLIP mean and std


def picture(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8)
    rgba = Image.fromarray(pixels)  # a random alpha: RGBA and LA composite every level on white
    if mode == "P":  # a palette with a transparent index: composited too
        image = rgba.convert("RGB").convert("P")
        image.info["transparency"] = 7
        return image
    return rgba.convert(mode)


def hf(config: dict, images: list) -> tuple[torch.Tensor, torch.Tensor]:
    out = Qwen2VLImageProcessorPil(**config)(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def assert_equal(ours: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]):
    assert ours[0].dtype == torch.float32 and ours[1].dtype == torch.int64
    assert torch.equal(ours[1], ref[1]), (ours[1].tolist(), ref[1].tolist())
    assert torch.equal(ours[0], ref[0])


# (width, height, mode) -> image_grid_thw under QWEN35 / SMALL / QWEN2: the grids pin the branch
CASES = [
    ((32, 32, "RGB"), [1, 16, 16], [1, 4, 4], [1, 4, 4]),  # min_pixels scales it up (QWEN35)
    ((20, 300, "RGB"), [1, 62, 6], [1, 18, 2], [1, 22, 2]),  # thin: a side under one patch
    ((1000, 700, "RGB"), [1, 44, 62], [1, 22, 32], [1, 50, 72]),  # max_pixels scales it down
    ((333, 517, "RGB"), [1, 32, 20], [1, 32, 20], [1, 36, 24]),  # odd sides: plain rounding
    ((517, 333, "L"), [1, 20, 32], [1, 20, 32], [1, 24, 36]),  # grey
    ((100, 80, "RGBA"), [1, 16, 18], [1, 4, 6], [1, 6, 8]),
    ((64, 48, "P"), [1, 14, 20], [1, 4, 4], [1, 4, 4]),
    ((50, 41, "LA"), [1, 16, 18], [1, 4, 6], [1, 4, 6]),
    ((200, 1, "RGB"), [1, 2, 228], [1, 2, 58], [1, 2, 58]),  # the widest aspect allowed
]


@pytest.mark.parametrize("config", [QWEN35, SMALL, QWEN2], ids=["qwen3.5", "small", "qwen2"])
def test_equals_transformers(config: dict) -> None:
    settings = ImageSettings.from_hf(config)
    column = [QWEN35, SMALL, QWEN2].index(config) + 1
    for seed, case in enumerate(CASES):
        image = picture(*case[0], seed=seed)
        ours = preprocess_images([image], settings)
        assert ours[1].tolist() == [case[column]], case[0]
        assert_equal(ours, hf(config, [image]))
        t, h, w = case[column]
        assert ours[0].shape == (t * h * w, settings.d_patch)


def test_a_batch_of_images_in_order() -> None:
    images = [picture(50, 60, seed=1), picture(20, 300, "L", seed=2), picture(1000, 700, seed=3)]
    ours = preprocess_images(images, ImageSettings.from_hf(SMALL))
    assert_equal(ours, hf(SMALL, images))
    assert ours[1].tolist() == [[1, 4, 4], [1, 18, 2], [1, 22, 32]]
    assert n_placeholders(ours[1], merge_size=2) == [4, 9, 176]
    assert sum(n_placeholders(ours[1])) * 4 == ours[0].shape[0]


def test_files(tmp_path: Path) -> None:
    paths = {}
    for mode in ("RGB", "L", "RGBA"):
        paths[mode] = tmp_path / f"{mode}.png"
        picture(70, 90, mode, seed=4).save(paths[mode])
    upright = tmp_path / "rotated.png"  # EXIF orientation 6: turned upright, as load_image does
    exif = Image.Exif()
    exif[0x0112] = 6
    picture(70, 90, seed=5).save(upright, exif=exif)
    for path in (paths["RGB"], paths["L"], upright, str(upright)):
        assert_equal(preprocess_images([path]), hf(QWEN35, [str(path)]))
    assert preprocess_images(upright)[1].tolist() == [[1, 16, 20]]  # 90 wide, 70 high turned
    # transformers reads an RGBA *path* with a bare convert("RGB") (alpha dropped) but composites
    # an RGBA image onto white; ours composites both ways, so it equals the opened image
    rgba = preprocess_images([paths["RGBA"]])
    assert_equal(rgba, hf(QWEN35, [Image.open(paths["RGBA"])]))
    assert not torch.equal(rgba[0], hf(QWEN35, [str(paths["RGBA"])])[0])


def every_alpha() -> torch.Tensor:
    """(4, 256, 256) uint8: every (colour, alpha) pair, at a size that is not resized (SMALL)."""
    level = torch.arange(256, dtype=torch.uint8)
    colour, alpha = level[:, None].expand(256, 256), level[None, :].expand(256, 256)
    return torch.stack([colour, alpha, 255 - colour, alpha])


@pytest.mark.parametrize("channels", [1, 3, 4, "every alpha"])
def test_tensors(channels: int | str) -> None:
    rng = np.random.default_rng(0)
    pixels = every_alpha() if channels == "every alpha" else torch.from_numpy(
        rng.integers(0, 256, (channels, 77, 130), dtype=np.uint8))
    channels = pixels.shape[0]
    ours = preprocess_images([pixels], ImageSettings.from_hf(SMALL))
    assert_equal(ours, hf(SMALL, [pixels]))  # transformers given the same tensor
    hwc = pixels.permute(1, 2, 0).numpy()
    image = Image.fromarray(hwc[..., 0] if channels == 1 else hwc)
    assert_equal(ours, preprocess_images([image], ImageSettings.from_hf(SMALL)))  # the same pixels
    for floats in (pixels.float() / 255, pixels.double() / 255, (pixels.float() / 255).half()):
        assert_equal(preprocess_images([floats], ImageSettings.from_hf(SMALL)), ours)


def test_keywords_override_the_settings() -> None:
    image = picture(333, 517)
    ours = preprocess_images(image, patch_size=14, min_pixels=3136, max_pixels=100_000,
                             mean=0.25, std=(0.5, 0.25, 2.0))
    config = {"patch_size": 14, "min_pixels": 3136, "max_pixels": 100_000, "image_mean": 0.25,
              "image_std": [0.5, 0.25, 2.0]}
    assert_equal(ours, hf(config, [image]))
    none = preprocess_images([])
    assert torch.equal(none[0], torch.zeros(0, 1536))
    assert torch.equal(none[1], torch.zeros(0, 3, dtype=torch.int64))


def test_settings_from_hf(tmp_path: Path) -> None:
    assert ImageSettings.from_hf(QWEN35) == ImageSettings()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN35))
    assert ImageSettings.from_hf(tmp_path) == ImageSettings()
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "processor_config.json").write_text(json.dumps({"image_processor": SMALL}))
    assert ImageSettings.from_hf(nested).max_pixels == 200_000
    qwen2 = ImageSettings.from_hf({})  # the class defaults transformers falls back on
    ref = Qwen2VLImageProcessorPil()
    assert (qwen2.patch_size, qwen2.min_pixels, qwen2.max_pixels, qwen2.mean, qwen2.std) == (
        ref.patch_size, ref.size["shortest_edge"], ref.size["longest_edge"],
        tuple(ref.image_mean), tuple(ref.image_std))
    legacy = {"min_pixels": 3136, "max_pixels": 12845056, "size": {"shortest_edge": 1}}
    assert ImageSettings.from_hf(legacy).min_pixels == 3136  # top level wins, as in transformers
    assert smart_resize(300, 20, 32, 65536, 16777216) == (992, 96)


def test_settings_errors(tmp_path: Path) -> None:
    cases = [
        ({"do_resize": False}, "image processor config: do_resize false is not supported "
         "(composer always converts to RGB, resizes, rescales and normalises)"),
        ({"patch_size": 0}, "image processor config: patch_size must be a positive integer, "
         "got 0"),
        ({"size": {"shortest_edge": 10, "longest_edge": 5}}, "image processor config: need "
         "0 <= min_pixels <= max_pixels, got 10 and 5"),
        ({"image_mean": [0.5, 0.5]}, "image processor config: mean must be 3 numbers (R, G, B), "
         "got [0.5, 0.5]"),
        ({"size": 65536}, "image processor config: size must be an object with shortest_edge "
         "and longest_edge, got 65536"),
        (tmp_path, f"{tmp_path}: no preprocessor_config.json or processor_config.json"),
    ]
    for source, message in cases:
        with pytest.raises(ConfigError) as info:
            ImageSettings.from_hf(source)
        assert str(info.value) == message
    with pytest.raises(ConfigError, match="image settings: no setting patch, pixels "):
        preprocess_images([picture(8, 8)], patch=16, pixels=3)


def test_bad_images(tmp_path: Path) -> None:
    (tmp_path / "notes.png").write_text("not a picture\n")
    truncated = tmp_path / "truncated.png"
    picture(300, 300).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:2000])
    cases = [
        ([tmp_path / "missing.png"], f"{tmp_path / 'missing.png'}: no such image file"),
        ([tmp_path / "notes.png"],
         f"{tmp_path / 'notes.png'}: not an image file (Pillow cannot identify it)"),
        ([tmp_path], f"{tmp_path}: a directory, not an image file"),
        ([truncated], f"{truncated}: cannot read the image: image file is truncated"),
        ([picture(8, 8), Image.new("RGB", (0, 5))],
         "image 1: 0x5 pixels is too small for one 16x16 patch"),
        ([torch.zeros(3, 4, 0, dtype=torch.uint8)],
         "image 0: 0x4 pixels is too small for one 16x16 patch"),
        ([picture(8, 8), picture(8, 8), picture(201, 1)],
         "image 2: 201x1 pixels has an aspect ratio of 201.0, over 200"),
        ([torch.zeros(2, 8, 8)], "image 0: a tensor image is (C, H, W) with C = 1, 3 or 4, "
         "got shape (2, 8, 8)"),
        ([torch.zeros(8, 8, 3)], "image 0: a tensor image is (C, H, W) with C = 1, 3 or 4, "
         "got shape (8, 8, 3)"),
        ([torch.full((3, 8, 8), 2.0)],
         "image 0: a float tensor image holds values in [0, 1], got [2, 2]"),
        ([torch.zeros(3, 8, 8, dtype=torch.int32)],
         "image 0: a tensor image is uint8 (0-255) or floating (0-1), got torch.int32"),
        ([np.zeros((8, 8, 3), np.uint8)],
         "image 0: expected a PIL image, a path or a (C, H, W) tensor, got ndarray"),
    ]
    for images, message in cases:
        with pytest.raises(ImageError) as info:
            preprocess_images(images)
        assert str(info.value) == message
    assert issubclass(ImageError, DataError) and issubclass(ImageError, ValueError)
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        hf(QWEN35, [picture(201, 1)])  # transformers refuses the same image


def test_too_small_only_when_min_pixels_lets_a_side_round_to_nothing() -> None:
    # any image of at least 1x1 is scaled up to min_pixels; with min_pixels 0, a 10x10 image
    # rounds to 0x0 (transformers then fails inside PIL)
    with pytest.raises(ImageError) as info:
        preprocess_images([picture(10, 10)], min_pixels=0)
    assert str(info.value) == ("image 0: 10x10 pixels is too small for one 32x32 block of "
                               "patches (min_pixels is 0)")
    with pytest.raises(ValueError):
        hf({**QWEN35, "size": {"shortest_edge": 0, "longest_edge": 16777216}}, [picture(10, 10)])
    assert_equal(preprocess_images([picture(1, 1)]), hf(QWEN35, [picture(1, 1)]))


def test_n_placeholders() -> None:
    assert n_placeholders(torch.tensor([[1, 16, 16], [1, 4, 6]])) == [64, 6]
    assert n_placeholders([1, 4, 6], merge_size=1) == [24]
    with pytest.raises(ValueError, match="image grid 1x3x4 does not split into 2x2 merge blocks"):
        n_placeholders([[1, 3, 4]])
