"""GLM-4.5 (Glm4MoeForCausalLM) and MiniMax-M2 (MiniMaxM2ForCausalLM): HF -> composer -> HF,
logits and bytes; the rotary-fraction config forms; refusals (MTP layers, unwritable configs)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from composer.config import ConfigError
from composer.convert import from_hf, infer_adapter, to_hf
from composer.convert.glm4_moe import Glm4MoeAdapter
from composer.convert.minimax_m2 import MiniMaxM2Adapter
from composer.zoo import get_preset
from tests.helpers import FP32_PARITY, rel_err


def glm_kwargs(**kw):
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                first_k_dense_replace=1, max_position_embeddings=256)
    return {**base, **kw}


def glm(randomize, seed=0, **kw):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    model = Glm4MoeForCausalLM(Glm4MoeConfig(**glm_kwargs(**kw))).eval()
    randomize(model, seed=seed)
    return model


def minimax_kwargs(**kw):
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=6,
                num_experts_per_tok=2, rotary_dim=8, max_position_embeddings=256,
                bos_token_id=None, eos_token_id=None)
    return {**base, **kw}


def minimax(randomize, seed=0, **kw):
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**minimax_kwargs(**kw))).eval()
    randomize(model, seed=seed)
    return model


# ---------------------------------------------------------------- GLM-4.5


@pytest.mark.parametrize(("qk_norm", "bias", "groups", "dense"),
                         [(True, True, 2, 1), (False, True, 1, 2), (True, False, 4, 0)])
def test_glm4_moe(check_family, randomize, tmp_path, qk_norm, bias, groups, dense):
    model = glm(randomize, seed=20 + dense, use_qk_norm=qk_norm, attention_bias=bias,
                n_group=groups, topk_group=max(1, groups // 2), routed_scaling_factor=2.5,
                first_k_dense_replace=dense, n_shared_experts=2 if dense == 2 else 1,
                norm_topk_prob=dense != 2)
    cfg = check_family(model)
    assert cfg.pattern == "*-" * dense + "*E" * (4 - dense)
    a, moe = cfg.attention, cfg.moe
    assert (a.qk_norm, a.qk_norm_scope, a.qkv_bias, a.out_bias) == (qk_norm, "head", bias, False)
    assert a.rotary_fraction == 0.5  # Glm4MoeConfig's default
    assert (moe.score_func, moe.score_correction_bias, moe.routed_scaling_factor) == \
        ("sigmoid", True, 2.5)
    assert (moe.n_expert_groups, moe.n_shared_experts, moe.renormalize) == \
        (groups, 2 if dense == 2 else 1, dense != 2)
    src, back = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "back"))
    assert back == src  # the export's config.json is the source's, field for field


def test_glm4_moe_bf16_keeps_router_fp32(tmp_path, randomize):
    """A checkpoint loaded by transformers in bf16 keeps the router in fp32 on disk; the
    export writes the same dtypes."""
    from transformers import AutoModelForCausalLM

    glm(randomize, seed=24).save_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "hf16")
    disk = load_file(tmp_path / "hf16" / "model.safetensors")
    assert disk["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert disk["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert disk["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    from_hf(tmp_path / "hf16", tmp_path / "ours")
    to_hf(tmp_path / "ours", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(disk)
    assert all(torch.equal(back[k].view(torch.uint8), disk[k].view(torch.uint8)) for k in disk)


def test_glm4_moe_hub_config_form(tmp_path, randomize):
    """The Hub's config.json (transformers 4.54) has top-level rope_theta and
    partial_rotary_factor; both are read and kept consistent on export."""
    model = glm(randomize, seed=25, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                     "partial_rotary_factor": 0.25})
    model.save_pretrained(tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf.pop("rope_parameters")
    hf.update(rope_theta=1e6, partial_rotary_factor=0.25, rope_scaling=None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    cfg = from_hf(tmp_path / "hf", tmp_path / "ours")
    assert cfg.attention.rotary_fraction == 0.25 and cfg.attention.rope_theta == 1e6
    out = to_hf(tmp_path / "ours", tmp_path / "back")
    assert out["partial_rotary_factor"] == 0.25
    assert out["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6,
                                      "partial_rotary_factor": 0.25}


def test_glm4_moe_mtp_layers_are_kept_aside_and_written_back(tmp_path, randomize):
    """GLM-4.5 ships its MTP layer at model.layers.{num_hidden_layers}: kept byte for byte in
    hf/aside/ and written back on export, in fp32 and bf16 alike."""
    glm(randomize, seed=26).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.4.eh_proj.weight"] = torch.randn(32, 64)
    tensors["model.layers.4.enorm.weight"] = torch.randn(32).to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})
    from_hf(tmp_path / "hf", tmp_path / "ours")
    assert (tmp_path / "ours" / "hf" / "aside").is_dir()
    to_hf(tmp_path / "ours", tmp_path / "back")
    back = {}
    for f in sorted((tmp_path / "back").glob("*.safetensors")):
        back.update(load_file(f))
    for k in ("model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight"):
        assert back[k].dtype == tensors[k].dtype and torch.equal(back[k], tensors[k]), k
    assert set(back) == set(tensors)


def test_glm4_moe_refusals():
    adapter = Glm4MoeAdapter()
    cfg = get_preset("glm4-moe-debug").config()
    cfg.pattern = "*E*-*E"
    with pytest.raises(ConfigError, match="the dense '\\*-' layers must all come first"):
        adapter.config_to_hf(cfg, {})
    cfg = get_preset("glm4-moe-debug").config()
    cfg.attention.out_bias = True
    with pytest.raises(ConfigError, match="no o_proj bias"):
        adapter.config_to_hf(cfg, {})
    cfg = get_preset("glm4-moe-debug").config()
    cfg.moe.score_func = "softmax"
    with pytest.raises(ConfigError, match="set moe.score_func=sigmoid"):
        adapter.config_to_hf(cfg, {})
    with pytest.raises(ConfigError, match="fewer than 2 per group"):
        adapter.config_from_hf(glm_kwargs(n_group=8, architectures=["Glm4MoeForCausalLM"]))


def test_glm4_moe_preset_is_inferred_and_fresh_export_has_no_mtp():
    cfg = get_preset("glm4-moe-debug").config()
    adapter = infer_adapter(cfg)
    assert adapter.family == "glm4-moe"
    assert adapter.config_to_hf(cfg, {})["num_nextn_predict_layers"] == 0


# ---------------------------------------------------------------- MiniMax-M2


@pytest.mark.parametrize("tied", [False, True])
def test_minimax_m2(check_family, randomize, tmp_path, tied):
    model = minimax(randomize, seed=30, tie_word_embeddings=tied)
    cfg = check_family(model)
    assert cfg.pattern == "*E*E*E" and cfg.tie_embeddings == tied
    a, moe = cfg.attention, cfg.moe
    assert (a.qk_norm, a.qk_norm_scope, a.qkv_bias, a.rotary_fraction) == (True, "all", False, 0.5)
    assert (moe.n_experts, moe.top_k, moe.d_ff, moe.score_func, moe.score_correction_bias) == \
        (6, 2, 16, "sigmoid", True)
    src, back = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "back"))
    assert back == src


def test_minimax_m2_rotary_dim_only(tmp_path, randomize):
    """The released config.json says rotary_dim (no partial_rotary_factor): it is honoured."""
    model = minimax(randomize, seed=31, rotary_dim=4)
    model.save_pretrained(tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf.pop("rope_parameters")
    hf["rope_theta"] = 5e6
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    cfg = from_hf(tmp_path / "hf", tmp_path / "ours")
    assert cfg.attention.rotary_fraction == 0.25
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(6))
    import composer

    with torch.no_grad():
        assert rel_err(composer.load(tmp_path / "ours")(ids), model(ids).logits) < FP32_PARITY
    out = to_hf(tmp_path / "ours", tmp_path / "back")
    assert out["rotary_dim"] == 4 and out["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_minimax_m2_fused_layout_on_disk_is_read(tmp_path, randomize):
    model = minimax(randomize, seed=32)
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    disk = load_file(tmp_path / "fused" / "model.safetensors")
    assert "model.layers.0.mlp.e_score_correction_bias" in disk
    from_hf(tmp_path / "fused", tmp_path / "ours")
    to_hf(tmp_path / "ours", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(disk) and all(torch.equal(back[k], disk[k]) for k in disk)


def test_minimax_m2_refusals(tmp_path, randomize):
    adapter = MiniMaxM2Adapter()
    cfg = get_preset("minimax-m2-debug").config()
    cfg.attention.qk_norm_scope = "head"
    with pytest.raises(ConfigError, match="qk-norm over the whole projection"):
        adapter.config_to_hf(cfg, {})
    cfg = get_preset("minimax-m2-debug").config()
    cfg.moe.routed_scaling_factor = 2.0
    with pytest.raises(ConfigError, match="needs moe.routed_scaling_factor=1.0"):
        adapter.config_to_hf(cfg, {})
    with pytest.raises(ConfigError, match="router_jitter_noise=0.1 is not supported"):
        adapter.config_from_hf(minimax_kwargs(router_jitter_noise=0.1))
    minimax(randomize, seed=33).save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.3.self_attn.q_proj.weight"] = torch.randn(64, 32)  # an MTP layer
    save_file(tensors, path, metadata={"format": "pt"})
    from_hf(tmp_path / "hf", tmp_path / "ours")  # kept aside, written back
    to_hf(tmp_path / "ours", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert torch.equal(back["model.layers.3.self_attn.q_proj.weight"],
                       tensors["model.layers.3.self_attn.q_proj.weight"])


def test_minimax_m2_preset_is_inferred():
    assert infer_adapter(get_preset("minimax-m2-debug").config()).family == "minimax-m2"
