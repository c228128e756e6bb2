"""DeepSeek-V3 (MLA + dense / sigmoid-routed MoE): HF -> composer -> HF, logits and bytes; the
interleaved RoPE rows are permuted on import and restored exactly on export."""

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
