"""LFM2 (Lfm2ForCausalLM) and LFM2-MoE (Lfm2MoeForCausalLM): HF -> composer -> HF on logits
(fp32, within 1e-4 of transformers; measured at most 2.2e-6) and bytes (fp32 and bf16, bit for
bit), transformers' reload of the export, greedy generation against ``transformers.generate``,
the config forms (``block_ff_dim`` / ``full_attn_idxs`` / ``tie_embedding`` / top-level
``rope_theta``, the MLP width rule ``block_auto_adjust_ff_dim``; MoE experts per expert or fused
on disk) and refusals. Preset parameter counts against transformers' class on meta are in
tests/zoo/test_presets.py with the other families'."""

from __future__ import annotations

import json

import pytest
import torch

import composer
from composer.config import ConfigError
from composer.convert import from_hf, infer_adapter, to_hf
from composer.convert.lfm2 import Lfm2Adapter, mlp_width, with_defaults
from composer.zoo import get_preset
from tests.helpers import FP32_PARITY, assert_greedy_equals_hf, hf_to_ours, load_hf, rel_err

TYPES = ["conv", "full_attention", "conv", "conv", "full_attention"]
COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, layer_types=TYPES)


def lfm2(randomize, seed: int = 0, **kw) -> torch.nn.Module:
    from transformers import Lfm2Config, Lfm2ForCausalLM

    kw = {"intermediate_size": 72, "block_multiple_of": 16, **kw}
    model = Lfm2ForCausalLM(Lfm2Config(**{**COMMON, **kw})).eval()
    randomize(model, seed=seed)
    return model


def same_config(tmp_path) -> None:
    src, back = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "back"))
    assert back == src  # the export's config.json is the source's, field for field


@pytest.mark.parametrize(("kw", "d_ff"), [
    # the default width rule: int(2 * 72 / 3) = 48, a multiple of 16
    (dict(), 48),
    # rounded up: int(2 * 100 / 3) = 66, times 1.5 = 99, up to 112; conv biases; untied
    (dict(intermediate_size=100, block_ffn_dim_multiplier=1.5, conv_bias=True,
          tie_word_embeddings=False, conv_L_cache=4), 112),
    # no adjustment (LFM2-2.6B); another RoPE theta
    (dict(intermediate_size=40, block_auto_adjust_ff_dim=False,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), 40)],
    ids=["adjusted", "rounded-bias-untied", "plain"])
def test_lfm2(check_family, randomize, tmp_path, kw, d_ff):
    model = lfm2(randomize, seed=10 + d_ff, **kw)
    assert model.model.layers[0].feed_forward.w1.weight.shape[0] == d_ff  # transformers' rule
    cfg = check_family(model)
    assert cfg.pattern == "C-*-C-C-*-"
    assert cfg.mlp.d_ff == d_ff and cfg.tie_embeddings == kw.get("tie_word_embeddings", True)
    s, a = cfg.shortconv, cfg.attention
    assert (s.d_conv, s.bias) == (kw.get("conv_L_cache", 3), kw.get("conv_bias", False))
    assert (a.qk_norm, a.qk_norm_scope, a.qkv_bias, a.d_head) == (True, "head", False, 8)
    assert a.rope_theta == kw.get("rope_parameters", {}).get("rope_theta", 1e6)
    same_config(tmp_path)


