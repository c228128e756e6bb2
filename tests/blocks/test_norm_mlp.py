"""RMSNorm, gated RMSNorm and the MLP against their plain-math twins."""

import pytest
import torch

from composer import MLPConfig, ModelConfig
from composer.blocks.mlp import ACTIVATIONS, MLP, activation_ref, mlp_ref
from composer.blocks.norm import GatedRMSNorm, RMSNorm, gated_rms_norm_ref, rms_norm_ref


def test_rms_norm():
    norm = RMSNorm(24, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, 1e-6), atol=1e-12, rtol=0)
    torch.testing.assert_close(norm.float()(x.float()), rms_norm_ref(x, norm.weight, 1e-6).float(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group_size", [24, 8, 4])
@pytest.mark.parametrize("gated", [True, False])
def test_gated_rms_norm(group_size, gated):
    norm = GatedRMSNorm(24, group_size=group_size, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.normal_()
    x, z = torch.randn(2, 7, 24, dtype=torch.float64), torch.randn(2, 7, 24, dtype=torch.float64)
    z = z if gated else None
    ref = gated_rms_norm_ref(x, z, norm.weight, group_size, 1e-5)
    torch.testing.assert_close(norm(x, z), ref, atol=1e-12, rtol=0)


def test_grouping_matters():
    x, z = torch.randn(4, 16), torch.randn(4, 16)
    whole = GatedRMSNorm(16, group_size=16)(x, z)
    grouped = GatedRMSNorm(16, group_size=4)(x, z)
    assert (whole - grouped).abs().max() > 1e-3


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activations(name):
    x = torch.linspace(-4, 4, 101, dtype=torch.float64)
    torch.testing.assert_close(ACTIVATIONS[name](x), activation_ref(name, x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "geglu_tanh", "relu2", "gelu", "silu",
                                        "relu"])
def test_mlp_matches_reference(activation):
    cfg = ModelConfig(pattern="-", d_model=16, mlp=MLPConfig(d_ff=40, activation=activation))
    mlp = MLP(cfg).double()
    mlp.reset_parameters(torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in mlp.parameters():
            p.mul_(10)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    gate = mlp.gate_proj.weight if mlp.gated else None
    ref = mlp_ref(x, mlp.up_proj.weight, mlp.down_proj.weight, activation, gate)
    torch.testing.assert_close(mlp(x), ref, atol=1e-10, rtol=0)
    assert hasattr(mlp, "gate_proj") == (activation in ("swiglu", "geglu", "geglu_tanh"))


def test_mlp_bias_and_flops():
    cfg = ModelConfig(pattern="-", d_model=16, mlp=MLPConfig(d_ff=40, activation="relu2",
                                                                bias=True))
    mlp = MLP(cfg)
    assert mlp.up_proj.bias is not None and mlp.down_proj.bias is not None
    weights = sum(p.numel() for n, p in mlp.named_parameters() if n.endswith("weight"))
    assert MLP.flops_per_token(cfg, 128) == 2 * weights


def test_sandwich_norm_layer_plain_math():
    """``x + out_norm(mixer(norm(x)))`` with zero-centred norms (Gemma 3), fp64."""
    from composer.blocks.layer import Layer
    from composer.config import ConfigError

    cfg = ModelConfig(pattern="-", d_model=8, sandwich_norm=True, norm_zero_centered=True,
                      residual_multiplier=0.5).validate()
    gen = torch.Generator().manual_seed(0)
    mixer = torch.nn.Linear(8, 8, bias=False)
    layer = Layer(cfg, 0, mixer=mixer, symbol="-").double()
    for norm in (layer.norm, layer.out_norm):
        norm.zero_centered = True  # as HybridModel sets it from the config
    f64 = torch.float64
    with torch.no_grad():
        for p in (mixer.weight, layer.norm.weight, layer.out_norm.weight):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=f64))
        x = torch.randn(2, 3, 8, generator=gen, dtype=f64)
        h = rms_norm_ref(x, layer.norm.weight, cfg.norm_eps, zero_centered=True) @ mixer.weight.T
        expected = x + 0.5 * rms_norm_ref(h, layer.out_norm.weight, cfg.norm_eps, True)
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-12)
    with pytest.raises(ConfigError, match="post_norm_layers and sandwich_norm exclude each other"):
        ModelConfig(pattern="-", sandwich_norm=True, post_norm_layers=(0,)).validate()


def test_embedding_multiplier_in_dtype():
    """Gemma rounds sqrt(d_model) to the embedding's dtype (sqrt(3072) is 55.5 in bf16)."""
    from composer.blocks.model import embed_tokens

    embed = torch.nn.Embedding(4, 8).to(torch.bfloat16)
    ids = torch.arange(4)[None]
    m = 3072**0.5
    rounded = ModelConfig(d_model=8, embedding_multiplier=m, embedding_multiplier_in_dtype=True)
    exact = ModelConfig(d_model=8, embedding_multiplier=m)
    w = embed.weight.detach()[None]
    assert torch.equal(embed_tokens(embed, rounded, ids), w * torch.tensor(55.5, dtype=w.dtype))
    assert torch.equal(embed_tokens(embed, exact, ids), w * m)
    assert not torch.equal(embed_tokens(embed, rounded, ids), embed_tokens(embed, exact, ids))
