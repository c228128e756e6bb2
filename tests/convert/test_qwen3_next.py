"""Qwen3-Next (Qwen3NextForCausalLM), Qwen3.5 (Qwen3_5ForCausalLM) and Qwen3.5-MoE
(Qwen3_5MoeForCausalLM): HF -> composer -> HF on logits and bytes (fp32 and bf16), the config
forms, the MTP module inside the model (or kept aside when the config has none), refusals; and
the family's block options (attention output gate, zero-centred RMSNorm, gated shared expert)
against plain math in fp64."""

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import composer
from composer.blocks.attention import Attention, attention_ref
from composer.blocks.moe import MoE, moe_ref
from composer.blocks.norm import RMSNorm, rms_norm_ref
from composer.config import AttentionConfig, ConfigError, ModelConfig, MoEConfig
from composer.convert import from_hf, infer_adapter, to_hf
from composer.convert.qwen3_next import Qwen3_5MoeAdapter, Qwen3NextAdapter
from composer.zoo import get_preset
from tests.helpers import FP32_PARITY, rel_err

FLA_REASON = ("flash-linear-attention is installed: transformers would run its CUDA kernels, "
              "not the torch path these CPU comparisons need")
F64 = torch.float64
pytestmark = pytest.mark.skipif(importlib.util.find_spec("fla") is not None,
                                reason=FLA_REASON)

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
              max_position_embeddings=256)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=24)


def qwen3_next(randomize, seed=0, **kw):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    model = Qwen3NextForCausalLM(Qwen3NextConfig(**{**COMMON, **MOE, **kw})).eval()
    randomize(model, seed=seed)
    return model


def qwen3_5(randomize, seed=0, **kw):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**COMMON, **kw})).eval()
    randomize(model, seed=seed)
    return model


def qwen3_5_moe(randomize, seed=0, **kw):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    base = {k: v for k, v in COMMON.items() if k != "intermediate_size"}
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**base, **MOE, **kw})).eval()
    randomize(model, seed=seed)
    return model


def same_config(tmp_path) -> None:
    src, back = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "back"))
    assert back == src  # the export's config.json is the source's, field for field


# ---------------------------------------------------------------- Qwen3-Next


@pytest.mark.parametrize(("mlp_only", "types", "bias", "renorm", "tied"), [
    ([1], None, False, True, False),
    ([], ["full_attention", "linear_attention", "full_attention", "linear_attention"], True,
     False, True),
    ([0, 3], ["linear_attention"] * 2 + ["full_attention", "linear_attention"], False, True,
     False)])
def test_qwen3_next(check_family, randomize, tmp_path, mlp_only, types, bias, renorm, tied):
    model = qwen3_next(randomize, seed=40 + len(mlp_only), mlp_only_layers=mlp_only,
                       layer_types=types, attention_bias=bias, norm_topk_prob=renorm,
                       tie_word_embeddings=tied, partial_rotary_factor=0.5)
    cfg = check_family(model)
    mixers = types or ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.pattern == "".join(("*" if t == "full_attention" else "G")
                                  + ("-" if i in mlp_only else "E") for i, t in enumerate(mixers))
    assert cfg.norm_zero_centered and cfg.tie_embeddings == tied
    if cfg.attention is not None:
        a = cfg.attention
        assert (a.output_gate, a.qk_norm, a.qkv_bias, a.out_bias, a.rotary_fraction) == \
            (True, True, bias, bias, 0.5)
    g, moe = cfg.gdn, cfg.moe
    assert (g.n_heads, g.n_kv_heads, g.d_head_k, g.d_head_v, g.norm_eps) == (4, 2, 8, 6, 1e-6)
    assert (moe.n_experts, moe.top_k, moe.d_ff, moe.d_ff_shared, moe.shared_expert_gate,
            moe.renormalize) == (6, 2, 16, 24, True, renorm)
    same_config(tmp_path)


