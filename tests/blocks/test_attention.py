"""Attention against its plain-math twin (fp64, 1e-10) and against transformers (fp32, 1e-5)."""

import pytest
import torch

from composer import AttentionConfig, ModelConfig, RopeScaling
from composer.blocks.attention import Attention, attention_ref, rope_frequencies
from composer.config import d_head_of


def _weights(attn: Attention) -> dict[str, torch.Tensor]:
    w = {name: getattr(attn, name).weight for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    for name in ("q", "k", "v"):
        if getattr(attn, f"{name}_proj").bias is not None:
            w[f"{name}_bias"] = getattr(attn, f"{name}_proj").bias
    if attn.o_proj.bias is not None:
        w["o_bias"] = attn.o_proj.bias
    if attn.qk_norm:
        w["q_norm"], w["k_norm"] = attn.q_norm.weight, attn.k_norm.weight
    return w


def _randomize(module: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3 + (p.ndim == 1))


CASES = {
    "mha-rope": AttentionConfig(n_heads=4),
    "gqa-llama3": AttentionConfig(n_heads=4, n_kv_heads=2, rope_theta=500000.0,
                                  rope_scaling=RopeScaling(factor=8.0, original_max_position=16)),
    "mqa-nope": AttentionConfig(n_heads=4, n_kv_heads=1, position="none"),
    "qknorm-bias-dhead": AttentionConfig(n_heads=4, n_kv_heads=2, d_head=12, qk_norm=True,
                                         qkv_bias=True, out_bias=True),
    "partial-rotary-scale": AttentionConfig(n_heads=2, rotary_fraction=0.5, softmax_scale=0.1),
    "qknorm-all-gqa-partial": AttentionConfig(n_heads=4, n_kv_heads=2, d_head=12, qk_norm=True,
                                              qk_norm_scope="all", rotary_fraction=0.5),
    "glm-qkv-bias-only": AttentionConfig(n_heads=4, n_kv_heads=2, qk_norm=True, qkv_bias=True,
                                         out_bias=False, rotary_fraction=0.5),
}


@pytest.mark.parametrize("name", CASES)
def test_attention_matches_reference(name):
    cfg = ModelConfig(pattern="*", d_model=32, attention=CASES[name])
    attn = Attention(cfg).double()
    _randomize(attn)
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    ref = attention_ref(x, _weights(attn), cfg.attention, d_head_of(cfg), cfg.norm_eps)
    torch.testing.assert_close(attn(x), ref, atol=1e-10, rtol=0)
    attn32 = attn.float()
    torch.testing.assert_close(attn32(x.float()), ref.float(), atol=1e-5, rtol=1e-5)


def test_attention_is_causal():
    cfg = ModelConfig(pattern="*", d_model=32, attention=AttentionConfig(n_heads=4, n_kv_heads=2))
    attn = Attention(cfg).double()
    _randomize(attn)
    x = torch.randn(1, 10, 32, dtype=torch.float64)
    y = attn(x)
    x2 = x.clone()
    x2[:, 6:] += torch.randn_like(x2[:, 6:])
    y2 = attn(x2)
    torch.testing.assert_close(y[:, :6], y2[:, :6], atol=1e-12, rtol=0)
    assert (y[:, 6:] - y2[:, 6:]).abs().max() > 1e-3


def test_llama3_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = rope_frequencies(128, 500000.0, RopeScaling(factor=8.0))
    torch.testing.assert_close(ours.float(), inv_freq.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_matches_transformers(family):
    if family == "llama":
        from transformers import LlamaConfig as C
        from transformers.models.llama.modeling_llama import LlamaAttention as A
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding as R
        extra = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8}}
        ours = AttentionConfig(n_heads=4, n_kv_heads=2, d_head=16, rope_theta=500000.0,
                               rope_scaling=RopeScaling(factor=8.0, original_max_position=8))
    else:
        from transformers import Qwen3Config as C
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention as A
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as R
        extra = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
        ours = AttentionConfig(n_heads=4, n_kv_heads=2, d_head=16, rope_theta=1e6, qk_norm=True)
    hf_cfg = C(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               rms_norm_eps=1e-6, attention_bias=False, **extra)
    hf_cfg._attn_implementation = "eager"
    hf = A(hf_cfg, layer_idx=0)
    _randomize(hf, seed=3)
    cfg = ModelConfig(pattern="*", d_model=32, norm_eps=1e-6, attention=ours)
    attn = Attention(cfg)
    missing, unexpected = attn.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(2, 13, 32)
    pos = torch.arange(13).unsqueeze(0).expand(2, -1)
    cos, sin = R(hf_cfg)(x, pos)
    mask = torch.full((13, 13), float("-inf")).triu(1)[None, None]
    expected = hf(x, position_embeddings=(cos, sin), attention_mask=mask)[0]
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)


