"""SFT of a vision-language model on conversations with images (issue 25 item 6), through the
engine: the first step's loss is the model's masked loss over the packed rows and their images,
the images change it, the micro-batch size does not change the gradient (a micro-batch without
images runs the tower's stand-in), and ``--freeze`` keeps the frozen parts' weights exactly.
The data: tiny pictures (8 to 24 pixels a side, patches of 4, 2 x 2 merged), some rows
without any."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import write_vl_tokenizer

pytest.importorskip("PIL")
pytest.importorskip("tokenizers")

CORPUS = ["what colour is it", "red green blue", "a picture", "hello there", "how many"]
PATCH4 = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 64,
          "max_pixels": 576, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 50, 220)}


def vl_dataset(root: Path, n_rows: int = 24) -> tuple[str, dict]:
    """A prepared image SFT set of ``n_rows`` conversations (every third without an image) and
    the recipe's ``model`` value: qwen3.5-vl-debug with the tokenizer's vision ids."""
    from PIL import Image

    from composer.cli import main
    from composer.data.tokenizer import load_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    tok = write_vl_tokenizer(root / "tok", CORPUS, preprocessor=PATCH4)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n_rows):
        name = list(COLOURS)[i % 3]
        if i % 3 == 2:
            rows.append({"messages": [{"role": "user", "content": "hello there"},
                                      {"role": "assistant", "content": "how many"}]})
            continue
        h, w = (8 * int(rng.integers(1, 4)) for _ in range(2))
        pixels = np.zeros((h, w, 3), np.uint8) + np.array(COLOURS[name], np.uint8)
        pixels = np.clip(pixels + rng.integers(-20, 20, pixels.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / f"{i}.png")
        rows.append({"messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "what colour is it"}]},
            {"role": "assistant", "content": name}], "images": [f"{i}.png"]})
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefix = root / "vl"
    assert main(["data", "prepare", str(root / "rows.jsonl"), "--format", "chat",
                 "--tokenizer", str(tok), "--out", str(prefix)]) == 0
    t = load_tokenizer(str(tok))
    ids = {k: t.token_id(f"<|{k}|>") for k in ("vision_start", "vision_end", "image_pad")}
    model = {"preset": "qwen3.5-vl-debug",
             "set": {"vision.vision_start_token_id": ids["vision_start"],
                     "vision.vision_end_token_id": ids["vision_end"],
                     "vision.image_token_id": ids["image_pad"]}}
    return str(prefix), model


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[str, dict]:
    return vl_dataset(tmp_path_factory.mktemp("vlsft"))


def vl_values(data: tuple[str, dict], **kw) -> dict:
    prefix, model = data
    return {"model": model, "objective": "sft", "data": [prefix], "seq_len": 48, "steps": 2,
            "global_batch_size": 4, "lr": 1e-3, "device": "cpu", "precision": "fp32", **kw}


def test_the_first_step_is_the_models_masked_loss_with_the_images(data) -> None:
    from composer.train.engine import resolve, setup
    from composer.train.loop import train_loop

    recipe, _ = resolve(None, None, vl_values(data, steps=1, micro_batch_size=2))
    run, last = setup(recipe, None, quiet=True)
    micro = run.batches.local(0, 1, 0, 2)
    assert sum(mb.image_grid_thw is not None for mb in micro) >= 1  # images in the batch
    total = count = 0.0
    blank = 0.0
    with torch.no_grad():
        for mb in micro:
            ids, labels = torch.from_numpy(mb.ids), torch.from_numpy(mb.labels)
            docs = torch.from_numpy(mb.doc_ids)
            n = int(((mb.labels[:, 1:] != -100) & (mb.doc_ids[:, 1:] == mb.doc_ids[:, :-1]))
                    .sum())
            kwargs = {} if mb.pixel_values is None else {
                "pixel_values": mb.pixel_values, "image_grid_thw": mb.image_grid_thw}
            loss = run.model(ids, labels, doc_ids=docs, **kwargs).loss
            total, count = total + float(loss) * n, count + n
            if kwargs:  # the same rows with other pictures: the images reach the loss
                kwargs["pixel_values"] = torch.zeros_like(mb.pixel_values)
                blank += abs(float(run.model(ids, labels, doc_ids=docs, **kwargs).loss) - loss)
    summary = train_loop(run, last, quiet=True)
    run.log.close()
    assert summary.rows[0]["supervised_tokens"] == count
    assert summary.losses[0] == pytest.approx(total / count, rel=1e-5)
    assert blank > 1e-4


@pytest.mark.slow
def test_micro_batches_without_images_do_not_change_the_gradient(data) -> None:
    from tests.train.test_sft import assert_grads_close, step_grads

    ref = step_grads(vl_values(data, micro_batch_size=4))
    got = step_grads(vl_values(data, micro_batch_size=1))
    assert any(k.startswith("visual.") for k in ref) and ref.keys() == got.keys()
    assert_grads_close(got, ref)


def test_freeze_keeps_the_frozen_parts(data) -> None:
    from composer.train.vision import part_of
    from tests.helpers import train_case

    start = train_case(vl_values(data, steps=0))["params"]
    out = train_case(vl_values(data, freeze=["vision"]))["params"]
    moved = {part_of(k) for k, p in out.items() if not torch.equal(p, start[k])}
    assert moved == {"merger", "language"}
    out = train_case(vl_values(data, freeze=["vision", "language"]))["params"]
    assert {part_of(k) for k, p in out.items() if not torch.equal(p, start[k])} == {"merger"}


def test_images_under_tp_are_refused(data) -> None:
    from composer.config import ConfigError
    from composer.train.engine import resolve, setup

    recipe, _ = resolve(None, None, vl_values(data, tp=2))
    with pytest.raises(ConfigError, match=r"training on images under --tp, --pp or --cp is not "):
        setup(recipe, None, quiet=True)
