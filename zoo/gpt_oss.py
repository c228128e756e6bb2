"""gpt-oss (OpenAI, 2025): attention with learned per-head sinks, sliding-window (``W``, 128
tokens) and full (``*``) layers alternating, each followed by a top-4 MoE (``E``) whose router
has a bias and softmaxes the chosen logits, whose experts have biases and a clamped SwiGLU.

Numbers from the HF ``config.json`` of ``openai/gpt-oss-20b`` and ``openai/gpt-oss-120b``
(https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json, .../gpt-oss-120b/...), shared
by both: vocabulary 201088, untied head, d_model 2880, 64 query heads and 8 kv heads of 64
(``head_dim``, decoupled from d_model), ``attention_bias`` true, RMSNorm eps 1e-5,
``initializer_range`` 0.02, RoPE theta 150000 with YaRN (factor 32, 4096 original positions,
beta_fast 32, beta_slow 1, not truncated), ``sliding_window`` 128, ``layer_types`` sliding then
full, expert width ``intermediate_size`` 2880, ``num_experts_per_tok`` 4, ``swiglu_limit`` 7.0
(``swiglu_alpha`` 1.702 is transformers' default); 20b: 24 layers, 32 experts; 120b: 36 layers,
128 experts. ``router_aux_loss_coef`` is 0.9 but ``output_router_logits`` false, so
transformers computes no load-balancing loss, and neither does the preset
(``tools/convert/gpt_oss.py``). The published experts are MXFP4; the presets are the
dequantised models.
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MoEConfig, RopeScaling

FAMILY = "gpt-oss"
SOURCE = "HF config.json of {}"


def gpt_oss(n_layers: int, n_experts: int, d_model: int = 2880, n_heads: int = 64,
            n_kv_heads: int = 8, d_head: int = 64, d_ff: int = 2880, top_k: int = 4,
            window: int = 128, vocab_size: int = 201088) -> ModelConfig:
    return ModelConfig(
        pattern="WE*E" * (n_layers // 2) + "WE" * (n_layers % 2),
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=False,
        norm_eps=1e-5,
        init_std=0.02,
        attention=AttentionConfig(
            n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head, rope_theta=150000.0,
            rope_scaling=RopeScaling(rope_type="yarn", factor=32.0, original_max_position=4096,
                                     beta_fast=32.0, beta_slow=1.0, truncate=False),
            qkv_bias=True, out_bias=True, sinks=True, window=window),
        mamba=None,
        mlp=None,
        moe=MoEConfig(n_experts=n_experts, top_k=top_k, d_ff=d_ff, activation="swiglu",
                      score_func="topk_softmax", router_bias=True, expert_bias=True,
                      swiglu_limit=7.0, swiglu_alpha=1.702),
    )


def _p(name: str, hf_id: str, make) -> Preset:
    return Preset(name, FAMILY, hf_id, SOURCE.format(hf_id), make)


PRESETS = [
    _p("gpt-oss-20b", "openai/gpt-oss-20b", lambda: gpt_oss(24, 32)),
    _p("gpt-oss-120b", "openai/gpt-oss-120b", lambda: gpt_oss(36, 128)),
    Preset("gpt-oss-debug", FAMILY, "(tiny random config)", "gpt-oss layout, tiny sizes",
           lambda: gpt_oss(4, 4, d_model=64, n_heads=4, n_kv_heads=2, d_head=16, d_ff=32,
                           top_k=2, window=8, vocab_size=512)),
]
