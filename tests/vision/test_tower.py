"""The vision tower against transformers' Qwen3.5-VL (``get_image_features``), its fp64 twin, and
its backward.

``HF_NAMES`` is the key map the converter will use: transformers' ``model.visual.*`` names to the
tower's canonical keys (composer/vision/tower.py), one tensor each, copied unchanged.
"""

from __future__ import annotations

import re

import pytest
import torch

from composer.config import ConfigError
from composer.vision.tower import VisionConfig, VisionTower, tower_flops, validate_vision
from composer.vision.tower_ref import vision_tower_ref
from tests.helpers import randomize, rel_err

V = VisionConfig(depth=2, d_model=32, n_heads=2, d_ff=48, patch_size=4, temporal_patch_size=2,
                 merge_size=2, d_out=40, n_position_embeddings=16)
ONE = [[1, 4, 6]]
TWO = [[1, 4, 6], [1, 6, 2]]  # different sizes and aspect ratios

HF_NAMES = [
    (r"model\.visual\.patch_embed\.proj\.(weight|bias)", r"patch_embed.\1"),
    (r"model\.visual\.pos_embed\.weight", r"pos_embed.weight"),
    (r"model\.visual\.blocks\.(\d+)\.norm1\.(weight|bias)", r"layers.{2i}.norm.\2"),
    (r"model\.visual\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)", r"layers.{2i}.mixer.qkv_proj.\2"),
    (r"model\.visual\.blocks\.(\d+)\.attn\.proj\.(weight|bias)", r"layers.{2i}.mixer.o_proj.\2"),
    (r"model\.visual\.blocks\.(\d+)\.norm2\.(weight|bias)", r"layers.{2i+1}.norm.\2"),
    (r"model\.visual\.blocks\.(\d+)\.mlp\.linear_fc1\.(weight|bias)",
     r"layers.{2i+1}.mixer.up_proj.\2"),
    (r"model\.visual\.blocks\.(\d+)\.mlp\.linear_fc2\.(weight|bias)",
     r"layers.{2i+1}.mixer.down_proj.\2"),
    (r"model\.visual\.merger\.norm\.(weight|bias)", r"merger.norm.\1"),
    (r"model\.visual\.merger\.linear_fc1\.(weight|bias)", r"merger.mlp.up_proj.\1"),
    (r"model\.visual\.merger\.linear_fc2\.(weight|bias)", r"merger.mlp.down_proj.\1"),
]
"""HF key (regex) -> ours; ``{2i}`` / ``{2i+1}``: HF block ``i`` is our attention layer ``2i``
and MLP layer ``2i + 1`` (the tower's pattern ``B-B-...``)."""


def ours_of(hf_key: str) -> str:
    for pattern, target in HF_NAMES:
        match = re.fullmatch(pattern, hf_key)
        if match:
            if "{" in target:  # a block's tensor: its index picks our layer
                i = int(match.group(1))
                target = target.replace("{2i}", str(2 * i)).replace("{2i+1}", str(2 * i + 1))
            return match.expand(target)
    raise KeyError(hf_key)


def hf_vlm():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(vocab_size=97, hidden_size=40, intermediate_size=48, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                layer_types=["full_attention"])
    vision = dict(depth=V.depth, hidden_size=V.d_model, num_heads=V.n_heads,
                  intermediate_size=V.d_ff, patch_size=V.patch_size,
                  temporal_patch_size=V.temporal_patch_size, spatial_merge_size=V.merge_size,
                  out_hidden_size=V.d_out, num_position_embeddings=V.n_position_embeddings,
                  hidden_act="gelu_pytorch_tanh")
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    model.eval()
    randomize(model.model.visual, seed=0)
    return model


@pytest.fixture(scope="module")
def pair():
    """(transformers' model, our tower with its weights copied through HF_NAMES)."""
    hf = hf_vlm()
    visual = {k: t for k, t in hf.state_dict().items() if k.startswith("model.visual.")}
    ours = {ours_of(k): t for k, t in visual.items()}
    tower = VisionTower(V).eval()
    tower.load_state_dict(ours, strict=True)  # every key of ours named, every HF tensor used
    assert len(ours) == len(visual) == len(tower.state_dict())
    return hf, tower


