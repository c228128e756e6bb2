"""The vision-language model: a tiny random Qwen3.5-VL (``Qwen3_5ForConditionalGeneration``,
gated delta net + gated attention with M-RoPE, and the vision tower) against transformers, with
images in the prompt; text-only input unchanged; the placeholder-count error; decoding with
images; ``composer build`` printing the tower.

Weights: the language model goes through the Qwen3.5 text converter (``from_hf`` of the
``model.language_model.*`` tensors saved as a ``Qwen3_5ForCausalLM``), the tower through
``HF_NAMES`` of tests/vision/test_tower.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import composer
from composer.build.builder import build_model, model_stats
from composer.config import ConfigError, VisionConfig
from composer.convert import from_hf
from tests.helpers import randomize, rel_err
from tests.vision.test_tower import ours_of

pytestmark = pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                                reason="flash-linear-attention would run CUDA kernels")

IMG, START, END = 90, 88, 89
V = VisionConfig(depth=2, d_model=32, n_heads=2, d_ff=48, patch_size=4, temporal_patch_size=2,
                 merge_size=2, d_out=40, n_position_embeddings=16, image_token_id=IMG,
                 vision_start_token_id=START, vision_end_token_id=END)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "mrope_section": [3, 3, 2], "mrope_interleaved": True}
TEXT = dict(vocab_size=97, hidden_size=40, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "full_attention"], rope_parameters=ROPE, max_position_embeddings=256)
TOL = 1e-4


def hf_vlm():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(depth=V.depth, hidden_size=V.d_model, num_heads=V.n_heads,
                  intermediate_size=V.d_ff, patch_size=V.patch_size,
                  temporal_patch_size=V.temporal_patch_size, spatial_merge_size=V.merge_size,
                  out_hidden_size=V.d_out, num_position_embeddings=V.n_position_embeddings,
                  hidden_act="gelu_pytorch_tanh")
    config = Qwen3_5Config(text_config=TEXT, vision_config=vision, image_token_id=IMG,
                           vision_start_token_id=START, vision_end_token_id=END,
                           video_token_id=91, tie_word_embeddings=False)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    randomize(model, seed=0)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' VLM, ours with the same weights)."""
    from transformers import Qwen3_5ForCausalLM

    hf = hf_vlm()
    tmp = tmp_path_factory.mktemp("vlm")
    text = Qwen3_5ForCausalLM(hf.config.text_config).eval()
    state = hf.state_dict()
    text.load_state_dict({k.replace("model.language_model.", "model."): t for k, t in state.items()
                          if not k.startswith("model.visual.")}, strict=True)
    text.save_pretrained(tmp / "hf")
    cfg = from_hf(tmp / "hf", tmp / "text")
    lm = composer.load(tmp / "text")
    cfg.attention = dataclasses.replace(cfg.attention, mrope_section=ROPE["mrope_section"],
                                        mrope_interleaved=True)
    cfg.vision = V
    ours = build_model(cfg).eval()
    tower = {"visual." + ours_of(k): t for k, t in state.items() if k.startswith("model.visual.")}
    ours.load_state_dict({**lm.state_dict(), **tower}, strict=True)
    return hf, ours, lm


def prompt(grids, texts, seed=3):
    """Ids: text, then per image <|vision_start|> N x <|image_pad|> <|vision_end|> text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 80, (texts[0],), generator=g).tolist()
    for (t, h, w), n_text in zip(grids, texts[1:], strict=True):
        ids += [START] + [IMG] * (t * h * w // V.merge_size**2) + [END]
        ids += torch.randint(0, 80, (n_text,), generator=g).tolist()
    return torch.tensor([ids])


def pixels(grids, seed=1):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, V.d_patch, generator=torch.Generator().manual_seed(seed))


ONE = [[1, 4, 6]]
TWO = [[1, 4, 6], [1, 6, 2]]


def hf_logits(hf, ids, pv, thw):
    """transformers' logits; ``mm_token_type_ids`` as its processor makes them (1: image)."""
    types = (ids == IMG).int()
    return hf(input_ids=ids, pixel_values=pv, image_grid_thw=thw, mm_token_type_ids=types).logits


@pytest.mark.parametrize("grids,texts", [(ONE, [3, 5]), (TWO, [2, 3, 4])],
                         ids=["one_image", "two_images"])
