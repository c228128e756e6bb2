"""GLM-4.5 and GLM-4.5-Air (Zhipu AI / Z.ai): attention with q/k/v biases and partial RoPE, a few
dense SwiGLU layers, then MoE layers with a sigmoid router, score-correction bias and a shared
expert.

Numbers from the HF ``config.json`` of each id (as mirrored by Megatron-Bridge's
``GLM45ModelProvider355B`` / ``GLM45AirModelProvider106B`` and THUDM slime's
``glm4.5-355B-A32B.sh`` / ``glm4.5-106B-A12B.sh``): 96 query heads and 8 kv heads of width 128,
RoPE theta 1e6 on half of each head, RMSNorm eps 1e-5, vocabulary 151552, untied, top-8 of the
routed experts plus one shared expert as wide as a routed one, ``n_group = topk_group = 1``,
renormalised top-k. GLM-4.5 has qk-norm and scales the routed weights by 2.5; Air has neither.
Both ship one multi-token-prediction layer (``num_nextn_predict_layers: 1``) that these presets
leave out (transformers does not build it either).
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MLPConfig, MoEConfig

FAMILY = "glm4-moe"


def glm4_moe(n_layers: int, n_dense: int, d_model: int, d_ff: int, n_experts: int,
             d_ff_expert: int, qk_norm: bool, scaling: float, n_heads: int = 96,
             n_kv_heads: int = 8, d_head: int = 128, top_k: int = 8,
             vocab_size: int = 151552) -> ModelConfig:
    return ModelConfig(
        pattern=f"(*-)x{n_dense}(*E)x{n_layers - n_dense}",
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=False,
        norm_eps=1e-5,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=d_head,
                                  rope_theta=1e6, rotary_fraction=0.5, qk_norm=qk_norm,
                                  qkv_bias=True, out_bias=False),
        mamba=None,
        mlp=MLPConfig(d_ff=d_ff, activation="swiglu"),
        moe=MoEConfig(n_experts=n_experts, top_k=top_k, d_ff=d_ff_expert, activation="swiglu",
                      n_shared_experts=1, score_func="sigmoid", renormalize=True,
                      score_correction_bias=True, routed_scaling_factor=scaling),
    )


PRESETS = [
    Preset("glm-4.5", FAMILY, "zai-org/GLM-4.5",
           "HF config.json of zai-org/GLM-4.5; Megatron-Bridge GLM45ModelProvider355B",
           lambda: glm4_moe(92, 3, 5120, 12288, 160, 1536, qk_norm=True, scaling=2.5)),
    Preset("glm-4.5-air", FAMILY, "zai-org/GLM-4.5-Air",
           "HF config.json of zai-org/GLM-4.5-Air; Megatron-Bridge GLM45AirModelProvider106B",
           lambda: glm4_moe(46, 1, 4096, 10944, 128, 1408, qk_norm=False, scaling=1.0)),
    Preset("glm4-moe-debug", FAMILY, "(tiny random config)", "GLM-4.5 layout, tiny sizes",
           lambda: glm4_moe(3, 1, 64, 128, 8, 32, qk_norm=True, scaling=2.5, n_heads=4,
                            n_kv_heads=2, d_head=16, top_k=2, vocab_size=512)),
]
