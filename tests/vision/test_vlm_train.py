"""The vision-language model in training: packed documents with images (each document's M-RoPE
positions count from 0, so a packed row equals its documents alone), activation checkpointing
recomputing with the images' positions, the tower's stand-in for a batch without images, and
``--freeze``. fp64 where a claim is exactness: the two sides differ only by summation order."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import composer
from composer.config import ConfigError
from composer.parallel.parallelize import apply_ac
from composer.train.vision import check_freeze, freeze, part_of
from composer.zoo import get_preset
from tests.helpers import randomize

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                                reason="flash-linear-attention would run CUDA kernels")


@pytest.fixture(scope="module")
def cfg():
    return get_preset("qwen3.5-vl-debug").config()


def fresh(cfg, dtype=torch.float64):
    model = composer.build_model(cfg, seed=0).to(dtype)
    randomize(model, seed=1, std=0.1)
    return model


def image(cfg, h: int, w: int, seed: int, dtype=torch.float64):
    """Random pixel values of an ``h x w``-patch image and its grid row."""
    v = cfg.vision
    g = torch.Generator().manual_seed(seed)
    return torch.randn(h * w, v.d_patch, generator=g, dtype=dtype), torch.tensor([[1, h, w]])


def block(cfg, grid) -> list[int]:
    v = cfg.vision
    n = int(grid[0, 0] * grid[0, 1] * grid[0, 2]) // v.merge_size ** 2
    return [v.vision_start_token_id, *[v.image_token_id] * n, v.vision_end_token_id]


def documents(cfg):
    """Three documents (ids, images): text + image + text, text only, image + text."""
    a, b = image(cfg, 4, 6, 0), image(cfg, 2, 2, 1)
    return [([3, 4, *block(cfg, a[1]), 7, 8, 9], [a]), ([10, 11, 12, 13, 14], []),
            ([*block(cfg, b[1]), 15, 16], [b])]


def packed(docs):
    ids = [i for d, _ in docs for i in d]
    doc_ids = [k for k, (d, _) in enumerate(docs) for _ in d]
    imgs = [im for _, ims in docs for im in ims]
    return (torch.tensor([ids]), torch.tensor([doc_ids]), torch.cat([p for p, _ in imgs]),
            torch.cat([g for _, g in imgs]))


def test_packed_documents_with_images_equal_each_alone(cfg):
    model = fresh(cfg).eval()
    docs = documents(cfg)
    ids, doc_ids, pixels, grid = packed(docs)
    with torch.no_grad():
        whole = model(ids, doc_ids=doc_ids, pixel_values=pixels, image_grid_thw=grid)
        alone = []
        for d, ims in docs:
            kwargs = {} if not ims else {"pixel_values": torch.cat([p for p, _ in ims]),
                                         "image_grid_thw": torch.cat([g for _, g in ims])}
            alone.append(model(torch.tensor([d]), **kwargs))
    ref = torch.cat(alone, dim=1)
    assert whole.shape == ref.shape
    assert torch.allclose(whole, ref, rtol=0, atol=1e-10), (whole - ref).abs().max()
    # the positions matter: the same row as one document differs (a check that can fail)
    with torch.no_grad():
        one = model(ids, doc_ids=torch.zeros_like(doc_ids), pixel_values=pixels,
                    image_grid_thw=grid)
    assert (one[0, len(docs[0][0]):] - ref[0, len(docs[0][0]):]).abs().max() > 1e-3


def test_an_image_block_across_a_document_boundary_is_one_line(cfg):
    model = fresh(cfg).eval()
    docs = documents(cfg)
    ids, doc_ids, pixels, grid = packed(docs)
    cut = doc_ids.clone()
    cut[0, 4:] += 1  # the first image's pads split over two documents
    with pytest.raises(ValueError, match=r"image 0: \d+ <\|image_pad\|> tokens") as err:
        model(ids, doc_ids=cut, pixel_values=pixels, image_grid_thw=grid)
    assert "\n" not in str(err.value)


def grads(model, ids, labels, **kwargs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(ids, labels, **kwargs).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_recomputes_with_the_images_positions(cfg):
    docs = documents(cfg)
    ids, doc_ids, pixels, grid = packed(docs)
    kwargs = {"doc_ids": doc_ids, "pixel_values": pixels, "image_grid_thw": grid}
    plain = grads(fresh(cfg), ids, ids, **kwargs)
    model = fresh(cfg)
    apply_ac(model, "full")
    recomputed = grads(model, ids, ids, **kwargs)
    assert plain.keys() == recomputed.keys() and any(k.startswith("visual.") for k in plain)
    for name, g in plain.items():
        assert torch.allclose(recomputed[name], g, rtol=0, atol=1e-12), name


def test_the_tower_stand_in_gives_zero_gradients_and_the_same_loss(cfg):
    model = fresh(cfg)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    base = model(ids, ids).loss.detach()
    model.zero_grad(set_to_none=True)
    out = model(ids, ids, tower_stand_in=True)
    out.loss.backward()
    assert torch.equal(out.loss.detach(), base)
    tower = {n: p.grad for n, p in model.named_parameters() if n.startswith("visual.")}
    assert tower and all(g is not None and not g.any() for g in tower.values())
    assert model.embed.weight.grad.abs().sum() > 0


def test_freeze_parts(cfg):
    model = composer.build_model(cfg, device="meta")
    freeze(model, ["vision", "language"])
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trains and all(n.startswith("visual.merger.") for n in trains)
    assert part_of("visual.blocks.0.attn.qkv.weight") == "vision"
    assert part_of("visual.merger.norm.weight") == "merger"
    assert part_of("layers.0.mixer.in_proj.weight") == "language"
    text = composer.ModelConfig(pattern="*-", d_model=32, vocab_size=64)
    cases = [(["eyes"], cfg, False, "--freeze 'eyes': expected some of vision, merger, language"),
             (["vision"], text, False, "the model has no vision tower"),
             (["language"], text, False, "nothing would train"),
             (["vision", "merger", "language"], cfg, False, "nothing would train"),
             (["vision"], cfg, True, "LoRA trains only its adapters")]
    for parts, c, lora, words in cases:
        with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
            check_freeze(parts, c, lora)


def test_the_tower_is_on_the_first_pipeline_stage(cfg):
    from composer.build.stages import split_stages, stage_layers
    from composer.parallel.pipeline import prune

    model = composer.build_model(cfg, device="meta")
    stages = split_stages(cfg, 2)
    assert sum(st.n_params for st in stages) == sum(p.numel() for p in model.parameters())
    groups = stage_layers(cfg, 2)
    held = []
    for rank in (0, 1):
        part = composer.build_model(cfg, device="meta")
        prune(part, groups, [rank])
        held.append(part.visual is not None)
        assert sum(p.numel() for p in part.parameters()) == stages[rank].n_params
    assert held == [True, False]
