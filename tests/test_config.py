"""Typed config: YAML round trip, overrides with type checks and suggestions, validation."""

import math

import pytest

from composer import (
    AttentionConfig,
    ConfigError,
    MambaConfig,
    ModelConfig,
    MoEConfig,
    RopeScaling,
    apply_overrides,
)
from composer.zoo import presets


def test_yaml_round_trip(tmp_path):
    cfg = ModelConfig(pattern="(M-)x2*E", d_model=96, tie_embeddings=True,
                      attention=AttentionConfig(n_heads=6, n_kv_heads=2, d_head=16,
                                                rope_scaling=RopeScaling(factor=4.0)),
                      mamba=MambaConfig(n_groups=2, dt_limit=(0.0, math.inf)),
                      moe=MoEConfig(score_func="sigmoid", n_shared_experts=1))
    cfg.save(tmp_path / "c.yaml")
    back = ModelConfig.load(tmp_path / "c.yaml")
    assert back == cfg
    assert isinstance(back.attention.rope_scaling, RopeScaling)
    assert back.mamba.dt_limit == (0.0, math.inf)


@pytest.mark.parametrize("name", sorted(presets()))
def test_every_preset_round_trips(tmp_path, name):
    cfg = presets()[name].config().validate()
    cfg.save(tmp_path / "c.yaml")
    assert ModelConfig.load(tmp_path / "c.yaml") == cfg


def test_overrides_apply_and_coerce():
    cfg = ModelConfig()
    apply_overrides(cfg, ["attention.n_heads=8", "d_model=512", "norm_eps=1e-6",
                          "tie_embeddings=true", "moe.score_func=sigmoid", "pattern=M*-",
                          "attention.n_kv_heads=null", "mamba.dt_limit=[0.0, 0.5]"])
    assert cfg.attention.n_heads == 8 and cfg.d_model == 512 and cfg.norm_eps == 1e-6
    assert cfg.tie_embeddings is True and cfg.moe.score_func == "sigmoid"
    assert cfg.pattern == "M*-" and cfg.attention.n_kv_heads is None
    assert cfg.mamba.dt_limit == (0.0, 0.5)
    apply_overrides(cfg, ["init_std=1"])  # int accepted for a float field
    assert cfg.init_std == 1.0 and isinstance(cfg.init_std, float)


def test_override_creates_missing_section_and_removes_one():
    cfg = ModelConfig(moe=None)
    apply_overrides(cfg, ["moe.n_experts=4"])
    assert cfg.moe == MoEConfig(n_experts=4)
    apply_overrides(cfg, ["attention.rope_scaling.factor=2"])
    assert cfg.attention.rope_scaling == RopeScaling(factor=2.0)
    apply_overrides(cfg, ["moe=null"])
    assert cfg.moe is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("attention.n_head=8",
         "unknown config key 'attention.n_head'; did you mean 'attention.n_heads'?"),
        ("atention.n_heads=8", "unknown config key 'atention'; did you mean 'attention'?"),
        ("d_modle=3", "unknown config key 'd_modle'; did you mean 'd_model'?"),
        ("d_model=abc", "d_model expects int, got 'abc'"),
        ("d_model=1.5", "d_model expects int, got 1.5"),
        ("tie_embeddings=3", "tie_embeddings expects bool, got 3"),
        ("mlp.activation=tanh", "mlp.activation must be one of swiglu, geglu"),
        ("mamba.dt_limit=3", "mamba.dt_limit expects a list of 2 numbers, got 3"),
        ("d_model", "override 'd_model' must look like key=value"),
        ("d_model.x=3", "d_model is not a section"),
    ],
)
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError) as info:
        apply_overrides(ModelConfig(), [override])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "changes, message",
    [
        (["attention.n_heads=6", "attention.n_kv_heads=4"],
         "attention.n_heads (6) must be divisible by attention.n_kv_heads (4)"),
        (["mamba.n_heads=6", "mamba.n_groups=4"],
         "mamba.n_heads (6) must be divisible by mamba.n_groups (4)"),
        (["moe.top_k=9"], "moe.top_k (9) must be <= moe.n_experts (8)"),
        (["moe=null"], "pattern symbol 'E' needs the 'moe' section, which is None"),
        (["pattern=M*Q"], "invalid symbol: character 'Q' at column 3"),
        (["d_model=0"], "d_model must be positive, got 0"),
        (["attention.n_heads=3"], "d_model (256) must be divisible by attention.n_heads (3)"),
        (["mamba.norm_group_size=100"], "mamba.norm_group_size (100) must divide"),
        (["attention.rotary_fraction=0.3"], "attention.rotary_fraction (0.3) must be in (0, 1]"),
        (["moe.n_expert_groups=3"], "moe.n_experts (8) must divide into moe.n_expert_groups"),
        (["mamba.dt_min=0.5"], "mamba.dt_min (0.5) must be positive and <= dt_max (0.1)"),
    ],
)
def test_validation(changes, message):
    cfg = apply_overrides(ModelConfig(), changes)
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert message in str(info.value)


