"""Qwen3.5-VL (Qwen3_5ForConditionalGeneration) and its MoE variant: HF -> composer -> HF.

The language model converts through the text adapters; the tower's ``model.visual.*`` tensors
are linked to our model's ``visual.*``. Proven here: logits
equal transformers' on text and on a prompt with an image, bit-exact round trips in fp32 and
bf16, transformers' reload of the export giving the same logits as its reload of the source with
an image, the tower key map (:func:`vision_links`) giving a VisionTower transformers'
``get_image_features``, one-line errors leaving nothing written for stray, missing and
mis-shaped tower tensors, every VL preset's count equal to transformers' VL class on the meta
device, and a fresh export of a model built here loading in transformers with equal logits.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import composer
from composer.convert import from_hf, to_hf
from composer.convert.infer import adapter_for_architecture
from composer.convert.qwen3_5_vl import vision_from_hf, vision_links
from composer.portable import CheckpointError
from composer.vision.tower import VisionTower
from tests.helpers import FP32_PARITY, assert_same_tensors, randomize, rel_err

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("fla") is not None,
    reason="flash-linear-attention is installed: transformers would run its CUDA kernels")

TEXT = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
            max_position_embeddings=256,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                 partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
                                 mrope_interleaved=True))
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24)
VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=32,
              num_position_embeddings=16, hidden_act="gelu_pytorch_tanh")
IDS = dict(image_token_id=90, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)
GRID = [[1, 4, 6]]  # one image: 24 patches, 6 merged tokens


def vl_model(moe: bool, seed: int):
    import transformers as tf

    if moe:
        text = {k: v for k, v in TEXT.items() if k != "intermediate_size"} | MOE
        cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=VISION, **IDS)
        model = tf.Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        cfg = tf.Qwen3_5Config(text_config=TEXT, vision_config=VISION, **IDS)
        model = tf.Qwen3_5ForConditionalGeneration(cfg)
    randomize(model.eval(), seed=seed)
    return model


def load_vl(folder, moe: bool):
    """transformers' VL class from ``folder``, every tensor in fresh memory (see
    tests/helpers.load_hf: equal weights then give equal bits)."""
    import transformers as tf

    cls = tf.Qwen3_5MoeForConditionalGeneration if moe else tf.Qwen3_5ForConditionalGeneration
    model = cls.from_pretrained(folder).eval()
    with torch.no_grad():
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    module._parameters[name] = torch.nn.Parameter(p.detach().clone(),
                                                                  p.requires_grad)
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.clone()
    return model


def image_prompt(dtype=torch.float32):
    """A batch of one: text, <vision_start>, 6 image pads, <vision_end>, text; its pixels."""
    g = torch.Generator().manual_seed(3)
    text = torch.randint(0, 89, (9,), generator=g)
    ids = torch.cat([text[:4], torch.tensor([92] + [90] * 6 + [93]), text[4:]])[None]
    n = sum(t * h * w for t, h, w in GRID)
    pixels = torch.randn(n, 3 * 2 * 4 * 4, generator=g).to(dtype)
    return ids, pixels, torch.tensor(GRID)


def vision_state(folder):
    return {k: v for k, v in load_file(folder / "model.safetensors").items()
            if k.startswith("model.visual.")}


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def converted(request, tmp_path_factory):
    """(moe, tmp folder, the HF model): fp32 source ``hf``, ours ``ours``, export ``back``."""
    moe, tmp = request.param, tmp_path_factory.mktemp("vl")
    model = vl_model(moe, seed=70 + moe)
    model.save_pretrained(tmp / "hf")
    from_hf(tmp / "hf", tmp / "ours")
    to_hf(tmp / "ours", tmp / "back")
    return moe, tmp, model


def test_language_model_logits(converted):
    moe, tmp, model = converted
    ours = composer.load(tmp / "ours")
    ids = torch.randint(0, 89, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = ours(ids)
    assert rel_err(got, expected) < FP32_PARITY


def test_logits_with_an_image(converted):
    """Our converted model's logits on a prompt with an image equal transformers' (fp32
    parity), every tower tensor linked."""
    moe, tmp, model = converted
    ours = composer.load(tmp / "ours")
    assert any(k.startswith("visual.") for k in ours.state_dict())
    assert not (tmp / "ours" / "hf" / "aside").exists()  # every tower tensor linked
    ids, pixels, grid = image_prompt()
    with torch.no_grad():
        expected = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                         mm_token_type_ids=(ids == IDS["image_token_id"]).int()).logits
        got = ours(ids, pixel_values=pixels, image_grid_thw=grid)
    assert rel_err(got, expected) < FP32_PARITY, rel_err(got, expected)


def test_round_trip_fp32_is_bit_exact_and_reloads_with_equal_logits(converted):
    moe, tmp, _ = converted
    assert_same_tensors(tmp / "hf", tmp / "back")
    src_cfg = json.loads((tmp / "hf" / "config.json").read_text())
    back_cfg = json.loads((tmp / "back" / "config.json").read_text())
    for key in ("architectures", "model_type", "vision_config", *IDS):
        assert back_cfg[key] == src_cfg[key], key
    assert back_cfg["text_config"]["rope_parameters"]["mrope_section"] == [1, 1, 0]
    ids, pixels, grid = image_prompt()
    inputs = dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                  mm_token_type_ids=(ids == IDS["image_token_id"]).int())  # as the processor's
    with torch.no_grad():
        a = load_vl(tmp / "hf", moe)(**inputs).logits
        b = load_vl(tmp / "back", moe)(**inputs).logits
        text_only = load_vl(tmp / "hf", moe)(input_ids=ids).logits
    assert torch.equal(a, b)
    assert not torch.allclose(a, text_only)  # the image reached the logits


def test_round_trip_bf16_is_bit_exact(converted, tmp_path):
    moe, tmp, _ = converted  # a copy: the module's model keeps its fp32 weights
    load_vl(tmp / "hf", moe).to(torch.bfloat16).save_pretrained(tmp_path / "hf16")
    from_hf(tmp_path / "hf16", tmp_path / "ours16")
    to_hf(tmp_path / "ours16", tmp_path / "back16")
    assert_same_tensors(tmp_path / "hf16", tmp_path / "back16")


def test_tower_key_map_gives_transformers_image_features(converted):
    """The links of :func:`vision_links`, applied to the checkpoint's ``model.visual.*``,
    load our VisionTower strictly; its features equal ``get_image_features`` (fp32)."""
    moe, tmp, model = converted
    hf_cfg = json.loads((tmp / "hf" / "config.json").read_text())
    v = vision_from_hf(hf_cfg["vision_config"])
    state = vision_state(tmp / "hf")
    links = vision_links(v)
    assert sorted(link.hf for link in links) == sorted(state)
    tower = VisionTower(v).eval()
    tower.load_state_dict({link.ours.removeprefix("visual."): state[link.hf] for link in links},
                          strict=True)
    _, pixels, grid = image_prompt()
    with torch.no_grad():
        theirs = torch.cat(model.get_image_features(pixels, image_grid_thw=grid).pooler_output)
        ours = tower(pixels, grid)
    assert rel_err(ours, theirs) < 1e-5


def test_text_only_class_still_uses_the_text_adapter():
    assert adapter_for_architecture("Qwen3_5ForCausalLM").family == "qwen3.5"
    assert adapter_for_architecture("Qwen3_5ForConditionalGeneration").family == "qwen3.5-vl"
    assert adapter_for_architecture("Qwen3_5MoeForConditionalGeneration").family == \
        "qwen3.5-moe-vl"


def _broken(src, dst, edit):
    dst.mkdir()
    for p in src.iterdir():
        if p.name != "model.safetensors":
            (dst / p.name).write_bytes(p.read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def _drop(t):
    del t["model.visual.blocks.1.mlp.linear_fc2.bias"]


def _stray(t):
    t["model.visual.blocks.2.norm1.weight"] = torch.ones(32)


def _reshape(t):
    t["model.visual.pos_embed.weight"] = torch.zeros(25, 32)


@pytest.mark.parametrize("edit, words", [
    (_drop, "tensor 'model.visual.blocks.1.mlp.linear_fc2.bias' is missing"),
    (_stray, "unexpected tensor 'model.visual.blocks.2.norm1.weight'"),
    (_reshape, "'model.visual.pos_embed.weight'"),
], ids=["missing", "stray", "misshaped"])
def test_bad_tower_tensors_are_one_line_errors_leaving_nothing(converted, tmp_path, edit, words):
    _, tmp, _ = converted
    _broken(tmp / "hf", tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as exc:
        from_hf(tmp_path / "bad", tmp_path / "out")
    assert words in str(exc.value) and "\n" not in str(exc.value)
    if edit is _reshape:
        assert "[25, 32]" in str(exc.value) and "[16, 32]" in str(exc.value)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]


# ---------------------------------------------------------------- presets: counts and configs

_VISION_PUBLISHED = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304,
                         hidden_act="gelu_pytorch_tanh", patch_size=16, temporal_patch_size=2,
                         spatial_merge_size=2, num_position_embeddings=2304)
"""vision_config of Qwen/Qwen3.5-27B and -35B-A3B as transformers 5.24 documents them (its
Qwen3_5VisionConfig / Qwen3_5MoeVisionConfig defaults), written out independently of the zoo."""


def _published(name: str) -> tuple[str, dict]:
    from tests.zoo.test_presets import PUBLISHED

    text_name, width = {"qwen3.5-27b-vl": ("qwen3.5-27b", 5120),
                        "qwen3.5-35b-a3b-vl": ("qwen3.5-35b-a3b", 2048)}[name]
    cls, text = PUBLISHED[text_name]
    moe = cls.__name__.startswith("Qwen3_5Moe")
    return ("Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration",
            dict(text_config=text, vision_config=dict(_VISION_PUBLISHED, out_hidden_size=width),
                 image_token_id=248056, vision_start_token_id=248053,
                 vision_end_token_id=248054))


def _hf_count(arch: str, kwargs: dict) -> int:
    import transformers as tf

    config_cls = tf.Qwen3_5MoeConfig if "Moe" in arch else tf.Qwen3_5Config
    with torch.device("meta"):
        model = getattr(tf, arch)(config_cls(**kwargs))
    return sum(p.numel() for p in model.parameters())


def _our_count(cfg) -> int:
    """The model's parameters, the tower's included."""
    model = composer.build_model(cfg, device="meta")
    assert any(k.startswith("visual.") for k in model.state_dict())
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["qwen3.5-27b-vl", "qwen3.5-35b-a3b-vl"])
def test_published_vl_preset_count_equals_transformers(name):
    from composer.zoo.qwen3_next import VL_PRESETS

    cfg = {p.name: p for p in VL_PRESETS}[name].config().validate()
    arch, kwargs = _published(name)
    assert _our_count(cfg) == _hf_count(arch, kwargs)


@pytest.mark.parametrize("name", ["qwen3.5-vl-debug", "qwen3.5-moe-vl-debug",
                                  "qwen3.5-27b-vl", "qwen3.5-35b-a3b-vl"])
def test_vl_preset_config_round_trips_and_counts(name):
    """Each VL preset as a fresh config.json (no source to keep fields from): transformers'
    class of it has our count, and reading it back gives the preset again."""
    from composer.config import config_diff
    from composer.zoo.qwen3_next import VL_PRESETS

    preset = {p.name: p for p in VL_PRESETS}[name]
    cfg = preset.config().validate()
    adapter = adapter_for_architecture({"qwen3.5-vl": "Qwen3_5ForConditionalGeneration",
                                        "qwen3.5-moe-vl": "Qwen3_5MoeForConditionalGeneration"}
                                       [preset.family])
    hf = adapter.config_to_hf(cfg, {})
    assert hf["text_config"]["rope_parameters"]["mrope_section"] == cfg.attention.mrope_section
    assert not config_diff(cfg.canonical(), adapter.config_from_hf(hf).canonical())
    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "model_type")}
    assert _our_count(cfg) == _hf_count(hf["architectures"][0], kwargs)


@pytest.mark.parametrize("name", ["qwen3.5-vl-debug", "qwen3.5-moe-vl-debug"])
def test_fresh_export_of_a_built_vl_model_reloads_with_equal_logits(tmp_path, name):
    """A model built here (no source config.json): to-hf writes text_config, vision_config,
    the token ids and mrope_section; transformers' VL class of the export gives our logits on a
    prompt with an image, and from-hf of the export gives the config back."""
    from composer.zoo import get_preset

    cfg = get_preset(name).config()
    model = composer.build_model(cfg, seed=4).eval()
    composer.save(model, tmp_path / "ck")
    to_hf(tmp_path / "ck", tmp_path / "hf")
    v = cfg.vision
    g = torch.Generator().manual_seed(5)
    text = torch.randint(0, 500, (7,), generator=g)
    ids = torch.cat([text[:3], torch.tensor([v.vision_start_token_id] + [v.image_token_id] * 6
                                            + [v.vision_end_token_id]), text[3:]])[None]
    pixels = torch.randn(24, v.d_patch, generator=g)
    grid = torch.tensor(GRID)
    hf = load_vl(tmp_path / "hf", moe="moe" in name)
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                      mm_token_type_ids=(ids == v.image_token_id).int()).logits
        got = model(ids, pixel_values=pixels, image_grid_thw=grid)
    assert rel_err(got, expected) < FP32_PARITY, rel_err(got, expected)
    from composer.config import config_diff

    back = from_hf(tmp_path / "hf", tmp_path / "back")
    assert not config_diff(cfg.canonical(), back.canonical())
