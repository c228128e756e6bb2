"""Gemma 3 text (Gemma3ForCausalLM): HF -> composer -> HF on logits (fp32, within 1e-4 of
transformers; measured at most 1e-6) and bytes (fp32 and bf16, bit for bit), transformers' reload
of the export, greedy generation against ``transformers.generate`` past the sliding window (the
ring caches wrap), the config forms (``rope_parameters`` per layer type, or the Hub's
``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` / ``sliding_window_pattern``) and
refusals. Preset parameter counts against transformers' class on meta are in
tests/zoo/test_presets.py with the other families'."""

from __future__ import annotations

import json

import pytest
import torch

from composer.config import ConfigError
from composer.convert import from_hf, to_hf
from composer.convert.gemma3 import Gemma3Adapter
from tests.helpers import FP32_PARITY, assert_greedy_equals_hf, hf_to_ours, load_hf, rel_err

TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
              layer_types=TYPES)
ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


def gemma3(randomize, seed: int = 0, **kw) -> torch.nn.Module:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    model = Gemma3ForCausalLM(Gemma3TextConfig(**{**COMMON, **kw})).eval()
    randomize(model, seed=seed)
    return model


def same_config(tmp_path) -> None:
    src, back = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "back"))
    assert back == src  # the export's config.json is the source's, field for field


@pytest.mark.parametrize("kw", [
    dict(query_pre_attn_scalar=12, rope_parameters=ROPE),
    dict(tie_word_embeddings=False, query_pre_attn_scalar=16, num_key_value_heads=1,
         attention_bias=True),
    dict(layer_types=["full_attention"] * 4, head_dim=8, hidden_activation="gelu")],
    ids=["linear-rope", "untied-bias-mqa", "all-global"])
def test_gemma3(check_family, randomize, tmp_path, kw):
    cfg = check_family(gemma3(randomize, seed=len(kw), **kw))
    types = kw.get("layer_types", TYPES)
    assert cfg.pattern == "".join("W-" if t == "sliding_attention" else "*-" for t in types)
    a = cfg.attention
    assert (a.window, a.qk_norm, a.d_head) == (5, True, kw.get("head_dim", 16))
    assert a.softmax_scale == kw.get("query_pre_attn_scalar", 256) ** -0.5
    assert (cfg.sandwich_norm, cfg.norm_zero_centered, cfg.embedding_multiplier) == (
        True, True, 32**0.5)
    same_config(tmp_path)


def test_logits_parity_is_measured(randomize, tmp_path):
    """A longer input, many windows long: the fp32 distance stays far below 1e-4."""
    model = gemma3(randomize, seed=3, rope_parameters=ROPE)
    ours = hf_to_ours(model, tmp_path)
    ids = torch.randint(0, 97, (3, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = rel_err(ours(ids), model(ids).logits)
    assert err < FP32_PARITY / 10, err


def test_greedy_generation_equals_transformers(randomize, tmp_path):
    """``composer.generate`` gives transformers' greedy tokens, 24 new ones (nearly 5 windows:
    the local layers' ring caches wrap) after prompts of 3 and 9, and after left padding."""
    model = gemma3(randomize, seed=5, rope_parameters=ROPE, tie_word_embeddings=False)
    ours = hf_to_ours(model, tmp_path)
    assert_greedy_equals_hf(model, ours, 97, 24, left_pad=4)


def test_hub_config_form(randomize, tmp_path):
    """The Hub's fields, as gemma-3-1b-it's config.json has them (``rope_theta``,
    ``rope_local_base_freq``, ``rope_scaling``, ``sliding_window_pattern``, no ``layer_types``):
    read as transformers reads them; the export writes transformers 5's form, which
    transformers reads to the same logits."""
    model = gemma3(randomize, seed=7, num_hidden_layers=6, layer_types=None,
                   sliding_window_pattern=3, rope_parameters=ROPE)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    hub = json.loads(path.read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        hub.pop(key, None)
    hub.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    path.write_text(json.dumps(hub))
    cfg = from_hf(tmp_path / "hf", tmp_path / "ours")
    assert cfg.pattern == "W-W-*-W-W-*-"
    a = cfg.attention
    assert (a.rope_theta, a.window_rope_theta, a.rope_scaling.rope_type) == (1e6, 1e4, "linear")
    out = to_hf(tmp_path / "ours", tmp_path / "back")
    assert out["rope_parameters"] == ROPE and "rope_local_base_freq" not in out
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(load_hf(tmp_path / "hf")(ids).logits, want)
        assert torch.equal(load_hf(tmp_path / "back")(ids).logits, want)


@pytest.mark.parametrize(("extra", "message"), [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 \\(logit soft-capping\\)"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"text_config": {}}, "Gemma3ForConditionalGeneration"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "sliding layers' RoPE must be unscaled")])
def test_refusals(extra, message):
    with pytest.raises(ConfigError, match=message):
        Gemma3Adapter().config_from_hf({**COMMON, **extra})


def test_export_refuses_what_gemma3_cannot_express():
    cfg = Gemma3Adapter().config_from_hf(COMMON)
    cfg.sandwich_norm = False
    cfg.attention.sinks = True
    with pytest.raises(ConfigError, match="it needs sandwich_norm=true, attention.sinks=false"):
        Gemma3Adapter().config_to_hf(cfg, {})
    cfg.pattern = "W-*E"
    with pytest.raises(ConfigError, match="every layer must be 'W-' or '\\*-'"):
        Gemma3Adapter().config_to_hf(cfg, {})


@pytest.mark.parametrize("name", ["gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b"])
def test_presets_export_the_published_config(name):
    """Each preset, written by the converter, is the published config where it matters (the
    layer types, window, scale, RoPE per layer type, widths); the counts are in test_presets."""
    from transformers import Gemma3TextConfig

    from composer.zoo import get_preset
    from tests.zoo.test_presets import PUBLISHED

    want = Gemma3TextConfig(**PUBLISHED[name][1])
    got = Gemma3TextConfig(**Gemma3Adapter().config_to_hf(get_preset(name).config(), {}))
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters",
                "head_dim", "hidden_size", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rms_norm_eps",
                "hidden_activation"):
        assert getattr(got, key) == getattr(want, key), key
