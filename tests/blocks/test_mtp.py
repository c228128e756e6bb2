"""Multi-token prediction (``main/p/p``): the loss against its plain-math twin, targets and masks
position by position, the shared head and embedding, ``loss = ce + aux + mtp``, inference
untouched, layer numbering, counts, checkpoints."""

import pytest
import torch

import composer
from composer import ModelConfig, build_model, model_stats
from composer.blocks.loss import IGNORE_INDEX
from composer.blocks.mtp import depth_inputs, mtp_loss_ref, segments
from composer.build.registry import REGISTRY
from composer.config import AttentionConfig, MambaConfig, MLPConfig, MoEConfig, MTPConfig
from tests.helpers import randomize

F64 = torch.float64


def tiny(pattern: str, **kw) -> ModelConfig:
    return ModelConfig(
        pattern=pattern, d_model=32, vocab_size=97, **kw,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2),
        mamba=MambaConfig(n_heads=4, d_head=16, n_groups=2, d_state=8, chunk_size=8),
        mlp=MLPConfig(d_ff=64), moe=MoEConfig(n_experts=4, top_k=2, d_ff=32,
                                                n_shared_experts=1, aux_loss_coeff=0.01))


def f64_model(cfg: ModelConfig, seed: int = 0) -> composer.HybridModel:
    model = build_model(cfg, seed=seed).double()
    randomize(model, seed=seed)
    return model


DOCS = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2],
                     [5, 5, 5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7, 7, 7, 7, 7, 7]])


@pytest.mark.parametrize("docs", [False, True], ids=["rows", "documents"])
@pytest.mark.parametrize("pattern", ["M*-/*E", "M*-/-M/-M"], ids=["D1", "D2"])
def test_loss_equals_plain_math(pattern, docs):
    cfg = tiny(pattern, mtp=MTPConfig(loss_weight=0.3), embedding_multiplier=1.7,
               logits_scaling=1.3)
    model = f64_model(cfg)
    ids = torch.randint(0, 97, (2, 18), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 7] = IGNORE_INDEX
    doc_ids = DOCS if docs else None
    out = model(ids, labels, doc_ids=doc_ids)
    want, per_depth = mtp_loss_ref(model, ids, labels, doc_ids)
    assert abs(out.mtp_loss.item() - want.item()) < 1e-10
    assert len(out.mtp_losses) == len(per_depth) == len(cfg.parsed.mtp)
    for got, ref in zip(out.mtp_losses, per_depth, strict=True):
        assert abs(got.item() - ref.item()) < 1e-10
    params = [p for n, p in model.named_parameters() if n.startswith(("mtp.", "embed", "lm_"))]
    got_g = torch.autograd.grad(out.mtp_loss, params)
    ref_g = torch.autograd.grad(want, params)
    for a, b in zip(got_g, ref_g, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_zero_centred_norms_and_tied_head():
    cfg = tiny("*-/*-", norm_zero_centered=True, tie_embeddings=True)
    model = f64_model(cfg, seed=4)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(5))
    out = model(ids, ids)
    want, _ = mtp_loss_ref(model, ids, ids)
    assert model.mtp[0].norm_h.zero_centered and model.mtp[0].final_norm.zero_centered
    assert abs(out.mtp_loss.item() - want.item()) < 1e-10


def test_targets_and_keep_masks_position_by_position():
    ids = torch.arange(10, 19)[None]  # 9 tokens: 10 .. 18
    doc_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
    labels = ids.clone()
    labels[0, 7] = IGNORE_INDEX
    x = IGNORE_INDEX
    ids_k, keep, target = depth_inputs(ids, labels, segments(ids, doc_ids), 2)
    # position t reads token t + 2 and predicts token t + 3, within its document only
    assert ids_k.tolist() == [[12, 13, 14, 15, 16, 17, 18, 0, 0]]
    assert keep.tolist() == [[True, True, False, False, True, True, True, False, False]]
    assert target.tolist() == [[13, x, x, x, x, 18, x, x, x]]
    _, keep, target = depth_inputs(ids, labels, segments(ids, None), 1)
    assert keep.tolist() == [[True] * 8 + [False]]
    assert target.tolist() == [[12, 13, 14, 15, 16, x, 18, x, x]]


def test_loss_is_ce_plus_aux_plus_mtp_and_inference_ignores_mtp():
    main, with_mtp = tiny("M*-E"), tiny("M*-E/*E/*E")
    a, b = build_model(main, seed=3), build_model(with_mtp, seed=3)  # per-name seeded init
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(2))
    ref, out = a(ids, ids), b(ids, ids)
    ce = (out.loss - out.aux_loss - out.mtp_loss).item()  # the main cross-entropy
    assert ce == pytest.approx((ref.loss - ref.aux_loss).item(), rel=1e-6, abs=0)
    mixers = [layer.mixer for layer in b.all_layers() if hasattr(layer.mixer, "aux_loss")]
    assert len(mixers) == 3 and out.aux_loss == sum(m.aux_loss for m in mixers)
    assert out.aux_loss > ref.aux_loss > 0  # the MTP depths' MoE layers count
    assert ref.mtp_loss == 0 and ref.mtp_losses == ()
    with torch.no_grad():
        assert torch.equal(b(ids), a(ids))
        assert torch.equal(composer.generate(b, ids[:, :4], 5), composer.generate(a, ids[:, :4], 5))


