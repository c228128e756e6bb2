"""Falcon-H1 (FalconH1ForCausalLM): HF -> composer -> HF on logits (fp32, within 1e-4 of
transformers; measured at most 1e-6) and bytes (fp32 and bf16, bit for bit), transformers'
reload of the export, greedy generation against ``transformers.generate``, every µP multiplier
carried as a number (none folded into a weight), the Mamba options (``mamba_d_ssm``, gated norm
on / off, norm before the gate, the three bias flags) and refusals. Preset parameter counts
against transformers' class on meta are in tests/zoo/test_presets.py."""

from __future__ import annotations

import json

import pytest
import torch

import composer
from composer.config import ConfigError
from composer.convert import from_hf, infer_adapter, to_hf
from composer.convert.falcon_h1 import FalconH1Adapter
from composer.zoo import get_preset
from tests.helpers import FP32_PARITY, assert_greedy_equals_hf, hf_to_ours, load_hf, rel_err

MUP = dict(embedding_multiplier=2.5, lm_head_multiplier=0.3, mlp_multipliers=[0.7, 1.3],
           key_multiplier=0.6, attention_in_multiplier=0.9, attention_out_multiplier=0.8,
           ssm_in_multiplier=1.2, ssm_out_multiplier=0.5, ssm_multipliers=[0.5, 1.5, 0.7, 1.1, 0.9])
COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=12, mamba_d_ssm=48,
              mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4,
              mamba_chunk_size=8, max_position_embeddings=256,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **MUP)


def falcon_h1(randomize, seed: int = 0, **kw) -> torch.nn.Module:
    """A random FalconH1ForCausalLM; its ``mup_vector`` (a non-persistent buffer, rebuilt from
    the config on load) is set back from the config after the randomisation."""
    from transformers import FalconH1Config, FalconH1ForCausalLM
    from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

    config = FalconH1Config(**{**COMMON, **kw})
    model = FalconH1ForCausalLM(config).eval()
    randomize(model, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mamba.mup_vector.copy_(compute_mup_vector(config))
    return model


def same_config(tmp_path) -> None:
    src, back = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "back"))
    assert back == src  # the export's config.json is the source's, field for field


@pytest.mark.parametrize("kw", [
    dict(mamba_rms_norm=True, mamba_norm_before_gate=False),
    dict(mamba_rms_norm=True, mamba_norm_before_gate=True, attention_bias=True, mlp_bias=True,
         projectors_bias=True),
    # the published form: no gated norm, no biases; mamba_d_ssm null (expand * hidden), tied
    dict(mamba_rms_norm=False, mamba_d_ssm=None, mamba_expand=3, mamba_n_heads=8,
         tie_word_embeddings=True, mamba_proj_bias=True, mamba_conv_bias=False)],
    ids=["norm-after-gate", "norm-before-gate-biases", "no-norm-expand-tied"])
def test_falcon_h1(check_family, randomize, tmp_path, kw):
    cfg = check_family(falcon_h1(randomize, seed=10 + len(kw), **kw))
    assert cfg.pattern == "[M*]-[M*]-"
    m, a, mlp = cfg.mamba, cfg.attention, cfg.mlp
    assert (m.gated_norm, m.norm_before_gate) == (kw["mamba_rms_norm"],
                                                  kw["mamba_norm_before_gate"] if
                                                  "mamba_norm_before_gate" in kw else True)
    assert m.n_heads * m.d_head == (96 if kw.get("mamba_d_ssm", 48) is None else 48)
    # every multiplier a number in the config (the weights are the source's, byte for byte)
    assert m.multipliers == MUP["ssm_multipliers"] and a.key_multiplier == 0.6
    assert (mlp.gate_multiplier, mlp.down_multiplier) == (0.7, 1.3)
    assert (cfg.embedding_multiplier, cfg.logits_scaling) == (2.5, 1 / 0.3)
    assert [(b.symbol, b.in_multiplier, b.out_multiplier) for b in cfg.parallel.branches] == \
        [("M", 1.2, 0.5), ("*", 0.9, 0.8)]
    same_config(tmp_path)


