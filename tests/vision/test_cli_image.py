"""``composer generate SOURCE --image PATH``: the prompt gets each image's placeholder block
before the text and the images' pixels go with the prefill, so the command's tokens are
``composer.generate``'s with the same pixels; a text model, an unreadable image and a missing one
are one-line errors, exit 2; with ``--chat`` the template's one placeholder per image is expanded
to its image's count."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import composer
from composer.cli import main


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> tuple[Path, Path]:
    from PIL import Image

    from composer.zoo import get_preset

    tmp = tmp_path_factory.mktemp("vlm")
    composer.save(composer.build_model(get_preset("qwen3.5-vl-debug").config(), seed=0),
                  tmp / "ck")
    pixels = np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp / "a.png")
    return tmp / "ck", tmp / "a.png"


def test_generate_with_an_image_is_the_library_call(vlm, capsys):
    from composer.data.tokenizer import load_tokenizer
    from composer.vision.preprocess import ImageSettings, n_placeholders, preprocess_images

    ck, png = vlm
    code = main(["generate", str(ck), "--image", str(png), "--prompt", "hi", "--tokenizer",
                 "byte", "--max-new-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    model = composer.load(ck).eval()
    v = model.config.vision
    pv, thw = preprocess_images([png], ImageSettings(patch_size=v.patch_size,
                                                     merge_size=v.merge_size))
    n = n_placeholders(thw, v.merge_size)[0]
    prompt = [v.vision_start_token_id, *[v.image_token_id] * n, v.vision_end_token_id,
              *load_tokenizer("byte").encode_prompt("hi")]
    assert out["prompt_token_ids"] == prompt
    ids = composer.generate(model, torch.tensor([prompt]), 4, pixel_values=pv,
                            image_grid_thw=thw, vocab_limit=256)
    new = out["token_ids"]  # up to 4, fewer when an end-of-document id came first
    assert 1 <= len(new) <= 4 and new == ids[0, len(prompt):].tolist()[:len(new)]


def test_image_errors_are_one_line(vlm, tmp_path, capsys):
    ck, png = vlm
    text = tmp_path / "text"
    composer.save(composer.build_model(composer.ModelConfig(pattern="*-", d_model=32,
                                                            vocab_size=300)), text)
    (tmp_path / "bad.png").write_text("not an image")
    cases = [(text, png, "has no vision tower"), (ck, tmp_path / "bad.png", "bad.png"),
             (ck, tmp_path / "missing.png", "missing.png")]
    for source, image, words in cases:
        code = main(["generate", str(source), "--image", str(image), "--prompt", "hi",
                     "--tokenizer", "byte", "--max-new-tokens", "2"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and words in err and "\n" not in err, err


def test_chat_with_images_expands_the_template_placeholders(vlm, tmp_path, capsys):
    import dataclasses

    pytest.importorskip("tokenizers")
    from composer.data.tokenizer import load_tokenizer
    from composer.vision.preprocess import ImageSettings, n_placeholders, preprocess_images
    from composer.zoo import get_preset
    from tests.helpers import VL_SPECIALS, write_vl_tokenizer

    folder = tmp_path / "ck"
    cfg = get_preset("qwen3.5-vl-debug").config()
    tokenizer = write_vl_tokenizer(tmp_path / "tok", ["describe the two pictures"])
    loaded = load_tokenizer(str(tokenizer))
    ids = {t: loaded.token_id(t) for t in VL_SPECIALS}
    cfg = dataclasses.replace(cfg, vision=dataclasses.replace(
        cfg.vision, vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], image_token_id=ids["<|image_pad|>"]))
    composer.save(composer.build_model(cfg, seed=0), folder)
    shutil.copytree(tokenizer, folder / "tokenizer")
    _, png = vlm
    code = main(["generate", str(folder), "--chat", "--image", str(png), "--image", str(png),
                 "--prompt", "describe the two pictures", "--max-new-tokens", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    v = cfg.vision
    _, thw = preprocess_images([png, png], ImageSettings(patch_size=v.patch_size,
                                                         merge_size=v.merge_size))
    n = n_placeholders(thw, v.merge_size)
    block = [v.vision_start_token_id, *[v.image_token_id] * n[0], v.vision_end_token_id]
    head = loaded.encode("<|im_start|>user\n")
    tail = loaded.encode("describe the two pictures<|im_end|>\n<|im_start|>assistant\n")
    assert out["prompt_token_ids"] == head + block + block + tail
