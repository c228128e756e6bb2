"""Llama 3.x (Meta): attention + SwiGLU MLP blocks, RoPE with Llama-3 frequency scaling.

Numbers from the HF ``config.json`` of each id (Grattafiori et al. 2024, "The Llama 3 Herd of
Models", Table 3). A classic transformer block is two pattern symbols, ``*-``.
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MLPConfig, RopeScaling

FAMILY = "llama"


def llama3(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int,
           tie: bool, rope_factor: float | None, vocab_size: int = 128256,
           rope_theta: float = 500000.0) -> ModelConfig:
    scaling = RopeScaling(factor=rope_factor) if rope_factor else None
    return ModelConfig(
        pattern=f"(*-)x{n_layers}",
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=tie,
        norm_eps=1e-5,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads,
                                  d_head=d_model // n_heads, rope_theta=rope_theta,
                                  rope_scaling=scaling),
        mamba=None,
        mlp=MLPConfig(d_ff=d_ff, activation="swiglu"),
        moe=None,
    )


PRESETS = [
    Preset("llama-3.1-8b", FAMILY, "meta-llama/Llama-3.1-8B",
           "HF config.json of meta-llama/Llama-3.1-8B; Llama 3 paper Table 3",
           lambda: llama3(32, 4096, 32, 8, 14336, tie=False, rope_factor=8.0)),
    Preset("llama-3.2-1b", FAMILY, "meta-llama/Llama-3.2-1B",
           "HF config.json of meta-llama/Llama-3.2-1B",
           lambda: llama3(16, 2048, 32, 8, 8192, tie=True, rope_factor=32.0)),
    Preset("llama-debug", FAMILY, "(tiny random config)", "Llama 3 layout, tiny sizes",
           lambda: llama3(2, 64, 4, 2, 128, tie=False, rope_factor=8.0, vocab_size=512)),
]
