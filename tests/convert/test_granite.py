"""Bamba and Granite-4.0-H (GraniteMoeHybrid): HF -> composer -> HF, logits and bytes."""

import pytest
import torch

import composer
from composer.config import ConfigError
from composer.convert import from_hf, infer_adapter, to_hf
from composer.convert.granite import BambaAdapter, GraniteMoeHybridAdapter
from tests.helpers import FP32_PARITY, rel_err

# 19 tokens: not a multiple of the Mamba chunk size (8), so the scan's padding path runs.
IDS = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(1))
MUP = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015,
           logits_scaling=8.0)


def mamba(**kw):
    base = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=8,
                mamba_chunk_size=8, mamba_expand=2, max_position_embeddings=256)
    base.update(kw)
    return base


def bamba(**kw):
    from transformers import BambaConfig, BambaForCausalLM

    return BambaForCausalLM(BambaConfig(**mamba(**{"intermediate_size": 48,
                                                   "attn_layer_indices": [1], **kw})))


def granite(**kw):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    hf = mamba(intermediate_size=16, shared_intermediate_size=24, num_local_experts=4,
               num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba"],
               position_embedding_type="rope")
    hf.update(kw)
    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**hf))


@pytest.mark.parametrize("tied", [False, True])
def test_bamba(check_family, randomize, tied):
    model = bamba(tie_word_embeddings=tied, mamba_conv_bias=True, mamba_proj_bias=not tied)
    randomize(model, seed=10)
    cfg = check_family(model, IDS)
    assert cfg.pattern == "M-*-M-" and cfg.tie_embeddings == tied
    assert cfg.attention.rotary_fraction == 0.5 and cfg.mamba.n_groups == 2
    assert cfg.mamba.d_head == 8 and cfg.mamba.proj_bias == (not tied)


def test_bamba_full_rotary_and_limit(check_family, randomize):
    """A rope_parameters value beats BambaConfig's 0.5 default and must be written back."""
    model = bamba(rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                   "partial_rotary_factor": 1.0},
                  time_step_limit=(0.01, 2.0), attn_layer_indices=[0, 2])
    randomize(model, seed=11)
    cfg = check_family(model, IDS, bf16=False)
    assert cfg.pattern == "*-M-*-" and cfg.attention.rotary_fraction == 1.0
    assert cfg.mamba.dt_limit == (0.01, 2.0) and cfg.attention.rope_theta == 500.0


@pytest.mark.parametrize("position", ["rope", "nope"])
def test_granite_moe_with_multipliers(check_family, randomize, position):
    model = granite(position_embedding_type=position, **MUP)
    randomize(model, seed=12)
    cfg = check_family(model, IDS)
    assert cfg.pattern == "ME*EME"
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) == (12, 0.22, 8)
    assert cfg.attention.softmax_scale == 0.015
    assert cfg.attention.position == ("rope" if position == "rope" else "none")
    assert cfg.moe.n_shared_experts == 1 and cfg.moe.d_ff_shared == 24 and cfg.moe.renormalize


@pytest.mark.parametrize("tied", [False, True])
def test_granite_dense(check_family, randomize, tied):
    model = granite(num_local_experts=0, tie_word_embeddings=tied, attention_bias=True,
                    layer_types=["full_attention", "linear_attention"], num_hidden_layers=2,
                    **MUP)
    randomize(model, seed=13)
    cfg = check_family(model, IDS, bf16=tied)
    assert cfg.pattern == "*-M-" and cfg.moe is None and cfg.mlp.d_ff == 24


def test_granite_in_memory_expert_names_are_read(tmp_path, randomize):
    """save_original_format=False writes experts.gate_up_proj / router.weight: read them too,
    write the Hub's input_linear / router.layer names."""
    model = granite(**MUP).eval()
    randomize(model, seed=14)
    model.save_pretrained(tmp_path / "mem", save_original_format=False)
    cfg = from_hf(tmp_path / "mem", tmp_path / "ours")
    with torch.no_grad():
        assert rel_err(composer.load(tmp_path / "ours")(IDS), model(IDS).logits) < FP32_PARITY
    to_hf(tmp_path / "ours", tmp_path / "back")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "back" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.block_sparse_moe.input_linear.weight" in names
    assert "model.layers.0.block_sparse_moe.router.layer.weight" in names
    assert cfg.moe.n_experts == 4


