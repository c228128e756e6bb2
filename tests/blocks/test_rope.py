"""RoPE scalings (linear, llama3, yarn) against transformers' rotary code, and their HF config
round trip."""

import pytest
import torch

from composer import AttentionConfig, ModelConfig, RopeScaling
from composer.blocks.attention import Attention, attention_ref
from composer.blocks.rope import rope_frequencies, rope_gain
from composer.config import d_head_of
from composer.convert.base import rope_scaling_from_hf, rope_scaling_to_hf

HF_PARAMS = {
    "linear": {"rope_type": "linear", "factor": 8.0},
    "yarn-gpt-oss": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 4096},
    "yarn-truncate": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
                      "original_max_position_embeddings": 2048},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5,
                              "original_max_position_embeddings": 2048},
    "yarn-mscale": {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                    "original_max_position_embeddings": 4096},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


@pytest.mark.parametrize("name", HF_PARAMS)
def test_scaling_matches_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 150000.0, **HF_PARAMS[name]}
    hf = LlamaConfig(hidden_size=512, num_attention_heads=8, head_dim=64,
                     max_position_embeddings=131072, rope_parameters=params)
    inv_freq, gain = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    scaling = rope_scaling_from_hf(params)
    ours = rope_frequencies(64, 150000.0, scaling)
    torch.testing.assert_close(ours.float(), inv_freq.float(), rtol=1e-6, atol=0)
    assert rope_gain(scaling) == pytest.approx(gain, rel=1e-12)
    back = {"rope_theta": 150000.0, **rope_scaling_to_hf(scaling)}
    assert rope_scaling_from_hf(back) == scaling


@pytest.mark.parametrize("scaling", [RopeScaling(rope_type="linear", factor=4.0),
                                     RopeScaling(rope_type="yarn", factor=8.0,
                                                 original_max_position=16, truncate=False)],
                         ids=["linear", "yarn"])
def test_scaled_attention_matches_reference(scaling):
    cfg = ModelConfig(pattern="*", d_model=32, attention=AttentionConfig(
        n_heads=4, n_kv_heads=2, rope_theta=1000.0, rope_scaling=scaling))
    attn = Attention(cfg).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    w = {n: getattr(attn, n).weight for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    x = torch.randn(2, 23, 32, dtype=torch.float64, generator=g)
    ref = attention_ref(x, w, cfg.attention, d_head_of(cfg))
    torch.testing.assert_close(attn(x), ref, atol=1e-10, rtol=0)


def test_yarn_attention_matches_transformers_rotary():
    """Our cos/sin tables (YaRN gain included) equal transformers' rotary embedding's."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"rope_theta": 10000.0, **HF_PARAMS["yarn-gpt-oss"]}
    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64,
                     max_position_embeddings=131072, rope_parameters=params)
    rot = LlamaRotaryEmbedding(hf)
    x = torch.zeros(1, 40, 64)
    cos, sin = rot(x, torch.arange(40)[None])
    cfg = ModelConfig(pattern="*", d_model=256, attention=AttentionConfig(
        n_heads=4, d_head=64, rope_theta=10000.0, rope_scaling=rope_scaling_from_hf(params)))
    ours_cos, ours_sin = Attention(cfg).rotary.table(40, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(ours_cos, cos[0], atol=1e-5, rtol=0)  # fp32 vs fp64 freqs
    torch.testing.assert_close(ours_sin, sin[0], atol=1e-5, rtol=0)


def test_scaling_validation():
    from composer.config import ConfigError

    cfg = ModelConfig(pattern="*", d_model=32, attention=AttentionConfig(
        n_heads=4, rope_scaling=RopeScaling(rope_type="yarn", factor=-1.0)))
    with pytest.raises(ConfigError, match="attention.rope_scaling.factor"):
        cfg.validate()