def test_logits_equal_transformers_with_images(pair, grids, texts):
    hf, ours, _ = pair
    ids, pv, thw = prompt(grids, texts), pixels(grids), torch.tensor(grids)
    with torch.no_grad():
        theirs = hf_logits(hf, ids, pv, thw)
        got = ours(ids, pixel_values=pv, image_grid_thw=thw)
    err = rel_err(got, theirs)
    assert err < TOL, err
    # the image matters: the same ids with other pixels give other logits
    with torch.no_grad():
        other = ours(ids, pixel_values=pixels(grids, seed=9), image_grid_thw=thw)
    assert rel_err(other, got) > 1e-3


def test_text_only_is_the_text_model(pair):
    hf, ours, lm = pair
    ids = torch.randint(0, 80, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = ours(ids)
        assert torch.equal(got, lm(ids))  # 1-D RoPE, bit for bit
        assert rel_err(got, hf(input_ids=ids).logits) < TOL


def test_placeholder_count_mismatch_is_one_line(pair):
    _, ours, _ = pair
    ids = prompt(ONE, [3, 5])
    ids = torch.cat([ids[:, :5], ids[:, 6:]], 1)  # one <|image_pad|> fewer
    with pytest.raises(ValueError) as err:
        ours(ids, pixel_values=pixels(ONE), image_grid_thw=torch.tensor(ONE))
    assert "\n" not in str(err.value) and "<|image_pad|>" in str(err.value)
    with pytest.raises(ValueError, match="text-only model"):
        pair[2](ids, pixel_values=pixels(ONE), image_grid_thw=torch.tensor(ONE))


def test_decoding_with_images_equals_full_forwards(pair):
    """Prefill of image + text, then steps: each step's logits equal a full forward of the
    sequence so far (the decode-time M-RoPE offset), and those equal transformers'."""
    hf, ours, _ = pair
    ids, pv, thw = prompt(TWO, [2, 3, 4]), pixels(TWO), torch.tensor(TWO)
    cache = ours.new_cache(1, ids.shape[1] + 4)
    with torch.no_grad():
        logits = ours.forward_cached(ids, cache, pixel_values=pv, image_grid_thw=thw)
        seq = ids
        for _ in range(3):
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            logits = ours.forward_cached(nxt, cache)
            full = ours(seq, pixel_values=pv, image_grid_thw=thw)[:, -1]
            assert rel_err(logits, full) < TOL
        theirs = hf_logits(hf, seq, pv, thw)[:, -1]
        assert rel_err(logits, theirs) < TOL


def padded_batch():
    """Batch 2, left-padded: row 0 one image, row 1 two; (ids, mask, pixel_values, grids)."""
    rows = [(ONE, [3, 5]), (TWO, [2, 3, 4])]
    prompts = [prompt(g, t, seed=5 + i)[0] for i, (g, t) in enumerate(rows)]
    n = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(n - len(p), dtype=torch.long), p])
                       for p in prompts])
    mask = torch.stack([torch.arange(n) >= n - len(p) for p in prompts]).long()
    pv = torch.cat([pixels(ONE, seed=11), pixels(TWO, seed=12)])
    return ids, mask, pv, torch.tensor(ONE + TWO)


def test_left_padded_batch_prefill_and_steps(pair):
    """Batch 2, left-padded (row 0 one image, row 1 two images): each row's logits equal its
    own prompt alone, at prefill and after decoding steps."""
    _, ours, _ = pair
    ids, mask, pv, thw = padded_batch()
    cache = ours.new_cache(2, ids.shape[1] + 3)
    steps = torch.tensor([[7], [8]])
    with torch.no_grad():
        batched = [ours.forward_cached(ids, cache, attention_mask=mask, pixel_values=pv,
                                       image_grid_thw=thw)]
        batched += [ours.forward_cached(steps + k, cache) for k in range(2)]
        n_pix = [sum(t * h * w for t, h, w in g) for g in (ONE, TWO)]
        for r, (grids, lo) in enumerate([(ONE, 0), (TWO, n_pix[0])]):
            real = ids[r, mask[r].bool()][None]
            one = ours.new_cache(1, real.shape[1] + 3)
            alone = [ours.forward_cached(real, one, pixel_values=pv[lo:lo + n_pix[r]],
                                         image_grid_thw=torch.tensor(grids))]
            alone += [ours.forward_cached(steps[r:r + 1] + k, one) for k in range(2)]
            for b, a in zip(batched, alone, strict=True):
                assert rel_err(b[r:r + 1], a) < TOL


