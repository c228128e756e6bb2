"""Qwen3 and Qwen3-MoE (Alibaba): attention with qk-norm, SwiGLU MLP or softmax top-k MoE.

Numbers from the HF ``config.json`` of each id (Qwen3 Technical Report, 2025, Tables 1-2):
RMSNorm eps 1e-6, RoPE theta 1e6, head width 128, no qkv bias, vocabulary 151936.
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MLPConfig, MoEConfig


def qwen3(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, tie: bool,
          moe: MoEConfig | None = None, vocab_size: int = 151936,
          d_head: int = 128) -> ModelConfig:
    return ModelConfig(
        pattern=f"(*{'E' if moe else '-'})x{n_layers}",
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=tie,
        norm_eps=1e-6,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
                                  rope_theta=1e6, qk_norm=True),
        mamba=None,
        mlp=None if moe else MLPConfig(d_ff=d_ff, activation="swiglu"),
        moe=moe,
    )


def qwen3_moe(n_experts: int, top_k: int, d_ff: int) -> MoEConfig:
    return MoEConfig(n_experts=n_experts, top_k=top_k, d_ff=d_ff, activation="swiglu",
                     score_func="softmax", renormalize=True, aux_loss_coeff=0.001)


PRESETS = [
    Preset("qwen3-0.6b", "qwen3", "Qwen/Qwen3-0.6B", "HF config.json of Qwen/Qwen3-0.6B",
           lambda: qwen3(28, 1024, 16, 8, 3072, tie=True)),
    Preset("qwen3-8b", "qwen3", "Qwen/Qwen3-8B", "HF config.json of Qwen/Qwen3-8B",
           lambda: qwen3(36, 4096, 32, 8, 12288, tie=False)),
    Preset("qwen3-30b-a3b", "qwen3-moe", "Qwen/Qwen3-30B-A3B",
           "HF config.json of Qwen/Qwen3-30B-A3B",
           lambda: qwen3(48, 2048, 32, 4, 6144, tie=False, moe=qwen3_moe(128, 8, 768))),
    Preset("qwen3-debug", "qwen3", "(tiny random config)", "Qwen3 layout, tiny sizes",
           lambda: qwen3(2, 64, 4, 2, 128, tie=True, vocab_size=512, d_head=16)),
    Preset("qwen3-moe-debug", "qwen3-moe", "(tiny random config)", "Qwen3-MoE layout, tiny sizes",
           lambda: qwen3(2, 64, 4, 2, 128, tie=False, vocab_size=512, d_head=16,
                         moe=qwen3_moe(8, 2, 32))),
]