def test_qwen3_next_mtp_kept_aside(tmp_path, randomize):
    """``mtp.*`` tensors (which transformers ignores) survive HF -> composer -> HF byte for
    byte, in their dtypes; the model's tensors are unchanged."""
    qwen3_next(randomize, seed=50).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    g = torch.Generator().manual_seed(0)
    mtp = {"mtp.fc.weight": torch.randn(32, 64, generator=g).to(torch.bfloat16),
           "mtp.norm.weight": torch.randn(32, generator=g),
           "mtp.layers.0.self_attn.q_proj.weight": torch.randn(128, 32, generator=g)}
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    from_hf(tmp_path / "hf", tmp_path / "ours")
    assert "mtp.fc.weight" not in composer.load(tmp_path / "ours").state_dict()
    to_hf(tmp_path / "ours", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted({**tensors, **mtp})
    for k, v in {**tensors, **mtp}.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8),
                                                        v.view(torch.uint8)), k


def qwen3_next_with_mtp(folder, randomize, dtype=torch.float32):
    """A tiny Qwen3-Next checkpoint with its MTP module as the Hub stores it (``mtp.fc``, the
    two pre-fc norms, ``mtp.layers.0`` a full-attention MoE decoder layer with per-expert
    weights, ``mtp.norm``; ``mtp_num_hidden_layers: 1``). transformers builds no MTP module:
    its decoder layer (random weights) provides the layer. Returns the model, that layer and
    the tensors written."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    model = qwen3_next(randomize, seed=53)
    layer = Qwen3NextDecoderLayer(model.config, 3).eval()  # layer 3: full attention, MoE
    return model, layer, save_with_mtp(folder, model, layer, randomize, dtype)


def save_with_mtp(folder, model, layer, randomize, dtype=torch.float32):
    """Save ``model`` with ``layer`` (random weights) as its ``mtp.layers.0``; returns the
    tensors written."""
    randomize(layer, seed=54)
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = 0.3 * torch.randn(32, generator=g)
    tensors["mtp.fc.weight"] = 0.2 * torch.randn(32, 64, generator=g)
    for name, t in layer.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = t[e, :16].clone()
                tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = t[e, 16:].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            tensors[f"mtp.layers.0.{name}"] = t.clone()
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((folder / "config.json").read_text())
    hf.update(mtp_num_hidden_layers=1, dtype=str(dtype).removeprefix("torch."))
    (folder / "config.json").write_text(json.dumps(hf))
    return tensors


def test_qwen3_5_mtp_round_trips_inside_the_model(tmp_path, randomize):
    """Qwen3.5 dense: the MTP layer is full attention with a dense SwiGLU (``/*-``)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    from tests.helpers import assert_same_tensors

    model = qwen3_5(randomize, seed=55)
    save_with_mtp(tmp_path / "hf", model, Qwen3_5DecoderLayer(model.config, 3), randomize)
    assert from_hf(tmp_path / "hf", tmp_path / "ours").pattern == "G-G-G-*-/*-"
    to_hf(tmp_path / "ours", tmp_path / "back")
    assert_same_tensors(tmp_path / "hf", tmp_path / "back")
    same_config(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qwen3_next_mtp_round_trips_inside_the_model(tmp_path, randomize, dtype):
    from tests.helpers import assert_same_tensors, read_all

    _, _, tensors = qwen3_next_with_mtp(tmp_path / "hf", randomize, dtype)
    cfg = from_hf(tmp_path / "hf", tmp_path / "ours")
    assert cfg.pattern == "GEGEGE*E/*E"
    assert not (tmp_path / "ours" / "hf" / "aside").exists()
    ours = read_all(tmp_path / "ours")
    fc = tensors["mtp.fc.weight"]  # [e; h] on disk, [h; e] ours
    assert torch.equal(ours["mtp.0.proj.weight"], torch.cat([fc[:, 32:], fc[:, :32]], 1))
    assert torch.equal(ours["mtp.0.norm_e.weight"], tensors["mtp.pre_fc_norm_embedding.weight"])
    to_hf(tmp_path / "ours", tmp_path / "back")
    assert_same_tensors(tmp_path / "hf", tmp_path / "back")
    same_config(tmp_path)


@pytest.mark.parametrize("change", ["wider-fc", "extra-tensor"])
def test_qwen3_next_mtp_that_is_not_our_part_is_kept_aside(tmp_path, randomize, capsys,
                                                           change):
    """An MTP layer that cannot become our MTP part exactly (an ``mtp.fc`` over three inputs, or
    a tensor our part would not read) is kept aside whole, byte for byte, with a one-line
    notice; the model converts and the export is the source bit for bit."""
    from tests.helpers import assert_same_tensors, read_all

    _, _, tensors = qwen3_next_with_mtp(tmp_path / "hf", randomize)
    g = torch.Generator().manual_seed(7)
    if change == "wider-fc":
        tensors["mtp.fc.weight"] = torch.randn(32, 96, generator=g)
        why = "shape mismatch: 'mtp.fc.weight'"
    else:
        tensors["mtp.embed_tokens.weight"] = torch.randn(97, 32, generator=g)
        why = "'mtp.embed_tokens.weight' has no place in our MTP part"
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    cfg = from_hf(tmp_path / "hf", tmp_path / "ours")
    err = capsys.readouterr().err
    assert cfg.pattern == "GEGEGE*E"  # the main model, no MTP part
    n_mtp = sum(k.startswith("mtp.") for k in tensors)
    assert err.startswith(f"composer: note: {n_mtp} multi-token-prediction tensors kept aside "
                          "byte for byte in hf/aside/ (written back by to-hf), not converted: "
                          + why), err
    assert err.count("\n") == 1
    aside = read_all(tmp_path / "ours" / "hf" / "aside")
    assert sorted(aside) == sorted(k for k in tensors if k.startswith("mtp."))
    to_hf(tmp_path / "ours", tmp_path / "back")
    assert_same_tensors(tmp_path / "hf", tmp_path / "back")
    same_config(tmp_path)


def test_qwen3_next_mtp_loss_equals_a_reference_from_the_hf_tensors(tmp_path, randomize):
    """The formula on the checkpoint's tensors: ``mtp.fc`` on ``[norm_e(e); norm_h(h)]`` as
    stored, zero-centred norms, transformers' decoder layer for the block."""
    model, layer, w = qwen3_next_with_mtp(tmp_path / "hf", randomize)
    from_hf(tmp_path / "hf", tmp_path / "ours")
    ours = composer.load(tmp_path / "ours")
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(6))
    n = ids.shape[1] - 1

    def rms(x, weight):  # zero-centred
        return (1 + weight) * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    assert model.config._attn_implementation == "sdpa"  # no mask: causal
    with torch.no_grad():
        out = ours(ids, ids)
        h = model(ids, output_hidden_states=True).hidden_states[-1]  # after model.norm
        e = w["model.embed_tokens.weight"][ids[:, 1:]]
        u = torch.cat([rms(e, w["mtp.pre_fc_norm_embedding.weight"]),
                       rms(h[:, :n], w["mtp.pre_fc_norm_hidden.weight"])], -1) @ w[
            "mtp.fc.weight"].T
        pos = torch.arange(n)[None]
        x = layer(u, position_embeddings=model.model.rotary_emb(u, pos), position_ids=pos)
        logp = torch.log_softmax(rms(x, w["mtp.norm.weight"]) @ w["lm_head.weight"].T, -1)
        want = -logp[:, :n - 1].gather(-1, ids[:, 2:, None]).mean()
    # a mean of log-softmax values of fp32 logits (FP32_PARITY's error model; log-softmax
    # passes an error with gain <= 2, the mean averages them): the same bound holds
    assert abs(out.mtp_losses[0] - want) < FP32_PARITY * want
    assert abs(out.mtp_loss - 0.1 * want) < FP32_PARITY * out.mtp_loss


def test_qwen3_next_hub_config_form(tmp_path, randomize):
    """The Hub's config.json (transformers 4.57) says full_attention_interval, top-level
    rope_theta and partial_rotary_factor, no layer_types: read, and the interval form kept."""
    model = qwen3_next(randomize, seed=51, rope_parameters={
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        num_hidden_layers=8)
    model.save_pretrained(tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        hf.pop(key)
    hf.update(rope_theta=1e7, partial_rotary_factor=0.25, full_attention_interval=4)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    cfg = from_hf(tmp_path / "hf", tmp_path / "ours")
    assert cfg.pattern == "GEGEGE*E" * 2
    assert cfg.attention.rotary_fraction == 0.25 and cfg.attention.rope_theta == 1e7
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel_err(composer.load(tmp_path / "ours")(ids), model(ids).logits) < FP32_PARITY
    out = to_hf(tmp_path / "ours", tmp_path / "back")
    assert "layer_types" not in out and out["full_attention_interval"] == 4
    assert out["partial_rotary_factor"] == 0.25
    assert out["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_qwen3_next_fused_layout_on_disk_is_read(tmp_path, randomize):
    model = qwen3_next(randomize, seed=52)
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    disk = load_file(tmp_path / "fused" / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj" in disk
    from_hf(tmp_path / "fused", tmp_path / "ours")
    to_hf(tmp_path / "ours", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(disk) and all(torch.equal(back[k], disk[k]) for k in disk)


def test_qwen3_next_refusals():
    adapter = Qwen3NextAdapter()
    cfg = get_preset("qwen3-next-debug").config()
    cfg.norm_zero_centered = False
    with pytest.raises(ConfigError, match="qwen3-next needs norm_zero_centered=true"):
        adapter.config_to_hf(cfg, {})
    cfg = get_preset("qwen3-next-debug").config()
    cfg.attention.output_gate = False
    with pytest.raises(ConfigError, match="attention.output_gate=true"):
        adapter.config_to_hf(cfg, {})
    cfg = get_preset("qwen3-next-debug").config()
    cfg.pattern = "GEG*E-*E"
    with pytest.raises(ConfigError, match="every layer must be a 'G' or '\\*' followed by"):
        adapter.config_to_hf(cfg, {})
    cfg = get_preset("qwen3-next-debug").config()
    cfg.moe.shared_expert_gate = False
    with pytest.raises(ConfigError, match="one gated shared expert"):
        adapter.config_to_hf(cfg, {})
    with pytest.raises(ConfigError, match="layer_types must list 2 of"):
        adapter.config_from_hf({**COMMON, "num_hidden_layers": 2, "layer_types": ["mamba"] * 2})
    cfg = get_preset("qwen3.5-moe-debug").config()
    cfg.moe.renormalize = False
    with pytest.raises(ConfigError, match="renormalised in Qwen3.5-MoE"):
        Qwen3_5MoeAdapter().config_to_hf(cfg, {})


def test_qwen3_next_preset_is_inferred():
    assert infer_adapter(get_preset("qwen3-next-debug").config()).family == "qwen3-next"


# ---------------------------------------------------------------- Qwen3.5


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_5(check_family, randomize, tmp_path, tied):
    model = qwen3_5(randomize, seed=60, tie_word_embeddings=tied)
    cfg = check_family(model)
    assert cfg.pattern == "G-G-G-*-" and cfg.moe is None and cfg.mlp.d_ff == 48
    assert cfg.norm_zero_centered and cfg.attention.output_gate
    same_config(tmp_path)


def test_qwen3_5_moe(check_family, randomize, tmp_path):
    model = qwen3_5_moe(randomize, seed=61, layer_types=[
        "linear_attention", "full_attention", "linear_attention", "full_attention"])
    cfg = check_family(model)
    assert cfg.pattern == "GE*EGE*E" and cfg.mlp is None
    assert cfg.moe.renormalize and cfg.moe.shared_expert_gate
    same_config(tmp_path)


def test_qwen3_5_mrope_fields_kept(tmp_path, randomize):
    """Hub text configs carry mrope_section / mrope_interleaved in rope_parameters (text-only
    positions make M-RoPE plain RoPE): kept on export."""
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    model = qwen3_5(randomize, seed=62, rope_parameters=rope)
    model.save_pretrained(tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "ours")
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert rel_err(composer.load(tmp_path / "ours")(ids), model(ids).logits) < FP32_PARITY
    assert to_hf(tmp_path / "ours", tmp_path / "back")["rope_parameters"] == rope


# ---------------------------------------------------------------- block options, fp64


def _linear_weights(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)


@pytest.mark.parametrize("scope", ["head", "all"])
def test_attention_output_gate_and_zero_centred_qk_norm(scope):
    a = AttentionConfig(n_heads=4, n_kv_heads=2, d_head=8, rotary_fraction=0.25, qk_norm=True,
                        qk_norm_scope=scope, output_gate=True, qkv_bias=True, out_bias=True)
    cfg = ModelConfig(pattern="*", d_model=24, attention=a, norm_zero_centered=True, mamba=None,
                      mlp=None, moe=None)
    block = Attention(cfg).to(F64)
    assert block.q_proj.weight.shape == (2 * 4 * 8, 24)
    _linear_weights(block, 0)
    sd = block.state_dict()
    w = {k.removesuffix(".weight"): v for k, v in sd.items() if k.endswith("weight")}
    w.update({f"{k[0]}_bias": v for k, v in sd.items() if k.endswith("bias")})
    x = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(1), dtype=F64)
    with torch.no_grad():
        got = block(x)
    want = attention_ref(x, w, a, 8, eps=cfg.norm_eps, zero_centered=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # the gate and the (1 + w) scale both matter
    ones = {**w, "q_proj": w["q_proj"].clone()}
    ones["q_proj"].view(4, 2, 8, 24)[:, 1] = 0  # g = bias only
    assert not torch.allclose(attention_ref(x, ones, a, 8, cfg.norm_eps, zero_centered=True), want)
    assert not torch.allclose(attention_ref(x, w, a, 8, cfg.norm_eps), want)


def test_zero_centred_rms_norm():
    norm = RMSNorm(16, 1e-6, zero_centered=True).to(F64)
    assert torch.equal(norm.weight, torch.zeros(16, dtype=F64))  # 1 + 0: the identity scale
    _linear_weights(norm, 2)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3), dtype=F64)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), rms_norm_ref(x, norm.weight, 1e-6, True),
                                   atol=1e-14, rtol=0)
        assert not torch.allclose(norm(x), rms_norm_ref(x, norm.weight, 1e-6))


def test_zero_centred_flag_reaches_every_norm():
    model = composer.build_model(get_preset("qwen3-next-debug").config(), device="meta")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 8 + 1 + 2 and all(n.zero_centered for n in norms)
    plain = composer.build_model(get_preset("qwen3-debug").config(), device="meta")
    assert not any(m.zero_centered for m in plain.modules() if isinstance(m, RMSNorm))


def test_gated_shared_expert():
    moe = MoEConfig(n_experts=4, top_k=2, d_ff=8, n_shared_experts=1, d_ff_shared=12,
                    shared_expert_gate=True)
    cfg = ModelConfig(pattern="E", d_model=16, moe=moe, attention=None, mamba=None, mlp=None)
    block = MoE(cfg).to(F64)
    _linear_weights(block, 4)
    assert block.shared_expert_gate.weight.shape == (1, 16)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(5), dtype=F64)
    with torch.no_grad():
        got = block(x)
    want = moe_ref(x, dict(block.state_dict()), cfg)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    ungated = dict(block.state_dict())
    ungated["shared_expert_gate.weight"] = torch.full((1, 16), 0.0, dtype=F64)  # gate 1/2
    assert not torch.allclose(moe_ref(x, ungated, cfg), want)
    with pytest.raises(ConfigError, match="moe.shared_expert_gate needs shared experts"):
        ModelConfig(pattern="E", d_model=16, attention=None, mamba=None, mlp=None,
                    moe=MoEConfig(shared_expert_gate=True)).validate()
