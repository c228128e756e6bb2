"""Llama, Qwen3, Qwen3-MoE and Mixtral: HF -> composer -> HF, logits and bytes."""

import pytest
import torch

import composer
from composer.convert import from_hf, to_hf
from tests.helpers import FP32_PARITY, rel_err


def small(**kw):
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    base.update(kw)
    return base


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


@pytest.mark.parametrize("tied", [False, True])
def test_llama(check_family, randomize, tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**small(tie_word_embeddings=tied,
                                                 rope_parameters=LLAMA3_ROPE)))
    randomize(model)
    cfg = check_family(model)
    assert cfg.pattern == "*-*-*-" and cfg.tie_embeddings == tied
    assert cfg.attention.rope_scaling.original_max_position == 16


def test_llama_bias_and_plain_rope(check_family, randomize):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**small(attention_bias=True, mlp_bias=True,
                                                 rope_theta=1234.0, head_dim=16)))
    randomize(model, seed=1)
    cfg = check_family(model)
    assert cfg.attention.rope_theta == 1234.0 and cfg.attention.d_head == 16
    assert cfg.attention.qkv_bias and cfg.mlp.bias


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3(check_family, randomize, tied):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**small(head_dim=16, tie_word_embeddings=tied)))
    randomize(model, seed=2)
    cfg = check_family(model)
    assert cfg.attention.qk_norm


@pytest.mark.parametrize("norm_topk", [True, False])
def test_qwen3_moe_with_dense_layers(check_family, randomize, norm_topk):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_cfg = Qwen3MoeConfig(**small(head_dim=16, num_hidden_layers=4, moe_intermediate_size=24,
                                    num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                    decoder_sparse_step=1, norm_topk_prob=norm_topk))
    model = Qwen3MoeForCausalLM(hf_cfg)
    randomize(model, seed=3)
    cfg = check_family(model)
    assert cfg.pattern == "*E*-*E*E"
    assert cfg.moe.renormalize == norm_topk


def test_qwen3_moe_sparse_step(check_family, randomize):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_cfg = Qwen3MoeConfig(**small(head_dim=8, num_hidden_layers=4, moe_intermediate_size=16,
                                    num_experts=3, num_experts_per_tok=1, decoder_sparse_step=2))
    model = Qwen3MoeForCausalLM(hf_cfg)
    randomize(model, seed=4)
    assert check_family(model, bf16=False).pattern == "*-*E*-*E"


def test_mixtral(check_family, randomize):
    from transformers import MixtralConfig, MixtralForCausalLM

    model = MixtralForCausalLM(MixtralConfig(**small(num_local_experts=4,
                                                     num_experts_per_tok=2)))
    randomize(model, seed=5)
    cfg = check_family(model)
    assert cfg.pattern == "*E*E*E" and cfg.moe.n_experts == 4


def test_fused_expert_layout_on_disk_is_read(tmp_path, randomize):
    """transformers 5 can save experts fused (save_original_format=False): read that too."""
    from transformers import MixtralConfig, MixtralForCausalLM

    model = MixtralForCausalLM(MixtralConfig(**small(num_local_experts=3))).eval()
    randomize(model, seed=6)
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "pt") as f:
        assert any("experts.gate_up_proj" in k for k in f.keys())
    from_hf(tmp_path / "fused", tmp_path / "ours")
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert rel_err(composer.load(tmp_path / "ours")(ids), model(ids).logits) < FP32_PARITY
    to_hf(tmp_path / "ours", tmp_path / "back")  # the fused layout is reproduced
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "fused" / "model.safetensors"), \
        load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