def test_logits_parity_is_measured(randomize, tmp_path):
    """On a longer input (several scan chunks) the fp32 distance to transformers stays far below
    1e-4 (measured: at most 1e-6)."""
    model = falcon_h1(randomize, seed=3, mamba_rms_norm=True)
    ours = hf_to_ours(model, tmp_path)
    ids = torch.randint(0, 97, (3, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = rel_err(ours(ids), model(ids).logits)
    assert err < FP32_PARITY / 10, err


@pytest.mark.slow
def test_greedy_generation_equals_transformers(randomize, tmp_path):
    """``composer.generate`` (prefill, then one token per step through each layer's conv window,
    SSM state and KV cache) gives transformers' greedy tokens, 20 new ones after prompts of 3
    and 9."""
    model = falcon_h1(randomize, seed=5, mamba_rms_norm=True)
    ours = hf_to_ours(model, tmp_path)
    assert_greedy_equals_hf(model, ours, 97, 20)


def test_top_level_rope_theta_and_lm_head_multiplier_are_written_back(randomize, tmp_path):
    """A config with a top-level ``rope_theta`` (the Hub's form) is written back in that form,
    and ``lm_head_multiplier`` is the source's number even where ``1 / (1 / m) != m``."""
    assert 1.0 / (1.0 / 0.11) != 0.11  # a number whose reciprocal's reciprocal is not itself
    model = falcon_h1(randomize, seed=7)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    hub = json.loads(path.read_text())
    del hub["rope_parameters"]
    hub.update(rope_theta=1e4, lm_head_multiplier=0.11)
    path.write_text(json.dumps(hub))
    from_hf(tmp_path / "hf", tmp_path / "ours")
    out = to_hf(tmp_path / "ours", tmp_path / "back")
    assert out["rope_theta"] == 1e4 and "rope_parameters" not in out
    assert out["lm_head_multiplier"] == 0.11


def test_preset_built_here_is_written_as_falcon_h1(tmp_path):
    """The debug preset (every multiplier set, no HF source) is inferred as Falcon-H1 and reloads
    in transformers with our logits."""
    preset = get_preset("falcon-h1-debug")
    assert infer_adapter(preset.config()).family == "falcon-h1"
    model = composer.build_model(preset.config(), seed=0)
    composer.save(model, tmp_path / "ck", family=preset.family)
    out = to_hf(tmp_path / "ck", tmp_path / "hf")
    assert (out["ssm_out_multiplier"], out["attention_in_multiplier"], out["lm_head_multiplier"],
            out["mamba_rms_norm"]) == (0.5, 0.75, 0.25, True)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(model(ids), load_hf(tmp_path / "hf")(ids).logits) < FP32_PARITY


@pytest.mark.parametrize(("change", "message"), [
    (["attention.qk_norm=true"], "Falcon-H1 cannot express this model; it needs "
                                 "attention.qk_norm=false"),
    (["mlp.activation=geglu"], "Falcon-H1 cannot express this model; it needs "
                               "mlp.activation='swiglu'"),
    (["pattern=[M*]-M-"], "pattern '[M*]-M-' cannot be written as falcon-h1: every layer must "
                          "be '[M*]-' (Mamba-2 and attention side by side, then an MLP)")])
def test_refusals(change, message):
    cfg = composer.apply_overrides(get_preset("falcon-h1-debug").config(), change)
    with pytest.raises(ConfigError) as exc:
        FalconH1Adapter().config_to_hf(cfg, {})
    assert str(exc.value) == message


def test_other_families_refuse_falcon_options():
    """No other HF class has a field for Falcon-H1's options: writing one as Nemotron-H (or any
    other family) names them instead of dropping them."""
    from composer.convert.nemotron_h import NemotronHAdapter

    cfg = composer.apply_overrides(get_preset("nemotron-h-debug").config(),
                                   ["mamba.gated_norm=false", "mlp.down_multiplier=2.0"])
    with pytest.raises(ConfigError) as exc:
        NemotronHAdapter().config_to_hf(cfg, {})
    assert str(exc.value) == ("NemotronHForCausalLM has no field for mlp.down_multiplier=2.0, "
                              "mamba.gated_norm=False (Falcon-H1's options)")


def test_config_refusals():
    with pytest.raises(ConfigError, match=r"mamba_n_heads \* mamba_d_head \(6 \* 7\) must equal "
                                          r"the Mamba width mamba_d_ssm \(48\)"):
        FalconH1Adapter().config_from_hf({**COMMON, "mamba_d_head": 7})
    with pytest.raises(ConfigError, match="ssm_multipliers must list 5 numbers"):
        FalconH1Adapter().config_from_hf({**COMMON, "ssm_multipliers": [1.0, 2.0]})
    with pytest.raises(ConfigError, match="hidden_act='gelu' is not supported"):
        FalconH1Adapter().config_from_hf({**COMMON, "hidden_act": "gelu"})