def test_logits_parity_is_measured(randomize, tmp_path):
    """On a longer input the fp32 distance to transformers stays far below 1e-4 (measured: at
    most 2.2e-6 over three seeds and three configs, 19 and 64 tokens)."""
    model = lfm2(randomize, seed=3)
    ours = hf_to_ours(model, tmp_path)
    ids = torch.randint(0, 97, (3, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = rel_err(ours(ids), model(ids).logits)
    assert err < FP32_PARITY / 10, err


def test_greedy_generation_equals_transformers(randomize, tmp_path):
    """``composer.generate`` (prefill, then one token per step through the conv windows and the
    KV caches) gives transformers' greedy tokens, 24 new ones after prompts of 3 and 9, and
    after a left-padded batch."""
    model = lfm2(randomize, seed=5, tie_word_embeddings=False, conv_bias=True)
    ours = hf_to_ours(model, tmp_path)
    # left padding: transformers zeroes the padded conv inputs and masks them in attention; we
    # treat the padding as an earlier document
    assert_greedy_equals_hf(model, ours, 97, 24, left_pad=4)


def test_hub_config_form(randomize, tmp_path):
    """The Hub's older fields, as LFM2-1.2B's config.json has them (``block_ff_dim`` beside a
    stale ``intermediate_size``, ``full_attn_idxs`` and no ``layer_types``, ``tie_embedding``,
    a top-level ``rope_theta``, ``block_dim`` / ``conv_dim``): read as transformers reads them,
    and written back as they came (the width fields too, since they give the same width)."""
    model = lfm2(randomize, seed=7, intermediate_size=96)  # int(2 * 96 / 3) = 64
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    hub = json.loads(path.read_text())
    for key in ("layer_types", "rope_parameters", "intermediate_size"):
        del hub[key]
    hub.update(block_ff_dim=96, intermediate_size=64, full_attn_idxs=[1, 4], tie_embedding=True,
               rope_theta=1e6, block_dim=32, conv_dim=32)
    path.write_text(json.dumps(hub))
    cfg = from_hf(tmp_path / "hf", tmp_path / "ours")
    assert (cfg.pattern, cfg.mlp.d_ff, cfg.tie_embeddings) == ("C-*-C-C-*-", 64, True)
    out = to_hf(tmp_path / "ours", tmp_path / "back")
    for key in ("block_ff_dim", "intermediate_size", "full_attn_idxs", "tie_embedding",
                "block_dim", "conv_dim", "block_auto_adjust_ff_dim"):
        assert out[key] == hub[key], key
    assert out["layer_types"] == TYPES
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(load_hf(tmp_path / "back")(ids).logits, load_hf(tmp_path / "hf")(ids)
                           .logits)


def test_a_changed_width_is_written_unadjusted(randomize, tmp_path):
    """A width the source's fields do not give (here after ``--set mlp.d_ff``) is written as
    ``intermediate_size`` with the adjustment off, so that transformers builds exactly it."""
    h = with_defaults({"intermediate_size": 96, "block_multiple_of": 16})
    assert mlp_width(h) == 64
    cfg = Lfm2Adapter().config_from_hf({**COMMON, "intermediate_size": 96,
                                        "block_multiple_of": 16})
    cfg.mlp.d_ff = 80
    out = Lfm2Adapter().config_to_hf(cfg, {**COMMON, "intermediate_size": 96,
                                           "block_multiple_of": 16, "block_ff_dim": 96})
    assert (out["intermediate_size"], out["block_ff_dim"], out["block_auto_adjust_ff_dim"]) == \
        (80, 80, False)
    assert mlp_width(with_defaults(out)) == 80
    fresh = Lfm2Adapter().config_to_hf(get_preset("lfm2-debug").config(), {})
    assert (fresh["intermediate_size"], fresh["block_auto_adjust_ff_dim"]) == (128, False)


def test_preset_built_here_is_written_as_lfm2(tmp_path):
    """A model built from the preset (no HF source) is inferred as LFM2 and reloads in
    transformers with our logits."""
    preset = get_preset("lfm2-debug")
    assert infer_adapter(preset.config()).family == "lfm2"
    model = composer.build_model(preset.config(), seed=0)
    composer.save(model, tmp_path / "ck", family=preset.family)
    to_hf(tmp_path / "ck", tmp_path / "hf")
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(ids), load_hf(tmp_path / "hf")(ids).logits) < FP32_PARITY


@pytest.mark.parametrize(("change", "message"), [
    ({"attention.qk_norm": False}, "LFM2 cannot express this model; it needs "
                                   "attention.qk_norm=true"),
    ({"mlp.activation": "geglu"}, "LFM2 cannot express this model; it needs "
                                  "mlp.activation='swiglu'"),
    ({"pattern": "C-*E"}, "pattern 'C-*E' cannot be written as lfm2: every layer must be 'C-' "
                          "or '*-' (C: short convolution)")])
def test_refusals(change, message):
    cfg = get_preset("lfm2-debug").config()
    if "pattern" in change:
        cfg = composer.apply_overrides(cfg, [f"pattern={change['pattern']}",
                                             "moe.n_experts=4", "moe.top_k=2"])
    else:
        cfg = composer.apply_overrides(cfg, [f"{k}={v}" for k, v in change.items()])
    with pytest.raises(ConfigError) as exc:
        Lfm2Adapter().config_to_hf(cfg, {})
    assert str(exc.value) == message


def test_config_refusals():
    with pytest.raises(ConfigError, match="config.json: layer_types must list 5 entries of "
                                          "'conv' / 'full_attention', got"):
        Lfm2Adapter().config_from_hf({**COMMON, "layer_types": ["conv", "sliding_attention"]})
    with pytest.raises(ConfigError, match="attention_bias=true, but transformers' "
                                          "Lfm2Attention has no biases"):
        Lfm2Adapter().config_from_hf({**COMMON, "attention_bias": True})


# ---------------------------------------------------------------- LFM2-MoE

MOE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=256, num_dense_layers=1, num_experts=6, num_experts_per_tok=2,
           layer_types=["conv", "full_attention", "conv", "full_attention"])


