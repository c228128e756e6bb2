"""DeepSeek-V3 (MLA + dense / sigmoid-routed MoE): HF -> composer -> HF, logits and bytes; the
interleaved RoPE rows are permuted on import and restored exactly on export. DeepSeek-V3.2: the
same up to index_topk tokens, its DSA indexer tensors kept aside byte for byte, longer sequences
refused."""

import pytest
import torch

from composer.config import ConfigError

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.707, "mscale_all_dim": 1.0}


def tiny(**kw):
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_group=2, topk_group=1,
                num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
                max_position_embeddings=256, rope_parameters=YARN, num_nextn_predict_layers=0)
    base.update(kw)
    return base


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["lora-q", "full-q"])
def test_deepseek_v3(check_family, randomize, q_lora_rank):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(DeepseekV3Config(**tiny(q_lora_rank=q_lora_rank)))
    randomize(model, seed=5)
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0  # the score-correction bias is random too
    cfg = check_family(model)
    assert cfg.pattern == "+-+E+E"
    assert cfg.mla.q_lora_rank == q_lora_rank and cfg.mla.rope_scaling.mscale_all_dim == 1.0
    assert (cfg.moe.n_expert_groups, cfg.moe.topk_groups, cfg.moe.routed_scaling_factor) == \
        (2, 1, 2.5)


def test_deepseek_v3_plain_rope_all_moe(check_family, randomize):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf = DeepseekV3Config(**tiny(first_k_dense_replace=0, n_group=1, topk_group=1,
                                 n_shared_experts=2, norm_topk_prob=False,
                                 rope_parameters={"rope_type": "default",
                                                  "rope_theta": 5000.0}))
    model = DeepseekV3ForCausalLM(hf)
    randomize(model, seed=6)
    cfg = check_family(model, bf16=False)
    assert cfg.pattern == "+E+E+E" and cfg.moe.n_shared_experts == 2
    assert cfg.mla.rope_scaling is None and not cfg.moe.renormalize


def test_mtp_weights_are_kept_aside_and_written_back(tmp_path, randomize):
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from composer.convert import from_hf, to_hf

    model = DeepseekV3ForCausalLM(DeepseekV3Config(**tiny(num_nextn_predict_layers=1)))
    randomize(model)
    model.save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    weights["model.layers.3.eh_proj.weight"] = torch.randn(32, 64)
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    from_hf(tmp_path / "hf", tmp_path / "ours")
    to_hf(tmp_path / "ours", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert set(back) == set(weights)
    assert torch.equal(back["model.layers.3.eh_proj.weight"],
                       weights["model.layers.3.eh_proj.weight"])


def test_unsupported_fields_are_refused():
    from composer.convert.deepseek import DeepseekV3Adapter

    adapter = DeepseekV3Adapter()
    with pytest.raises(ConfigError, match="rope_interleave=false"):
        adapter.config_from_hf(tiny(rope_interleave=False))
    with pytest.raises(ConfigError, match="quantized checkpoints"):
        adapter.config_from_hf(tiny(quantization_config={"quant_method": "fp8"}))


def tiny_v32(**kw):
    base = tiny(index_topk=24, index_n_heads=2, index_head_dim=8)
    base.update(kw)
    return base


@pytest.mark.parametrize("mlp_layer_types", [None, ["sparse", "dense", "sparse"]],
                         ids=["first-k-dense", "mixed"])
def test_deepseek_v32(check_family, randomize, tmp_path, mlp_layer_types):
    from safetensors.torch import load_file
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    import composer

    model = DeepseekV32ForCausalLM(DeepseekV32Config(**tiny_v32(mlp_layer_types=mlp_layer_types)))
    randomize(model, seed=7)
    indexer = model.model.layers[0].self_attn.indexer
    assert indexer.k_norm.bias.abs().max() > 0 and indexer.wq_b.weight.abs().max() > 0
    # 2 x 19 tokens <= index_topk: the indexer selects every causal key, dense MLA is exact
    cfg = check_family(model, bf16=mlp_layer_types is None)
    assert cfg.mla.max_dense_len == 24
    assert cfg.pattern == ("+-+E+E" if mlp_layer_types is None else "+E+-+E")
    aside = load_file(tmp_path / "ours" / "hf" / "aside" / "model.safetensors")
    names = {f"model.layers.{i}.self_attn.indexer.{w}" for i in range(3)
             for w in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                       "weights_proj.weight")}
    assert set(aside) == names
    back = load_file(tmp_path / "back" / "model.safetensors")
    for name in names:  # written back byte for byte
        assert back[name].dtype == aside[name].dtype and torch.equal(back[name], aside[name])
    import json
    hf_back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (hf_back["index_topk"], hf_back["index_n_heads"], hf_back["index_head_dim"]) == \
        (24, 2, 8)
    assert "rope_interleave" not in hf_back
    ours = composer.load(tmp_path / "ours")
    ids = torch.randint(0, 97, (1, 25))
    with pytest.raises(ValueError, match=r"sparse attention \(DeepSeek-V3.2's indexer, top-k "
                       r"24\) is not built; sequences up to 24 tokens are exact"):
        ours(ids)
    with torch.no_grad():
        assert ours(ids[:, :24]).shape == (1, 24, 97)


def test_deepseek_v32_refusals():
    from composer.convert.deepseek import DeepseekV32Adapter

    adapter = DeepseekV32Adapter()
    with pytest.raises(ConfigError, match="needs q_lora_rank"):
        adapter.config_from_hf(tiny_v32(q_lora_rank=None))
    with pytest.raises(ConfigError, match="layer_types"):
        adapter.config_from_hf(tiny_v32(layer_types=["full_attention"] * 3))
    cfg = adapter.config_from_hf(tiny_v32())
    with pytest.raises(ConfigError, match="source checkpoint"):
        adapter.config_to_hf(cfg, {})