def test_load_rejects_unknown_yaml_key(tmp_path):
    (tmp_path / "c.yaml").write_text("pattern: M\nmamba:\n  n_head: 4\n")
    with pytest.raises(ConfigError, match="did you mean 'mamba.n_heads'"):
        ModelConfig.load(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        ModelConfig.load(tmp_path / "d.yaml")


def test_a_literal_none_choice_is_not_null():
    cfg = apply_overrides(ModelConfig(pattern="M*"), ["attention.position=none"])
    assert cfg.attention.position == "none"


# ------------------------------------------- issue 21: a pattern symbol gets its section


def test_every_symbol_gets_its_section_sized_by_d_model():
    from composer.config import GDNConfig, MLAConfig, default_section

    # at the default width the derived sections are the dataclasses' defaults
    assert default_section("gdn", 256) == GDNConfig() and default_section("mla", 256) == MLAConfig()
    cfg = ModelConfig(pattern="G-+E", d_model=64)
    assert cfg.gdn == GDNConfig(n_heads=2)  # value width 2 x 64 in heads of 64
    assert cfg.mla == MLAConfig(n_heads=1, kv_lora_rank=16)
    assert cfg.mla == default_section("mla", 64)
    assert ModelConfig(pattern="M*").mla is None and ModelConfig(pattern="M*").gdn is None
    assert cfg.validate() is cfg


@pytest.mark.slow
def test_a_pattern_of_g_and_plus_builds_and_runs():
    import torch

    import composer
    from composer.config import GDNConfig, MLAConfig

    cfg = composer.ModelConfig(pattern="G-+E", d_model=64, vocab_size=97)
    spelled = composer.ModelConfig(pattern="G-+E", d_model=64, vocab_size=97,
                                   gdn=GDNConfig(n_heads=2),
                                   mla=MLAConfig(n_heads=1, kv_lora_rank=16))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = composer.build_model(cfg, seed=0)(ids)
    assert logits.shape == (2, 9, 97) and bool(torch.isfinite(logits).all())
    # the defaulted config is the spelled-out one: same seed, same ops, the same bits
    assert torch.equal(logits, composer.build_model(spelled, seed=0)(ids))


def test_overrides_keep_derived_sections_in_step():
    from composer.config import GDNConfig, MLAConfig, default_section

    cfg = apply_overrides(ModelConfig(pattern="G+"), ["d_model=64"])
    assert cfg.gdn == default_section("gdn", 64) and cfg.mla == default_section("mla", 64)
    cfg = apply_overrides(ModelConfig(pattern="G+"), ["gdn.d_head_k=32", "d_model=64"])
    assert cfg.gdn == GDNConfig(d_head_k=32)  # touched: kept, not re-derived
    assert cfg.mla == default_section("mla", 64)
    cfg = apply_overrides(ModelConfig(d_model=128), ["pattern=G+"])  # a new pattern
    assert cfg.gdn == GDNConfig(n_heads=4) and cfg.mla == MLAConfig(n_heads=2, kv_lora_rank=32)
    cfg = apply_overrides(ModelConfig(d_model=128), ["mla.n_heads=3"])  # created at d_model
    assert cfg.mla == MLAConfig(n_heads=3, kv_lora_rank=32)


def test_an_explicit_none_is_refused_with_the_keys_that_fix_it():
    for cfg in (ModelConfig(pattern="G", gdn=None),
                apply_overrides(ModelConfig(pattern="G", d_model=32), ["gdn=null"])):
        with pytest.raises(ConfigError) as info:
            cfg.validate()
        assert str(info.value) == (
            f"pattern symbol 'G' needs the 'gdn' section, which is None; give it one, e.g. "
            f"--set gdn.n_heads={max(1, cfg.d_model // 32)} (its other keys then take their "
            f"defaults for d_model {cfg.d_model})")
        apply_overrides(cfg, [str(info.value).split("--set ")[1].split(" ")[0]])
        assert cfg.validate().gdn == default_section_of(cfg)


def default_section_of(cfg):
    from composer.config import default_section

    return default_section("gdn", cfg.d_model)


def test_unknown_key_messages_quote_the_whole_key():
    with pytest.raises(ConfigError) as info:
        apply_overrides(ModelConfig(), ["mamba.d_stat=3"])
    assert str(info.value).startswith(
        "unknown config key 'mamba.d_stat'; did you mean 'mamba.d_state'? (valid: n_heads, ")
