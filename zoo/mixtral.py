"""Mixtral (Mistral AI): attention + softmax top-2 MoE of SwiGLU experts.

Numbers from the HF ``config.json`` of mistralai/Mixtral-8x7B-v0.1 (Jiang et al. 2024, "Mixtral of
Experts", Table 1): RoPE theta 1e6, RMSNorm eps 1e-5, vocabulary 32000, untied.
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MoEConfig


def mixtral(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int,
            n_experts: int = 8, top_k: int = 2, vocab_size: int = 32000) -> ModelConfig:
    return ModelConfig(
        pattern=f"(*E)x{n_layers}",
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=False,
        norm_eps=1e-5,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads,
                                  d_head=d_model // n_heads, rope_theta=1e6),
        mamba=None,
        mlp=None,
        moe=MoEConfig(n_experts=n_experts, top_k=top_k, d_ff=d_ff, activation="swiglu",
                      score_func="softmax", renormalize=True, aux_loss_coeff=0.02),
    )


PRESETS = [
    Preset("mixtral-8x7b", "mixtral", "mistralai/Mixtral-8x7B-v0.1",
           "HF config.json of mistralai/Mixtral-8x7B-v0.1; Mixtral paper Table 1",
           lambda: mixtral(32, 4096, 32, 8, 14336)),
    Preset("mixtral-debug", "mixtral", "(tiny random config)", "Mixtral layout, tiny sizes",
           lambda: mixtral(2, 64, 4, 2, 64, n_experts=4, top_k=2, vocab_size=512)),
]