def test_qk_norm_scope_all_is_one_rms_over_all_heads():
    """Scope 'all' normalises the whole projection: per-head norms give a different result, and
    the weights are as wide as the projection."""
    base = dict(n_heads=4, n_kv_heads=2, d_head=8, qk_norm=True)
    whole = Attention(ModelConfig(pattern="*", d_model=32,
                                  attention=AttentionConfig(**base, qk_norm_scope="all")))
    per_head = Attention(ModelConfig(pattern="*", d_model=32, attention=AttentionConfig(**base)))
    assert whole.q_norm.weight.shape == (32,) and whole.k_norm.weight.shape == (16,)
    assert per_head.q_norm.weight.shape == (8,)
    _randomize(whole)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(per_head, name).weight.copy_(getattr(whole, name).weight)
    x = torch.randn(1, 7, 32) * torch.tensor([3.0] * 16 + [0.1] * 16)
    assert (whole(x) - per_head(x)).abs().max() > 1e-3


def test_qk_norm_scope_all_refuses_tensor_parallel():
    from composer.blocks.attention import Unsplit

    a = AttentionConfig(n_heads=4, n_kv_heads=2, qk_norm=True, qk_norm_scope="all")
    rules = Attention.layout_rules(ModelConfig(pattern="*", d_model=32, attention=a))
    unsplit = [r for r in rules if isinstance(r, Unsplit)]
    assert len(unsplit) == 1 and unsplit[0].problem({"tp": 1}) is None
    assert unsplit[0].problem({"tp": 2}) == (
        "attention.qk_norm_scope='all' (one RMS over all heads) cannot be split over tp (2); "
        "use tp=1")
    head = AttentionConfig(n_heads=4, n_kv_heads=2, qk_norm=True)
    assert not any(isinstance(r, Unsplit) for r in Attention.layout_rules(
        ModelConfig(pattern="*", d_model=32, attention=head)))


def _hf_rope_check(hf_cfg, attn_cls, rope_cls, ours: AttentionConfig, seed: int) -> None:
    hf_cfg._attn_implementation = "eager"
    hf = attn_cls(hf_cfg, layer_idx=0)
    _randomize(hf, seed=seed)
    cfg = ModelConfig(pattern="*", d_model=32, norm_eps=1e-6, attention=ours)
    attn = Attention(cfg)
    attn.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(2, 13, 32)
    pos = torch.arange(13).unsqueeze(0).expand(2, -1)
    cos, sin = rope_cls(hf_cfg)(x, pos)
    assert cos.shape[-1] == int(d_head_of(cfg) * ours.rotary_fraction)
    mask = torch.full((13, 13), float("-inf")).triu(1)[None, None]
    expected = hf(x, position_embeddings=(cos, sin), attention_mask=mask)[0]
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-5)


def test_glm4_moe_attention_matches_transformers():
    """Partial rotate-half RoPE on the first half of each head, q/k/v biases without an o bias,
    per-head qk-norm."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeAttention as A
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding as R

    hf_cfg = Glm4MoeConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, rms_norm_eps=1e-6, attention_bias=True, use_qk_norm=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                            "partial_rotary_factor": 0.5})
    ours = AttentionConfig(n_heads=4, n_kv_heads=2, d_head=16, rope_theta=1e4, qk_norm=True,
                           qkv_bias=True, rotary_fraction=0.5)
    _hf_rope_check(hf_cfg, A, R, ours, seed=4)


def test_minimax_m2_attention_matches_transformers():
    """qk-norm over the whole projection and a rotary_dim of a quarter of each head."""
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2Attention as A
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RotaryEmbedding as R

    hf_cfg = MiniMaxM2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, rms_norm_eps=1e-6, rotary_dim=4, rope_theta=5e6)
    ours = AttentionConfig(n_heads=4, n_kv_heads=2, d_head=16, rope_theta=5e6, qk_norm=True,
                           qk_norm_scope="all", rotary_fraction=0.25)
    _hf_rope_check(hf_cfg, A, R, ours, seed=5)
