"""SFT conversations with images (composer.data.chat_images): ``composer data prepare --format
chat`` rows with ``"images"`` store resized pixels whose patches equal ``preprocess_images`` bit
for bit; the tokens are the template's with each pad expanded to its image's count, the mask is 0
on every image block and the text-only mask elsewhere; any --workers writes the same bytes; bad
rows are one line naming file:line, exit 2, nothing written; SFTSamples and Batches give the
images in the row-major order of their blocks, packed, and truncation never splits a block;
open_sft_data refuses a model the images do not fit."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from composer.cli import main
from composer.data.chat import ChatEncoder, parse_row
from composer.data.chat_images import vision_ids
from composer.data.masked import IMAGE_FILES, MaskedDataset
from composer.data.sft import SFTSamples
from composer.data.tokenizer import HFTokenizer
from composer.train.data import Batches
from tests.helpers import write_vl_tokenizer

pytest.importorskip("PIL")
pytest.importorskip("tokenizers")
from composer.vision.preprocess import (  # noqa: E402
    ImageSettings,
    image_patches,
    preprocess_images,
)

CORPUS = ["describe the picture", "a picture of noise", "look here done", "what is this",
          "a cat", "hello there", "user assistant system"]
SIZES = {"a.png": (32, 48), "b.png": (64, 96), "c.png": (40, 40)}  # (H, W); c is grey
PATCH4 = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 64,
          "max_pixels": 4096, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
"""The qwen3.5-vl-debug tower's patch sizes, for the training side."""
IMAGE = {"type": "image"}
ROWS = [
    {"messages": [{"role": "user", "content": [IMAGE, {"type": "text",
                                                       "text": "describe the picture"}]},
                  {"role": "assistant", "content": "a picture of noise"}],
     "images": ["img/a.png"]},
    {"messages": [{"role": "user", "content": "what is this"},
                  {"role": "assistant", "content": "a cat"}],
     "images": ["img/b.png", "img/c.png"]},  # no image part: both go first in the user turn
    {"prompt": "what is this", "completion": "a cat", "images": ["img/c.png"]},
    {"messages": [{"role": "user", "content": "hello there"},
                  {"role": "assistant", "content": "hello"}]},
    {"messages": [{"role": "user", "content": "look"},
                  {"role": "assistant", "content": [{"type": "text", "text": "look here"}, IMAGE,
                                                    {"type": "text", "text": " done"}]}],
     "images": ["img/a.png"]},  # an image inside a supervised turn
]
PATHS = [r.get("images", []) for r in ROWS]


def jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def run(capsys, *args) -> tuple[int, str, str]:
    code = main(["data", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("vl")
    (root / "img").mkdir()
    rng = np.random.default_rng(0)
    for name, (h, w) in SIZES.items():
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        (image.convert("L") if name == "c.png" else image).save(root / "img" / name)
    (root / "img" / "bad.png").write_text("not an image")
    write_vl_tokenizer(root / "tok", CORPUS)
    write_vl_tokenizer(root / "tok4", CORPUS, preprocessor=PATCH4)
    write_vl_tokenizer(root / "plain", CORPUS, specials=["<|im_start|>", "<|im_end|>"])
    jsonl(root / "rows.jsonl", ROWS)
    return root


def prepare(capsys, files: Path, prefix: Path, tok: str = "tok", *flags) -> dict:
    code, out, err = run(capsys, "prepare", files / "rows.jsonl", "--format", "chat",
                         "--tokenizer", files / tok, "--out", prefix, "--json", *flags)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def vl4(files, tmp_path_factory) -> Path:
    """ROWS prepared with the tokenizer whose preprocessor_config.json has patches of 4."""
    prefix = tmp_path_factory.mktemp("vl4") / "vl"
    code = main(["data", "prepare", str(files / "rows.jsonl"), "--format", "chat",
                 "--tokenizer", str(files / "tok4"), "--out", str(prefix)])
    assert code == 0
    return prefix


def without_images(row: dict) -> list[dict]:
    """The row's messages with their image parts left out (the text-only conversation)."""
    messages = parse_row(row)[0]
    return [{**m, "content": [p for p in m["content"] if p["type"] == "text"]}
            if isinstance(m["content"], list) else m for m in messages]


def test_pixels_tokens_and_mask(files, tmp_path, capsys):
    prefix = tmp_path / "out" / "vl"
    stats = prepare(capsys, files, prefix, "tok", "--min-pixels", 1024)
    assert (stats["documents"], stats["images"]["count"]) == (5, 5)
    settings = ImageSettings(min_pixels=1024)  # Qwen3.5's: patch 16, merge 2
    ds = MaskedDataset(prefix)
    assert ds.has_images and ds.image_settings == settings and ds.n_images == 5
    tok = HFTokenizer(files / "tok")
    v = vision_ids(tok)
    grids = [[g for _, g in ds.images(d)] for d in range(5)]
    assert grids == [[(1, 2, 4)], [(1, 4, 6), (1, 2, 2)], [(1, 2, 2)], [], [(1, 2, 4)]]
    for d, paths in enumerate(PATHS):
        if paths:  # the stored pixels, rescaled and patchified, are the processor's values
            pixel_values, thw = preprocess_images([files / p for p in paths], settings)
            got = [image_patches(pixels, ds.image_settings) for pixels, _ in ds.images(d)]
            assert torch.equal(torch.from_numpy(np.concatenate([p for p, _ in got])),
                               pixel_values)
            assert [list(g) for _, g in got] == thw.tolist()

    def block(hw: tuple[int, int, int]) -> list[int]:
        return [v.start, *[v.pad] * (hw[1] * hw[2] // 4), v.end]

    enc = tok.encode
    chat = "<|im_end|>\n<|im_start|>assistant\n"
    expected = [enc("<|im_start|>user\n") + block(grids[0][0])
                + enc(f"describe the picture{chat}a picture of noise<|im_end|>\n"),
                enc("<|im_start|>user\n") + block(grids[1][0]) + block(grids[1][1])
                + enc(f"what is this{chat}a cat<|im_end|>\n"),
                enc("<|im_start|>user\n") + block(grids[2][0])
                + enc(f"what is this{chat}a cat<|im_end|>\n")]
    expected.append(ChatEncoder(tok).encode(*parse_row(ROWS[3]))[0].tolist())
    expected.append(enc(f"<|im_start|>user\nlook{chat}look here") + block(grids[4][0])
                    + enc(" done<|im_end|>\n"))
    for d in range(5):
        ids, mask = (np.asarray(x) for x in ds.document(d))
        assert ids.tolist() == expected[d]
        blocks = ds.image_blocks(d)
        inside = np.zeros(len(ids), dtype=bool)
        for lo, hi in blocks:
            inside[lo:hi] = True
        assert not mask[inside].any()
        text_ids, text_mask = ChatEncoder(tok).encode(without_images(ROWS[d]))
        assert ids[~inside].tolist() == text_ids.tolist()
        assert mask[~inside].tolist() == text_mask.tolist()
    lo, hi = ds.image_blocks(4)[0]
    assert ds.document(4)[1][lo - 1] == 1 == ds.document(4)[1][hi]  # supervised around it
    info = json.loads(run(capsys, "inspect", prefix, "--json")[1])
    assert (info["images"], info["pixels_bytes"]) == (5, 3 * (2 * 32 * 64 + 64 * 96 + 2 * 32 * 32))
    assert json.loads(run(capsys, "inspect", prefix, "--row", 1, "--json")[1])[
        "image_grid_thw"] == [[1, 4, 6], [1, 2, 2]]


@pytest.mark.slow
def test_any_workers_write_the_same_bytes(files, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("composer.data.prepare.CHUNKSIZE", 2)  # chunks over both workers
    for workers in (1, 2):
        prepare(capsys, files, tmp_path / f"w{workers}", "tok", "--min-pixels", 1024,
                "--workers", workers)
    for suffix in (".bin", ".idx", ".mask.bin", ".mask.idx", *IMAGE_FILES, ".chat.json"):
        a, b = (Path(f"{tmp_path}/w{w}{suffix}").read_bytes() for w in (1, 2))
        assert a == b, suffix


TWO_PADS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}"
            "{{ m.content }}{% else %}{% for c in m.content %}{% if c.type == 'image' %}"
            "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>{% else %}{{ c.text }}"
            "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}")
BAD = [  # (row, extra flags, the words of the one-line error)
    ({"messages": ROWS[1]["messages"], "images": ["img/missing.png"]}, [],
     "{files}/img/missing.png: no such image file"),
    ({"messages": ROWS[1]["messages"], "images": ["img/bad.png"]}, [],
     "{files}/img/bad.png: not an image file (Pillow cannot identify it)"),
    ({"messages": [{"role": "user", "content": [IMAGE, IMAGE, {"type": "text", "text": "x"}]},
                   {"role": "assistant", "content": "a cat"}], "images": ["img/a.png"]}, [],
     "2 image part(s) in the messages for 1 image(s) in 'images'"),
    ({**ROWS[0], "images": ["img/a.png", "img/c.png"]}, [],
     "1 image part(s) in the messages for 2 image(s) in 'images'"),
    ({**ROWS[0], "images": "img/a.png"}, [], "'images' is not a list of image paths"),
    (ROWS[0], ["--tokenizer", "plain"], "the tokenizer has no <|vision_start|> and no "
     "<|image_pad|> and no <|vision_end|> token"),
    (ROWS[0], ["--chat-template", "two_pads.jinja"],
     "the chat template wrote 2 image placeholder(s) for 1 image(s)"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_rows_are_one_line_and_write_nothing(files, tmp_path, capsys, case):
    bad, flags, words = BAD[case]
    # a text row, a row with an image (its pixels are being written when the bad row comes),
    # the bad row; under a flag (the tokenizer, the template) the image row is bad already
    src = jsonl(tmp_path / "rows.jsonl", [ROWS[3], ROWS[2], bad])
    (tmp_path / "two_pads.jinja").write_text(TWO_PADS)
    extra = [files / f if f == "plain" else tmp_path / f if f.endswith(".jinja") else f
             for f in flags]
    args = ["prepare", src, "--format", "chat", "--tokenizer", files / "tok", "--image-root",
            files, "--min-pixels", 1024, *extra]
    code, _, err = run(capsys, *args, "--out", tmp_path / "out" / "vl")
    words = words.replace("{files}", str(files))
    line = 2 if flags else 3
    assert code == 2 and f"{src}:{line}: {words}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()  # no dataset, no temporaries
    code, out, err = run(capsys, *args, "--out", tmp_path / "kept", "--skip-bad-rows", "--json")
    stats = json.loads(out)
    skipped = 2 if flags else 1
    assert code == 0 and (stats["documents"], stats["skipped_rows"]) == (3 - skipped, skipped)
    ds = MaskedDataset(tmp_path / "kept")
    assert [ds.grids(d) for d in range(ds.n_documents)] == ([[]] if flags else [[], [(1, 2, 2)]])
    assert all(Path(f"{tmp_path}/kept{s}").exists() != bool(flags) for s in IMAGE_FILES)


def test_force_replaces_a_dataset_with_images(files, tmp_path, capsys):
    prefix = tmp_path / "vl"
    prepare(capsys, files, prefix, "tok", "--min-pixels", 1024)
    text = jsonl(tmp_path / "t.jsonl", [ROWS[3]])
    code, _, err = run(capsys, "prepare", text, "--format", "chat", "--tokenizer", files / "tok",
                       "--out", prefix)
    assert code == 2 and f"{prefix}.bin already exists (--force replaces it)" in err
    code, _, _ = run(capsys, "prepare", text, "--format", "chat", "--tokenizer", files / "tok",
                     "--out", prefix, "--force")
    assert code == 0 and not MaskedDataset(prefix).has_images
    assert not any(Path(f"{prefix}{s}").exists() for s in IMAGE_FILES)


@pytest.mark.slow
def test_text_rows_prepare_without_pillow(files, tmp_path):
    text = jsonl(tmp_path / "t.jsonl", [ROWS[3]])
    script = ("import sys; sys.modules['PIL'] = None\n"  # Pillow is not installed
              "from composer.data.chat_prepare import prepare_chat\n"
              f"print(prepare_chat([{str(text)!r}], {str(tmp_path / 'o')!r}, "
              f"{str(files / 'tok')!r})['documents'])\n"
              f"prepare_chat([{str(files / 'rows.jsonl')!r}], {str(tmp_path / 'i')!r}, "
              f"{str(files / 'tok')!r})\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout == "1\n", proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "composer.settings.DataError: a row with images: composer.vision.preprocess needs "
        "Pillow: pip install 'composer-lm[vision]'")
    assert not any(tmp_path.glob("i.*"))


def expected_images(files: Path, paths: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    return preprocess_images([files / p for p in paths], ImageSettings.from_hf(PATCH4))


def test_samples_and_batches_carry_the_images_in_block_order(files, vl4):
    ds = MaskedDataset(vl4)
    samples = SFTSamples(ds, 128, seed=0)
    rows = [samples.row(r) for r in range(samples.n_rows)]
    docs = [samples.row_docs[samples.row_start[r]:samples.row_start[r + 1]].tolist()
            for r in range(samples.n_rows)]
    assert max(sum(1 for d in row if PATHS[d]) for row in docs) >= 2  # packed with images
    micro = Batches(samples, samples.n_rows, has_images=True).micro_batch(rows, 0)
    paths = [p for row in docs for d in row for p in PATHS[d]]
    pixel_values, thw = expected_images(files, paths)
    assert torch.equal(micro.pixel_values, pixel_values)
    assert torch.equal(micro.image_grid_thw, thw)
    pad = vision_ids(HFTokenizer(files / "tok4")).pad
    per_row = np.cumsum([0] + [sum(1 for d in row for _ in PATHS[d]) for row in docs])
    for r in range(samples.n_rows):
        grid = thw[per_row[r]:per_row[r + 1]]
        assert int((micro.ids[r] == pad).sum()) == int((grid.prod(1) // 4).sum())
    text = SFTSamples(ds, 128, seed=0, documents=range(3, 4))  # the text-only conversation
    micro = Batches(text, 1, has_images=True).micro_batch([text.row(0)], 0)
    assert len(text.row(0)) == 4 and micro.pixel_values is None is micro.image_grid_thw


def test_truncation_moves_the_cut_to_a_block_edge(files, vl4):
    ds = MaskedDataset(vl4)
    ids, mask = (np.asarray(x) for x in ds.document(1))  # images b, c, then the text
    (lo_b, hi_b), (lo_c, hi_c) = ds.image_blocks(1)
    right = SFTSamples(ds, lo_b + 5, seed=0, documents=range(1, 2), truncate_side="right")
    tokens, doc_ids, m, images = right.row(0)
    assert tokens[:lo_b].tolist() == ids[:lo_b].tolist() and images == []
    assert (doc_ids[lo_b:] == 1).all() and right.n_tokens == lo_b  # the rest is padding
    n = len(ids)
    left = SFTSamples(ds, n - lo_b - 3, seed=0, documents=range(1, 2), truncate_side="left")
    tokens, doc_ids, m, images = left.row(0)
    assert left.n_tokens == n - hi_b and tokens[:n - hi_b].tolist() == ids[hi_b:].tolist()
    assert m[:n - hi_b].tolist() == mask[hi_b:].tolist()
    c_values, c_thw = expected_images(files, ["img/c.png"])
    assert len(images) == 1 and torch.equal(images[0][0], c_values)
    assert list(images[0][1]) == c_thw[0].tolist()


def test_prepare_truncation_keeps_whole_blocks(files, vl4, tmp_path, capsys):
    full = MaskedDataset(vl4)
    ids = np.asarray(full.document(1)[0])
    (lo_b, hi_b), _ = full.image_blocks(1)
    stats = prepare(capsys, files, tmp_path / "cut", "tok4", "--seq-len", len(ids) - lo_b - 3,
                    "--truncate", "left")
    ds = MaskedDataset(tmp_path / "cut")
    assert stats["truncated"] >= 1 and ds.document(1)[0].tolist() == ids[hi_b:].tolist()
    assert ds.grids(1) == full.grids(1)[1:] == [(1, 10, 10)]
    assert ds.image_blocks(1) == [(0, 27)]  # <|vision_start|>, 25 pads, <|vision_end|>


def vl_config(files: Path, **vision):
    from composer.zoo import get_preset

    cfg = get_preset("qwen3.5-vl-debug").config()
    return dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, **vision))


def test_open_sft_data_checks_the_tower(files, vl4, tmp_path, capsys):
    from composer.config import ConfigError, ModelConfig
    from composer.train.objectives import open_sft_data
    from composer.train.recipe import Recipe

    v = vision_ids(HFTokenizer(files / "tok4"))
    ids = {"image_token_id": v.pad, "vision_start_token_id": v.start,
           "vision_end_token_id": v.end}
    recipe = Recipe(objective="sft", data=[str(vl4)], seq_len=128, global_batch_size=2)
    train, _, _ = open_sft_data(recipe, vl_config(files, **ids))
    assert train.has_images
    assert sum(len(mb.image_grid_thw) for mb in train.local(0, 1, 0, 1)
               if mb.pixel_values is not None) >= 1
    text = ModelConfig(pattern="*-", d_model=32, vocab_size=300)
    patch16 = tmp_path / "p16"
    prepare(capsys, files, patch16, "tok", "--min-pixels", 1024)
    cases = [(vl4, text, "has 5 images and the model has no vision tower (a text model)"),
             (vl4, vl_config(files), f"has image_token_id {v.pad}, the model's "
              "vision.image_token_id is 508 (prepare the data with the model's tokenizer)"),
             (patch16, vl_config(files, **ids), "'s images have patch_size 16, the model's "
              "vision.patch_size is 4")]
    for prefix, cfg, words in cases:
        with pytest.raises(ConfigError, match="^--objective sft: ") as info:
            open_sft_data(dataclasses.replace(recipe, data=[str(prefix)]), cfg)
        assert words in str(info.value) and "\n" not in str(info.value)