def test_state_dict_keys_layer_numbering_and_shared_weights():
    cfg = tiny("*-M/*-/*-", post_norm_layers=(1,))
    model = build_model(cfg, seed=0)
    keys = [k for k in model.state_dict() if k.startswith("mtp.")]
    depth = ["norm_h.weight", "norm_e.weight", "proj.weight", "layers.0.norm.weight",
             "layers.0.mixer.q_proj.weight", "layers.0.mixer.k_proj.weight",
             "layers.0.mixer.v_proj.weight", "layers.0.mixer.o_proj.weight",
             "layers.1.norm.weight", "layers.1.mixer.gate_proj.weight",
             "layers.1.mixer.up_proj.weight", "layers.1.mixer.down_proj.weight",
             "final_norm.weight"]
    assert keys == [f"mtp.{d}.{k}" for d in range(2) for k in depth]
    assert model.state_dict()["mtp.0.proj.weight"].shape == (32, 64)
    assert [layer.layer_idx for layer in model.all_layers()] == [0, 1, 2, 3, 4, 5, 6]
    assert [layer.post_norm for layer in model.all_layers()] == [False, True] + [False] * 5
    ids = torch.randint(0, 97, (2, 9))
    model(ids, ids).mtp_loss.backward()  # the shared embedding and head get MTP gradients
    assert model.embed.weight.grad.abs().sum() > 0 and model.lm_head.weight.grad.abs().sum() > 0
    # g_0 is the trunk's output: the MTP loss trains the trunk too (DeepSeek-V3 §2.2)
    assert model.layers["0"].mixer.q_proj.weight.grad.abs().sum() > 0


def test_depth_without_a_target_contributes_nothing():
    model = build_model(tiny("*-/*-"), seed=1)
    ids = torch.randint(0, 97, (3, 2))  # a target for the main head, none two tokens ahead
    out = model(ids, ids)
    assert out.mtp_loss == 0 and torch.isnan(out.mtp_losses[0]) and torch.isfinite(out.loss)
    out.loss.backward()


def test_counts_include_every_depth():
    main, cfg = tiny("M*-E"), tiny("M*-E/*E/*E")
    a, b = model_stats(build_model(main, device="meta"), 64), \
        model_stats(build_model(cfg, device="meta"), 64)
    model = build_model(cfg, device="meta")
    depth = sum(p.numel() for p in model.mtp[0].parameters())
    assert b.params_by_kind["MTP depth 1 (*E)"] == b.params_by_kind["MTP depth 2 (*E)"] == depth
    assert b.n_params == a.n_params + 2 * depth
    d, v = 32, 97  # projection [d, 2d], the shared head [v, d], the part's layers
    per_depth = 4 * d * d + 2 * d * v + REGISTRY["*"].flops_per_token(cfg, 64) + \
        REGISTRY["E"].flops_per_token(cfg, 64)
    assert b.mtp_forward_flops_per_token == [per_depth, per_depth]
    assert b.forward_flops_per_token == a.forward_flops_per_token + 2 * per_depth
    assert b.flops_per_token == 3 * b.forward_flops_per_token
    assert b.n_params - b.n_active_params > a.n_params - a.n_active_params  # MTP experts


def test_portable_checkpoint_round_trip(tmp_path):
    model = build_model(tiny("M*/*-"), seed=2)
    composer.save(model, tmp_path / "ckpt")
    back = composer.load(tmp_path / "ckpt")
    assert back.config.parsed.mtp == (("*", "-"),)
    ids = torch.randint(0, 97, (2, 7))
    assert torch.equal(back(ids, ids).mtp_loss, model(ids, ids).mtp_loss)


def test_no_depth_reads_across_a_document_boundary():
    # what each depth computes for a document does not depend on the next document's tokens
    # (the shifted embedding is masked there, not only the targets)
    model = f64_model(tiny("M*-/*-/*-"), seed=6)
    outs = []
    for depth in model.mtp:
        depth.register_forward_hook(lambda mod, args, out: outs.append(out))
    ids = torch.randint(0, 97, (2, 18), generator=torch.Generator().manual_seed(7))
    other = ids.clone()
    other[0, 5:11] = (other[0, 5:11] + 1) % 97  # document 1 of row 0
    model(ids, ids, doc_ids=DOCS)
    model(other, other, doc_ids=DOCS)
    a, b = outs[:2], outs[2:]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x[0, :5], y[0, :5], atol=1e-12, rtol=0)
        torch.testing.assert_close(x[1], y[1], atol=1e-12, rtol=0)
        assert (x[0, 5:11] - y[0, 5:11]).abs().max() > 1e-3


def test_composer_build_prints_every_depth(capsys):
    from composer.cli import main

    assert main(["build", "--pattern", "M*-E/*E/*E", "--set", "mtp.loss_weight=0.3"]) == 0
    out = capsys.readouterr().out
    stats = model_stats(build_model(ModelConfig(pattern="M*-E/*E/*E"), device="meta"))
    for d in (1, 2):
        depth = stats.params_by_kind[f"MTP depth {d} (*E)"]
        assert f"MTP depth {d} (*E)" in out and f"{depth:,}" in out
    assert f"{stats.n_params:,}" in out and "M*-E/*E/*E" in out


def test_mtp_config_section():
    from composer import ConfigError

    assert tiny("M*").canonical().mtp is None  # no MTP part: the section is dropped
    assert tiny("M*/*-").canonical().mtp == MTPConfig(loss_weight=0.1)
    with pytest.raises(ConfigError, match=r"^mtp.loss_weight must be >= 0, got -1.0$"):
        tiny("M*/*-", mtp=MTPConfig(loss_weight=-1.0)).validate()
    model = build_model(tiny("M*/*E"), dtype=torch.bfloat16)  # MTP routers stay fp32 too
    assert model.mtp[0].layers["1"].mixer.router.weight.dtype == torch.float32
    assert model.mtp[0].proj.weight.dtype == torch.bfloat16