def lfm2_moe(randomize, seed: int = 0, **kw) -> torch.nn.Module:
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    model = Lfm2MoeForCausalLM(Lfm2MoeConfig(**{**MOE, **kw})).eval()
    randomize(model, seed=seed)  # the expert bias too: it must change which experts are chosen
    return model


@pytest.mark.parametrize("kw", [
    dict(),
    dict(use_expert_bias=False, norm_topk_prob=False, routed_scaling_factor=2.5,
         tie_word_embeddings=False, conv_bias=True),
    dict(num_dense_layers=0)], ids=["default", "no-bias-scaled-untied", "all-moe"])
def test_lfm2_moe(check_family, randomize, tmp_path, kw):
    cfg = check_family(lfm2_moe(randomize, seed=20 + len(kw), **kw))
    dense = kw.get("num_dense_layers", 1)
    assert cfg.pattern == "".join(m + ("-" if i < dense else "E")
                                  for i, m in enumerate("C*C*"))
    e = cfg.moe
    assert (e.n_experts, e.top_k, e.d_ff, e.score_func, e.aux_loss_coeff) == (6, 2, 16,
                                                                            "sigmoid", 0.0)
    assert (e.score_correction_bias, e.renormalize, e.routed_scaling_factor) == (
        kw.get("use_expert_bias", True), kw.get("norm_topk_prob", True),
        kw.get("routed_scaling_factor", 1.0))
    assert (cfg.mlp is None) == (dense == 0)
    same_config(tmp_path)


def test_lfm2_moe_fused_experts_on_disk_are_read(randomize, tmp_path):
    """Experts fused as transformers holds them (``gate_up_proj``, gate first, and
    ``down_proj``) convert like the per-expert layout it saves."""
    from safetensors.torch import load_file, save_file

    model = lfm2_moe(randomize, seed=30)
    model.save_pretrained(tmp_path / "hf")
    fused = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(fused, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert "model.layers.1.feed_forward.experts.gate_up_proj" in load_file(
        tmp_path / "hf" / "model.safetensors")
    from_hf(tmp_path / "hf", tmp_path / "ours")
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel_err(composer.load(tmp_path / "ours")(ids), model(ids).logits) < FP32_PARITY


def test_lfm2_moe_greedy_generation_equals_transformers(randomize, tmp_path):
    model = lfm2_moe(randomize, seed=31)
    ours = hf_to_ours(model, tmp_path)
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                              do_sample=False, pad_token_id=0)
    assert torch.equal(composer.generate(ours, ids, 20), want)


def test_lfm2_moe_refusals():
    from composer.convert.lfm2 import Lfm2MoeAdapter

    cfg = get_preset("lfm2-moe-debug").config()
    cfg.pattern = "C-*EC-*E"
    with pytest.raises(ConfigError) as exc:
        Lfm2MoeAdapter().config_to_hf(cfg, {})
    assert str(exc.value) == ("pattern 'C-*EC-*E' cannot be written as lfm2-moe: its dense MLP "
                              "layers come first (num_dense_layers), then the MoE ones")
    cfg = get_preset("lfm2-moe-debug").config()
    cfg.moe.score_func = "softmax"
    with pytest.raises(ConfigError) as exc:
        Lfm2MoeAdapter().config_to_hf(cfg, {})
    assert str(exc.value) == "LFM2-MoE cannot express this model; it needs moe.score_func=" \
                             "'sigmoid'"
    with pytest.raises(ConfigError, match="missing field 'layer_types'"):
        Lfm2MoeAdapter().config_from_hf({k: v for k, v in MOE.items() if k != "layer_types"})
