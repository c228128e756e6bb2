"""HybridModel end to end: causality, loss, training, checkpoints, dtype policy, counts."""

import pytest
import torch

import composer
from composer import ConfigError, ModelConfig, build_model, model_stats
from composer.config import AttentionConfig, MambaConfig, MLPConfig, MoEConfig


def tiny(pattern: str, **kw) -> ModelConfig:
    return ModelConfig(
        pattern=pattern, d_model=32, vocab_size=97, **kw,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2),
        mamba=MambaConfig(n_heads=4, d_head=16, n_groups=2, d_state=8, chunk_size=8),
        mlp=MLPConfig(d_ff=64), moe=MoEConfig(n_experts=4, top_k=2, d_ff=32,
                                                n_shared_experts=1, aux_loss_coeff=0.01))


def test_logits_shape_and_keys():
    model = build_model(tiny("M*-E"), seed=1)
    ids = torch.randint(0, 97, (2, 9))
    assert model(ids).shape == (2, 9, 97)
    keys = set(model.state_dict())
    assert {"embed.weight", "final_norm.weight", "lm_head.weight", "layers.0.norm.weight",
            "layers.0.mixer.in_proj.weight", "layers.1.mixer.q_proj.weight",
            "layers.2.mixer.up_proj.weight", "layers.3.mixer.router.weight"} <= keys


def test_whole_model_is_causal():
    model = build_model(tiny("M*-EM"), seed=2).double()
    ids = torch.randint(0, 97, (1, 21))
    ids2 = ids.clone()
    ids2[:, 13:] = (ids2[:, 13:] + 5) % 97
    a, b = model(ids), model(ids2)
    torch.testing.assert_close(a[:, :13], b[:, :13], atol=1e-12, rtol=0)
    assert (a[:, 13:] - b[:, 13:]).abs().max() > 1e-4


def test_loss_is_shifted_cross_entropy():
    model = build_model(tiny("*-", tie_embeddings=True), seed=3)
    ids = torch.randint(0, 97, (2, 12))
    labels = ids.clone()
    labels[0, 5] = -100
    out = model(ids, labels)
    logits = model(ids)
    keep = labels[:, 1:] != -100
    logp = torch.log_softmax(logits[:, :-1], -1)
    expected = -logp.gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep].mean()
    torch.testing.assert_close(out.loss, expected)
    assert out.aux_loss.item() == 0.0


@pytest.mark.parametrize("pattern", ["M", "*-", "M*-E"])
def test_loss_falls_over_30_adamw_steps(pattern):
    torch.manual_seed(0)
    model = build_model(tiny(pattern), seed=4)
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(5))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        out = model(ids, ids)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    if "E" in pattern:
        assert out.aux_loss.item() > 0


def test_seeded_init_is_deterministic():
    a = build_model(tiny("M*-E"), seed=7).state_dict()
    b = build_model(tiny("M*-E"), seed=7).state_dict()
    c = build_model(tiny("M*-E"), seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.1.mixer.q_proj.weight"], c["layers.1.mixer.q_proj.weight"])


def test_save_load_round_trip(tmp_path):
    model = build_model(tiny("M*-E", tie_embeddings=True), seed=9)
    composer.save(model, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.yaml",
                                                                    "model.safetensors"]
    back = composer.load(tmp_path / "ckpt")
    assert back.config == model.config
    ids = torch.randint(0, 97, (1, 10))
    torch.testing.assert_close(back(ids), model(ids), atol=0, rtol=0)
    with pytest.raises(FileExistsError, match="not empty"):
        composer.save(model, tmp_path / "ckpt")
    composer.save(model, tmp_path / "ckpt", force=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_load_rejects_mismatched_weights(tmp_path):
    composer.save(build_model(tiny("M*")), tmp_path / "a")
    cfg = tiny("M*")
    cfg.d_model = 48
    cfg.save(tmp_path / "a" / "config.yaml")
    with pytest.raises(ValueError, match=r"tensor 'embed.weight' has shape \[97, 32\], the config "
                                         r"needs \[97, 48\]"):
        composer.load(tmp_path / "a")


def test_cast_keeps_fp32_tensors():
    model = build_model(tiny("ME"), dtype=torch.bfloat16)
    assert model.layers["0"].mixer.A_log.dtype == torch.float32
    assert model.layers["1"].mixer.router.weight.dtype == torch.float32
    assert model.layers["0"].mixer.in_proj.weight_z.dtype == torch.bfloat16
    assert model(torch.randint(0, 97, (1, 5))).dtype == torch.bfloat16


def test_unbuilt_symbols_are_refused_in_mtp_parts_too():
    for pattern in ("MD", "M*/*D"):
        with pytest.raises(ConfigError, match=r"pattern symbol 'D' \(sparse attention\) is "
                           "recognised but not built yet; built symbols: M \\* - E"):
            build_model(tiny(pattern), device="meta")
    with pytest.raises(ConfigError, match=r"^the multi-token-prediction parts \('/\*E'\) need "
                       "the 'mtp' section, which is None$"):
        build_model(tiny("M*/*E", mtp=None), device="meta")


def test_meta_build_and_counts():
    cfg = tiny("M*-E")
    model = build_model(cfg, device="meta")
    assert model.embed.weight.is_meta
    stats = model_stats(model, seq_len=64)
    assert stats.n_params == sum(p.numel() for p in model.parameters())
    moe = model.layers["3"].mixer
    routed = sum(p.numel() for p in moe.experts.parameters())
    assert stats.n_active_params == stats.n_params - routed // 2  # top 2 of 4 experts
    assert stats.layer_counts == {"M": 1, "*": 1, "-": 1, "E": 1}
    assert stats.flops_per_token == 3 * stats.forward_flops_per_token
    tied = model_stats(build_model(tiny("M*-E", tie_embeddings=True), device="meta"))
    assert stats.n_params - tied.n_params == 97 * 32


def test_register_a_new_symbol():
    from composer.blocks.mlp import MLP
    from composer.build import registry

    class Doubler(MLP):
        def forward(self, x):
            return 2 * super().forward(x)

    try:
        composer.register("R", "double MLP", Doubler, "mlp")
        model = build_model(tiny("R*"), seed=0)
        assert type(model.layers["0"].mixer) is Doubler
        assert model(torch.randint(0, 97, (1, 4))).shape == (1, 4, 97)
    finally:
        registry.unregister("R")