def greedy(model, ids, mask, pv, thw, n_new):
    cache = model.new_cache(ids.shape[0], ids.shape[1] + n_new)
    logits = model.forward_cached(ids, cache, attention_mask=mask, pixel_values=pv,
                                  image_grid_thw=thw)
    out = []
    for _ in range(n_new):
        out.append(logits.argmax(-1, keepdim=True))
        logits = model.forward_cached(out[-1], cache)
    return torch.cat(out, 1)


@pytest.mark.parametrize("batch", [1, 2], ids=["batch1", "batch2_left_padded"])
def test_prefill_and_greedy_tokens_equal_transformers(pair, batch):
    """The prefill's logits on real slots, and greedy tokens against ``transformers.generate``
    (left padding: each row's M-RoPE offset after its own prompt)."""
    hf, ours, _ = pair
    if batch == 1:
        ids, pv, thw = prompt(TWO, [2, 3, 4]), pixels(TWO), torch.tensor(TWO)
        mask = torch.ones_like(ids)
    else:
        ids, mask, pv, thw = padded_batch()
    types = (ids == IMG).int()
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask, pixel_values=pv, image_grid_thw=thw,
                    mm_token_type_ids=types).logits
        got = ours.forward_cached(ids, ours.new_cache(*ids.shape), attention_mask=mask,
                                  pixel_values=pv, image_grid_thw=thw, last_only=False)
        real = mask.bool()
        assert rel_err(got[real], theirs[real]) < TOL
        want = hf.generate(input_ids=ids, attention_mask=mask, pixel_values=pv,
                           image_grid_thw=thw, mm_token_type_ids=types, max_new_tokens=5,
                           do_sample=False)[:, ids.shape[1]:]
        assert torch.equal(greedy(ours, ids, mask, pv, thw, 5), want)
        out = composer.generate(ours, ids, 5, attention_mask=mask, pixel_values=pv,
                                image_grid_thw=thw)
        assert torch.equal(out[:, ids.shape[1]:], want)


def test_config_validation():
    bad = dataclasses.replace(V, d_out=32)
    cfg = composer.ModelConfig(pattern="*-", d_model=40, vocab_size=97, vision=bad)
    with pytest.raises(ConfigError, match="vision.d_out"):
        cfg.validate()
    cfg.vision = dataclasses.replace(V, image_token_id=None)
    with pytest.raises(ConfigError, match="vision.image_token_id must be given"):
        cfg.validate()
    cfg.vision = V
    cfg.attention = dataclasses.replace(cfg.attention, mrope_section=[3, 3, 3])
    with pytest.raises(ConfigError, match="attention.mrope_section"):
        cfg.validate()
    cfg.attention = dataclasses.replace(cfg.attention, mrope_section=[2, 2, 1],
                                        rotary_fraction=1.0)
    cfg.validate()
    again = composer.ModelConfig.from_dict(cfg.to_dict())
    assert again.vision == V and again.attention.mrope_section == [2, 2, 1]


def test_build_counts_and_prints_the_tower(pair, tmp_path, capsys):
    from composer.cli import main

    _, ours, lm = pair
    stats = model_stats(build_model(ours.config, device="meta"))
    n_tower = sum(p.numel() for p in ours.visual.parameters())
    assert stats.params_by_kind["vision tower"] == stats.vision["n_params"] == n_tower
    assert stats.n_params == sum(p.numel() for p in lm.parameters()) + n_tower
    assert stats.vision["forward_flops_per_image"] > 0
    sets = ["d_model=64", "vocab_size=97", "vision.depth=2", "vision.d_out=64",
            "vision.image_token_id=90", "vision.vision_start_token_id=88"]
    argv = ["build", "--pattern", "*-"] + [a for s in sets for a in ("--set", s)]
    assert main([*argv, "--out", str(tmp_path / "built")]) == 0
    out = capsys.readouterr().out
    assert "vision tower" in out and "B bidirectional attention" in out
    assert "FLOPs/image" in out
    built = composer.load(tmp_path / "built")  # the tower initialised, saved and loaded
    assert built.config.vision.depth == 2
    w = built.visual.layers[0].mixer.o_proj.weight
    assert 0.01 < float(w.detach().std()) < 0.03 and not bool(built.visual.merger.norm.bias.any())
    again = build_model(built.config, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                 built.state_dict().values(), strict=True))