def test_legacy_layer_type_names_are_kept():
    """Hub Granite-4.0-H configs say mamba/attention and position_embedding_type 'nope'."""
    hf = {"num_hidden_layers": 2, "layer_types": ["mamba", "attention"], "hidden_size": 32,
          "vocab_size": 97, "num_attention_heads": 4, "num_local_experts": 0,
          "shared_intermediate_size": 24, "mamba_n_heads": 8, "mamba_d_state": 8,
          "mamba_chunk_size": 8, "position_embedding_type": "nope",
          "attention_multiplier": 0.015}
    adapter = GraniteMoeHybridAdapter()
    cfg = adapter.config_from_hf(hf)
    out = adapter.config_to_hf(cfg, hf)
    assert out["layer_types"] == ["mamba", "attention"]
    assert out["position_embedding_type"] == "nope"
    assert adapter.config_from_hf(out) == cfg


def test_export_without_source_picks_the_family():
    """A composer-built model with Granite's features exports as Granite; Bamba's as Bamba."""
    cfg = GraniteMoeHybridAdapter().config_from_hf(
        mamba(intermediate_size=16, shared_intermediate_size=24, num_local_experts=4,
              num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba"],
              position_embedding_type="rope", **MUP))
    assert isinstance(infer_adapter(cfg), GraniteMoeHybridAdapter)
    b = BambaAdapter().config_from_hf(mamba(intermediate_size=48, attn_layer_indices=[1]))
    assert isinstance(infer_adapter(b), BambaAdapter)


def test_refusals():
    b = BambaAdapter().config_from_hf(mamba(intermediate_size=48, attn_layer_indices=[1]))
    b.residual_multiplier = 0.5
    with pytest.raises(ConfigError, match="bamba has no multipliers; cannot express "
                                          "residual_multiplier=0.5"):
        BambaAdapter().config_to_hf(b, {})
    g = GraniteMoeHybridAdapter().config_from_hf(
        mamba(intermediate_size=16, shared_intermediate_size=24, num_local_experts=4,
              num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba"]))
    g.pattern = "ME*-ME"
    with pytest.raises(ConfigError, match="the same MLP kind throughout"):
        GraniteMoeHybridAdapter().config_to_hf(g, {})
    with pytest.raises(ConfigError, match="also the Mamba convolution's activation"):
        GraniteMoeHybridAdapter().config_from_hf(
            mamba(intermediate_size=16, shared_intermediate_size=24, num_local_experts=0,
                  hidden_act="gelu", layer_types=["mamba"] * 3))
    with pytest.raises(ConfigError, match="rope type 'longrope' is not supported"):
        GraniteMoeHybridAdapter().config_from_hf(
            mamba(intermediate_size=16, shared_intermediate_size=24, num_local_experts=0,
                  layer_types=["attention"] * 3, position_embedding_type="rope",
                  rope_parameters={"rope_type": "longrope", "factor": 2.0}))


@pytest.mark.parametrize("family", ["bamba", "granite"])
def test_composer_built_model_exports_without_a_source_config(tmp_path, randomize, family):
    """No hf/ folder: the family is inferred and config.json is written from scratch."""
    from transformers import AutoModelForCausalLM

    if family == "bamba":
        cfg = BambaAdapter().config_from_hf(mamba(intermediate_size=48, attn_layer_indices=[1]))
    else:
        cfg = GraniteMoeHybridAdapter().config_from_hf(
            mamba(intermediate_size=16, shared_intermediate_size=24, num_local_experts=4,
                  num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba"],
                  position_embedding_type="nope", **MUP))
    ours = composer.build_model(cfg)
    randomize(ours, seed=15)
    composer.save(ours, tmp_path / "ck")
    hf_cfg = to_hf(tmp_path / "ck", tmp_path / "hf")
    arch = {"bamba": "BambaForCausalLM", "granite": "GraniteMoeHybridForCausalLM"}[family]
    assert hf_cfg["architectures"] == [arch]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert rel_err(ours(IDS), hf(IDS).logits) < FP32_PARITY
