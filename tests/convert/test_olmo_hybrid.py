"""OLMo-Hybrid (OlmoHybridForCausalLM): HF -> composer -> HF on logits and bytes, the Hub tensor
layout (split q/k/v convs, OLMo-core norm names), NoPE, refusals; and the post-norm layer option
it needs (``post_norm_layers``) against plain math."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import composer
from composer.blocks.layer import Layer
from composer.config import ConfigError, ModelConfig
from composer.convert import from_hf, infer_adapter, to_hf
from composer.convert.olmo_hybrid import OlmoHybridAdapter
from composer.portable import CheckpointError
from composer.zoo import get_preset
from tests.helpers import FP32_PARITY, load_hf, rel_err


def olmo_kwargs(**kw):
    # q/k width 2 * 16 == v width 4 * 8: transformers' save_pretrained splits the fused conv in
    # equal thirds, which is the Hub's split only then (see test_hub_layout_unequal_widths).
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                max_position_embeddings=256, pad_token_id=None, eos_token_id=None)
    return {**base, **kw}


def olmo(randomize, seed=0, **kw):
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    model = OlmoHybridForCausalLM(OlmoHybridConfig(**olmo_kwargs(**kw))).eval()
    randomize(model, seed=seed)
    return model


@pytest.mark.parametrize(("types", "tied", "bias", "neg"), [
    (None, False, False, True),
    (["linear_attention", "full_attention", "linear_attention", "full_attention"], True, True,
     False)])
def test_olmo_hybrid(check_family, randomize, tmp_path, types, tied, bias, neg):
    model = olmo(randomize, seed=40, layer_types=types, tie_word_embeddings=tied,
                 attention_bias=bias, linear_allow_neg_eigval=neg,
                 rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    cfg = check_family(model)
    pairs = "G-G-G-*-" if types is None else "G-*-G-*-"
    assert cfg.pattern == pairs and cfg.tie_embeddings == tied
    assert cfg.post_norm_layers == ((6, 7) if types is None else (2, 3, 6, 7))
    a, d = cfg.attention, cfg.gdn
    assert (a.qk_norm, a.qk_norm_scope, a.qkv_bias, a.out_bias, a.rope_theta) == \
        (True, "all", bias, bias, 5e5)
    assert (d.n_heads, d.n_kv_heads, d.d_head_k, d.d_head_v, d.norm_eps, d.allow_neg_eigval) == \
        (4, 2, 16, 8, 1e-5, neg)
    src, back = (json.loads((tmp_path / x / "config.json").read_text()) for x in ("hf", "back"))
    assert back == src


def test_olmo_hybrid_nope(check_family, randomize, tmp_path):
    """``"rope_theta": null`` (the DPO release) is NoPE in transformers and here."""
    model = olmo(randomize, seed=41, rope_parameters={"rope_theta": None})
    assert model.model.rotary_emb is None
    cfg = check_family(model, bf16=False)
    assert cfg.attention.position == "none"
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["rope_parameters"]["rope_theta"] is None
    fresh = OlmoHybridAdapter().config_to_hf(cfg, {})
    assert fresh["rope_parameters"] == {"rope_theta": None, "rope_type": "default"}


def _hub_copy(model, folder):
    """The model as the Hub stores it: OLMo-core norm names, q/k/v convs split at their true
    widths (not transformers' equal thirds)."""
    model.config.architectures = ["OlmoHybridForCausalLM"]
    model.config.save_pretrained(folder)
    c = model.config
    qk = c.linear_num_key_heads * c.linear_key_head_dim
    out = {}
    for name, t in model.state_dict().items():
        name = name.replace("input_layernorm", "attention_layer_norm").replace(
            "post_attention_layernorm", "feedforward_layer_norm")
        if name.endswith("linear_attn.conv1d.weight"):
            stem = name.removesuffix("conv1d.weight")
            for x, part in zip("qkv", t.split([qk, qk, t.shape[0] - 2 * qk]), strict=True):
                out[f"{stem}{x}_conv1d.weight"] = part.contiguous()
        else:
            out[name] = t.contiguous()
    save_file(out, folder / "model.safetensors", metadata={"format": "pt"})
    return out


def test_hub_layout_unequal_widths(tmp_path, randomize):
    """v wider than q/k (the release's shape): the Hub split is read and written exactly and
    transformers loads our export (its own save, in torch.chunk thirds: test_gdn_widths.py)."""
    model = olmo(randomize, seed=42, linear_value_head_dim=32)
    disk = _hub_copy(model, tmp_path / "hf")
    assert disk["model.layers.0.linear_attn.v_conv1d.weight"].shape == (128, 1, 4)
    from_hf(tmp_path / "hf", tmp_path / "ours")
    ids = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        assert rel_err(composer.load(tmp_path / "ours")(ids), expected) < FP32_PARITY
    to_hf(tmp_path / "ours", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(disk) and all(torch.equal(back[k], disk[k]) for k in disk)
    with torch.no_grad():  # a reload against a reload, in fresh memory (see load_hf)
        assert torch.equal(load_hf(tmp_path / "back")(ids).logits,
                           load_hf(tmp_path / "hf")(ids).logits)


def test_conv_split_that_does_not_tile_the_rows_is_refused(tmp_path, randomize):
    """Three conv parts whose rows do not add up to the config's ``2 QK + VV`` are refused,
    naming the tensor."""
    model = olmo(randomize, seed=42, linear_value_head_dim=32)
    disk = _hub_copy(model, tmp_path / "hf")
    disk["model.layers.0.linear_attn.v_conv1d.weight"] = disk[
        "model.layers.0.linear_attn.v_conv1d.weight"][:120].clone()
    save_file(disk, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"shape mismatch: 'model\.layers\.0\.linear_attn\."
                                              r"v_conv1d\.weight' \(in model\.safetensors\) is "
                                              r"\[120, 1, 4\], .* needs \[128, 1, 4\]"):
        from_hf(tmp_path / "hf", tmp_path / "ours")


def test_olmo_hybrid_refusals():
    adapter = OlmoHybridAdapter()
    cfg = get_preset("olmo-hybrid-debug").config()
    cfg.post_norm_layers = ()
    with pytest.raises(ConfigError, match=r"post_norm_layers must be \[6, 7, 14, 15\], got \[\]"):
        adapter.config_to_hf(cfg, {})
    cfg = get_preset("olmo-hybrid-debug").config()
    cfg.attention.qk_norm_scope = "head"
    cfg.gdn.norm_eps = 1e-6
    with pytest.raises(ConfigError, match=r"it needs attention.qk_norm_scope='all', "
                                          r"gdn.norm_eps=1e-05"):
        adapter.config_to_hf(cfg, {})
    cfg = get_preset("olmo-hybrid-debug").config()
    cfg.pattern = "M-G-*-G-"
    with pytest.raises(ConfigError, match="every layer must be 'G-'"):
        adapter.config_to_hf(cfg, {})
    with pytest.raises(ConfigError, match="hidden_act='gelu' is not supported"):
        adapter.config_from_hf(olmo_kwargs(hidden_act="gelu"))


def test_olmo_hybrid_defaults_of_a_sparse_config():
    """Fields missing from config.json take OlmoHybridConfig's defaults (head sizes derived)."""
    cfg = OlmoHybridAdapter().config_from_hf(dict(
        vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=8,
        num_attention_heads=4))
    assert cfg.pattern == "G-G-G-*-" * 2 and cfg.post_norm_layers == (6, 7, 14, 15)
    d = cfg.gdn
    assert (d.n_heads, d.n_kv_heads, d.d_head_k, d.d_head_v, d.allow_neg_eigval) == \
        (4, 4, 12, 24, True)
    assert cfg.norm_eps == 1e-6 and cfg.attention.rope_theta == 10000.0


def test_olmo_hybrid_preset_is_inferred():
    assert infer_adapter(get_preset("olmo-hybrid-debug").config()).family == "olmo-hybrid"


# ---------------------------------------------------------------- the post-norm layer option


def _rms(x, w, eps):
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("post", [False, True])
def test_layer_pre_and_post_norm_plain_math(post):
    cfg = ModelConfig(pattern="-", d_model=8, post_norm_layers=(0,) if post else (),
                      residual_multiplier=0.5).validate()
    gen = torch.Generator().manual_seed(0)
    mixer = torch.nn.Linear(8, 8, bias=False)
    layer = Layer(cfg, 0, mixer=mixer, symbol="-").double()
    f64 = torch.float64
    with torch.no_grad():
        mixer.weight.copy_(torch.randn(8, 8, generator=gen, dtype=f64))
        layer.norm.weight.copy_(torch.randn(8, generator=gen, dtype=f64))
        x = torch.randn(2, 3, 8, generator=gen, dtype=f64)
        w, W = layer.norm.weight, mixer.weight
        expected = x + 0.5 * (_rms(x @ W.T, w, cfg.norm_eps) if post
                              else _rms(x, w, cfg.norm_eps) @ W.T)
        # fp64, values O(10), reductions of 8 terms: rounding ~1e-14; the claim is exactness
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)


def test_post_norm_layers_config(tmp_path):
    cfg = ModelConfig(pattern="*-*-", post_norm_layers=(2, 3))
    cfg.save(tmp_path / "c.yaml")
    assert ModelConfig.load(tmp_path / "c.yaml").validate().post_norm_layers == (2, 3)
    assert ModelConfig().post_norm_layers == ()
    with pytest.raises(ConfigError, match=r"post_norm_layers \[3, 4\] must be increasing layer "
                                          r"indices in \[0, 4\)"):
        ModelConfig(pattern="*-*-", post_norm_layers=(3, 4)).validate()
    with pytest.raises(ConfigError, match=r"post_norm_layers\[0\] expects int"):
        ModelConfig.from_dict({"pattern": "*-", "post_norm_layers": ["a"]})
