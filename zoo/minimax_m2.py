"""MiniMax-M2 (MiniMax): every layer attention with a whole-projection qk-norm and partial RoPE,
then a sigmoid-routed MoE of SwiGLU experts with a score-correction bias (no shared expert).

Numbers from the HF ``config.json`` of MiniMaxAI/MiniMax-M2 (also transformers 5.24's
``MiniMaxM2Config`` defaults and Megatron-Bridge's ``MiniMaxM2Bridge``): 62 layers, width 3072,
48 query heads and 8 kv heads of width 128, ``rotary_dim`` 64 (half of each head), RoPE theta
5e6, RMSNorm eps 1e-6, 256 experts of width 1536, top 8, router aux-loss coefficient 0.001,
vocabulary 200064, untied. The release's MTP modules (``num_mtp_modules: 3``) are left out, as
transformers leaves them out.
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MoEConfig

FAMILY = "minimax-m2"


def minimax_m2(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_head: int,
               n_experts: int, top_k: int, d_ff: int, vocab_size: int = 200064) -> ModelConfig:
    return ModelConfig(
        pattern=f"(*E)x{n_layers}",
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=False,
        norm_eps=1e-6,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
                                  rope_theta=5e6, rotary_fraction=0.5, qk_norm=True,
                                  qk_norm_scope="all"),
        mamba=None,
        mlp=None,
        moe=MoEConfig(n_experts=n_experts, top_k=top_k, d_ff=d_ff, activation="swiglu",
                      score_func="sigmoid", renormalize=True, score_correction_bias=True,
                      aux_loss_coeff=0.001),
    )


PRESETS = [
    Preset("minimax-m2", FAMILY, "MiniMaxAI/MiniMax-M2",
           "HF config.json of MiniMaxAI/MiniMax-M2; transformers MiniMaxM2Config defaults",
           lambda: minimax_m2(62, 3072, 48, 8, 128, 256, 8, 1536)),
    Preset("minimax-m2-debug", FAMILY, "(tiny random config)", "MiniMax-M2 layout, tiny sizes",
           lambda: minimax_m2(2, 64, 4, 2, 16, 8, 2, 32, vocab_size=512)),
]