def pixels(grid: list[list[int]], seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grid)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V.d_patch, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("grid", [ONE, TWO], ids=["one_image", "two_images"])
def test_matches_transformers_get_image_features(pair, grid):
    hf, tower = pair
    x, thw = pixels(grid), torch.tensor(grid)
    with torch.no_grad():
        theirs = torch.cat(hf.get_image_features(x, image_grid_thw=thw).pooler_output)
        ours = tower(x, thw)
    assert ours.shape == (sum(t * h * w for t, h, w in grid) // 4, V.d_out)
    assert rel_err(ours, theirs) < 1e-5


def test_images_do_not_see_each_other(pair):
    """The second image's features alone equal its features in the batch of two (fp64)."""
    _, tower = pair
    tower64 = VisionTower(V).double().eval()
    tower64.load_state_dict(tower.state_dict())
    x = pixels(TWO, dtype=torch.float64)
    with torch.no_grad():
        both = tower64(x, torch.tensor(TWO))
        second = tower64(x[24:], torch.tensor(TWO[1:]))
    assert both.shape[0] == 6 + 3
    assert rel_err(both[6:], second) < 1e-12


def test_reference_twin_fp64_values_and_gradients(pair):
    _, tower = pair
    tower64 = VisionTower(V).double()
    tower64.load_state_dict(tower.state_dict())
    x, thw = pixels(TWO, dtype=torch.float64).requires_grad_(), torch.tensor(TWO)
    ours = tower64(x, thw)
    params = dict(tower64.named_parameters())
    weights = {k: t.detach().clone().requires_grad_() for k, t in tower64.state_dict().items()}
    ref = vision_tower_ref(x, thw, weights, V)
    assert rel_err(ours, ref) < 1e-10
    probe = torch.randn(ours.shape, generator=torch.Generator().manual_seed(3), dtype=ours.dtype)
    (ours * probe).sum().backward()
    ours_grads = {k: p.grad for k, p in params.items()}
    x_grad, x.grad = x.grad, None
    (ref * probe).sum().backward()
    assert rel_err(x_grad, x.grad) < 1e-10
    # fused qkv_proj parts (weight_q, ...) against the fused key's gradient
    fused = {k: torch.cat([ours_grads[f"{k[:-len('weight')]}weight_{p}"] for p in "qkv"])
             for k in weights if k.endswith("qkv_proj.weight")}
    fused |= {k: torch.cat([ours_grads[f"{k[:-len('bias')]}bias_{p}"] for p in "qkv"])
              for k in weights if k.endswith("qkv_proj.bias")}
    worst = max(rel_err(fused.get(k, ours_grads.get(k)), w.grad) for k, w in weights.items())
    assert worst < 1e-10
    assert all(w.grad.abs().max() > 0 for w in weights.values())


def test_flops_equal_torch_count(pair):
    """``tower_flops`` against torch's own count of the forward's matmuls and attention."""
    from torch.utils.flop_counter import FlopCounterMode

    _, tower = pair
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        tower(pixels(TWO), torch.tensor(TWO))
    assert tower_flops(V, [tuple(g) for g in TWO]) == counter.get_total_flops()


def test_bad_input_is_one_line(pair):
    _, tower = pair
    with pytest.raises(ValueError, match=r"^grid_thw describes 24 patches but pixel_values "
                                         r"has 36 rows$"):
        tower(pixels(TWO), torch.tensor(ONE))
    with pytest.raises(ValueError, match=r"^image 0: grid \(t, h, w\) = \(1, 3, 4\) must be "
                                         r"positive with h and w divisible by the merge size 2$"):
        tower(pixels([[1, 3, 4]]), torch.tensor([[1, 3, 4]]))
    with pytest.raises(ConfigError, match=r"^vision.n_position_embeddings \(15\) must be a "
                                          r"square"):
        validate_vision(VisionConfig(n_position_embeddings=15))


def test_plans_name_real_weights(pair):
    """Every declared plan names the tower's own linears and parameters (applied later by
    composer/parallel): column, row and per-part row splits."""
    import fnmatch

    from composer.blocks.protocol import plan_of

    _, tower = pair
    declared = {}
    for path, module in tower.named_modules():
        plan = plan_of(module)
        if plan is None:
            continue
        names = [n for n, _ in module.named_parameters()]
        for sub in plan.colwise + plan.rowwise:
            assert isinstance(module.get_submodule(sub), torch.nn.Linear), (path, sub)
        for glob in plan.shard:
            assert fnmatch.filter(names, glob), (path, glob)
        declared[path] = (plan.colwise, plan.rowwise, tuple(plan.shard))
    attn, mlp = ((), ("o_proj",), ("qkv_proj.*",)), (("up_proj",), ("down_proj",), ())
    assert declared == {"layers.0.mixer": attn, "layers.1.mixer": mlp, "layers.2.mixer": attn,
                        "layers.3.mixer": mlp, "merger.mlp": mlp}
