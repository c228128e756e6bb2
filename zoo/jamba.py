"""Jamba (AI21 Labs): Mamba-1 / attention hybrids with a MoE every other layer.

Each HF layer is a mixer block then a feed-forward block (``S-``, ``SE``, ``*-``, ``*E``):
attention where ``i % attn_layer_period == attn_layer_offset``, a MoE where
``i % expert_layer_period == expert_layer_offset``. Shared by the family (transformers 5.24's
``JambaConfig`` and the published config.json): Mamba-1 with learned RMSNorms on dt, B and C,
expand 2, conv width 4; attention without position embedding or biases; swiglu MLP and experts
of one ``intermediate_size``; a softmax top-2 router whose weights are not renormalised (load
balancing coefficient 0.001); RMSNorm eps 1e-6; vocabulary 65536; untied embeddings.

Left out: AI21-Jamba-Reasoning-3B and Jamba-1.5-Large, whose config.json values could not be
found in the sources searched (secondary pages give only totals and ratios).
"""

from __future__ import annotations

from composer.config import ModelConfig
from composer.zoo import Preset
from composer.zoo.sections import AttentionConfig, MLPConfig, MoEConfig

FAMILY = "jamba"
SOURCE_MINI = ("HF config.json of ai21labs/AI21-Jamba-1.5-Mini "
               "(https://huggingface.co/ai21labs/AI21-Jamba-1.5-Mini/blob/main/config.json, as "
               "transcribed in sdpython/experimental-experiment, torch_models/"
               "llm_model_helper.py, get_ai21_jamba_15_mini)")


def jamba(pattern: str, d_model: int, n_heads: int, n_kv_heads: int, d_ff: int, n_experts: int,
          d_state: int, dt_rank: int, vocab_size: int = 65536) -> ModelConfig:
    from composer.blocks.mamba1 import Mamba1Config  # the kind's section (imports torch)

    return ModelConfig(
        pattern=pattern,
        d_model=d_model,
        vocab_size=vocab_size,
        tie_embeddings=False,
        norm_eps=1e-6,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads,
                                  d_head=d_model // n_heads, position="none"),
        mamba=None,
        mamba1=Mamba1Config(d_inner=2 * d_model, d_state=d_state, d_conv=4, dt_rank=dt_rank,
                            inner_norms="learned"),
        mlp=MLPConfig(d_ff=d_ff, activation="swiglu"),
        moe=MoEConfig(n_experts=n_experts, top_k=2, d_ff=d_ff, activation="swiglu",
                      score_func="softmax", renormalize=False, aux_loss_coeff=0.001),
    )


# attn_layer_period 8, offset 4; expert_layer_period 2, offset 1: four blocks of eight layers
P_1_5_MINI = "(S-SES-SE*-SES-SE)x4"

PRESETS = [
    Preset("jamba-1.5-mini", FAMILY, "ai21labs/AI21-Jamba-1.5-Mini", SOURCE_MINI,
           lambda: jamba(P_1_5_MINI, 4096, 32, 8, 14336, 16, 16, 256)),
    Preset("jamba-debug", FAMILY, "(tiny random config)",
           "Jamba layout (attention period 4 offset 2, MoE period 2 offset 1), tiny sizes",
           lambda: jamba("S-SE*-SE", 64, 4, 2, 128, 4, 8, 4, vocab_size=512)),
]
